"""The nixl engine's outgoing NIXL requests: queued by links, posted and polled by its progress thread.

Why apart from the links: every NIXL call on the engine's one initiating
agent holds its lock (`agent.Initiator`), and some of them (loading a new
peer's metadata, a first message to it, forgetting a dead one) run for tens
of ms of UCX work under CPU load. A caller's `write()` must not wait that
out — a `send()` to one peer would be slowed by another — so a link's
`submit` only appends a `Write` here (`queue`), and the progress thread,
which holds the agent for every poll anyway, makes the NIXL calls: `post`
in queue order under one hold of the lock, then `poll` for DONE/ERR.

How a write becomes a NIXL request (#23). Most writes name their rows by
block index into descriptor lists prepared once per region and granule
(`Initiator.local_list` / `remote_list`, kept in the engine's bounded
`Prepared`): `make_prepped_xfer` then costs ~1 µs whatever the row count,
where building two descriptor lists and `initialize_xfer` cost 6 µs for one
row and ~290 µs for 16,384 (measured on this VM). NIXL merges consecutive
blocks, so a row of many blocks is still one UCX operation. A write whose
granule would cut a region into more than `MAX_BLOCKS` blocks is posted the
old way (`Write.descs`).

Completion. NIXL reports DONE once the UCX flush after the writes
completed: the bytes are in the peer's memory. A write without a notify
payload completes then (`Write.acked_on_done`) and carries no notification;
a write with one completes on the receiver's `Acks`, after its handler ran —
the kit's contract for notify (`cases_writes.test_notify_arrives_after_all_data`).

Readiness is not waited here: the kit's post queue (`transport.posting`)
submits a write only once its producer's event is reached, so everything
queued here may go.

Writes naming a region (#19). Every write that moves bytes is counted
under `(link key, peer region)` from `queue` until its request ends — DONE,
ERR, released, or never posted — so a link told a region is `Gone` can wait
(`settled`, bounded, on a condition the progress thread notifies) for none
of its writes into that region to be left before it says `GoneAck`. The
count is kept under its own small lock, taken after any other and never
held across a NIXL call.

Locking: `queue` is the links' (a deque append is atomic); everything else
runs on the progress thread or, for `drop` and `release_all`, under the
initiator's lock held by the caller.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import numpy as np

from ..errors import PeerLostError, TransportError
from .agent import Initiator, translate
from .wire import gpu_of

log = logging.getLogger(__name__)
RELEASE_TRIES = 1000  # progress rounds a finished request's release is retried before teardown


def lost(what: str, exc: BaseException | str) -> PeerLostError:
    """The error a transfer fails with when NIXL reports it broken."""
    return PeerLostError(f"{what} failed: {exc}; the peer died, closed or dropped us")


class Write:
    """One write on its way to NIXL: by prepared block indices, by descriptors, or a notify alone.

    `blocks`: `(block bytes, local indices, remote indices)`; `descs`:
    `(local rows, remote rows)`; neither: a notify-only transfer. `src` is
    our region, `region`/`dst` the peer's region id and `Remote`.
    """

    __slots__ = ("blocks", "descs", "dst", "link", "mems", "note", "region", "seq", "src")

    def __init__(self, link: Any, seq: int, note: bytes | None, mems: tuple[str, str], src: Any = None,
                 region: int = 0, dst: Any = None, blocks: tuple | None = None,
                 descs: tuple | None = None) -> None:
        self.link, self.seq, self.note, self.mems = link, seq, note, mems
        self.src, self.region, self.dst = src, region, dst
        self.blocks, self.descs = blocks, descs

    @property
    def acked_on_done(self) -> bool:
        """No notify: NIXL's DONE (bytes in the peer's memory) completes it, no ack follows."""
        return self.note is None


class _Send:
    """A posted NIXL request, polled until DONE/ERR and then released; `names`: its count's key."""

    __slots__ = ("done_seq", "link", "names", "tries", "xfer")

    def __init__(self, link: Any, xfer: Any, done_seq: int | None, names: tuple[int, int]) -> None:
        self.link, self.xfer, self.tries, self.done_seq = link, xfer, 0, done_seq
        self.names = names


def _names(w: Write) -> tuple[int, int] | None:
    """What a write is counted under — `(link key, peer region)` — or None: it moves no bytes."""
    return None if w.blocks is None and w.descs is None else (w.link.key, w.region)


