"""A prefill worker in its own process, driven over stdin, for the SIGKILL/SIGSTOP tests.

Builds the same seeded pools as the test (`pdxfer_testkit.build_pools`),
starts a `PrefillEngine` on the given port and prints `READY host:port`.
Then one command per line:

    send <rid> <kv indices, comma-separated> <state indices, comma-separated or ->
    wait <rid>        -> prints `OK <rid>` or `FAIL <rid> <reason>`
    until <rid> <state> -> prints `AT <rid> <state>` once poll(rid) reaches it (polled, bounded)
    quit

Every reply is one flushed line, so the test can step it in lock-step.
"""

from __future__ import annotations

import argparse
import sys
import time

from pdxfer_testkit import BIG_KV_FIELDS, build_pools

from pdxfer import EngineConfig, KVPoll, PrefillEngine, RequestFailed, UnknownRequestError


def _indices(text: str) -> list[int]:
    return [] if text == "-" else [int(v) for v in text.split(",")]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    pools = build_pools(256, 16, seed=args.seed, kv_fields=BIG_KV_FIELDS)
    cfg = EngineConfig(transport=args.transport, port=args.port, timeout=args.timeout, abort_grace=0.3)
    engine = PrefillEngine(pools, cfg)
    print(f"READY {engine.bootstrap_address}", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "send":
            rid, kv, state = words[1], _indices(words[2]), _indices(words[3])
            engine.send(rid, {"kv": kv, "state": state} if state else {"kv": kv})
            print(f"SENT {rid}", flush=True)
        elif words[0] == "wait":
            try:
                engine.wait(words[1], 30.0)
                print(f"OK {words[1]}", flush=True)
            except RequestFailed as exc:
                print(f"FAIL {words[1]} {exc.reason}", flush=True)
        elif words[0] == "until":
            rid, want = words[1], KVPoll[words[2]]
            until = time.monotonic() + 30.0
            while time.monotonic() < until:
                try:
                    if engine.poll(rid) >= want:
                        break
                except UnknownRequestError:
                    pass
                time.sleep(0.001)
            print(f"AT {rid} {engine.poll(rid).name}", flush=True)
        elif words[0] == "quit":
            break
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
