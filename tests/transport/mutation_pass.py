"""The #9 mutation pass: delete one safety check at a time and see whether the suite notices.

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
FENCE = [T + "test_fence.py"]
CORE = FENCE + [T + f for f in ("test_conformance.py", "test_conformance_faults.py", "test_tcp_wire.py", "test_nixl.py", "test_tcp.py")]

# name, file, old text, new text, tests
MUTATIONS = [
    ("M1", "transport/loopback.py", "        with self._landing:\n            pass", "        pass", CORE),
    ("M2", "transport/tcp_recv.py", "        with self.landing:\n            if self.dropped:\n                return\n"
     "            if region.view", "        if True:\n            if self.dropped:\n                return\n"
     "            if region.view", CORE),
    ("M3", "transport/tcp_recv.py", "                return\n            if notify is not None:",
     "                return\n        if True:\n            if notify is not None:", CORE),
    ("M4", "transport/tcp_recv.py", "        self._shutdown()\n        with self.landing:\n            pass",
     "        self._shutdown()", CORE),
    ("M5", "transport/tcp_recv.py", "            if self.dropped:\n                return\n            if region.view",
     "            if region.view", FENCE),
    ("M6", "transport/nixl_peer.py", "        with self.delivering:\n            pass\n        if already",
     "        if already", CORE),
    ("M7", "transport/nixl_progress.py", "            with peer.delivering:", "            if True:", CORE),
    ("M8", "transport/loopback.py", "                with self._landing:\n                    if self._error is not None:\n"
     "                        item.handle.fail(self._error)\n                        return\n"
     "                    self._peer._deliver", "                if True:\n                    if False:\n"
     "                        return\n                    self._peer._deliver", CORE),
    ("M9", "transport/segments.py", "    if np.count_nonzero(stops[:-1] > starts[1:]):\n        return None", "    pass",
     [T + "test_segments_large.py"] + CORE),
    ("M10", "transport/segments.py", "    if starts.shape[0] < 2:\n        return\n    order",
     "    if True:\n        return\n    order", CORE),
    ("M11", "transport/tcp_recv.py", "        nbytes = check_ranges(ranges, region.length, what)",
     "        nbytes = int(ranges[:, 1].sum())", CORE),
    ("M12", "transport/wire.py", "    buf = bytearray()\n    while", "    buf = bytearray(); _pre = bytearray(nbytes)\n    while",
     [T + "test_listener.py"]),
    ("M13", "transport/wire.py", "        limit = self.max_frame if limit is None else min(limit, self.max_frame)",
     "        limit = self.max_frame", [T + "test_listener.py", T + "test_tcp_wire.py"]),
    ("M14", "transport/listener.py", "                full = len(self._pending) >= self.max_pending",
     "                full = False", [T + "test_listener.py"]),
    ("M15", "transport/listener.py", "            slot.admitted()  # first: a peer that sees the EOF finds the slot free\n"
     "            slot.expire()", "            pass", [T + "test_listener.py"]),
    ("M16", "transport/loopback.py", "        self.join(JOIN_TIMEOUT)\n", "", [T + "test_clean_exit.py"]),
    ("L1", "layout/segments.py", "    if src.size < 2 or (src[1:] >= src[:-1]).all():\n        return None",
     "    if src.size < 2:\n        return None\n    return np.argsort(src, kind='stable')[::-1]",
     ["tests/layout/test_planner_large.py"]),
    ("L2", "layout/segments.py", "    if arr.size < 2:\n        return\n    if arr.size <= _SMALL:",
     "    if arr.size < 2 or arr.size > _SMALL:\n        return\n    if arr.size <= _SMALL:",
     ["tests/layout/test_planner_large.py"]),
    ("L3", "layout/segments.py", "        if (arr[1:] > arr[:-1]).all():", "        if (arr[1:] >= arr[:-1]).all():",
     ["tests/layout/test_planner_large.py"]),
    ("L4", "layout/segments.py", "    offs = np.array([o for o, _ in ranges], dtype=np.int64)",
     "    ranges = ranges[:1]\n    offs = np.array([o for o, _ in ranges], dtype=np.int64)",
     ["tests/layout/test_planner_large.py"]),
    ("L5", "layout/segments.py", "        order = pos[pos >= 0]", "        order = pos[pos >= 0][::-1]",
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
