"""A decode worker in its own process, driven over stdin, for the stalled-decode tests.

Builds the same seeded pools as the test (`pdxfer_testkit.build_pools`),
starts a `DecodeEngine` and prints `READY <engine id>`. Then one command per
line, each answered with one flushed line:

    expect <rid> <prefill addr> <kv indices> <state indices or ->   -> EXPECTING <rid>
    wait <rid>                                                     -> OK <rid> | FAIL <rid> <reason>
    quit
"""

from __future__ import annotations

import argparse

from pdxfer_testkit import BIG_KV_FIELDS, build_pools, csv_indices, serve

from pdxfer import DecodeEngine, EngineConfig


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", required=True)
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args()
    pools = build_pools(512, 16, seed=2, kv_fields=BIG_KV_FIELDS)
    engine = DecodeEngine(pools, EngineConfig(transport=args.transport, timeout=args.timeout,
                                              abort_grace=0.3))
    print(f"READY {engine.engine_id}", flush=True)

    def expect(rid: str, addr: str, kv: str, state: str) -> str:
        kv_idx, state_idx = csv_indices(kv), csv_indices(state)
        engine.expect(rid, addr, {"kv": kv_idx, "state": state_idx} if state_idx else {"kv": kv_idx})
        return f"EXPECTING {rid}"

    serve(engine, {"expect": expect})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
