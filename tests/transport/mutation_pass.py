"""The mutation pass (#9, #19): delete one safety check at a time and see whether the suite notices.

Since #19 most checks live once, in the kit (K*), and are caught by the kit's
cases over every registry configuration; the backends' own guards (L*, T*,
N*, V*) by their own tests.

`python tests/transport/mutation_pass.py [NAME ...]` copies the committed tree (git
archive HEAD) to a scratch directory, makes it importable as `pdxfer` ahead of the
editable install, and for each mutation: applies it, runs its tests with `pytest -x`,
restores the file, and prints `NAME :: CAUGHT|MISSED | pytest's last line`. The working
tree is never edited. docs/reliability.md records the results.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

T = "tests/transport/"
KIT = T + "test_kit_conformance.py"


def kit(expr: str) -> list[str]:
    """The kit's cases matching `expr`, over every registry configuration."""
    return [KIT, "-k", expr]


# name, file, old text, new text, tests
MUTATIONS = [
    # -- the kit: one copy guards every backend ---------------------------------------------
    ("K1", "transport/inbound.py", "        self.cut()\n        with self.guard:  # waits out a landing or a notify in progress (re-entrant)\n            pass",
     "        self.cut()", kit("no_notify_starts_after_drop_peer")),
    ("K2", "transport/inbound.py", "                if self.dead:\n                    return False\n                if payload is not None",
     "                if payload is not None", kit("no_notify_starts or fences_earlier")),
    ("K3", "transport/link.py", "        nbytes = check_table(table, src.length, dst.length)",
     "        nbytes = int(table[:, 2].sum()) if table.shape[0] else 0", kit("bad_table")),
    ("K4", "transport/link.py", "        if dst.length != length:\n            raise",
     "        if False:\n            raise", kit("bad_region")),
    ("K5", "transport/engine.py", "        if not self.capabilities.fence:\n            raise",
     "        if False:\n            raise", kit("drop_peer_is_a_fence_or_refuses")),
    ("K6", "transport/engine.py", "    if unknown:\n", "    if False:\n", kit("unknown_option or refused_not_ignored")),
    ("K7", "transport/posting.py", "        if not self._waiting and reached(post.ready):", "        if not self._waiting:",
     kit("waits_in_its_links_queue or never_reached")),
    ("K8", "transport/dial.py", "            reply = protocol.recv(sock, deadline=deadline)",
     "            sock.settimeout(timeout)\n            reply = protocol.recv(sock)", kit("trickling_its_welcome")),
    ("K9", "transport/dial.py", "        for sock in socks:\n            try:\n                sock.shutdown",
     "        for sock in []:\n            try:\n                sock.shutdown", kit("close_ends_a_dial")),
    ("K10", "transport/listener.py", "                full = len(self._pending) >= self.max_pending",
     "                full = False", kit("pending_connections")),
    ("K11", "transport/listener.py", "            slot.admitted()  # first: a peer that sees the EOF finds the slot free\n"
     "            slot.expire()", "            pass", kit("trickling_its_handshake")),
    ("K12", "transport/wire.py", "        limit = self.max_frame if limit is None else min(limit, self.max_frame)",
     "        limit = self.max_frame", kit("pre_handshake")),
    ("K13", "transport/listener.py", "    msg = protocol.recv(sock, HANDSHAKE_MAX_FRAME)", "    msg = protocol.recv(sock)",
     kit("pre_handshake")),
    ("K14", "transport/wire.py", "    buf = bytearray()\n    while", "    buf = bytearray(); _pre = bytearray(nbytes)\n    while",
     [T + "test_listener.py"]),
    ("K15", "transport/segments.py", "    if np.count_nonzero(stops[:-1] > starts[1:]):\n        return None", "    pass",
     [T + "test_segments_large.py"]),
    ("K16", "transport/segments.py", "    if starts.shape[0] < 2:\n        return\n    order",
     "    if True:\n        return\n    order", kit("bad_table")),
    # -- what each backend keeps of its own ----------------------------------------------------
    ("L1", "transport/loopback.py", "                with arrival.guard:  # a fence waits out this copy, and none starts after it",
     "                if True:", [T + "test_fence.py"]),
    ("L2", "transport/loopback.py", "            self._worker.join(JOIN_TIMEOUT)", "            pass",
     [T + "test_clean_exit.py"]),
    ("T1", "transport/tcp/recv.py", "        with self.guard:\n            if self.dead:\n                return\n            if region.view",
     "        if True:\n            if self.dead:\n                return\n            if region.view", [T + "test_fence.py"]),
    ("T2", "transport/tcp/recv.py", "            if self.dead:\n                return\n            if region.view",
     "            if region.view", [T + "test_fence.py"]),
    ("T3", "transport/tcp/recv.py", "        nbytes = check_ranges(ranges, region.length, what)",
     "        nbytes = int(ranges[:, 1].sum())", [T + "test_tcp_wire.py"]),
    ("N1", "transport/nixl/engine.py", "                                   fence=fenceable)",
     "                                   fence=True)", [T + "test_nixl.py"]),
    ("V1", "transport/verbs/inbound.py", "            if ours:\n                mr.close()",
     "            if False:\n                mr.close()", [T + "test_verbs_backend.py"]),
    ("V2", "transport/verbs/engine.py", "        return replace(cls.capabilities, fence=fence == \"mr\")",
     "        return replace(cls.capabilities, fence=True)", [T + "test_verbs_backend.py"]),
    ("K17", "transport/control.py", "        if self.deliver(payload for _, payload in landed):\n            self.ack",
     "        for _, payload in landed:\n            if payload is not None:\n                self.table.notify(self.sender, payload)\n        if True:\n            self.ack",
     kit("(nixl or verbs) and no_notify_starts")),
    ("U1", "transport/ucx/progress.py", "        if self._workers.pop(id(worker), None) is not None:",
     "        if False and self._workers.pop(id(worker), None) is not None:",
     [T + "test_ucx.py", "-k", "bytes_in_flight"]),
    ("U2", "transport/ucx/inbound.py", "            check_ranges(runs, region.length, what)", "            pass",
     [T + "test_ucx.py", "-k", "region_cannot_hold"]),
    ("U3", "transport/ucx/lib.py", "    if not address or not own or (address[0] & 0x0F) != (own[0] & 0x0F):",
     "    if False:", [T + "test_ucx.py", "-k", "hello_with"]),
    # -- #25.1: proving a link that cannot be fenced quiet ----------------------------------------
    ("K18", "transport/inbound.py", "        if self.self_settles or self.quiet_said or self.peer_gone:",
     "        if True:", kit("settled_once")),
    ("K19", "transport/inbound.py", "            if sender in self._sealed:", "            if False:",
     kit("refuse_new_links")),
    ("D1", "pdxfer/lifecycle/decode.py", "        if self.links or links:", "        if False:",
     ["tests/pdxfer/test_engine_late_bytes.py"]),
    ("V3", "transport/verbs/send.py", "        marked: set[int] = set()\n", "        return True\n",
     ["tests/pdxfer/test_engine_late_bytes.py", "-k", "verbs"]),
    ("N2", "transport/nixl/requests.py", "(not send.link.dead or send.link.ctx.drains)", "not send.link.dead",
     ["tests/pdxfer/test_engine_late_bytes.py", "-k", "nixl"]),
    ("U4", "transport/ucx/send.py", "        pause = 0.0\n        while True:\n            left",
     "        return True\n        while True:\n            left",
     ["tests/pdxfer/test_engine_late_bytes.py", "-k", "ucx"]),
    # -- #19: deregistration keeps nothing alive (nixl's GoneAck) ----------------------------------
    ("N3", "transport/control.py", "            link.gone_settled(region.region_id, deadline)",
     "            pass",
     ["tests/transport/test_nixl.py", "tests/transport/test_kit_conformance.py", "-k",
      "gone or keeps_nothing"]),
    ("N4", "transport/nixl/send.py",
     "                        region_id, self.peer, timeout)\n            return\n",
     "                        region_id, self.peer, timeout)\n",
     ["tests/transport/test_nixl.py", "-k", "gone"]),
    ("N5", "transport/nixl/send.py", "            if post.region not in self.peer_regions:",
     "            if False:", ["tests/transport/test_nixl.py", "-k", "producer"]),
    # -- #25.2: aliased destination memory ----------------------------------------------------------
    ("A1", "layout/per_layer.py", "        alias = first_alias(footprints)\n        if alias is not None:",
     "        alias = first_alias(footprints)\n        if False:",
     ["tests/layout/test_per_layer.py", "-k", "sharing_memory"]),
    ("A2", "pdxfer/pools.py", "    alias = first_alias(footprints)\n    if alias is not None:",
     "    alias = first_alias(footprints)\n    if False:",
     ["tests/pdxfer/test_pool_aliasing.py"]),
    # -- layout's planner ------------------------------------------------------------------------
    ("P1", "layout/segments.py", "    if src.size < 2 or (src[1:] >= src[:-1]).all():\n        return None",
     "    if src.size < 2:\n        return None\n    return np.argsort(src, kind='stable')[::-1]",
     ["tests/layout/test_planner_large.py"]),
    ("P2", "layout/segments.py", "    if arr.size < 2:\n        return\n    if arr.size <= _SMALL:",
     "    if arr.size < 2 or arr.size > _SMALL:\n        return\n    if arr.size <= _SMALL:",
     ["tests/layout/test_planner_large.py"]),
    ("P3", "layout/segments.py", "        if (arr[1:] > arr[:-1]).all():", "        if (arr[1:] >= arr[:-1]).all():",
     ["tests/layout/test_planner_large.py"]),
    ("P4", "layout/segments.py", "    offs = np.array([o for o, _ in ranges], dtype=np.int64)",
     "    ranges = ranges[:1]\n    offs = np.array([o for o, _ in ranges], dtype=np.int64)",
     ["tests/layout/test_planner_large.py"]),
    ("P5", "layout/segments.py", "        order = pos[pos >= 0]", "        order = pos[pos >= 0][::-1]",
     ["tests/layout/test_planner_large.py"]),
]


def main(names: list[str]) -> None:
    repo = pathlib.Path(__file__).resolve().parents[2]
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="pdxfer-mutants-"))
    tree, pkg = scratch / "tree", scratch / "pkg"
    tree.mkdir()
    pkg.mkdir()
    archive = subprocess.run(["git", "-C", str(repo), "archive", "HEAD"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    for sub in ("layout", "transport"):  # the installed namespace: pdxfer.layout, pdxfer.transport
        (tree / "pdxfer" / sub).symlink_to(tree / sub)
    (pkg / "pdxfer").symlink_to(tree / "pdxfer")
    env = {**os.environ, "PYTHONPATH": str(pkg)}
    for name, rel, old, new, tests in MUTATIONS:
        if names and name not in names:
            continue
        path = tree / rel
        orig = path.read_text()
        assert old in orig, f"{name}: anchor not found in {rel}"
        path.write_text(orig.replace(old, new, 1))
        try:
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                               cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
        finally:
            path.write_text(orig)
        last = (r.stdout.strip().splitlines() or [r.stderr[-200:]])[-1]
        print(f"{name} :: {'CAUGHT' if r.returncode else 'MISSED'} | {last}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
