"""An SGLang prefill worker in its own process, scripted over stdin: SGLang's queues, pdxfer below.

`python sglang_prefill_proc.py BOOTSTRAP_PORT KIND TP [RANKS [SERVER [DP [FLAGS]]]]` starts
SGLang's bootstrap server (the pdxfer backend's, i.e. SGLang's own registry;
unless SERVER is 0: then its ranks register with another process's) and the
prefill ranks RANKS (comma-separated, default all TP; each its own pdxfer
manager over its own seeded pools; see `sglang_harness` for what is real and
what is simulated; DP > 1: that many DP ranks of them, `round_robin`; FLAGS:
a JSON list of more SGLang flags), prints `{"ready": true}`, then serves one
JSON request per line (`"dp"` picks the DP rank; KIND is 0 (MHA), 1 (MHA + Mamba) or mla):

    {"rank" or "ranks": [...], "room", "n", "src": [pages], "slot", "ends": [token ends], "token", "mode"}

It adds the request to each rank's `PrefillBootstrapQueue` (`ranks`: the TP
ranks of one group, stepped together), polls
`pop_bootstrapped` until the decode's metadata arrived, runs one simulated
forward per entry of `ends` (the last is the last chunk) through the real
`_send_kv_chunk`, and polls the inflight queue until SGLang finishes the
request, printing per rank `{"room", "rank", "finished", "message", "crc", "page_crcs",
"nbytes"}` (the bytes its sender moved). Modes: `normal`;
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


def serve(prefills: dict[int, H.Prefill], cmd: dict, port: int) -> None:
    """One request on each of `prefills` (TP rank -> rank), stepped together as a TP group is."""
    room, n, src, slot = cmd["room"], cmd["n"], cmd["src"], cmd.get("slot")
    reqs = {rank: H.request(room, n, port) for rank in prefills}

    def be(rank: int) -> None:
        H.as_rank(rank, dp_rank=cmd.get("dp", 0) if cmd["dp_size"] > 1 else None)

    def each(fn) -> None:
        for rank, prefill in prefills.items():
            be(rank)
            fn(rank, prefill, reqs[rank])

    each(lambda rank, prefill, req: prefill.queue.add(req, num_kv_heads=H.HEADS))
    pending = dict(prefills)
    deadline = time.monotonic() + DEADLINE_S
    while pending:
        if time.monotonic() > deadline:
            raise SystemExit("prefill harness: gave up waiting")
        for rank in list(pending):
            be(rank)
            q, req = pending[rank].queue, reqs[rank]
            if req in q.pop_bootstrapped() or req.finished():
                del pending[rank]
        time.sleep(0.005)
    senders = {rank: req.disagg_kv_sender for rank, req in reqs.items()}
    failed = {rank: req for rank, req in reqs.items() if req.finished()}
    for rank, req in failed.items():  # bootstrap failed: SGLang already aborted and streamed it
        emit(room=room, rank=rank, finished=type(req.finished_reason).__name__,
             message=req.finished_reason.message, crc=None)
    prefills = {rank: p for rank, p in prefills.items() if rank not in failed}
    if not prefills:
        return
    if cmd["mode"] == "hold":
        emit(room=room, phase="bootstrapped")
        assert sys.stdin.readline().strip() == "go"
    row = room % H.ROWS  # the request's row in the token and Mamba maps (allocation simulated)
    tokens = torch.cat([torch.arange(p * H.PAGE, (p + 1) * H.PAGE) for p in src])[:n]

    def forward(rank, prefill, req) -> None:
        req.kv.req_pool_idx = row
        prefill.tokens.req_to_token[row, :n] = tokens.to(torch.int32)
        if slot is not None:
            prefill.tokens.req_index_to_mamba_index_mapping[row] = slot
        req.output_ids = [cmd["token"]]  # the forward pass, simulated: its first sampled token
        if cmd["mode"] == "corrupt":
            mb, set_buf = prefill.mb, prefill.mb.set_buf

            def corrupted(r, mb=mb, set_buf=set_buf):
                set_buf(r)
                mb.bootstrap_room[r.metadata_buffer_index, 0] = r.bootstrap_room + 1

            mb.set_buf = corrupted

    each(forward)
    ends = cmd["ends"]
    for i, end in enumerate(ends):
        last = i == len(ends) - 1
        each(lambda rank, prefill, req, end=end, last=last: prefill.send_chunk(req, end, last=last))
        if i == 0 and cmd["mode"] in ("step", "die"):
            for rank in prefills:
                posted = senders[rank].kv_mgr.engine.stats(senders[rank].rid).nbytes  # counted at post
                emit(room=room, phase="sent-first", nbytes=posted)
            assert sys.stdin.readline().strip() == "go"  # `die`: stopped, then killed, here
    if cmd["mode"] == "corrupt":
        for prefill in prefills.values():
            del prefill.mb.set_buf  # the instance attribute: the class's own again
    pending, deadline = dict(prefills), time.monotonic() + DEADLINE_S
    while pending:
        if time.monotonic() > deadline:
            raise SystemExit("prefill harness: gave up waiting for the inflight queue")
        for rank in list(pending):
            be(rank)
            if reqs[rank] in pending[rank].inflight():
                del pending[rank]
        time.sleep(0.005)
    for rank, prefill in prefills.items():
        reason = reqs[rank].finished_reason
        emit(room=room, rank=rank, finished=type(reason).__name__,
             message=getattr(reason, "message", None), crc=H.page_crc(prefill.pool, src, slot),
             page_crcs=[H.page_crc(prefill.pool, [page], None) for page in src],
             nbytes=senders[rank].get_transfer_metric().transfer_total_bytes)


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
    port, hybrid, mla, tp = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[2] == "mla", int(sys.argv[3])
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
            # MLA's latent cache is replicated over the TP ranks: the same bytes on each
            seed = 10 + 100 * d + (0 if mla else rank)
            ranks[d, rank] = H.Prefill(server_args, hybrid, seed=seed, mla=mla)
    emit(ready=True)
    for line in sys.stdin:
        if line.strip():
            cmd = json.loads(line)
            one = cmd["batch"][0] if "batch" in cmd else cmd
            d = one.get("dp", 0)
            H.as_rank(one.get("rank", 0), dp_rank=d if dp > 1 else None)
            if "batch" in cmd:
                serve_batch(ranks[d, one["rank"]], cmd["batch"], port)
            else:
                group = cmd.get("ranks", [cmd.get("rank", 0)])
                serve({r: ranks[d, r] for r in group}, {**cmd, "dp_size": dp}, port)
    for p in ranks.values():
        p.queue.kv_manager.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
