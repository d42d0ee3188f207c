"""A prefill worker using examples/sglang_adapter.py, in its own process, scripted over stdin.

Prints `{"bootstrap": addr}`, then for each JSON request line
`{"room", "pages", "slot", "chunk", "mode"}` drives one `KVSender` the way
SGLang's prefill scheduler does (poll until WaitingForInput, send chunk by
chunk, poll until finished) and prints JSON events:

- `normal`: `{"room", "state", "crc"}` once finished (crc of its source pages);
- `abort-mid`: `{"room", "phase": "sent-first"}` after the first chunk, then
  polls without sending more until the decode's abort fails it;
- `abort-early`: `{"room", "phase": "waiting"}` once decode expects it, then
  sends everything when the test writes `go`.

Finished requests print `state`, and `reason` from `failure_exception()`.
"""

from __future__ import annotations

import json
import sys
import time

from sglang_kit import checksum, seeded_pools

from examples.sglang_adapter import KVManager, KVSender
from pdxfer import EngineConfig, KVPoll, RequestFailed

_POLL_S = 0.002  # a scheduler loop's tick


def _until(sender: KVSender, done, deadline_s: float = 30.0) -> KVPoll:
    deadline = time.monotonic() + deadline_s
    while not done(state := sender.poll()):
        if time.monotonic() > deadline:
            raise SystemExit(f"sender stuck in {state.name}")
        time.sleep(_POLL_S)
    return state


def _emit(**event) -> None:
    print(json.dumps(event), flush=True)


def main() -> int:
    transport = sys.argv[1]
    pools = seeded_pools(64, 8, seed=1)
    mgr = KVManager("prefill", pools, EngineConfig(transport=transport, timeout=5.0, abort_grace=0.3))
    _emit(bootstrap=mgr.bootstrap_addr)
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            room, pages, chunk, mode = req["room"], req["pages"], req["chunk"], req["mode"]
            sender = KVSender(mgr, room)
            sender.init(len(pages))
            _until(sender, lambda s: s is not KVPoll.Bootstrapping)
            chunks = [pages[i:i + chunk] for i in range(0, len(pages), chunk)]
            if mode == "abort-mid":
                sender.send(chunks[0])
                _emit(room=room, phase="sent-first")
                chunks = []
            elif mode == "abort-early":
                _emit(room=room, phase="waiting")
                assert sys.stdin.readline().strip() == "go"
            for part in chunks:
                sender.send(part, [req["slot"]])
            state = _until(sender, lambda s: s.finished)
            reason = None
            try:
                sender.failure_exception()
            except RequestFailed as exc:
                reason = exc.reason
            _emit(room=room, state=state.name, reason=reason,
                  crc=checksum(pools, pages, req["slot"]))
            sender.clear()
    finally:
        mgr.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
