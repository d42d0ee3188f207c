"""The receiving side's bookkeeping, once for every backend: inbound links, the fence, notify delivery.

An `InboundLink` is one incarnation of one sender's link into this engine —
a tcp stream, a nixl serving agent with its control socket, a verbs link's
QPs, a loopback connection seen from its target. It carries the two rules
every backend must keep and, before the kit, each kept in its own copy:

* **the fence.** `fence()` returns only when no byte of this link can land
  in our memory any more and no notify of it is running or can start —
  except one whose handler itself called `drop_peer`/`close` (the guard is
  re-entrant for exactly that). The backend's `cut()` stops the data path
  (shut the socket down, destroy the agent, QPs to ERR and MRs closed) and
  must itself return only when nothing of it lands any more; the kit then
  waits out `guard`.
* **notify delivery.** `deliver()` hands a payload to the engine's handler
  under `guard` and only while the link is not fenced: so no notify starts
  after `drop_peer` returns. A backend that lands bytes on our CPU (tcp,
  loopback) holds the same `guard` while it does, so the fence waits out a
  landing in progress too.

`InboundTable` is the engine's set of them: links still in their handshake
(so `close()` reaches them), the `has_peer` and `settled` answers, the seal
(`seal`: a sender's new links refused until its old ones settled), `drop_peer`'s fence of
every link of one sender, and the threads to join at close.

**Settled** (#25.1): whether no byte of a link can still arrive, which a
receiver that cannot fence asks before it hands memory back
(`InboundTable.settled`, the engine's `settled`). A link settles once its
data path has ended *and* that ending is a proof:

* where our own progress lands every byte (tcp's stream read, loopback's
  copies, nixl and ucx over tcp) or a revoke stops the writer's DMA (verbs
  `fence="mr"`), our own stop is the proof (`self_settles`): a fence, or
  the end the sender caused (tcp's EOF after the last buffered byte);
* where the sender writes into our memory and nothing here can stop it
  (nixl's cma/rc, verbs `fence="qp"`, ucx `tls="all"`: `self_settles`
  False), only the sender can say it: its `Bye(quiet=True)`, sent once every
  operation it posted on the link completed or was flushed (`quiet_said`),
  or its side of the control connection ending without any `Bye`
  (`peer_gone`: our senders never hang up without one while alive — the
  process died). A link of that kind that ends otherwise (we cut it, or
  the sender could not drain) stays *unproven*: `settled` says False for
  its sender and incarnation for as long as the engine lives (bounded:
  `MAX_UNPROVEN` records; docs/reliability.md says what is left).

An incarnation is what the receiver calls one link: tcp's link id (every
stream of it), `sender#serial` for the control backends (the sender learns
it from the `Welcome`), loopback's link. A link carries bytes only after its
handshake named it here, so an incarnation this table never saw, or saw
settle and forgot, has nothing left to land.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable

from . import closing
from .errors import PeerLostError

log = logging.getLogger(__name__)

JOIN_TIMEOUT = 2.0
# Links that ended without proof that nothing of them can still land, remembered so
# `settled` keeps saying False for them. Each one's requests stay quarantined at the
# caller; past this many (a broken or hostile sender minting links), the oldest is dropped
# with an error logged — the data plane trusts its network (docs/reliability.md).
MAX_UNPROVEN = 1024


class InboundLink:
    """One incarnation of one sender's link into this engine: its fence and its notify delivery.

    Backends subclass it: `cut()` stops the data path, `start()`/`thread`
    run the link's own thread if it has one. `identify(sender, incarnation)`
    once the handshake named the sender.
    """

    def __init__(self, table: InboundTable, where: str) -> None:
        self.table = table
        self.where = where
        self.sender: str | None = None
        self.incarnation: str | None = None
        # Held while a byte of this link lands on our CPU or one of its notifies is handed over.
        self.guard = threading.RLock()
        self.dead = False  # fenced or ended: nothing of it lands, no notify of it starts
        self.settled = threading.Event()  # its data path has ended: nothing of it can arrive
        self.thread: threading.Thread | None = None
        # Whether our own stop of the data path proves nothing of it arrives (module docstring).
        self.self_settles = table.self_settles
        self.quiet_said = False  # the sender said every operation it posted here has ended
        self.peer_gone = False  # the sender's side ended the link without a word: it died

    # -- identity -------------------------------------------------------------
    def identify(self, sender: str, incarnation: str) -> None:
        """The handshake named the sender; `PeerLostError` if the engine is closing or refuses it.

        Refused, the link stays nameless: it never carried a byte.
        """
        self.table.admit(self, sender, incarnation)

    # -- notify delivery ------------------------------------------------------
    def deliver(self, payloads: Iterable[bytes | None]) -> bool:
        """Hand each payload to the handler, in order, unless the link is fenced; False if it was.

        Payloads that are None (a transfer without notify) are skipped. Checked
        per payload: a handler earlier in the batch may have fenced the link.
        """
        with self.guard:
            for payload in payloads:
                if self.dead:
                    return False
                if payload is not None and self.sender is not None:
                    self.table.notify(self.sender, payload)
            return not self.dead

    # -- the fence ------------------------------------------------------------
    def fence(self) -> None:
        """Stop this link for good: after return, no byte of it lands and no notify of it starts."""
        self.dead = True
        self.cut()
        with self.guard:  # waits out a landing or a notify in progress (re-entrant)
            pass
        self._settle()

    def ended(self) -> None:
        """The link's data path ended on its own (EOF, Bye): forget it, as a fence would."""
        self.dead = True
        with self.guard:
            pass
        self._settle()

    def _settle(self) -> None:
        """Nothing of this link lands through our side now: settled if that is a proof, else unproven."""
        if self.self_settles or self.quiet_said or self.peer_gone:
            self.settled.set()
            self.table.forget(self)
        else:
            self.table.unproven(self)

    def cut(self) -> None:
        """Stop the data path; return once no byte of this link can land (backends)."""

    # -- the thread -------------------------------------------------------------
    def start(self, target: Callable[[], None], name: str) -> bool:
        """Run `target` on this link's thread (joined by the engine's close); False if closing."""
        self.thread = threading.Thread(target=target, name=name, daemon=True)
        if not self.table.started(self):
            return False
        self.thread.start()
        return True

    def join(self, timeout: float) -> None:
        """Wait (bounded) for the link's thread; never from that thread itself."""
        thread = self.thread
        if thread is not None and thread.ident is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def running(self) -> bool:
        thread = self.thread
        return thread is not None and (thread.ident is None or thread.is_alive())


