"""The prefill worker: runs prompts and ships their caches with pdxfer.

Serves two RPCs (`examples.rpc`): `Hello`, answering with the model digest and
the pdxfer bootstrap address decode engines connect to, and `Prefill`: take
entries from the three pools, run the prompt through the model (which writes
K/V pages, recurrent + compressor state and the first token through the arena
views), `send` those entries to the decode entries named in the request, wait
until they have landed, give the entries back and reply with what the
transfer cost — including how many segments a layer-major pool would have
posted for the same entries.

Model arithmetic runs under one lock (the model and the allocator are not
thread-safe); the wait for the transfer does not hold it.

Run on its own: `python -m examples.prefill_worker --host 0.0.0.0 --port 7000
--bootstrap-port 7001`; it prints one readiness line (see `examples.serving`).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
from typing import Any

import numpy as np

from pdxfer import LayoutError, PdxferError, PrefillEngine
from pdxfer.integrations.layer_stream import group_ends

from .caches import (
    POOLS,
    LayerMajorBaseline,
    ModelCaches,
    PoolExhausted,
    prefill_counts,
)
from .cluster import add_directory_args, open_from_args, register_prefill
from .elastic import BoundaryMover
from .model import HybridModel, ModelConfig, check_context, deterministic_torch
from .reference import resolve_device
from .rpc import (
    Failed,
    Hello,
    HelloReply,
    Prefill,
    PrefillDone,
    RpcServer,
    TransferFigures,
    figures_to_wire,
)
from .serving import (
    PORT,
    StopSignals,
    WorkerOptions,
    abort_and_release,
    add_worker_args,
    check_prompt,
    logger,
    options_from_args,
    parse_worker_args,
    serve_metrics,
    serve_until_signalled,
    stop_metrics,
)
from .startup import handled


class PrefillWorker:
    """Model, pools, a `PrefillEngine` over them, and the RPC server in front.

    Given a peer directory and an instance name, it registers its one rank
    there (`cluster.register_prefill`) once it serves, and withdraws on close.
    """

    def __init__(self, opts: WorkerOptions, cfg: ModelConfig | None = None,
                 directory: Any = None, instance: str | None = None) -> None:
        self.opts = opts
        self.log = logger("prefill", opts.verbose)
        self.model = HybridModel(cfg or ModelConfig(), opts.device)
        self.caches = ModelCaches(self.model.cfg, opts.sizes, self.model.device,
                                  elastic=bool(opts.resize_every),
                                  interleaved=bool(opts.layer_groups))
        self.baseline = LayerMajorBaseline(self.caches)
        self._lock = threading.Lock()
        self.engine = PrefillEngine(pools=self.caches.pools, config=opts.engine_config())
        self.directory = directory
        self.mover = BoundaryMover("prefill", self.caches, self.engine, opts.resize_every,
                                   opts.resize_step)
        self.metrics = None
        try:
            self.metrics = serve_metrics(opts, self.engine)
            self.server = RpcServer(opts.host, opts.port, self.handle,
                                    functools.partial(self.log, error=True))
            if directory is not None:
                register_prefill(directory, instance or "p0", self.model, self.engine,
                                 self.caches.pools, self.ready_info()["rpc"])
        except BaseException:
            self.close()
            raise

    def ready_info(self) -> dict[str, Any]:
        host, port = self.server.address
        info = {"role": "prefill", "rpc": f"{host}:{port}",
                "bootstrap": self.engine.bootstrap_address, "pid": os.getpid()}
        if self.metrics is not None:
            info["metrics"] = self.metrics[1]
        return info

    def handle(self, msg: Any) -> Any:
        if isinstance(msg, Hello):
            return HelloReply(role="prefill", model_digest=self.model.digest(),
                              transport=self.opts.transport, device=str(self.model.device),
                              bootstrap=self.engine.bootstrap_address)
        if isinstance(msg, Prefill):
            return self._prefill(msg)
        return Failed(getattr(msg, "request_id", ""), f"a prefill worker does not serve {msg.TYPE!r}")

    def _prefill(self, msg: Prefill) -> PrefillDone | Failed:
        rid = msg.request_id
        try:
            prompt = check_prompt(msg.prompt, self.model.cfg.vocab)
            too_long = check_context(self.model.cfg, len(prompt), 0)
            if too_long is not None:
                raise ValueError(too_long)
            need = prefill_counts(self.model.cfg, len(prompt))
            dst, dst_entries = _check_destination(msg.dst_indices, msg.dst_entries, need)
        except ValueError as exc:
            return Failed(rid, f"prefill refused request {rid!r}: {exc}")
        with self._lock:
            try:
                src = self.caches.allocate(need)
            except PoolExhausted as exc:
                return Failed(rid, f"prefill worker: {exc}")
        reusable = True
        try:
            try:
                # Planned before anything runs: it also checks decode's indices.
                layer_major = self.baseline.segments(src, dst, dst_entries)
            except LayoutError as exc:
                return Failed(rid, f"prefill refused request {rid!r}: {exc}")
            with self._lock:
                self.model.prefill(self.caches, prompt, src["kv"],
                                   int(src["state"][0]), int(src["aux"][0]),
                                   on_layer=self._streamer(rid, src))
                # Written, not yet sent: a boundary move now relocates live entries,
                # and the transfer ships them from where they moved to.
                src, resizes = self.mover.maybe(rid, src)
            if resizes:  # the sources moved: count the layer-major baseline for where they are
                layer_major = self.baseline.segments(src, dst, dst_entries)
            try:
                if self.opts.layer_groups:  # the kv pages went out by layer groups already
                    self.engine.send(rid, {p: v for p, v in src.items() if p != "kv"})
                else:
                    self.engine.send(rid, src)
                self.engine.wait(rid, timeout=self.opts.rpc_timeout)
                stats = self.engine.stats(rid)
                self.engine.release(rid)
            except PdxferError as exc:
                reusable = abort_and_release(self.engine, rid, f"prefill worker gave up: {exc}",
                                             self.opts.rpc_timeout)
                return Failed(rid, f"prefill of {rid!r}: transfer failed: {exc}")
        finally:
            if reusable:
                with self._lock:
                    self.caches.free(src)
            else:
                self.log(f"{rid}: the engine never finished the aborted transfer; "
                         "its entries stay out of use", error=True)
        self.log(f"{rid}: {len(prompt)} tokens, {stats.nbytes} B in {stats.segments} segments")
        figures = TransferFigures(stats.nbytes, stats.segments, layer_major, stats.elapsed_s)
        return PrefillDone(request_id=rid, transfer=figures_to_wire(figures), resizes=resizes)

    def _streamer(self, rid: str, src: dict) -> Any:
        """`on_layer` for `HybridModel.prefill`: send each group of attention layers once
        computed (`--layer-groups`), or None (whole entries after the forward pass).

        The groups split the model's attention layers as evenly as integers allow; the
        state and first token are final only after the last layer, so they follow whole.
        """
        n = self.model.cfg.attn_layers
        groups = min(self.opts.layer_groups, n)
        if not groups:
            return None
        ends = set(group_ends(n, groups))
        start = [0]

        def on_layer(layer: int) -> None:
            if layer + 1 in ends:
                self.engine.send(rid, {"kv": src["kv"]}, layers=(start[0], layer + 1), last=False)
                start[0] = layer + 1

        return on_layer

    def serve_forever(self) -> None:
        self.server.serve_forever()

    def close(self) -> None:
        """Withdraw from the directory, stop serving, then close the engine. Idempotent."""
        if self.directory is not None:
            self.directory.close()  # revokes the lease: routers see "down" at once
        if hasattr(self, "server"):
            self.server.close()
        stop_metrics(self.metrics)
        self.metrics = None
        self.engine.close()


def _check_destination(
    indices: dict, entries: dict, need: dict[str, int],
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """The decode side's entries as arrays, checked against what this prompt ships."""
    if set(indices) != set(POOLS) or set(entries) != set(POOLS):
        raise ValueError(f"destination must name pools {list(POOLS)}, got {sorted(indices)}")
    out = {}
    for name in POOLS:
        idx = np.asarray(indices[name], dtype=np.int64)
        if idx.shape != (need[name],):
            raise ValueError(
                f"pool {name!r}: the prompt fills {need[name]} entries, decode offered "
                f"{idx.shape[0] if idx.ndim == 1 else idx.shape}"
            )
        if not isinstance(entries[name], int) or entries[name] <= 0:
            raise ValueError(f"pool {name!r}: decode arena size {entries[name]!r} is not a count")
        out[name] = idx
    return out, dict(entries)


def main(argv: list[str] | None = None) -> int:
    """`python -m examples.prefill_worker`: serve until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m examples.prefill_worker",
                                     description=__doc__.splitlines()[0])
    add_worker_args(parser)
    parser.add_argument("--bootstrap-port", type=PORT, default=0,
                        help="port of the pdxfer bootstrap listener decode engines connect to")
    add_directory_args(parser)
    parser.add_argument("--instance", default="p0",
                        help="with --directory: the prefill instance name this worker registers")
    args = parse_worker_args(parser, argv)
    handled()  # StopSignals takes over from startup's quiet exit
    with StopSignals() as signals:  # before the model is built: see StopSignals
        directory = None
        try:
            deterministic_torch()
            directory = open_from_args(args)
            worker = PrefillWorker(options_from_args(args, str(resolve_device(args.device))),
                                   directory=directory, instance=args.instance)
        except KeyboardInterrupt:
            if directory is not None:
                directory.close()
            print("interrupted while starting", file=sys.stderr, flush=True)
            return 130
        return serve_until_signalled(worker.serve_forever, worker.close, args.die_with_parent,
                                     signals, worker.ready_info())


if __name__ == "__main__":
    raise SystemExit(main())
