"""`python -m examples.launch_tp --prefill-tp 4 --decode-tp 2`: heterogeneous TP, checked.

Starts every rank as its own process, all at once (`examples.tp_rank`: P
prefill ranks and D decode ranks, each group joined by gloo; forked from this
process, so torch is imported once), hands the decode ranks the prefill
group's addresses, and collects each rank's result.
Each request's tokens (every decode rank computes them) are compared with the
monolithic run of the same model in this process (`tp_model.tp_reference`),
and each decode rank's segment count with "entries (merged runs) x
contributing rank pairs", per pool. Exit 0 only when every output is
identical and every count matches; 1 otherwise. `launch_pd --prefill-tp ...`
lands here too.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time

from pdxfer.layout import contributing_ranks

from pdxfer.cliargs import bounded_int, positive_float

from .caches import prefill_counts
from .launching import WorkerStartError
from .model import check_context
from .serving import check_transport, cross_process, installed_transports
from .startup import handled
from .tp_model import TP_CONFIG, tp_reference
from .tp_rank import forked, prompts

# launch_pd's flags that the TP variant has no counterpart for: refused by
# name (a flag that is silently dropped is a flag that lies).
_PD_ONLY = {
    "--kill-prefill-after": "the TP ranks are forked children with no kill hook",
    "--resize-every": "the TP pools are shard-major arenas, not elastic pools",
    "--resize-step": "the TP pools are shard-major arenas, not elastic pools",
    "--verbose": "the TP ranks log nothing per request",
}


def parse_args(argv: list[str] | None, prog: str = "python -m examples.launch_tp") -> argparse.Namespace:
    """The TP launcher's flags; every flag is honoured or refused by name, none ignored.

    `prog` is the command the user typed (launch_pd hands its TP flags here).
    """
    parser = argparse.ArgumentParser(prog=prog,
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--prefill-tp", type=bounded_int(1), default=4)
    parser.add_argument("--decode-tp", type=bounded_int(1), default=2)
    parser.add_argument("--replicated", action="store_true",
                        help="MLA-style: K/V replicated on every rank, shipped from one")
    parser.add_argument("--transport", default="tcp",
                        help="pdxfer backend every rank's engine uses; it must cross processes "
                        f"(installed: {', '.join(installed_transports())})")
    parser.add_argument("--device", default="cpu",
                        help="cpu (or auto): the TP ranks run on CPU only")
    parser.add_argument("--requests", type=bounded_int(1), default=2)
    parser.add_argument("--prompt-len", type=bounded_int(1), default=12)
    parser.add_argument("--gen-len", type=bounded_int(1), default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=positive_float, default=20.0)
    for flag in _PD_ONLY:
        parser.add_argument(flag, default=None, help=argparse.SUPPRESS,
                            **({"action": "store_true"} if flag == "--verbose" else {}))
    args = parser.parse_args(argv)
    for flag, why in _PD_ONLY.items():
        if getattr(args, flag[2:].replace("-", "_")) not in (None, False):
            parser.error(f"{flag} is not supported with --prefill-tp/--decode-tp: {why}")
    if args.device.strip().lower() not in ("cpu", "auto"):
        parser.error(f"--device {args.device}: the TP example runs its ranks on CPU only "
                     "(gloo groups, CPU pools); use --device cpu")
    check_transport(parser, args.transport)
    if not cross_process(args.transport):
        parser.error(f"--transport {args.transport}: every TP rank is its own process, and "
                     f"{args.transport!r} cannot connect two processes")
    for name in ("prefill_tp", "decode_tp"):
        tp = getattr(args, name)
        if TP_CONFIG.heads % tp:
            parser.error(f"--{name.replace('_', '-')} {tp} must divide the model's "
                         f"{TP_CONFIG.heads} heads")
    why = check_context(TP_CONFIG, args.prompt_len, args.gen_len)
    if why is not None:
        parser.error(f"--prompt-len {args.prompt_len} --gen-len {args.gen_len}: {why}")
    return args


def _rank_argv(args: argparse.Namespace, role: str, tp: int, peer_tp: int, rank: int,
               store: str) -> list[str]:
    return ["--role", role, "--tp", str(tp), "--rank", str(rank), "--peer-tp", str(peer_tp),
            "--store", store, "--requests", str(args.requests), "--prompt-len",
            str(args.prompt_len), "--gen-len", str(args.gen_len), "--seed", str(args.seed),
            "--timeout", str(args.timeout), "--transport", args.transport,
            ] + (["--replicated"] if args.replicated else [])


class Rank:
    """One forked rank process and the launcher's end of its pipe."""

    def __init__(self, argv: list[str]) -> None:
        ctx = mp.get_context("fork")  # torch is imported here already: the rank reuses it
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=forked, args=(argv, child), daemon=True)
        self.proc.start()
        child.close()

    def expect(self, kind: str, deadline: float) -> object:
        """The next message, which must be of `kind`; `WorkerStartError` otherwise."""
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            raise WorkerStartError(f"rank process {self.proc.pid} sent no {kind} in time")
        try:
            got, payload = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise WorkerStartError(f"rank process {self.proc.pid} exited with status "
                                   f"{self.proc.exitcode} before its {kind}") from None
        if got != kind:
            raise WorkerStartError(f"rank process {self.proc.pid}: {payload}")
        return payload

    def stop(self, deadline: float) -> None:
        self.proc.join(max(0.1, deadline - time.monotonic()))
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def expected_segments(args: argparse.Namespace, q: int) -> int:
    """Entries (merged runs) x contributing rank pairs, per pool, for decode rank q."""
    P, D = args.prefill_tp, args.decode_tp
    pages = prefill_counts(TP_CONFIG, args.prompt_len)["kv"]
    if args.replicated or P == D:
        kv = 1 * len(contributing_ranks(P, D, q, split=not args.replicated))  # one run of pages
    else:
        kv = pages * len(contributing_ranks(P, D, q))
    return kv + 1 + 1  # the state entry and the aux entry, from the replica source


