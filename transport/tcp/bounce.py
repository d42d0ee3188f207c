"""tcp's bounce memory: one bounded pool per engine, shared by every stream of every link.

A socket reads and writes host memory only, so CUDA bytes cross a pinned host
buffer on their way out and in. Until #23 every stream owned one
(`bounce_bytes` each, both ways): a prefill linked to 100 decodes over 8
streams pinned `8 MiB × 8 × 100` ≈ 6.4 GB, growing with peers, not with work.
Here the engine owns one `BouncePool` of at most `total_bytes` (default
`DEFAULT_POOL_BYTES`), cut into slots of `slot_bytes`, and a stream borrows a
slot for one batch (`Bounce.lease`) and gives it back when that batch has
crossed its socket. So pinned memory is bounded by the pool whatever the
number of peers, and a transfer's size only decides how many batches it takes.

Rules, each with its reason:

* **Two halves.** Sending streams borrow from one half, landing streams from
  the other. A sender holds its slot until the receiver has read the batch,
  and a receiver holds one only while the batch it announced arrives (its
  header is sent by a sender already holding a slot), so neither half ever
  waits on itself — even for an engine linked to itself, where one shared
  set of slots could be taken entirely by senders whose receivers then wait
  for a slot forever.
* **Allocated when streams are made, never on a transfer's path.** Slots are
  allocated once the engine holds CUDA memory (`activate`), up to as many as
  the streams made so far could hold at once (`grow`, called at connect and
  accept) and never beyond the half's share of the total: pinning takes
  milliseconds and must not happen inside a landing or a send. A host-only
  engine allocates nothing.
* **Bounded waits.** A slot holder cannot keep it for ever: the stream arms
  a send/receive timeout of `timeout` seconds (the engine's
  `connect_timeout`) on its socket while it holds one (`held_for`), so a peer
  that does not move a whole batch within that time is taken for stalled and
  its link is cut, which frees the slot — a deadline for the batch, not an
  idle timeout, so a trickle of bytes does not extend it. A stream waits for
  a free slot at most twice that (so a stalled holder is cut before a waiter
  gives up), then fails with `TransferTimeout` naming the pool.
* **First come, first served.** A freed slot goes to the stream that has
  waited longest (`_Half.take`). A stream gives its slot back after every
  batch and asks again at once; without a line it could win the slot back
  every time and starve another peer's stream for as long as its own peer
  keeps reading — past that waiter's bound, with no peer stalled.

Accounting, testable without a GPU: `allocated_bytes` is what the allocator
handed out (`allocate(nbytes) -> torch.Tensor`, an injectable seam; the
default pins when CUDA is available, so on a CPU-only machine the same
slots are plain host memory and only `pinned` differs), and tests bound it.
What only a GPU run can show: that `cudaHostAlloc` of the slots happens at
connect and registration (not in a transfer), and the pinned bytes
`torch.cuda` reports.

Only tcp bounces today, so this lives with tcp; it imports nothing of tcp's,
and moves to the kit unchanged the day a second backend needs bounce buffers.
"""

from __future__ import annotations

import collections
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from ..device_copy import Scratches, copy_rows
from ..errors import TransferTimeout
from ..segments import split_rows
from ..streams import CopyStream, cuda_device
from .io import batches

# The pool's default total: a bound stated once, flat from one peer to hundreds.
DEFAULT_POOL_BYTES = 256 << 20

Allocate = Callable[[int], torch.Tensor]


def pinned_allocator(pinned: bool) -> Allocate:
    """The default allocator: page-locked host memory when CUDA is available, else plain."""
    return lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


