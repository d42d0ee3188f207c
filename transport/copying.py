"""Copying a checked segment table between two CPU byte arrays at memory speed.

Loopback's data path, kept apart from its queueing and fencing so each can be
read alone. The caller has already run `segments.check_table`: every row lies
inside both arrays and no two destination rows overlap, so this module only
chooses *how* to copy, never *whether*.

What costs time, measured on a 2-vCPU VM (numpy 2, glibc), and the answer to each:

- Per-row Python work (~1 us per slice copy) dominates rows of a few KiB.
  Rows adjacent on *both* sides are first merged into one row (`coalesce`),
  so a table that is really one range becomes one copy. Remaining short
  rows of one length are copied by one numpy call per batch
  (`_equal_rows`: a strided view, a `[positions, n]` window view or
  `np.take`; bytes move once unless both sides are scattered), which runs
  in C with the GIL released — no Python per row.
- One thread copying pieces of a few MiB reaches about half of a one-call
  memcpy of the same bytes: glibc uses non-temporal stores only for single
  copies far larger than that. A merged run is therefore copied by *one*
  call, never split — splitting would throw that path away and make the
  figure depend on a second core being free. Many pieces are shared over a
  few threads instead: the caller's thread and up to `threads - 1` helpers
  claim batches of about `BATCH` bytes from one list, largest first, so a
  helper that is slow to start (or finds no free core) just takes fewer
  batches instead of holding everyone back, as a fixed split by bytes did;
  a helper still queued when the list runs dry is cancelled, not awaited.
  Two threads reach the one-call memcpy only when a second core is free.
- Small tables (the engine posts 1-17 rows per request at a high rate) skip
  all planning: a few slice copies on the caller's thread. Planning costs a
  dozen numpy calls (~20 us), which is what a request-sized table would
  otherwise pay for nothing.

No byte outside a row is written: every copy, slice or fancy-indexed, has
exactly the row's length, at the row's destination offset.

Deliberately absent: CUDA memory (loopback sends it to `device_copy`)
and splitting one large row over threads (see above; revisit if a machine's
memcpy never takes the non-temporal path).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# Tables of at most _TINY_ROWS rows, or at most _DIRECT_ROWS rows of
# _DIRECT_MIN_ROW bytes on average, moving under PARALLEL_MIN bytes, are copied
# straight away: planning would cost more than it saves. (The PD engine's
# per-request tables — a few runs of KV pages, one state entry — are these.)
_TINY_ROWS = 8
_DIRECT_ROWS = 64
_DIRECT_MIN_ROW = 16 * 1024
# Transfers below this many bytes stay on the caller's thread: waking a
# helper costs tens of microseconds.
PARALLEL_MIN = 8 << 20
# Rows at least this long are copied one slice each; shorter rows of equal
# size go through the vectorised window copy.
_LONG_ROW = 256 * 1024
# Bytes per claimed batch: large enough that claiming costs nothing, small
# enough that batches spread evenly over the threads.
BATCH = 4 << 20
# Fewer equal rows than this are cheaper as slices than as a window copy.
_VECTOR_MIN = 8


def coalesce(table: np.ndarray) -> np.ndarray:
    """Merge consecutive rows adjacent in both source and destination into one row.

    Exists because a run copied by one call is faster than the same bytes in
    pieces (and only one call can reach glibc's non-temporal path). Only
    neighbours in table order merge; the result moves exactly the same bytes.
    """
    if table.shape[0] < 2:
        return table
    s, d, n = table[:, 0], table[:, 1], table[:, 2]
    joins = (s[1:] == s[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1])
    if not joins.any():
        return table
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    out = table[starts]  # fancy indexing: a copy, the caller's table is untouched
    out[:, 2] = np.add.reduceat(n, starts)
    return out


def coalesce_posted(table: np.ndarray) -> np.ndarray:
    """`coalesce` for a table about to be posted on a link (tcp stripes, NIXL descriptors).

    A row costs a posting path its own descriptor, range header entry and
    iovec, so a contiguous run of 65,536 4 KiB rows is one operation after
    this instead of 65,536 (NIXL merges adjacent descriptors itself; we
    must too). Tables of a request's size (a few runs the layout planner
    already merged) skip it: the dozen numpy calls would cost more than the
    rare merge saves.
    """
    return table if table.shape[0] <= _DIRECT_ROWS else coalesce(table)


def _slices(src: np.ndarray, dst: np.ndarray, rows: np.ndarray) -> None:
    for s, d, n in rows.tolist():
        dst[d:d + n] = src[s:s + n]


def _window(a: np.ndarray, n: int) -> np.ndarray:
    # Row p of the view is a[p:p + n]: indexing it with byte offsets selects
    # whole rows, wherever they start. Built with np.ndarray (not as_strided,
    # ~10x slower) over the same memory; writes through it land in `a`.
    return np.ndarray((a.size - n + 1, n), np.uint8, buffer=a, strides=(1, 1))


def _even_rows(a: np.ndarray, offsets: np.ndarray, n: int) -> np.ndarray | None:
    # `a`'s rows at `offsets` as one [k, n] view when they are evenly spaced
    # (back to back, or every other entry of an arena), else None.
    step = int(offsets[1] - offsets[0]) if offsets.shape[0] > 1 else n
    if step <= 0 or not (np.diff(offsets) == step).all():
        return None
    return np.ndarray((offsets.shape[0], n), np.uint8, buffer=a, offset=int(offsets[0]),
                      strides=(step, 1))


def _equal_rows(src: np.ndarray, dst: np.ndarray, rows: np.ndarray) -> None:
    """Copy rows that all have the same length with one numpy call per batch.

    Bytes move once where the source rows are evenly spaced (a strided view
    scattered into the destination window), or where the destination rows
    are back to back and the source rows sit on a grid of the row length
    (`np.take` into the destination). Otherwise numpy gathers the batch into
    a temporary first (bounded by BATCH, so it stays in cache).
    """
    n = int(rows[0, 2])
    s, d = rows[:, 0], rows[:, 1]
    value = _even_rows(src, s, n)
    if value is None:
        out = _even_rows(dst, d, n)
        r = int(s[0]) % n
        if out is not None and out.flags.c_contiguous and (s % n == r).all():
            grid = src[r:r + (src.size - r) // n * n].reshape(-1, n)
            np.take(grid, (s - r) // n, axis=0, out=out, mode="clip")  # "raise" would buffer
            return
        value = _window(src, n)[s]
        if out is not None:
            out[...] = value
            return
    _window(dst, n)[d] = value


def _batches(rows: np.ndarray, fn: Callable) -> list[tuple[int, Callable, np.ndarray]]:
    # Consecutive runs of about BATCH bytes (a longer row is a run alone),
    # each with its byte count, from one cumulative sum rather than per run.
    cum = np.cumsum(rows[:, 2])
    ends = np.append(np.flatnonzero(np.diff(cum // BATCH)) + 1, rows.shape[0])
    sizes = np.diff(cum[ends - 1], prepend=0)
    starts = np.concatenate(([0], ends[:-1])).tolist()
    return [(b, fn, rows[a:e]) for a, e, b in zip(starts, ends.tolist(), sizes.tolist(), strict=True)]


def plan(table: np.ndarray) -> list[tuple[int, Callable, np.ndarray]]:
    """The batches that copy `table`: (bytes, copy function, rows), largest first.

    Merges adjacent rows, groups the rest by length, and sends groups of
    many short rows to the vectorised window copy and everything else to
    slice copies. Vectorised over the table: the Python work is per batch
    and per distinct row length, not per row.
    """
    table = coalesce(table)
    sizes = table[:, 2]
    if sizes.min() != sizes.max():
        table = table[np.argsort(sizes, kind="stable")]
        sizes = table[:, 2]
    bounds = np.flatnonzero(np.diff(sizes)) + 1
    if bounds.size * _VECTOR_MIN > table.shape[0]:  # mostly distinct lengths: nothing to vectorise
        return sorted(_batches(table, _slices), key=lambda job: -job[0])
    jobs, slices = [], []
    for group in np.split(table, bounds):
        if group[0, 2] < _LONG_ROW and group.shape[0] >= _VECTOR_MIN:
            jobs += _batches(group, _equal_rows)
        else:
            slices.append(group)
    if slices:
        jobs += _batches(np.concatenate(slices), _slices)
    jobs.sort(key=lambda job: -job[0])
    return jobs


class CopyPool:
    """Copies segment tables between CPU arrays, sharing big ones with helper threads.

    One per engine; helper threads start on first need. `close` stops them;
    a copy in progress then finishes on the caller's thread alone.
    """

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def copy(self, src: np.ndarray, dst: np.ndarray, table: np.ndarray) -> None:
        """Copy every row of a checked `table` from `src` to `dst`; returns when all landed."""
        if table.shape[0] <= _DIRECT_ROWS:
            rows = table.tolist()
            total = sum(r[2] for r in rows)
            # A few rows, or rows long enough that a slice's ~1 us of Python
            # is noise beside its bytes, and too little to share: planning
            # (merge, group, batch: a dozen numpy calls) would cost more.
            if total < PARALLEL_MIN and (len(rows) <= _TINY_ROWS or total >= _DIRECT_MIN_ROW * len(rows)):
                for s, d, n in rows:
                    dst[d:d + n] = src[s:s + n]
                return
        jobs = plan(table)
        helpers = min(self.threads - 1, len(jobs) - 1)
        if helpers < 1 or sum(job[0] for job in jobs) < PARALLEL_MIN:
            for _, fn, rows in jobs:
                fn(src, dst, rows)
            return
        self._share(src, dst, jobs, helpers)

    def _share(self, src: np.ndarray, dst: np.ndarray, jobs: list, helpers: int) -> None:
        claim_lock = threading.Lock()
        state = {"next": 0, "stop": False}

        def drain() -> None:
            while True:
                with claim_lock:
                    i = state["next"]
                    if state["stop"] or i >= len(jobs):
                        return
                    state["next"] = i + 1
                _, fn, rows = jobs[i]
                fn(src, dst, rows)

        futures = []
        with self._lock:
            pool = self._executor()
            if pool is not None:
                futures = [pool.submit(drain) for _ in range(helpers)]
        try:
            drain()
        except BaseException:
            with claim_lock:
                state["stop"] = True
            raise
        finally:
            # A helper still queued (behind another transfer's, on a shared
            # pool) has nothing left to claim: drop it rather than wait. One
            # that started may still be writing; the caller's landing-lock
            # fence covers this thread only, so never return before it ends.
            for f in futures:
                f.cancel()
            concurrent.futures.wait(futures)
        for f in futures:
            if not f.cancelled() and f.exception() is not None:
                raise f.exception()

    def _executor(self) -> ThreadPoolExecutor | None:
        if self._closed:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="loopback-copy")
        return self._pool

    def close(self, timeout: float = 10.0) -> None:
        """Stop the helper threads and join them, `timeout` s each (idempotent).

        Queued helper work is cancelled; a batch being copied finishes first.
        Joined rather than left to die: a helper still copying at interpreter
        exit runs native code while the runtime tears down.
        """
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
            # ThreadPoolExecutor.shutdown(wait=True) has no bound; its threads do.
            for thread in list(getattr(pool, "_threads", ())):
                if thread is not threading.current_thread():
                    thread.join(timeout)