class Requests:
    """One engine's queue of writes not yet posted, and its posted NIXL requests.

    A link here is anything with `agent` (the peer agent's name), `peer`,
    `key` (what its prepared lists are filed under), `dead` and `ctx.drains`
    — the engine's `NixlLink`s. A dead link's request
    still running is released at once, unless its link drains (the peer
    cannot stop our writes: #25.1): then it is polled until it ends on its
    own, and `drained` says when none of that link's is left.
    """

    def __init__(self, initiator: Initiator) -> None:
        self._initiator = initiator
        self._queue: collections.deque[Write] = collections.deque()
        self._sends: list[_Send] = []
        # Requests whose release kept failing (RELEASE_TRIES rounds): kept for `release_all`.
        self.leaked: list[_Send] = []
        self._rounds = threading.Condition()  # notified after every poll (`drained`)
        self._round = 0
        # (link key, peer region) -> writes queued or posted that name it (`settled`)
        self._naming: collections.Counter[tuple[int, int]] = collections.Counter()
        self._ended = threading.Condition()  # guards `_naming`; notified as a count reaches 0

    def queue(self, write: Write) -> None:
        """Hand one write to the progress thread. Link's thread (its lock held: see `settled`)."""
        names = _names(write)
        if names is not None:
            with self._ended:
                self._naming[names] += 1
        self._queue.append(write)

    def _end(self, names: tuple[int, int] | None) -> None:
        """One write counted under `names` ended (or was never posted)."""
        if names is None:
            return
        with self._ended:
            left = self._naming[names] - 1
            if left > 0:
                self._naming[names] = left
                return
            del self._naming[names]
            self._ended.notify_all()

    def settled(self, key: int, region: int, deadline: float) -> bool:
        """Wait (until `deadline`, monotonic) until no write of link `key` naming peer region
        `region` is queued or posted; True if none is.

        For a link that has stopped submitting writes into `region` (it heard
        `Gone`, under the lock its `submit` runs under): what is left can
        only end. Never from the progress thread (it is what ends them).
        """
        with self._ended:
            return self._ended.wait_for(lambda: (key, region) not in self._naming,
                                        max(0.0, deadline - time.monotonic()))

    @property
    def in_flight(self) -> bool:
        """Whether a posted request is still moving (its bytes move only when we poll: tls=tcp)."""
        return bool(self._sends)

    def post(self) -> tuple[list[tuple[Any, int, TransportError]], bool]:
        """Post every queued write, in order (progress thread): `(refused (link, seq, error), worked)`."""
        if not self._queue:
            return [], False
        posts, refused = [], []
        while self._queue:
            posts.append(self._queue.popleft())
        ini = self._initiator
        with ini.lock:
            agent = ini.agent
            if agent is None:
                for w in posts:
                    self._end(_names(w))
                return refused, True  # closing: close() fails every link's handles
            for w in posts:
                link = w.link
                if link.dead:
                    self._end(_names(w))
                    continue  # its handles already failed with the link's error
                try:
                    if w.blocks is None and w.descs is None:
                        agent.send_notif(link.agent, w.note)
                        continue
                    xfer = self._make(ini, agent, w)
                    state = agent.transfer(xfer)
                except Exception as exc:
                    self._end(_names(w))  # not posted (NIXL refused to make or start it)
                    refused.append((link, w.seq, translate(exc, f"posting a write to {link.peer}")))
                    continue
                self._sends.append(_Send(link, xfer, w.seq if w.acked_on_done else None, _names(w)))
                if state == "ERR":
                    refused.append((link, w.seq, PeerLostError(
                        f"NIXL refused to post a write to {link.peer}: the link is broken")))
        return refused, True

    @staticmethod
    def _make(ini: Initiator, agent: Any, w: Write) -> Any:
        note = w.note or b""
        if w.descs is not None:
            local, remote = w.descs
            return agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, w.mems[0]),
                                         agent.get_xfer_descs(remote, w.mems[1]), w.link.agent, note)
        block, lidx, ridx = w.blocks
        base, gpu = w.dst.info
        mine = ini.local_list(w.src, block, gpu_of(w.src), w.mems[0])
        theirs = ini.remote_list(w.link.key, w.link.agent, w.region, base, w.dst.length, block, gpu,
                                 w.mems[1])
        return agent.make_prepped_xfer("WRITE", mine, lidx, theirs, ridx, note)

    def poll(self, notifs: bool = False) -> tuple[list[tuple[Any, TransportError]], list[tuple[Any, int]],
                                                  dict[str, list[bytes]], bool]:
        """One look at every posted request.

        Returns `(links to sever, (link, seq) completed by DONE, the initiating
        agent's notifications, whether any request is still moving)`. The
        notifications matter only when the initiator also serves inbound
        links (`notifs=True`, tls="all"); otherwise the call just progresses
        its worker for a notify-only send (nobody writes to this agent then).
        """
        failed, done = [], []
        got: dict[str, list[bytes]] = {}
        ini = self._initiator
        with ini.lock:
            agent = ini.agent
            if agent is None:
                return [], [], {}, False
            try:
                got = agent.get_new_notifs() or {}
            except Exception as exc:
                log.debug("nixl: progress of the initiating agent: %s", exc)
            keep = []
            for send in self._sends:
                try:
                    state = agent.check_xfer_state(send.xfer)
                except Exception as exc:
                    state = translate(exc, f"a write to {send.link.peer}")
                if state == "PROC" and (not send.link.dead or send.link.ctx.drains):
                    keep.append(send)  # a dead link that drains lets its writes end on their own
                    continue
                if state == "DONE":
                    if send.done_seq is not None:
                        done.append((send.link, send.done_seq))
                elif not send.link.dead:
                    failed.append((send.link, lost(f"a write to {send.link.peer}", state)))
                try:
                    send.xfer.release()
                except Exception:  # still active and not cancellable yet: retry next round
                    send.tries += 1
                    send.done_seq = None
                    if send.tries < RELEASE_TRIES:
                        keep.append(send)
                        continue
                    # Kept, never forgotten (NIXL's own API keeps `_leaked_xfer_handles` too):
                    # dropping the last reference to an active request is not ours to do, and
                    # teardown tries its release once more (`release_all`).
                    self.leaked.append(send)
                    log.error("nixl: a request to %s could not be released after %d tries; "
                              "keeping it for a last release at close", send.link.peer, send.tries)
                self._end(send.names)
            self._sends = keep
            moving = any(not s.link.dead or s.link.ctx.drains for s in keep)
        with self._rounds:
            self._round += 1
            self._rounds.notify_all()
        return failed, done, (got if notifs else {}), moving

    def drained(self, link: Any, deadline: float, kick: Any) -> bool:
        """Wait (until `deadline`) until no request of `link` is posted; True if none is.

        Checked under the initiator's lock, which `post` holds while it posts:
        a write being posted as the link died is seen here once posted. Not
        from the progress thread (it is what ends them); `kick` wakes it.
        """
        while True:
            with self._rounds:
                seen = self._round
            with self._initiator.lock:
                if not any(send.link is link for send in self._sends):
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            kick()
            with self._rounds:
                self._rounds.wait_for(lambda seen=seen: self._round != seen, left)

    def drop(self, link: Any) -> None:
        """Release a dead link's posted requests (the initiator's lock held by the caller)."""
        keep = []
        for send in self._sends:
            if send.link is link:
                try:
                    send.xfer.release()
                    self._end(send.names)
                    continue
                except Exception:  # still active: poll() retries the release
                    pass
            keep.append(send)
        self._sends = keep

    def release_all(self) -> None:
        """At close, the initiator's lock held: release every request and forget the queue.

        The requests polling gave up releasing (`leaked`) are tried once more
        here; one that still refuses stays in `leaked`, referenced for as long
        as this object lives, and is logged.
        """
        still = []
        for send in (*self.leaked, *self._sends):
            try:
                send.xfer.release()
            except Exception as exc:
                still.append(send)
                log.error("nixl: a request to %s could not be released at close either: %s",
                          send.link.peer, exc)
        self.leaked = still
        self._sends = []
        self._queue.clear()
        with self._ended:  # the engine is going: nothing it posted is waited for any more
            self._naming.clear()
            self._ended.notify_all()


