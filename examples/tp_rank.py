"""One tensor-parallel rank of the heterogeneous-TP example, as its own process.

`python -m examples.tp_rank --role prefill|decode --tp T --rank R ...` joins
its TP group (gloo over a FileStore the launcher names), builds its
shard-major pools and a pdxfer engine over them, prints one readiness line
(`examples.serving`: role, rank, bootstrap address), and then serves the
launcher's requests, which every rank derives from the same seed:

- prefill: run each prompt (attention over its heads, all-gathered), then
  `HeteroTPPrefill.send` its part to every decode rank it contributes to, and
  wait until they have it;
- decode: read the prefill group's addresses from stdin (the launcher learns
  them from the prefill ranks' readiness lines), `HeteroTPDecode.expect` each
  request, wait for every contributing rank's bytes, decode.

Each rank ends by printing one `RESULT` JSON line (tokens and per-request
transfer figures) and exits 0, or 1 with the reason on stderr. Every wait is
bounded by `--timeout` (engines) and the collective's own timeout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import signal
import sys

import numpy as np
import torch.distributed as dist

from pdxfer import DecodeEngine, EngineConfig, HeteroTPDecode, HeteroTPPrefill, PrefillEngine

from .caches import PoolSizes, decode_counts, prefill_counts
from .model import deterministic_torch
from .serving import announce_ready
from .tp_model import TP_CONFIG, TPCaches, TPModel

RESULT_PREFIX = "PDXFER_TP_RESULT "


def prompts(seed: int, requests: int, prompt_len: int) -> list[list[int]]:
    """The launcher's prompts; every rank and the reference derive the same ones."""
    rng = random.Random(seed)
    return [[rng.randrange(TP_CONFIG.vocab) for _ in range(prompt_len)] for _ in range(requests)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.tp_rank",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--peer-tp", type=int, required=True, help="the other group's TP size")
    parser.add_argument("--store", required=True, help="FileStore path of this TP group")
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=12)
    parser.add_argument("--gen-len", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--replicated", action="store_true", help="MLA-style replicated K/V")
    parser.add_argument("--transport", default="tcp", help="pdxfer backend of this rank's engine")
    args = parser.parse_args(argv)
    if not 0 <= args.rank < args.tp:
        parser.error(f"--rank {args.rank} outside 0..{args.tp - 1}")
    return args


def _join_group(args: argparse.Namespace) -> object:
    if args.tp == 1:
        return None
    store = dist.FileStore(args.store, args.tp)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.tp,
                            timeout=datetime.timedelta(seconds=3 * args.timeout))
    return dist.group.WORLD


def run(args: argparse.Namespace, announce=announce_ready,
        read_group=lambda: sys.stdin.readline().strip()) -> dict:
    """One rank's whole life; `announce`/`read_group` default to stdout/stdin."""
    deterministic_torch()
    group = _join_group(args)
    cfg = TP_CONFIG
    model = TPModel(cfg, "cpu", tp=args.tp, rank=args.rank, replicated_kv=args.replicated,
                    group=group)
    need = decode_counts(cfg, args.prompt_len, args.gen_len)
    sizes = PoolSizes(kv_pages=args.requests * need["kv"], state_entries=args.requests)
    caches = TPCaches(cfg, sizes, model.device, tp=args.tp, rank=args.rank,
                      replicated_kv=args.replicated)
    config = EngineConfig(transport=args.transport, timeout=args.timeout)
    result: dict = {"role": args.role, "rank": args.rank, "tokens": {}, "segments": {},
                    "nbytes": {}, "pairs": {}}
    if args.role == "prefill":
        engine = PrefillEngine(caches.pools, config)
        group_side = HeteroTPPrefill(engine, caches.pools)
        announce({"role": "prefill", "rank": args.rank, "bootstrap": engine.bootstrap_address,
                  "transport": engine.config.transport})
    else:
        engine = DecodeEngine(caches.pools, config)
        group_side = HeteroTPDecode(engine, caches.pools)
        announce({"role": "decode", "rank": args.rank, "transport": engine.config.transport})
    try:
        if args.role == "prefill":
            _prefill(args, model, caches, group_side, result)
        else:
            prefill_group = read_group()
            _decode(args, model, caches, group_side, prefill_group, result)
    finally:
        engine.close()
        if group is not None:
            dist.destroy_process_group()
    return result


def _record(result: dict, group_side, rid: str) -> None:
    stats = group_side.stats(rid)
    result["segments"][rid] = stats.segments
    result["nbytes"][rid] = stats.nbytes
    result["pairs"][rid] = len(group_side.sub_requests(rid))


def _prefill(args, model, caches, group_side: HeteroTPPrefill, result: dict) -> None:
    for i, prompt in enumerate(prompts(args.seed, args.requests, args.prompt_len)):
        rid = f"req-{i}"
        src = caches.allocate(prefill_counts(model.cfg, len(prompt)))
        model.prefill(caches, prompt, src["kv"], int(src["state"][0]), int(src["aux"][0]))
        group_side.send(rid, src, decode_tp=args.peer_tp)
        group_side.wait(rid, timeout=3 * args.timeout)
        _record(result, group_side, rid)


def _decode(args, model, caches, group_side: HeteroTPDecode, prefill_group: str,
            result: dict) -> None:
    for i, prompt in enumerate(prompts(args.seed, args.requests, args.prompt_len)):
        rid = f"req-{i}"
        dst = caches.allocate(decode_counts(model.cfg, len(prompt), args.gen_len))
        first = {"kv": dst["kv"][: prefill_counts(model.cfg, len(prompt))["kv"]],
                 "state": dst["state"], "aux": dst["aux"]}
        group_side.expect(rid, prefill_group, first)
        group_side.wait(rid, timeout=3 * args.timeout)
        _record(result, group_side, rid)
        tokens = model.decode(caches, len(prompt), args.gen_len, np.asarray(dst["kv"]),
                              int(dst["state"][0]), int(dst["aux"][0]))
        result["tokens"][rid] = tokens


def forked(argv: list[str], conn) -> None:
    """A rank forked by `examples.launch_tp`: the same `run`, over a pipe instead of stdio.

    Forked rather than exec'd so that a 9-process run does not import torch
    nine times on a shared two-core machine.
    """
    # A terminal's Ctrl-C reaches every rank too: the launcher answers it and
    # stops the ranks, so a rank neither dies mid-collective nor prints a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = parse_args(argv)

    def read_group() -> str:
        if not conn.poll(3 * args.timeout):
            raise TimeoutError(f"no prefill group from the launcher within {3 * args.timeout} s")
        return conn.recv()

    try:
        result = run(args, lambda info: conn.send(("ready", info)), read_group)
    except Exception as exc:
        conn.send(("error", f"{args.role} rank {args.rank}: {type(exc).__name__}: {exc}"))
    else:
        conn.send(("result", result))
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except Exception as exc:  # the launcher reads the reason from stderr
        print(f"[{args.role} rank {args.rank}] error: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        return 1
    print(RESULT_PREFIX + json.dumps(result, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
