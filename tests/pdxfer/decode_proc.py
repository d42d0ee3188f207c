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
import sys

from pdxfer_testkit import BIG_KV_FIELDS, build_pools

from pdxfer import DecodeEngine, EngineConfig, RequestFailed


def _indices(text: str) -> list[int]:
    return [] if text == "-" else [int(v) for v in text.split(",")]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", required=True)
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args()
    pools = build_pools(512, 16, seed=2, kv_fields=BIG_KV_FIELDS)
    engine = DecodeEngine(pools, EngineConfig(transport=args.transport, timeout=args.timeout,
                                              abort_grace=0.3))
    print(f"READY {engine.engine_id}", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "expect":
            rid, addr, kv, state = words[1], words[2], _indices(words[3]), _indices(words[4])
            engine.expect(rid, addr, {"kv": kv, "state": state} if state else {"kv": kv})
            print(f"EXPECTING {rid}", flush=True)
        elif words[0] == "wait":
            try:
                engine.wait(words[1], 30.0)
                print(f"OK {words[1]}", flush=True)
            except RequestFailed as exc:
                print(f"FAIL {words[1]} {exc.reason}", flush=True)
        elif words[0] == "quit":
            break
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
