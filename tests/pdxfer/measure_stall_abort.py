"""Issue #29 item 3's adversary on a timeline, against this checkout or an older one.

    PYTHONPATH=ROOT python tests/pdxfer/measure_stall_abort.py ROOT BACKEND VARIANT
        [--grace G] [--secs S] [--big N]

Prefill P and healthy decode D2 in this process, decode D1 in a child (ROOT's
tests/pdxfer/decode_proc.py); D1 warmed by one request, expects `big` (N
entries of 32 KiB, default 500 = 16 MiB), is SIGSTOPped; P sends `big` and
aborts it. Then D2's requests, by VARIANT:

  burst    D2 cold, 8 requests right after the abort (the suite's first test)
  seq      D2 warm before the stall; one request at a time for --secs, each waited
  seqcold  the same with D2 cold (its handshake beside the pending abort)
  late     D2 cold; its requests start once `big` failed on P (the cut done)
  pipe     D2 warm; a request every 0.2 s for --secs, all waited at the end

Prints a line per request slower than 0.3 s or failed, and `RESULT ... ok= fails=
max_lat=`. ROOT must import as itself: an older checkout needs `pdxfer/transport`
and `pdxfer/layout` linked to its own folders (docs/reliability.md, #29 item 3).
"""
import sys
import time

root, backend, variant = sys.argv[1], sys.argv[2], sys.argv[3]
grace = None
secs = 8.0
big_n = 500
args = sys.argv[4:]
while args:
    k = args.pop(0)
    if k == "--grace":
        grace = float(args.pop(0))
    elif k == "--secs":
        secs = float(args.pop(0))
    elif k == "--big":
        big_n = int(args.pop(0))
sys.path[:0] = [root, root + "/tests/pdxfer"]

from pdxfer_procs import Decode  # noqa: E402
from pdxfer_testkit import BIG_KV_FIELDS, build_pools, poll_or_none, until  # noqa: E402

import pdxfer  # noqa: E402
from pdxfer import DecodeEngine, EngineConfig, KVPoll, PrefillEngine, RequestFailed  # noqa: E402

assert pdxfer.__file__.startswith(root), pdxfer.__file__
kw = dict(transport=backend, timeout=2.0)
if grace is not None:
    kw["abort_grace"] = grace
cfg = EngineConfig(**kw)
BIG = list(range(big_n))
t0 = time.monotonic()


def log(*a) -> None:
    print(f"{time.monotonic() - t0:7.3f}", *a, flush=True)


prefill = PrefillEngine(build_pools(512, 16, seed=1, kv_fields=BIG_KV_FIELDS), cfg)
healthy = DecodeEngine(build_pools(512, 16, seed=2, kv_fields=BIG_KV_FIELDS), cfg)
stalled = Decode(backend, timeout=2.0)
addr = prefill.bootstrap_address
fails = []
lat = []
n = 0


def one(rid: str, i: int) -> None:
    healthy.expect(rid, addr, {"kv": [8 * (i % 60), 8 * (i % 60) + 1], "state": [i % 16]})
    prefill.send(rid, {"kv": [i % 500, (i + 1) % 500], "state": [i % 16]})


try:
    stalled.expect("s-warm", addr, list(range(4)), [])
    prefill.send("s-warm", {"kv": list(range(4))})
    assert stalled.wait("s-warm") == "OK s-warm"
    if variant not in ("burst", "late", "seqcold"):
        one("h-warm", 0)
        assert healthy.wait("h-warm", 30) is KVPoll.Success
    stalled.expect("big", addr, [8 + i for i in BIG], [])
    until(lambda: poll_or_none(prefill, "big") is KVPoll.WaitingForInput, "Expect seen")
    stalled.freeze()
    log("frozen")
    prefill.send("big", {"kv": BIG})
    prefill.abort("big")
    log("aborted")
    if variant == "burst":
        for i in range(8):
            one(f"h{i}", i)
        for i in range(8):
            s = time.monotonic()
            try:
                healthy.wait(f"h{i}", 30)
                prefill.wait(f"h{i}", 30)
                lat.append(time.monotonic() - s)
            except RequestFailed as e:
                fails.append((f"h{i}", str(e)))
    if variant == "late":
        until(lambda: poll_or_none(prefill, "big") is KVPoll.Failed, "big failed", 30)
        log("big Failed on the prefill")
        variant = "seq"
    if variant in ("seq", "seqcold"):
        end = time.monotonic() + secs
        while time.monotonic() < end:
            n += 1
            rid = f"h{n}"
            s = time.monotonic()
            one(rid, n)
            try:
                healthy.wait(rid, 30)
                prefill.wait(rid, 30)
                lat.append(time.monotonic() - s)
                if lat[-1] > 0.3:
                    log(f"slow {rid} {lat[-1]:.3f}")
            except RequestFailed as e:
                fails.append((rid, str(e)))
                log(f"FAIL {rid} after {time.monotonic() - s:.3f}: {e}")
    elif variant == "pipe":
        end = time.monotonic() + secs
        posted = []
        while time.monotonic() < end:
            n += 1
            rid = f"h{n}"
            one(rid, n)
            posted.append((rid, time.monotonic()))
            time.sleep(0.2)
        for rid, _posted_at in posted:
            try:
                healthy.wait(rid, 30)
                prefill.wait(rid, 30)
            except RequestFailed as e:
                fails.append((rid, str(e)))
                log(f"FAIL {rid}: {e}")
    try:
        prefill.wait("big", 30)
        log("big: no failure?!")
    except RequestFailed as e:
        log("big failed:", e.reason if hasattr(e, "reason") else e)
finally:
    log(f"RESULT {backend} {variant}: ok={len(lat) if lat else '-'} fails={len(fails)} "
        f"max_lat={max(lat) if lat else 0:.3f}")
    for f in fails[:5]:
        log("  ", f)
    stalled.stop()
    healthy.close()
    prefill.close()
    log("closed")