# Tables of at most this many rows (a request's: already merged by the planner)
# are cut into blocks in plain ints: a few numpy calls cost more than the loop.
SMALL = 64


def blocks(table: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """`(block, local indices, remote indices)`: every row of `table` as the blocks it covers.

    `block` is the largest power of two dividing every offset and length
    (the table's granule); a row of k blocks lists k consecutive indices on
    each side (NIXL merges them back into one operation). int32, as
    `make_prepped_xfer` takes them.
    """
    if table.shape[0] <= SMALL:
        rows = table.tolist()
        bits = 0
        for s, d, n in rows:
            bits |= s | d | n
        block = bits & -bits
        src: list[int] = []
        dst: list[int] = []
        for s, d, n in rows:
            k, a, b = n // block, s // block, d // block
            if k == 1:
                src.append(a)
                dst.append(b)
            else:
                src.extend(range(a, a + k))
                dst.extend(range(b, b + k))
        return block, np.array(src, dtype=np.int32), np.array(dst, dtype=np.int32)
    table = table.view(np.ndarray)  # a proven table's subclass makes every numpy call slower
    bits = int(np.bitwise_or.reduce(table.reshape(-1)))
    block = bits & -bits
    counts = table[:, 2] // block
    first_src, first_dst = table[:, 0] // block, table[:, 1] // block
    if int(counts.max()) == 1:
        return block, first_src.astype(np.int32), first_dst.astype(np.int32)
    starts = np.cumsum(counts) - counts
    step = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)
    return (block, (np.repeat(first_src, counts) + step).astype(np.int32),
            (np.repeat(first_dst, counts) + step).astype(np.int32))