class _Half:
    """One direction's slots: a free list under a condition, grown up to `cap` slots."""

    def __init__(self, what: str, cap: int, slot_bytes: int, allocate: Allocate) -> None:
        self.what = what
        self.cap = cap
        self.slot_bytes = slot_bytes
        self._allocate = allocate
        self._cond = threading.Condition()
        self._free: list[torch.Tensor] = []
        # Waiters in arrival order: a freed slot goes to the longest waiter, so a stream that
        # gives its slot back between batches and asks again at once cannot starve another
        # peer's stream of it (it did: a flood to one peer kept the only slot for over 1 s).
        self._waiting: collections.deque[object] = collections.deque()
        self.count = 0  # slots allocated (or being allocated) so far
        self.wanted = 0  # streams that may each hold one slot at a time
        self.active = False

    def grow(self, streams: int = 0, *, activate: bool = False) -> None:
        """Register `streams` more streams (and/or activate); allocate what they could use at once."""
        with self._cond:
            self.wanted += streams
            self.active = self.active or activate
            if not self.active:
                return
            extra = max(0, min(self.cap, self.wanted) - self.count)
            self.count += extra  # reserved now: a concurrent grow does not allocate them twice
        if extra:
            bufs = [self._allocate(self.slot_bytes) for _ in range(extra)]  # no lock held: slow
            with self._cond:
                self._free.extend(bufs)
                self._cond.notify(len(bufs))

    def take(self, timeout: float) -> torch.Tensor:
        """A free slot, waiting at most `timeout` s; `TransferTimeout` naming the pool."""
        deadline = time.monotonic() + timeout
        me = object()
        with self._cond:
            self._waiting.append(me)
            try:
                while not (self._free and self._waiting[0] is me):
                    if (self._waiting[0] is me and self.count < self.cap
                            and self.count < max(self.wanted, 1)):
                        # Only when a stream raced the activation that allocates its slot.
                        self.count += 1
                        self._cond.release()
                        try:
                            return self._allocate(self.slot_bytes)
                        finally:
                            self._cond.acquire()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TransferTimeout(
                            f"no tcp bounce slot for {self.what} freed within {timeout} s: all "
                            f"{self.count} slots of {self.slot_bytes} B are held by other streams' "
                            "CUDA transfers; raise bounce_pool_bytes, or move fewer CUDA transfers "
                            "at once")
                    self._cond.wait(left)
                return self._free.pop()
            finally:
                self._waiting.remove(me)  # at most one entry per stream: short
                self._cond.notify_all()  # the next in line may be served by what is free

    def give(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify_all()  # the one at the head of the line must wake, whoever that is

    @property
    def free(self) -> int:
        with self._cond:
            return len(self._free)


class BouncePool:
    """One engine's bounce slots: `total_bytes` at most, in slots of `slot_bytes`, two halves.

    `force` sends host memory through the pool too (tests without a GPU) and
    activates it at once. `timeout` bounds every wait for a slot and every
    socket operation made while holding one. `scratches`: the engine's device
    temporaries (`device_copy.Scratches`), which the copies in and out use.
    """

    def __init__(self, slot_bytes: int, total_bytes: int = DEFAULT_POOL_BYTES, *, force: bool = False,
                 timeout: float = 10.0, allocate: Allocate | None = None,
                 scratches: Scratches | None = None) -> None:
        if total_bytes < 2 * slot_bytes:
            raise ValueError(f"a bounce pool of {total_bytes} B cannot hold one {slot_bytes} B "
                             "slot per direction; give it at least 2 x bounce_bytes")
        self.slot_bytes = slot_bytes
        self.total_bytes = total_bytes
        self.force = force
        self.timeout = timeout
        self.pinned = allocate is None and torch.cuda.is_available()
        alloc = allocate if allocate is not None else pinned_allocator(self.pinned)
        share = total_bytes // 2 // slot_bytes
        self.send = _Half("sending", share, slot_bytes, alloc)
        self.recv = _Half("landing", share, slot_bytes, alloc)
        # device temporaries of the copies in and out of the slots: the engine's bounded scratch
        self.scratches = scratches if scratches is not None else Scratches()
        if force:
            self.activate()

    @property
    def allocated_bytes(self) -> int:
        """Bytes the allocator handed out for slots (pinned when `pinned`)."""
        return (self.send.count + self.recv.count) * self.slot_bytes

    def activate(self) -> None:
        """The engine holds CUDA memory (or `force`): allocate what the streams made so far may use."""
        self.send.grow(activate=True)
        self.recv.grow(activate=True)

    def bounce(self, sending: bool) -> Bounce:
        """A new stream's access to its half (counted: the half may grow by one slot)."""
        half = self.send if sending else self.recv
        half.grow(1)
        return Bounce(half, self.timeout, self.scratches)


class Bounce:
    """One stream's access to its engine's pool: lease a slot per batch, copy in and out of it.

    Copies run on this stream's own copy stream (`CopyStream`), in a few
    batched `device_copy` ops whose temporaries come from the engine's
    bounded scratch, and return once landed (never a device-wide synchronise).
    """

    def __init__(self, half: _Half, timeout: float, scratches: Scratches) -> None:
        self.half = half
        self.nbytes = half.slot_bytes
        self.timeout = timeout
        self.copies = CopyStream()
        self.scratches = scratches

    def plan(self, rows: np.ndarray, max_rows: int) -> Iterator[np.ndarray]:
        """`rows` cut into batches that fit one slot."""
        return batches(split_rows(rows, self.nbytes), max_rows, self.nbytes)

    @contextmanager
    def lease(self) -> Iterator[torch.Tensor]:
        """A slot for one batch, given back on exit (waits at most 2 x `timeout`)."""
        buf = self.half.take(2 * self.timeout)
        try:
            yield buf
        finally:
            self.half.give(buf)

    @contextmanager
    def held_for(self, sock: socket.socket, option: int) -> Iterator[Callable[[], None]]:
        """Bound what crosses `sock` while a slot is held to `timeout` s in all; yields `pace`.

        `pace()`, called before each blocking call (`io.send_all`/`recv_all`
        take it), arms `option` (SO_SNDTIMEO / SO_RCVTIMEO) with the time left
        and raises `BlockingIOError` once it is spent. A deadline for the whole
        batch, not an idle timeout per call: a peer that takes a few bytes
        every so often (a window that opens by a segment) would otherwise keep
        a shared slot for ever — one did, past a waiter's bound.
        """
        deadline = time.monotonic() + self.timeout

        def pace() -> None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BlockingIOError(f"a bounced batch not across within {self.timeout} s")
            secs = int(left)
            # (0, 0) would mean no timeout at all: at least one microsecond
            sock.setsockopt(socket.SOL_SOCKET, option,
                            struct.pack("ll", secs, max(1, int((left - secs) * 1e6))))

        pace()
        try:
            yield pace
        finally:
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", 0, 0))
            except OSError:
                pass  # closed meanwhile: nothing left to disarm

    def gather(self, buf: torch.Tensor, src: torch.Tensor, rows: np.ndarray, column: int,
               ready: object = None) -> memoryview:
        """Copy rows of `src` (offsets in `column`) into slot `buf`, after `ready`; its filled part."""
        table, pos = _packed(rows, column, to_buffer=True)
        device = cuda_device(src)
        with self.scratches.lease(device, self.timeout) as scratch:
            self.copies.run(device, ready, lambda: copy_rows(src, buf, table, scratch))
        return memoryview(buf.numpy())[:pos]

    @staticmethod
    def space(buf: torch.Tensor, nbytes: int) -> memoryview:
        """The first `nbytes` of slot `buf`, to receive into."""
        return memoryview(buf.numpy())[:nbytes]

    def scatter(self, buf: torch.Tensor, dst: torch.Tensor, rows: np.ndarray, column: int) -> None:
        """Copy slot `buf`'s leading bytes out to rows of `dst` (offsets in `column`); returns once landed."""
        table, _ = _packed(rows, column, to_buffer=False)
        device = cuda_device(dst)
        with self.scratches.lease(device, self.timeout) as scratch:
            self.copies.run(device, None, lambda: copy_rows(buf, dst, table, scratch))


def _packed(rows: np.ndarray, column: int, *, to_buffer: bool) -> tuple[np.ndarray, int]:
    # The copy table between a tensor's rows and the slot packed from 0, and its bytes.
    n = rows[:, -1].astype(np.int64)
    packed = np.cumsum(n) - n
    offsets = rows[:, column].astype(np.int64)
    cols = (offsets, packed) if to_buffer else (packed, offsets)
    return np.stack([*cols, n], 1), int(n.sum())
