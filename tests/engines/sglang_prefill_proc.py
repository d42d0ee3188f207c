"""An SGLang prefill worker in its own process, scripted over stdin: SGLang's queues, pdxfer below.

`python sglang_prefill_proc.py BOOTSTRAP_PORT HYBRID TP [RANKS [SERVER [DP [FLAGS]]]]` starts
SGLang's bootstrap server (the pdxfer backend's, i.e. SGLang's own registry;
unless SERVER is 0: then its ranks register with another process's) and the
prefill ranks RANKS (comma-separated, default all TP; each its own pdxfer
manager over its own seeded pools; see `sglang_harness` for what is real and
what is simulated; DP > 1: that many DP ranks of them, `round_robin`; FLAGS:
a JSON list of more SGLang flags), prints `{"ready": true}`, then serves one
JSON request per line (`"dp"` picks the DP rank):

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

`{"batch": [request, ...]}` serves many one-chunk requests at once, as a
scheduler's queues hold them: all are added, bootstrapped as the decode's
metadata arrives (in any order), sent, and finished; it prints
`{"batch_done": [{"room", "finished", "crc"}, ...]}`.
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
    row = room % H.ROWS  # the request's row in the token and Mamba maps (allocation simulated)
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


def serve_batch(prefill: H.Prefill, cmds: list[dict], port: int) -> None:
    """Many one-chunk requests in flight together, each stepped as its decode gets to it."""
    q, reqs = prefill.queue, {}
    for cmd in cmds:
        reqs[cmd["room"]] = (H.request(cmd["room"], cmd["n"], port), cmd)
        q.add(reqs[cmd["room"]][0], num_kv_heads=H.HEADS)
    waiting, inflight, done = dict(reqs), {}, {}
    deadline = time.monotonic() + DEADLINE_S * 10
    while len(done) < len(reqs):
        if time.monotonic() > deadline:
            raise SystemExit(f"prefill harness: batch gave up with {len(done)}/{len(reqs)} done")
        ready = q.pop_bootstrapped()
        for room, (req, cmd) in list(waiting.items()):
            if req.finished():  # bootstrap failed: SGLang aborted it
                done[room] = {"room": room, "finished": type(req.finished_reason).__name__,
                              "message": req.finished_reason.message, "crc": None}
                del waiting[room]
            elif req in ready:
                row = room % H.ROWS
                req.kv.req_pool_idx = row
                tokens = torch.cat([torch.arange(p * H.PAGE, (p + 1) * H.PAGE) for p in cmd["src"]])
                prefill.tokens.req_to_token[row, :cmd["n"]] = tokens[:cmd["n"]].to(torch.int32)
                req.output_ids = [cmd["token"]]
                prefill.send_chunk(req, cmd["n"], last=True)
                inflight[room] = (req, cmd)
                del waiting[room]
        if inflight:
            finished = prefill.inflight()
            for room, (req, cmd) in list(inflight.items()):
                if req in finished:
                    reason = req.finished_reason
                    done[room] = {"room": room, "finished": type(reason).__name__,
                                  "message": getattr(reason, "message", None),
                                  "crc": H.page_crc(prefill.pool, cmd["src"], None)}
                    del inflight[room]
        time.sleep(0.005)
    emit(batch_done=[done[room] for room in sorted(done)])


def main() -> int:
    port, hybrid, tp = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
    hosted = [int(r) for r in sys.argv[4].split(",")] if len(sys.argv) > 4 else list(range(tp))
    dp = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    # DP > 1: SGLang's system data parallel with the load balancer people set for PD
    # (`round_robin`), every DP rank a TP group of its own, each rank its own manager.
    extra = ("--dp-size", str(dp), "--load-balance-method", "round_robin") if dp > 1 else ()
    extra += tuple(json.loads(sys.argv[7])) if len(sys.argv) > 7 else ()  # more SGLang flags
    server_args = H.start("prefill", port, tp=tp, extra=extra)
    if len(sys.argv) <= 5 or sys.argv[5] == "1":
        PdxferKVBootstrapServer("127.0.0.1", port)
    ranks = {}
    for d in range(dp):
        for rank in hosted:
            H.as_rank(rank, dp_rank=d if dp > 1 else None)
            ranks[d, rank] = H.Prefill(server_args, hybrid, seed=10 + rank + 100 * d)
    emit(ready=True)
    for line in sys.stdin:
        if line.strip():
            cmd = json.loads(line)
            one = cmd["batch"][0] if "batch" in cmd else cmd
            d = one.get("dp", 0)
            H.as_rank(one["rank"], dp_rank=d if dp > 1 else None)
            if "batch" in cmd:
                serve_batch(ranks[d, one["rank"]], cmd["batch"], port)
            else:
                serve(ranks[d, one["rank"]], cmd, port)
    for p in ranks.values():
        p.queue.kv_manager.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
