"""A prefill process that registers itself in etcd, for the directory's SIGKILL/SIGSTOP tests.

`prefill_proc.py`'s engine (same seeded pools) plus an `EtcdDirectory`
holding one record under `--cluster`, slot (m, prefill, `--instance`, 0, 0),
on a lease of `--ttl` seconds. Prints `READY <bootstrap address> <engine id>`
once registered, then serves `send`/`wait` lines (`pdxfer_testkit.serve`).
"""

from __future__ import annotations

import argparse

from pdxfer_testkit import BIG_KV_FIELDS, build_pools, csv_indices, serve

from pdxfer import EngineConfig, PrefillEngine
from pdxfer.directory import EtcdDirectory, Slot, engine_record


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--instance", default="p0")
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    pools = build_pools(256, 16, seed=1, kv_fields=BIG_KV_FIELDS)
    engine = PrefillEngine(pools, EngineConfig(transport="tcp", port=args.port, timeout=2.0,
                                               abort_grace=0.3))
    directory = EtcdDirectory(args.etcd, cluster=args.cluster, ttl=args.ttl)
    record, layouts = engine_record(Slot("m", "prefill", args.instance), engine, pools)
    directory.register(record.slot, record, layouts)
    print(f"READY {engine.bootstrap_address} {engine.engine_id}", flush=True)

    def send(rid: str, kv: str, state: str) -> str:
        kv_idx, state_idx = csv_indices(kv), csv_indices(state)
        engine.send(rid, {"kv": kv_idx, "state": state_idx} if state_idx else {"kv": kv_idx})
        return f"SENT {rid}"

    try:
        serve(engine, {"send": send})
    finally:
        directory.close()
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
