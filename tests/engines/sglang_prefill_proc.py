"""An SGLang prefill worker in its own process, scripted over stdin: SGLang's queues, pdxfer below.

`python sglang_prefill_proc.py BOOTSTRAP_PORT HYBRID TP` starts SGLang's
bootstrap server (the pdxfer backend's, i.e. SGLang's own registry) and TP
prefill ranks (each its own pdxfer manager over its own seeded pools; see
`sglang_harness` for what is real and what is simulated), prints
`{"ready": true}`, then serves one JSON request per line:

    {"rank", "room", "n", "src": [pages], "slot", "ends": [token ends], "token", "mode"}

It adds the request to the rank's `PrefillBootstrapQueue`, polls
`pop_bootstrapped` until the decode's metadata arrived, runs one simulated
forward per entry of `ends` (the last is the last chunk) through the real
`_send_kv_chunk`, and polls the inflight queue until SGLang finishes the
request, printing `{"room", "finished", "message", "crc"}`. Modes: `normal`;
`step` (prints `{"phase": "sent-first", "nbytes"}` (bytes posted) after the first chunk and waits for
a `go` line); `hold` (prints `{"phase": "bootstrapped"}` and waits for `go`
before any chunk); `corrupt` (the aux row's room is overwritten after SGLang
filled it); `die` (prints `sent-first`, then waits to be stopped/killed).
"""

from __future__ import annotations

import json
import sys
import time

import sglang_harness as H
import torch

from pdxfer.integrations.sglang import PdxferKVBootstrapServer

DEADLINE_S = 60.0  # a scheduler loop's patience in this harness; the tests bound themselves


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def until(fn):
    deadline = time.monotonic() + DEADLINE_S
    while not (out := fn()):
        if time.monotonic() > deadline:
            raise SystemExit("prefill harness: gave up waiting")
        time.sleep(0.005)
    return out


def serve(prefill: H.Prefill, cmd: dict, port: int) -> None:
    room, n, src, slot = cmd["room"], cmd["n"], cmd["src"], cmd.get("slot")
    req = H.request(room, n, port)
    q = prefill.queue
    q.add(req, num_kv_heads=H.HEADS)
    until(lambda: req in q.pop_bootstrapped() or req.finished())
    if req.finished():  # bootstrap failed: SGLang already aborted and streamed it
        return emit(room=room, finished=type(req.finished_reason).__name__,
                    message=req.finished_reason.message, crc=None)
    if cmd["mode"] == "hold":
        emit(room=room, phase="bootstrapped")
        assert sys.stdin.readline().strip() == "go"
    row = room % 8  # the request's row in the token and Mamba maps (allocation simulated)
    req.kv.req_pool_idx = row
    tokens = torch.cat([torch.arange(p * H.PAGE, (p + 1) * H.PAGE) for p in src])[:n]
    prefill.tokens.req_to_token[row, :n] = tokens.to(torch.int32)
    if slot is not None:
        prefill.tokens.req_index_to_mamba_index_mapping[row] = slot
    req.output_ids = [cmd["token"]]  # the forward pass, simulated: its first sampled token
    if cmd["mode"] == "corrupt":
        mb, set_buf = prefill.mb, prefill.mb.set_buf

        def corrupted(r):
            set_buf(r)
            mb.bootstrap_room[r.metadata_buffer_index, 0] = r.bootstrap_room + 1

        mb.set_buf = corrupted
    ends = cmd["ends"]
    for i, end in enumerate(ends):
        prefill.send_chunk(req, end, last=i == len(ends) - 1)
        if i == 0 and cmd["mode"] in ("step", "die"):
            posted = prefill.queue.kv_manager.engine.stats(str(room)).nbytes  # counted at post
            emit(room=room, phase="sent-first", nbytes=posted)
            assert sys.stdin.readline().strip() == "go"  # `die`: stopped, then killed, here
    if cmd["mode"] == "corrupt":
        prefill.mb.set_buf = set_buf
    until(lambda: req in prefill.inflight())
    reason = req.finished_reason
    emit(room=room, finished=type(reason).__name__, message=getattr(reason, "message", None),
         crc=H.page_crc(prefill.pool, src, slot))


def main() -> int:
    port, hybrid, tp = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
    server_args = H.start("prefill", port, tp=tp)
    PdxferKVBootstrapServer("127.0.0.1", port)
    ranks = []
    for rank in range(tp):
        H.as_rank(rank)
        ranks.append(H.Prefill(server_args, hybrid, seed=10 + rank))
    emit(ready=True)
    for line in sys.stdin:
        if line.strip():
            cmd = json.loads(line)
            H.as_rank(cmd["rank"])
            serve(ranks[cmd["rank"]], cmd, port)
    for p in ranks:
        p.queue.kv_manager.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
