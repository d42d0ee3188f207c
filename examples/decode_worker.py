"""The decode worker: receives a request's caches with pdxfer and generates.

Serves `Hello` and `Generate` (`examples.rpc`). For each `Generate` it takes
entries from its three pools (pages for the prompt *and* the tokens to come),
tells its `DecodeEngine` to `expect` the request into the first of them, asks
the prefill worker over RPC to run the prompt, and waits for two things at
once: the engine saying every byte has landed, and the prefill worker's reply.
Either one failing — the engine fails the request, the prefill refuses, the
prefill's socket hangs up because the process died — aborts the request at
once, frees its entries and answers `Failed` with the reason; nothing waits
longer than `WorkerOptions.rpc_timeout`. Then it decodes from the received
caches and replies with the tokens and the transfer's figures.

One request at a time, on purpose: the example demonstrates the transfer and
the bit-for-bit check, not a scheduler, and a serial worker runs the model on
exactly the shapes the single-process reference does.

Run on its own: `python -m examples.decode_worker --prefill HOST:PORT`, where
HOST:PORT is the prefill worker's RPC address.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from pdxfer.transport.errors import PeerLostError, TransferTimeout

from pdxfer import DecodeEngine, KVPoll, PdxferError, RequestFailed
from pdxfer.directory import PeerRecord

from .caches import POOLS, ModelCaches, PoolExhausted, decode_counts, prefill_counts
from .cluster import add_directory_args, model_name, open_from_args, resolve_prefill
from .elastic import BoundaryMover
from .model import HybridModel, ModelConfig, check_context, deterministic_torch
from .reference import resolve_device
from .rpc import (
    Failed,
    Generate,
    GenerateDone,
    Hello,
    HelloReply,
    Prefill,
    PrefillDone,
    RoutedGenerate,
    RpcClient,
    RpcServer,
    TransferFigures,
    expect_reply,
    figures_from_wire,
    figures_to_wire,
    parse_hostport,
)
from .serving import (
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

# How often the wait loop looks at the engine while the prefill reply is not
# in yet. Only bounds how late a *failure* is noticed: success is read from
# the engine, and its own stats time the transfer, not this loop.
_POLL_S = 0.002
_WILDCARD_HOSTS = {"", "0.0.0.0", "::"}
_CLOSE_WAIT_S = 5.0


class _EntriesHeld(RuntimeError):
    """A failed request whose entries the engine could not confirm are fenced."""


class DecodeWorker:
    """Model, pools, a `DecodeEngine`, an RPC link to the prefill worker, an RPC server."""

    def __init__(self, opts: WorkerOptions, prefill_rpc: str | None,
                 cfg: ModelConfig | None = None,
                 open_directory: Callable[[str], Any] | None = None) -> None:
        self.opts = opts
        # Without a fixed prefill worker, each RoutedGenerate names an instance
        # and the directory gives its record (pdxfer) and RPC address (meta).
        # `open_directory(model name)` opens one following that model's prefills.
        self.prefill_rpc = prefill_rpc
        self.log = logger("decode", opts.verbose)
        self.model = HybridModel(cfg or ModelConfig(), opts.device)
        self.directory = open_directory(model_name(self.model)) if open_directory else None
        self.caches = ModelCaches(self.model.cfg, opts.sizes, self.model.device,
                                  elastic=bool(opts.resize_every),
                                  interleaved=bool(opts.layer_groups))
        self._lock = threading.Lock()
        self._link: RpcClient | None = None
        self.bootstrap: str | PeerRecord | None = None
        try:
            if prefill_rpc is not None:
                self.bootstrap = self._hello_prefill()
        except BaseException:
            self._drop_link()
            raise
        self.engine = DecodeEngine(pools=self.caches.pools, config=opts.engine_config(),
                                   directory=self.directory)
        self.mover = BoundaryMover("decode", self.caches, self.engine, opts.resize_every,
                                   opts.resize_step)
        self.metrics = None
        try:
            self.metrics = serve_metrics(opts, self.engine)
            self.server = RpcServer(opts.host, opts.port, self.handle,
                                    functools.partial(self.log, error=True))
        except BaseException:
            stop_metrics(self.metrics)
            self.engine.close()
            raise

    def _hello_prefill(self) -> str:
        """Check the prefill worker serves our model; its bootstrap address.

        Retries the connection for `rpc_timeout` seconds, so the two workers
        of a two-machine set-up may be started in either order.
        """
        deadline = time.monotonic() + self.opts.rpc_timeout
        while True:
            try:
                link = self._prefill_link()
                break
            except PeerLostError as exc:
                if time.monotonic() > deadline:
                    raise PeerLostError(
                        f"no prefill worker at {self.prefill_rpc} within "
                        f"{self.opts.rpc_timeout:.0f} s ({exc}); start one with "
                        "`python -m examples.prefill_worker` and pass its readiness line's 'rpc'"
                    ) from exc
                time.sleep(0.5)
        try:
            reply = expect_reply(link.call(Hello()), HelloReply)
        except (PdxferError, OSError, ValueError) as exc:
            # Something listens there but does not speak the example's RPC:
            # most often the prefill worker's pdxfer bootstrap port, the other
            # address of its readiness line.
            raise PeerLostError(
                f"{self.prefill_rpc} answered, but not as a prefill worker's RPC port ({exc}); "
                "pass --prefill the 'rpc' address of its readiness line, not its 'bootstrap'"
            ) from exc
        mine = self.model.digest()
        if reply.model_digest != mine:
            raise RuntimeError(
                f"prefill worker at {self.prefill_rpc} serves model {reply.model_digest}, "
                f"this decode worker {mine}; run both from the same pdxfer checkout"
            )
        if reply.transport != self.opts.transport:
            raise RuntimeError(
                f"prefill worker uses transport {reply.transport!r}, this decode worker "
                f"{self.opts.transport!r}; pass the same --transport to both"
            )
        host, port = parse_hostport(reply.bootstrap)
        if host in _WILDCARD_HOSTS:  # bound to all interfaces: reach it where its RPC is
            host = parse_hostport(self.prefill_rpc)[0]
        return f"{host}:{port}"

    def _prefill_link(self) -> RpcClient:
        """The RPC link to the prefill worker, reconnected if the old one hung up.

        An idle link with something to read is a peer that closed it (a worker
        that sends nothing unasked), so it is replaced before use; a prefill
        worker that is gone then fails the request here, fast, as unreachable.
        """
        if self._link is not None and self._link.readable(0):
            self._drop_link()
        if self._link is None:
            self._link = RpcClient(self.prefill_rpc, self.opts.rpc_timeout)
        return self._link

    def _drop_link(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None

    def ready_info(self) -> dict[str, Any]:
        host, port = self.server.address
        info = {"role": "decode", "rpc": f"{host}:{port}", "prefill": self.prefill_rpc or "",
                "pid": os.getpid()}
        if self.metrics is not None:
            info["metrics"] = self.metrics[1]
        return info

    def handle(self, msg: Any) -> Any:
        if isinstance(msg, Hello):
            return HelloReply(role="decode", model_digest=self.model.digest(),
                              transport=self.opts.transport, device=str(self.model.device),
                              bootstrap="")
        if isinstance(msg, Generate):
            with self._lock:
                return self._generate(msg)
        if isinstance(msg, RoutedGenerate):
            with self._lock:
                try:
                    self._route(msg.prefill)
                except LookupError as exc:
                    return Failed(msg.request_id, f"decode cannot route {msg.request_id!r}: {exc}")
                return self._generate(msg)
        return Failed(getattr(msg, "request_id", ""), f"a decode worker does not serve {msg.TYPE!r}")

    def _route(self, instance: str) -> None:
        """Serve the next request from prefill `instance`, as the directory lists it now."""
        if self.directory is None:
            raise LookupError("this decode worker was started without --directory")
        record = resolve_prefill(self.directory, self.model, instance)
        rpc = record.meta.get("rpc")
        if not isinstance(rpc, str):
            raise LookupError(f"prefill instance {instance!r} registered no RPC address")
        if rpc != self.prefill_rpc:
            self._drop_link()
            self.prefill_rpc = rpc
        self.bootstrap = record

    def _generate(self, msg: Generate | RoutedGenerate) -> GenerateDone | Failed:
        rid = msg.request_id
        cfg = self.model.cfg
        try:
            prompt = check_prompt(msg.prompt, cfg.vocab)
            if msg.gen_len < 1:
                raise ValueError(f"gen_len must be at least 1, got {msg.gen_len}")
            too_long = check_context(cfg, len(prompt), msg.gen_len)
            if too_long is not None:
                raise ValueError(too_long)
            idx = self.caches.allocate(decode_counts(cfg, len(prompt), msg.gen_len))
        except (ValueError, PoolExhausted) as exc:
            return Failed(rid, f"decode refused request {rid!r}: {exc}")
        try:
            figures, resizes = self._receive(rid, prompt, idx)
            # The caches landed and the engine let go of them: a boundary move now
            # relocates this request's live entries, and decoding reads them moved.
            idx, moved = self.mover.maybe(rid, idx)
            tokens = self.model.decode(self.caches, len(prompt), msg.gen_len, idx["kv"],
                                       int(idx["state"][0]), int(idx["aux"][0]))
        except _EntriesHeld as exc:
            self.log(f"{rid}: failed, and its entries stay out of use: {exc}", error=True)
            return Failed(rid, str(exc))
        except (PdxferError, RuntimeError, OSError) as exc:
            self.caches.free(idx)
            self.log(f"{rid}: failed: {exc}", error=True)
            return Failed(rid, str(exc))
        self.caches.free(idx)
        self.log(f"{rid}: {len(tokens)} tokens after {figures.nbytes} B")
        return GenerateDone(request_id=rid, tokens=tokens, transfer=figures_to_wire(figures),
                            resizes=resizes + moved)

    def _receive(self, rid: str, prompt: list[int], idx: dict) -> tuple[TransferFigures, list]:
        """Get the prompt's caches into `idx`'s leading entries, or raise why not.

        Returns the transfer's figures and the prefill worker's boundary moves (wire form).

        On failure the request is aborted and released before this raises,
        unless the engine would not confirm it was fenced: then `_EntriesHeld`,
        and the entries must not be reused.
        """
        ships = prefill_counts(self.model.cfg, len(prompt))
        dst = {name: idx[name][: ships[name]] for name in POOLS}
        try:
            link = self._prefill_link()
        except PeerLostError as exc:
            raise PeerLostError(f"prefill worker unreachable: {exc}") from exc
        self.engine.expect(rid, self.bootstrap, dst)
        try:
            link.send(Prefill(
                request_id=rid, prompt=prompt,
                dst_indices={name: dst[name].tolist() for name in POOLS},
                dst_entries={name: self.caches.index_space(name) for name in POOLS},
            ))
            done = self._await(rid, link)
        except (PdxferError, RuntimeError, OSError) as exc:
            # Dropped whatever went wrong: a dead link cannot carry the next
            # request, and a live one may still bring this request's late
            # reply, which must not be read as the next request's.
            self._drop_link()
            reason = f"prefill worker lost: {exc}" if isinstance(exc, PeerLostError) else str(exc)
            if not abort_and_release(self.engine, rid, f"decode worker gave up: {reason}",
                                     self.opts.rpc_timeout):
                raise _EntriesHeld(reason) from exc
            raise RuntimeError(reason) from exc
        self.engine.release(rid)
        return figures_from_wire(done.transfer), list(done.resizes)

    def _await(self, rid: str, link: RpcClient) -> PrefillDone:
        """Until the caches have landed AND the prefill worker has confirmed.

        The engine's poll and the RPC socket are watched together so that the
        first of them to go wrong ends the wait.
        """
        deadline = time.monotonic() + self.opts.rpc_timeout
        landed, reply = False, None
        while True:
            if not landed:
                state = self.engine.poll(rid)
                if state == KVPoll.Failed:
                    raise RequestFailed(rid, self.engine.failure_reason(rid) or "unknown")
                landed = state == KVPoll.Success
            left = deadline - time.monotonic()
            if landed and reply is not None:
                return reply
            if left <= 0:
                raise TransferTimeout(
                    f"request {rid!r}: no {'reply' if landed else 'caches'} from the prefill "
                    f"worker within {self.opts.rpc_timeout:.1f} s"
                )
            if reply is None:
                if link.readable(left if landed else _POLL_S):
                    reply = expect_reply(link.recv(), PrefillDone, rid)
            else:  # confirmed, still landing (not the usual order): just poll
                time.sleep(_POLL_S)

    def serve_forever(self) -> None:
        self.server.serve_forever()

    def close(self) -> None:
        """Stop serving, close the engine, hang up on prefill. Idempotent.

        The engine goes first: closing it fails a request in flight at once,
        so the request's thread lets go of the prefill link promptly and the
        link is not closed under its feet.
        """
        self.server.close()
        stop_metrics(self.metrics)
        self.metrics = None
        self.engine.close()
        if self.directory is not None:
            self.directory.close()
        got = self._lock.acquire(timeout=_CLOSE_WAIT_S)
        try:
            self._drop_link()
        finally:
            if got:
                self._lock.release()


def _hostport(text: str) -> str:
    """An argparse `type` for `--prefill`: HOST:PORT, checked before anything starts."""
    try:
        parse_hostport(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT (the 'rpc' of the prefill worker's readiness line), got {text!r}"
        ) from None
    return text


def main(argv: list[str] | None = None) -> int:
    """`python -m examples.decode_worker --prefill HOST:PORT`: serve until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m examples.decode_worker",
                                     description=__doc__.splitlines()[0])
    add_worker_args(parser)
    parser.add_argument("--prefill", type=_hostport, default=None, metavar="HOST:PORT",
                        help="the prefill worker's RPC address (its readiness line's 'rpc')")
    add_directory_args(parser)
    args = parse_worker_args(parser, argv)
    if (args.prefill is None) == (args.directory is None):
        parser.error("give --prefill HOST:PORT (one prefill worker) or --directory URL "
                     "(requests name their prefill instance), not both")
    handled()  # StopSignals takes over from startup's quiet exit
    with StopSignals() as signals:  # before the model is built: see StopSignals
        try:
            deterministic_torch()
            opts = options_from_args(args, str(resolve_device(args.device)))
            follow = None
            if args.directory is not None:
                def follow(name: str) -> Any:
                    return open_from_args(args, follow=((name, "prefill"),))
            if args.prefill is not None:
                print(f"waiting for the prefill worker at {args.prefill} "
                      f"(up to {opts.rpc_timeout:.0f} s)", file=sys.stderr, flush=True)
            worker = DecodeWorker(opts, args.prefill, open_directory=follow)
        except KeyboardInterrupt:
            print("interrupted while starting", file=sys.stderr, flush=True)
            return 130
        except (PdxferError, RuntimeError, OSError) as exc:
            # One line naming the cause: what went wrong is the peer or the
            # flags, never this program, so a traceback would only bury it.
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
        return serve_until_signalled(worker.serve_forever, worker.close, args.die_with_parent,
                                     signals, worker.ready_info())


if __name__ == "__main__":
    raise SystemExit(main())
