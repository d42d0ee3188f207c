"""A prefill worker in its own process, driven over stdin, for the SIGKILL/SIGSTOP tests.

Builds the same seeded pools as the test (`pdxfer_testkit.build_pools`),
starts a `PrefillEngine` on the given port and prints `READY host:port`.
Then one command per line:

    send <rid> <kv indices, comma-separated> <state indices, comma-separated or ->
    stream <rid> <kv indices> <a> <b>  -> layers a..b-1 of those kv entries (last=True)
    wait <rid>        -> prints `OK <rid>` or `FAIL <rid> <reason>`
    until <rid> <state> -> prints `AT <rid> <state>` once poll(rid) reaches it (polled, bounded)
    peers <n>         -> prints `PEERS <count>` once `len(engine.peers())` is n (polled, bounded)
    quit

Every reply is one flushed line, so the test can step it in lock-step.
"""

from __future__ import annotations

import argparse
import time

from pdxfer_testkit import BIG_KV_FIELDS, build_pools, csv_indices, poll_or_none, serve

from pdxfer import EngineConfig, KVPoll, PrefillEngine


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kind", default="entry", help="the kv pool's axis order: entry, layer or interleaved")
    parser.add_argument("--entries", type=int, default=256)
    parser.add_argument("--grace", type=float, default=0.3)
    parser.add_argument("--fence", default="on", help="off: transport_options fence=False")
    args = parser.parse_args()
    pools = build_pools(args.entries, 16, kind=args.kind, seed=args.seed, kv_fields=BIG_KV_FIELDS)
    cfg = EngineConfig(transport=args.transport, port=args.port, timeout=args.timeout,
                       abort_grace=args.grace,
                       transport_options={"fence": False} if args.fence == "off" else {})
    engine = PrefillEngine(pools, cfg)
    print(f"READY {engine.bootstrap_address}", flush=True)

    def send(rid: str, kv: str, state: str) -> str:
        kv_idx, state_idx = csv_indices(kv), csv_indices(state)
        engine.send(rid, {"kv": kv_idx, "state": state_idx} if state_idx else {"kv": kv_idx})
        return f"SENT {rid}"

    def stream(rid: str, kv: str, a: str, b: str) -> str:
        engine.send(rid, {"kv": csv_indices(kv)}, layers=(int(a), int(b)))
        return f"SENT {rid}"

    def until(rid: str, state: str) -> str:
        want, deadline = KVPoll[state], time.monotonic() + 30.0
        now = poll_or_none(engine, rid)
        while time.monotonic() < deadline and (now is None or now < want and not now.finished):
            time.sleep(0.001)  # polling a state another thread changes, bounded
            now = poll_or_none(engine, rid)
        return f"AT {rid} {engine.poll(rid).name}"

    def peers(n: str) -> str:
        deadline = time.monotonic() + 30.0
        while len(engine.peers()) != int(n) and time.monotonic() < deadline:
            time.sleep(0.001)  # polling a table the progress thread changes, bounded
        return f"PEERS {len(engine.peers())}"

    serve(engine, {"send": send, "stream": stream, "until": until, "peers": peers})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
