"""One SGLang decode TP rank in its own process, scripted over stdin; WORLD of them form a gloo group.

`python sglang_decode_proc.py RANK WORLD INIT_FILE` joins a real WORLD-rank
gloo group (the TP group SGLang's decode queues all-reduce their polls and
holds over), builds this rank's decode queues (`sglang_harness.Decode`) over
two pdxfer managers, `tcp` (fences) and `nofence` (tcp with `fence=False`,
what a one-sided transport that cannot fence does), prints `{"ready": true}`
and serves one JSON command per line. Every rank must get the same commands
in the same order (their queue turns are collectives), except `abort`:

    {"op": "admit", "key", "room", "n", "port", "dst"}  -> {"admitted": room}
    {"op": "abort", "key", "room"}                      -> {"aborted": room}
    {"op": "run", "key", "room"}   turns pop_transferred + resolve_deferred_releases
                                   until the room left both -> {"room", "finished",
                                   "message", "releases", "at_release"}; first
                                   {"phase": "quarantined"} if pdxfer quarantined it
    {"op": "check", "key", "room"}                      -> {"canary": bool}

`run` plays the next owner of the pages: the instant SGLang frees them it
records pdxfer's state of the request (`at_release`) and writes a canary over
them; `check`, sent once the prefill's last write is over, says whether any
byte of them changed since.
"""

from __future__ import annotations

import json
import sys
import time

import sglang_harness as H
import torch

from pdxfer.integrations.sglang import request_id

CANARY = 77.0
DEADLINE_S = 60.0


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def main() -> int:
    rank, world, init_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    server_args = H.start("decode", 0, tp=world, rank=rank, world=world, init_file=init_file)
    H.as_rank(rank)
    decodes = {}
    for key, config in (("tcp", {"timeout": 2.0}),
                        ("nofence", {"timeout": 10.0, "heartbeat_interval": 0.5,
                                     "transport_options": {"fence": False}})):
        H.pdxfer_env(**config)
        decodes[key] = H.Decode(server_args, hybrid=False)
    reqs: dict[int, tuple] = {}
    emit(ready=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        dec, room = decodes[cmd["key"]], cmd["room"]
        if cmd["op"] == "admit":
            req = H.request(room, cmd["n"], cmd["port"])
            mgr, addr = dec.prealloc.kv_manager, f"127.0.0.1:{cmd['port']}"
            # This rank's registry lookup first (per rank, no collective), so both ranks
            # resolve the request in the same queue turn, as a warm scheduler does.
            deadline = time.monotonic() + DEADLINE_S
            while not mgr.try_ensure_parallel_info(addr):
                assert time.monotonic() < deadline, "registry lookup"
            dreq = dec.admit(req)
            while not (dreq.waiting_for_input or req.finished()):  # reduced: same turn on every rank
                assert time.monotonic() < deadline, "handshake"
                dec.prealloc._update_handshake_waiters()
            dec.allocate(dreq, cmd["dst"], None)
            reqs[room] = (req, dreq, cmd["dst"])
            emit(admitted=room)
        elif cmd["op"] == "abort":
            reqs[room][1].kv_receiver.abort()
            emit(aborted=room)
        elif cmd["op"] == "run":
            req, dreq, dst = reqs[room]
            engine, at_release = dec.prealloc.kv_manager.engine, []

            def freed(r, dec=dec, engine=engine, dst=dst, at_release=at_release):
                state = engine.try_poll(request_id(r.bootstrap_room, rank))
                at_release.append(None if state is None else state.name)
                for t in H.buffers(dec.pool):
                    t.view(-1, H.PAGE, *t.shape[1:])[torch.as_tensor(dst)] = CANARY

            releases, deadline, told = 0, time.monotonic() + DEADLINE_S, False
            while req in [d.req for d in dec.transfer.queue] or dec.busy():
                assert time.monotonic() < deadline, "transfer queue"
                if not told and request_id(room, rank) in engine.quarantined():
                    told = True  # the test may now let the prefill go (kill it)
                    emit(phase="quarantined", room=room)
                _, release = dec.transferred(on_release=freed)
                releases += release.call_count
                time.sleep(0.005)
            reason = req.finished_reason
            emit(room=room, finished=type(reason).__name__, message=getattr(reason, "message", None),
                 releases=releases, at_release=at_release)
        elif cmd["op"] == "check":
            dst = reqs[room][2]
            ok = all(bool((t.view(-1, H.PAGE, *t.shape[1:])[torch.as_tensor(dst)] == CANARY).all())
                     for t in H.buffers(dec.pool))
            emit(canary=ok)
    for dec in decodes.values():
        dec.prealloc.kv_manager.close()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