def run(args: argparse.Namespace) -> int:
    P, D = args.prefill_tp, args.decode_tp
    print(f"pdxfer heterogeneous-TP example: prefill TP {P} -> decode TP {D}"
          f"{' (replicated K/V, MLA-style)' if args.replicated else ''}, transport "
          f"{args.transport}, device cpu, {args.requests} "
          f"requests, prompt {args.prompt_len}, {args.gen_len} generated", flush=True)
    ranks: list[Rank] = []
    started = time.monotonic()
    deadline = started + 6 * args.timeout + 60
    interrupted = False
    handled()  # a Ctrl-C from here stops the ranks (before: one line, see examples/startup.py)
    with tempfile.TemporaryDirectory(prefix="pdxfer-tp-") as tmp:
        try:
            for rank in range(P):
                ranks.append(Rank(_rank_argv(args, "prefill", P, D, rank,
                                             os.path.join(tmp, "prefill"))))
            for rank in range(D):
                ranks.append(Rank(_rank_argv(args, "decode", D, P, rank,
                                             os.path.join(tmp, "decode"))))
            ready = [r.expect("ready", deadline) for r in ranks]
            group = ",".join(info["bootstrap"] for info in ready[:P])
            used = sorted({info["transport"] for info in ready})
            print(f"  {P + D} rank processes ready (pids "
                  f"{', '.join(str(r.proc.pid) for r in ranks)}, engines over "
                  f"{', '.join(used)}); prefill group {group}", flush=True)
            for r in ranks[P:]:
                r.conn.send(group)
            results = [r.expect("result", deadline) for r in ranks]
        except WorkerStartError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            interrupted = True
            print("interrupted: stopping the ranks", file=sys.stderr)
            return 130
        finally:
            for r in ranks:
                r.stop(deadline if sys.exc_info()[0] is None and not interrupted
                       else time.monotonic() + 5)
    decode = results[P:]
    ok = True
    print(f"{'request':<10}{'bytes':>10}{'segments':>10}{'expected':>10}{'pairs':>7}  result")
    for i, prompt in enumerate(prompts(args.seed, args.requests, args.prompt_len)):
        rid = f"req-{i}"
        want = tp_reference(prompt, args.gen_len, args.replicated)
        got = [r["tokens"][rid] for r in decode]
        segs = sum(r["segments"][rid] for r in decode)
        expect = sum(expected_segments(args, q) for q in range(D))
        pairs = sum(r["pairs"][rid] for r in decode)
        same = all(t == want for t in got)
        ok = ok and same and segs == expect
        verdict = "identical" if same else f"MISMATCH: expected {want}, got {got}"
        print(f"{rid:<10}{sum(r['nbytes'][rid] for r in decode):>10,}{segs:>10}{expect:>10}"
              f"{pairs:>7}  {verdict} {got[0]}")
    if ok:
        print(f"outputs identical: all {args.requests} requests match the monolithic run token "
              "for token; segments = entries (merged runs) x contributing rank pairs")
    else:
        print("FAILED: an output or a segment count differs")
    print(f"finished in {time.monotonic() - started:.1f} s")
    return 0 if ok else 1


def main(argv: list[str] | None = None, prog: str = "python -m examples.launch_tp") -> int:
    args = parse_args(argv, prog)
    try:
        return run(args)
    except KeyboardInterrupt:  # the ranks are stopped; checking their results was interrupted
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