class InboundTable:
    """One engine's inbound links: admission, `has_peer`, the fence by sender, close and joins.

    `notify(sender, payload)` is the engine's delivery to its handler (it
    swallows the handler's exceptions); `self_settles` is its links' default
    (`EngineBase.cut_settles`).
    """

    def __init__(self, name: str, notify: Callable[[str, bytes], None], *,
                 self_settles: bool = True) -> None:
        self.name = name
        self.notify = notify
        self.self_settles = self_settles  # each link's default (`InboundLink.self_settles`)
        self._lock = threading.Lock()
        self._links: set[InboundLink] = set()
        self._threads: set[InboundLink] = set()  # links whose thread may still run
        # (sender, incarnation) of links that ended without proof, oldest first
        self._unproven: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._sealed: set[str] = set()  # senders whose new links wait for their old ones (`seal`)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def track(self, link: InboundLink) -> bool:
        """Count a just-accepted link (before its handshake) so close() reaches it; False if closing."""
        with self._lock:
            if self._closed:
                return False
            self._links.add(link)
        return True

    def admit(self, link: InboundLink, sender: str, incarnation: str) -> None:
        """A link finished its handshake: name it; `PeerLostError` if closing or `sender` is sealed."""
        with self._lock:
            if self._closed:
                raise PeerLostError(f"{self.name} engine is closing")
            if sender in self._sealed:
                if not self._settled(sender, None):  # (this link is not named yet)
                    raise PeerLostError(
                        f"{self.name}: a new link from {sender} is refused until every earlier "
                        "link of it is proven quiet (a request it may still write is quarantined)")
                self._sealed.discard(sender)  # its old links settled: the seal has done its work
            link.sender, link.incarnation = sender, incarnation
            self._links.add(link)

    def seal(self, sender: str) -> None:
        """Refuse new links from `sender` until every link it has now settled (then lifted by itself).

        For a receiver that lost the control channel to `sender` while a
        request of it may still be written: without the seal, a sender that
        has not noticed yet could open a fresh link after the old ones ended
        and post a transfer it still had queued — after `settled(sender)`
        said True. A link being admitted as the seal comes is counted, not
        refused.
        """
        with self._lock:
            self._sealed.add(sender)

    def started(self, link: InboundLink) -> bool:
        """Record that `link` runs a thread; False (do not start it) if closing."""
        with self._lock:
            if self._closed:
                return False
            self._threads = {t for t in self._threads if t.running}
            self._threads.add(link)
        return True

    def forget(self, link: InboundLink) -> None:
        """`link` settled: drop it, and its name from the unproven (a proof that came late counts)."""
        with self._lock:
            self._links.discard(link)
            if link.sender is not None and link.incarnation is not None:
                self._unproven.pop((link.sender, link.incarnation), None)

    def of(self, sender: str) -> list[InboundLink]:
        """The live links `sender` has into this engine."""
        with self._lock:
            return [link for link in self._links if link.sender == sender and not link.dead]

    def links(self) -> list[InboundLink]:
        """Every tracked link (identified or still in its handshake)."""
        with self._lock:
            return list(self._links)

    def has_peer(self, sender: str) -> bool:
        """Whether a link from `sender` is still open (its bytes may still land)."""
        return bool(self.of(sender))

    def unproven(self, link: InboundLink) -> None:
        """`link` ended without proof that nothing of it can land: forget it, remember its name."""
        dropped = None
        with self._lock:
            self._links.discard(link)
            if link.sender is None or link.incarnation is None:
                return  # never through its handshake: it carried no byte
            self._unproven[(link.sender, link.incarnation)] = None
            if len(self._unproven) > MAX_UNPROVEN:
                dropped, _ = self._unproven.popitem(last=False)
            if self._closed:
                return  # the engine is going: nobody asks any more
        log.warning("%s: link %s of %s ended without proof that none of its bytes can still land; "
                    "settled() says False for it", self.name, link.incarnation, link.sender)
        if dropped is not None:
            log.error("%s: more than %d links ended unproven; forgetting %s of %s — settled() "
                      "now says True for it", self.name, MAX_UNPROVEN, dropped[1], dropped[0])

    def settled(self, sender: str, incarnation: str | None = None) -> bool:
        """Whether no byte of `sender`'s link `incarnation` (None: of any link) can still arrive.

        False while such a link is open, still settling, or ended unproven.
        An incarnation never seen here, or seen to settle, has nothing left.
        """
        with self._lock:
            return self._settled(sender, incarnation)

    def _settled(self, sender: str, incarnation: str | None) -> bool:
        for link in self._links:
            if (link.sender == sender and not link.settled.is_set()
                    and (incarnation is None or link.incarnation == incarnation)):
                return False
        if incarnation is not None:
            return (sender, incarnation) not in self._unproven
        return not any(s == sender for s, _ in self._unproven)

    def fence(self, sender: str) -> None:
        """Fence every link of `sender` (drop_peer)."""
        for link in self.of(sender):
            link.fence()

    def close(self) -> None:
        """Refuse new links and fence every tracked one (engine close). Idempotent, total.

        Every link is fenced even if an earlier one's fence raised (one
        `CloseError` naming each); a fenced link leaves the table, so a second
        call fences again only the links whose fence failed.
        """
        with self._lock:
            self._closed = True
            links = list(self._links)
        closing.each(f"{self.name} inbound links", links, InboundLink.fence,
                     name=lambda link: f"link from {link.sender or link.where}")

    def join(self, timeout: float = JOIN_TIMEOUT) -> bool:
        """Join every link thread started (after `close`), all within `timeout` s in total.

        False if one was still running then (the next call waits for it again).
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for link in threads:
            link.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._threads = {t for t in self._threads if t.running}
            return not self._threads
