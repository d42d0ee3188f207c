"""`python -m examples.launch_pd`: the PD example end to end, checked.

Starts a prefill worker and a decode worker (real processes on 127.0.0.1,
ports picked by the kernel), then acts as a client: for each of `--requests`
random prompts it asks the decode worker to generate `--gen-len` tokens. The
decode worker allocates entries, `expect`s the request, has the prefill worker
run the prompt and ship the caches with pdxfer, and decodes from what landed.

Every answer is compared, token for token, with the same model run in this
process without disaggregation (`examples.reference`). Printed per request
and in total: bytes moved, segments posted (and what a layer-major pool of the
same fields would have posted), transfer time, and whether the output is
identical. Exit status 0 only when every request succeeded and matched;
1 on any failure or mismatch.

`--kill-prefill-after N` SIGKILLs the prefill worker right after submitting
request N (0-based), to show that a dead peer turns into failed requests and
a non-zero exit, never a hang.

`--resize-every N` keeps each worker's KV pages and per-request states in one
allocation (`layout.ElasticPools`) and moves their boundary every N requests
on both workers, growing the state pool by `--resize-step` slots and
shrinking it back, in the middle of a request whose entries hold live data
(`examples.elastic`). Each move prints a line under its request: entries
moved, bytes, time. The outputs must still be identical.

A transport that cannot cross processes (loopback) runs both workers as
threads of this process instead; see `examples.launching`.

`--prefill-tp P --decode-tp D` (and `--replicated`) runs the heterogeneous
tensor-parallel variant instead, one process per rank: `examples.launch_tp`.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from pdxfer.transport.errors import PeerLostError, TransferTimeout

from pdxfer.cliargs import bounded_int, device_name, positive_float

from .caches import PoolSizes, decode_counts
from .elastic import ResizeFigures
from .elastic import figures_from_wire as resize_from_wire
from .launching import WorkerHandle, WorkerStartError, spawn_worker, start_in_process
from .model import HybridModel, ModelConfig, check_context, deterministic_torch
from .reference import reference_generate, resolve_device
from .rpc import (
    Failed,
    Generate,
    GenerateDone,
    Hello,
    HelloReply,
    RpcClient,
    TransferFigures,
    expect_reply,
    figures_from_wire,
)
from .serving import (
    WorkerOptions,
    add_resize_args,
    add_stream_args,
    check_stream_args,
    check_transport,
    cross_process,
    installed_transports,
)
from .startup import handled

_STARTUP_TIMEOUT_S = 90.0  # two torch imports on a loaded machine


@dataclass
class Outcome:
    request_id: str
    expected: list[int]
    tokens: list[int] | None = None
    figures: TransferFigures | None = None
    error: str | None = None
    resizes: list[ResizeFigures] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.error is None and self.tokens == self.expected


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.launch_pd",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="tcp",
                        help=f"pdxfer transport backend (installed: {', '.join(installed_transports())})")
    parser.add_argument("--requests", type=bounded_int(1), default=8)
    parser.add_argument("--prompt-len", type=bounded_int(1), default=48)
    parser.add_argument("--gen-len", type=bounded_int(1), default=8)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--device", type=device_name, default="auto", help="cpu, cuda, or auto")
    parser.add_argument("--timeout", type=positive_float, default=10.0,
                        help="seconds before a silent peer fails a request")
    parser.add_argument("--kill-prefill-after", type=bounded_int(0), default=None, metavar="N",
                        help="SIGKILL the prefill worker right after submitting request N")
    parser.add_argument("--verbose", action="store_true", help="workers log each request")
    add_resize_args(parser)
    add_stream_args(parser)
    args = parser.parse_args(argv)
    check_transport(parser, args.transport)
    check_stream_args(parser, args)
    why = check_context(ModelConfig(), args.prompt_len, args.gen_len)
    if why is not None:
        parser.error(f"--prompt-len {args.prompt_len} --gen-len {args.gen_len}: {why}")
    if args.kill_prefill_after is not None and not cross_process(args.transport):
        parser.error(f"--kill-prefill-after needs a cross-process transport; "
                     f"{args.transport!r} runs both workers in this process")
    if args.kill_prefill_after is not None and args.kill_prefill_after >= args.requests:
        parser.error(f"--kill-prefill-after {args.kill_prefill_after} names no request; "
                     f"requests are numbered 0..{args.requests - 1}")
    return args


def start_workers(args: argparse.Namespace, device: str, sizes: PoolSizes,
                  handles: list[WorkerHandle]) -> tuple[WorkerHandle, WorkerHandle]:
    """Prefill then decode, appended to `handles` as they start (for the caller's cleanup)."""
    if cross_process(args.transport):
        common = ["--transport", args.transport, "--device", device,
                  "--kv-pages", str(sizes.kv_pages), "--state-entries", str(sizes.state_entries),
                  "--timeout", str(args.timeout), "--resize-every", str(args.resize_every),
                  "--resize-step", str(args.resize_step), "--layer-groups", str(args.layer_groups)
                  ] + (["--verbose"] if args.verbose else [])
        prefill = spawn_worker("prefill", common, _STARTUP_TIMEOUT_S)
        handles.append(prefill)
        decode = spawn_worker("decode", [*common, "--prefill", prefill.info["rpc"]],
                              _STARTUP_TIMEOUT_S)
        handles.append(decode)
        return prefill, decode
    from .decode_worker import DecodeWorker
    from .prefill_worker import PrefillWorker

    opts = WorkerOptions(transport=args.transport, device=device, sizes=sizes,
                         timeout=args.timeout, verbose=args.verbose,
                         resize_every=args.resize_every, resize_step=args.resize_step,
                         layer_groups=args.layer_groups)
    prefill = start_in_process(PrefillWorker(opts))
    handles.append(prefill)
    decode = start_in_process(DecodeWorker(opts, prefill.info["rpc"]))
    handles.append(decode)
    return prefill, decode


def run_requests(args: argparse.Namespace, client: RpcClient, model: HybridModel,
                 prefill: WorkerHandle) -> list[Outcome]:
    """Submit every request in turn, printing its row; a failure is recorded, never raised."""
    rng = random.Random(args.seed)
    reply_timeout = 4 * args.timeout + 30  # the decode worker bounds itself well inside this
    outcomes: list[Outcome] = []
    decode_lost: str | None = None
    for i in range(args.requests):
        prompt = [rng.randrange(model.cfg.vocab) for _ in range(args.prompt_len)]
        out = Outcome(f"req-{i}", reference_generate(model, prompt, args.gen_len))
        outcomes.append(out)
        if decode_lost is not None:
            out.error = decode_lost
        else:
            decode_lost = _submit(args, client, prefill, prompt, out, reply_timeout, i)
        print(row(out), flush=True)
        for resize in out.resizes:
            print(resize.line(), flush=True)
    return outcomes


def _submit(args: argparse.Namespace, client: RpcClient, prefill: WorkerHandle,
            prompt: list[int], out: Outcome, reply_timeout: float, i: int) -> str | None:
    """One request into `out`; returns why the decode worker is gone, if it is."""
    try:
        client.send(Generate(request_id=out.request_id, prompt=prompt, gen_len=args.gen_len))
        if args.kill_prefill_after == i:
            prefill.kill()
            print(f"killed the prefill worker (pid {prefill.info['pid']}) "
                  f"after submitting {out.request_id}", flush=True)
        reply = client.recv(reply_timeout)
    except (PeerLostError, TransferTimeout) as exc:
        out.error = f"decode worker lost: {exc}"
        return out.error
    if isinstance(reply, Failed):
        out.error = reply.reason
        return None
    try:
        done = expect_reply(reply, GenerateDone, out.request_id)
    except PeerLostError as exc:
        out.error = f"decode worker misbehaved: {exc}"
        return out.error
    out.tokens, out.figures = list(done.tokens), figures_from_wire(done.transfer)
    try:
        out.resizes = [resize_from_wire(r) for r in done.resizes]
    except PeerLostError as exc:
        out.error = f"decode worker misbehaved: {exc}"
        return out.error
    return None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


HEADER = f"{'request':<10}{'bytes':>10}{'segments':>10}{'layer-major':>13}{'transfer':>12}  result"


def row(o: Outcome) -> str:
    """One request's line of the table."""
    if o.error is not None:
        return f"{o.request_id:<10}{'-':>10}{'-':>10}{'-':>13}{'-':>12}  FAILED: {o.error}"
    f = o.figures
    assert f is not None
    verdict = "identical" if o.identical else f"MISMATCH: expected {o.expected}, got"
    return (f"{o.request_id:<10}{f.nbytes:>10,}{f.segments:>10}{f.layer_major_segments:>13}"
            f"{_ms(f.transfer_s):>12}  {verdict} {o.tokens}")


def summary(outcomes: list[Outcome]) -> bool:
    """Print the totals and the verdict; True when every output is identical."""
    figures = [o.figures for o in outcomes if o.error is None and o.figures is not None]
    segs = sum(f.segments for f in figures)
    lm = sum(f.layer_major_segments for f in figures)
    ratio = f" ({lm / segs:.1f}x fewer segments than layer-major)" if segs else ""
    print(f"{'total':<10}{sum(f.nbytes for f in figures):>10,}{segs:>10}{lm:>13}"
          f"{_ms(sum(f.transfer_s for f in figures)):>12}  "
          f"{len(figures)} of {len(outcomes)} requests transferred{ratio}")
    resizes = [r for o in outcomes for r in o.resizes]
    if resizes:
        by = {w: sum(r.worker == w for r in resizes) for w in ("prefill", "decode")}
        print(f"resizes: {len(resizes)} boundary moves ({by['prefill']} on prefill, "
              f"{by['decode']} on decode) relocated {sum(r.entries for r in resizes)} entries, "
              f"{sum(r.nbytes for r in resizes):,} B, in "
              f"{sum(r.copy_s for r in resizes) * 1e3:.3f} ms")
    failed = [o.request_id for o in outcomes if o.error is not None]
    mismatched = [o.request_id for o in outcomes if o.error is None and not o.identical]
    if not failed and not mismatched:
        print(f"outputs identical: all {len(outcomes)} requests match the single-process run "
              "token for token")
        return True
    if failed:
        print(f"FAILED: {len(failed)} of {len(outcomes)} requests failed: {', '.join(failed)}")
    if mismatched:
        print(f"MISMATCH: {len(mismatched)} of {len(outcomes) - len(failed)} outputs differ "
              f"from the single-process run: {', '.join(mismatched)}")
    return False


def finish(ok: bool, handles: list[WorkerHandle], started: float) -> int:
    """Say which workers died and how long it took; the exit status for `ok`."""
    for h in handles:
        if not h.alive():
            print(f"  {h.info['role']} worker {h.describe_exit()}")
    print(f"finished in {time.monotonic() - started:.1f} s")
    return 0 if ok else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    flags = sys.argv[1:] if argv is None else argv
    if any(a.split("=")[0] in ("--prefill-tp", "--decode-tp") for a in flags):
        from .launch_tp import main as launch_tp  # one process per TP rank: examples.launch_tp

        return launch_tp(flags, prog="python -m examples.launch_pd")
    args = parse_args(argv)
    # SIGTERM/SIGHUP unwind like Ctrl-C, so `run`'s finally stops the workers.
    # Restored afterwards: main() is also called in-process (tests).
    if threading.current_thread() is not threading.main_thread():
        return run(args)
    saved = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return run(args)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def run(args: argparse.Namespace) -> int:
    """The whole example for parsed `args`; the exit status."""
    deterministic_torch()
    device = str(resolve_device(args.device))
    cfg = ModelConfig()
    model = HybridModel(cfg, device)
    need = decode_counts(cfg, args.prompt_len, args.gen_len)
    # One request at a time is in flight, so pools sized for one (plus slack
    # that makes entries get reused at different indices) always suffice; a
    # moving boundary takes up to --resize-step pages from the page pool.
    step = args.resize_step if args.resize_every else 0
    sizes = PoolSizes(kv_pages=max(4 * need["kv"], 16) + step, state_entries=4)
    elastic = (f", boundary moved every {args.resize_every} requests by {step} slots"
               if args.resize_every else "")
    if args.layer_groups:
        groups = min(args.layer_groups, cfg.attn_layers)
        elastic += (f", kv streamed in {groups} layer group(s) while the prefill computes"
                    + (f" (the model has {cfg.attn_layers} attention layers)"
                       if groups < args.layer_groups else ""))
    handles: list[WorkerHandle] = []
    client: RpcClient | None = None
    started = time.monotonic()
    try:
        # A Ctrl-C from here stops the workers (before: one line, see examples/startup.py).
        # Before the banner: a Ctrl-C right after it (a test's cue that the workers start)
        # must find this handling, not the start-up's.
        handled()
        print(f"pdxfer PD example: {args.requests} requests, prompt {args.prompt_len} tokens, "
              f"{args.gen_len} generated, transport {args.transport}, device {device}{elastic}",
              flush=True)
        prefill, decode = start_workers(args, device, sizes, handles)
        for h in handles:
            print(f"  {h.info['role']:<8}worker pid {h.info['pid']}, rpc {h.info['rpc']}"
                  + (f", bootstrap {h.info['bootstrap']}" if "bootstrap" in h.info else ""))
        client = RpcClient(decode.info["rpc"], timeout=args.timeout)
        hello = expect_reply(client.call(Hello()), HelloReply)
        if hello.model_digest != model.digest():
            print(f"error: decode worker serves model {hello.model_digest}, the reference "
                  f"is {model.digest()}", file=sys.stderr)
            return 1
        print(HEADER, flush=True)
        outcomes = run_requests(args, client, model, prefill)
        return finish(summary(outcomes), handles, started)
    except (WorkerStartError, PeerLostError, TransferTimeout, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: stopping the workers", file=sys.stderr)
        return 130
    finally:
        if client is not None:
            client.close()
        for h in reversed(handles):
            h.stop()


if __name__ == "__main__":
    raise SystemExit(main())
