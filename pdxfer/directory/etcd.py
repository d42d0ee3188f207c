"""`EtcdDirectory`: the peer directory on a real etcd — leases for liveness, watches for news.

Keys, under one cluster id (the namespace: `MC_METADATA_CLUSTER_ID` /
`NIXL_ETCD_NAMESPACE` play this part elsewhere):

    /pdx/<cluster>/v1/<model>/<role>/peers/<instance>/<dp>/<tp>  record (JSON), on the process's lease
    /pdx/<cluster>/v1/<model>/<role>/layouts/<fingerprint>       description (JSON), put-if-absent, no lease
    /pdx/<cluster>/v1/epoch                                      this store's random id, put-if-absent, no lease

A process follows the (model, role) pairs it routes to — a decode or a router
follows `<model>/prefill/` — with one list and one watch each, never the
whole cluster: "everyone lists everyone" is how a thousand-process start-up
collapses (docs/directory.md). Layouts live beside the records they describe
so one prefix gives both; they are immutable and content-addressed, so they
carry no lease and can never be stale (a cluster's are removed with it).

Liveness: ONE lease per process (per `EtcdDirectory`), TTL `ttl`, refreshed
every ttl/3 scaled by a random 0.8-1.0 — jitter, so a thousand processes
started together do not refresh in lockstep (dynamo#7932). All of the
process's records ride it; `close()` revokes it, and peers see "down" in
milliseconds. A process that dies, or stops (SIGSTOP, a hung host), stops
refreshing, and etcd deletes its records within TTL + ~0.5 s. A keep-alive
that finds the lease expired (we were cut off longer than the TTL) grants a
new one and puts our records back with the same engine ids — unless a new
incarnation took a slot meanwhile, which we then leave to it.

Following: list the prefix (one snapshot, paged) -> the view; watch from that
revision + 1, so no change falls between the two. When the stream breaks
(etcd restarted, network) it is resumed from the last revision seen, with
backoff and jitter; only if etcd answers that this revision was compacted
away does the follower re-list and diff (records missing from the new list
go "down"). Resuming instead of re-listing on every reconnect keeps a
restarted etcd from being flooded by every process's full listing at once
(kubernetes#22669).

Hostile or broken values: anyone who can write to etcd can put anything
under a followed prefix — a key whose rank is '²', key bytes that are not
UTF-8, a value nested 5,000 deep or a record claiming tp_size 2**40. Such a
value is skipped and counted (`health().skipped`), logged once per key, and
never stops the list or the watch: every exception from reading one value is
that value's fault (records.py bounds sizes, depth and every number). A slot
whose value turns unreadable has no record any more ("down").

Knowing the view is current: a follower that registers nothing has no
keep-alive to notice a frozen etcd (SIGSTOP keeps its sockets open and its
kernel answers TCP keep-alive). So a follower probes: every `probe` seconds
(default ttl/3, jittered) one linearizable read of the cluster's epoch key,
bounded by `timeout`; no answer marks `health()` degraded within
probe + timeout and breaks the watch (a frozen member may hold it). The same
probe notices an etcd rebuilt from nothing at the same URL — the store a
watch resumed on would stay silent until its revision passed ours — by the
epoch key (a random value put-if-absent at first list) having gone or
changed, the store's revision being behind the view's, or another cluster
id; the watch's "created" answer is checked the same way. Then every
followed prefix is re-listed.

The directory never fails a transfer and never touches an engine's links on
its own: etcd down means `health()` degraded and a view that stops changing;
requests already bound to a peer go on, decided by their control link.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence

from .base import DirectoryHealth, PeerDirectory, check_cluster, check_record, claim
from .errors import DirectoryError, DirectoryUnavailable, RecordError
from .etcd_client import (
    AnswerTooLarge,
    EtcdClient,
    Header,
    WatchStream,
    event_key,
    event_value,
    message_header,
)
from .records import PeerRecord, Slot, check_name, decode_layout, encode_layout

log = logging.getLogger("pdxfer.directory")

# Reconnect backoff: first retry soon, doubling to this cap, each scaled by a
# random 0.5-1.0 so that a restarted etcd is not met by every process at once.
_BACKOFF_FIRST = 0.05
_BACKOFF_CAP = 5.0
# Keys whose bad values are logged (once each); past this many, only counted.
_MAX_WARNED = 1024


def root(cluster: str) -> str:
    """The key prefix of everything a cluster stores."""
    return f"/pdx/{check_cluster(cluster)}/v1/"


class EtcdDirectory(PeerDirectory):
    """This process's directory on etcd: one lease, and one list+watch per followed (model, role).

    `endpoints`: one etcd client URL or several members' (comma-separated or a
    list). `follow`: the (model, role) pairs whose records this process needs
    (a prefill worker that only registers follows none). `timeout` bounds
    each call to etcd (default: a third of the TTL, at most 5 s). `probe`:
    seconds between a follower's liveness probes (default a third of the
    TTL); a frozen or rebuilt etcd is noticed within probe + timeout.
    """

    def __init__(self, endpoints: str | Sequence[str], *, cluster: str = "default",
                 ttl: float = 10.0, follow: Iterable[tuple[str, str]] = (),
                 timeout: float | None = None, seed: int | None = None,
                 probe: float | None = None) -> None:
        super().__init__()
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 1 <= ttl < 1e6:
            raise DirectoryError(f"ttl must be a number of seconds >= 1 (etcd leases count whole "
                                 f"seconds), got {ttl!r}")
        self.ttl = int(math.ceil(ttl))
        if probe is not None and (isinstance(probe, bool) or not isinstance(probe, (int, float))
                                  or not 0.05 <= probe <= 3600):
            raise DirectoryError(f"probe must be a number of seconds in 0.05..3600, got {probe!r}")
        self.probe = float(probe) if probe is not None else self.ttl / 3
        self.cluster = cluster
        self.root = root(cluster)
        self.follow = [(check_name("model", m), r) for m, r in follow]
        for _, role in self.follow:
            Slot("m", role, "i")  # the role check, worded once
        timeout = timeout if timeout is not None else min(5.0, max(0.5, self.ttl / 3))
        self._client = EtcdClient(endpoints, timeout=timeout)
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._reg_lock = threading.Lock()  # register/unregister/keeper: one lease story at a time
        self._lease = 0
        self._mine: dict[Slot, bytes] = {}
        self._streams: dict[str, WatchStream] = {}
        self._problems: dict[str, str] = {}
        self._since = time.monotonic()
        self._revisions: dict[str, int] = {}  # follower -> store revision its view reflects
        self.relists = 0  # full listings taken (first ones included): what a storm would show
        self.rebuilds = 0  # times the store was found not to be the one the view came from
        self.skipped = 0  # values refused (bad key or value), each skipped, never fatal
        self._warned: set[str] = set()
        self._epoch_key = self.root + "epoch"
        self._epoch: bytes | None = None  # the store's epoch value at the last list
        self._cluster_id = ""
        self._relist: set[str] = set()  # followers that must re-list (the store changed)
        self._my_layouts: dict[str, bytes] = {}  # published by us: re-put on a rebuilt store
        self._threads: list[threading.Thread] = []
        for model, role in self.follow:
            self._problems[f"watch {model}/{role}"] = "not listed yet"
            self._spawn(self._follow, f"pdxfer-dir-watch-{model}-{role}", model, role)
        if self.follow:
            self._spawn(self._probe_loop, "pdxfer-dir-probe")

    # -- registration -----------------------------------------------------------------
    def register(self, slot: Slot, record: PeerRecord, layouts: Mapping[str, dict] | None = None,
                 *, takeover: bool = False) -> None:
        self._check_open()
        check_record(slot, record)
        value = record.encode()
        key = self.root + slot.path()
        with self._reg_lock:
            if not self._lease:
                self._lease, granted = self._client.grant(self.ttl)
                self._ok("lease")
                if not any(t.name == "pdxfer-dir-lease" for t in self._threads):
                    self._spawn(self._keep, "pdxfer-dir-lease")
                if granted != self.ttl:
                    log.info("pdxfer directory: etcd granted TTL %d s for %d s asked", granted, self.ttl)
            for fp, desc in (layouts or {}).items():
                lkey = f"{self.root}{slot.model}/{slot.role}/layouts/{fp}"
                self._my_layouts[lkey] = encode_layout(desc)
                self._client.put_if(lkey, self._my_layouts[lkey])
            for _ in range(8):  # each retry means the slot changed between our read and write
                kv = self._client.get(key)
                held = None
                if kv is not None:
                    try:
                        held = PeerRecord.decode(slot, kv.value)
                    except RecordError as exc:
                        if not takeover:
                            raise DirectoryError(f"register: {exc}; register with takeover=True "
                                                 "to overwrite it") from exc
                claim(slot, held, record, takeover)
                if self._client.put_if(key, value, self._lease,
                                       mod_revision=kv.mod_revision if kv else 0):
                    self._mine[slot] = value
                    return
            raise DirectoryUnavailable(f"register({slot.path()}): the slot kept changing under us")

    def unregister(self, slot: Slot) -> None:
        with self._reg_lock:
            if self._mine.pop(slot, None) is not None and self._lease:
                self._client.delete_if_lease(self.root + slot.path(), self._lease)

    # -- the lease ---------------------------------------------------------------------
    def _keep(self) -> None:
        """Keep the lease alive (jittered), re-grant and re-put if it expired; never raises."""
        wait = self._period()
        failures = 0
        while not self._stop.wait(wait):
            try:
                with self._reg_lock:
                    if self._stop.is_set():
                        return
                    left = self._client.keepalive(self._lease) if self._lease else 0
                    if left <= 0:
                        self._regrant()
                self._ok("lease")
                failures = 0
                wait = self._period()
            except DirectoryUnavailable as exc:
                failures += 1
                self._problem("lease", f"keep-alive failed {failures} time(s): {exc}")
                wait = min(self._period(), _BACKOFF_FIRST * 2 ** failures) * self._rng.uniform(0.5, 1.0)

    def _period(self) -> float:
        return self.ttl / 3 * self._rng.uniform(0.8, 1.0)

    def _regrant(self) -> None:
        """Our lease expired while we were cut off: a new one, and our records back on it."""
        old = self._lease
        self._lease, _ = self._client.grant(self.ttl)
        log.warning("pdxfer directory: lease %x expired (cut off from etcd for over %d s, or etcd "
                    "was rebuilt); re-registering %d record(s) on lease %x", old, self.ttl,
                    len(self._mine), self._lease)
        for lkey, lvalue in self._my_layouts.items():  # a rebuilt store lost them too
            self._client.put_if(lkey, lvalue)
        for slot, value in list(self._mine.items()):
            key = self.root + slot.path()
            kv = self._client.get(key)
            if kv is not None and kv.lease != old:
                record = _decode_or_none(slot, kv.value)
                mine = PeerRecord.decode(slot, value)
                if record is None or record.engine != mine.engine:
                    log.warning("pdxfer directory: %s was taken by engine %s meanwhile; leaving "
                                "it to the new holder", slot.path(),
                                record.engine if record else "(unreadable)")
                    del self._mine[slot]
                    continue
            self._client.put_if(key, value, self._lease, mod_revision=kv.mod_revision if kv else 0)

    # -- following ---------------------------------------------------------------------
    def _follow(self, model: str, role: str) -> None:
        """List, then watch from the next revision; resume after a break; re-list if compacted
        or if the store is not the one the view came from."""
        name = f"watch {model}/{role}"
        prefix = f"{self.root}{model}/{role}/"
        revision = 0  # last revision this view reflects; 0: must list
        failures = 0
        while not self._stop.is_set():
            if self._take_relist(name):
                revision = 0
            try:
                if revision == 0:
                    revision = self._list(model, role, prefix, name)
                stream = self._client.watch(prefix, revision + 1, keepalive_idle=max(1, self.ttl))
                self._streams[name] = stream
                with self._cond:
                    if self._stop.is_set() or name in self._relist:
                        stream.close()
                for msg in stream:
                    if msg.get("created"):
                        why = self._foreign(message_header(msg), revision)
                        if why:
                            self._store_changed(f"{name}: the watch at {stream.where} {why}")
                            stream.close()
                            break
                        self._ok(name)
                        failures = 0
                    if msg.get("canceled") or msg.get("compact_revision"):
                        log.warning("pdxfer directory: %s: revision %d was compacted away (oldest "
                                    "kept %s); re-listing", name, revision + 1,
                                    msg.get("compact_revision"))
                        revision = 0
                        stream.close()
                        break
                    revision = self._events(model, role, msg.get("events", ()), revision)
                    self._note_revision(name, message_header(msg).revision)
                else:
                    with self._cond:
                        quiet = self._stop.is_set() or name in self._relist
                    if not quiet:
                        self._problem(name, f"watch stream from {stream.where} ended")
                with self._cond:
                    again = revision == 0 or name in self._relist
                if again:
                    continue  # compacted or another store: re-list at once, that is not a failure
            except AnswerTooLarge as exc:
                # A watch catching up sends up to 1,000 revisions in one message: a burst of
                # huge values makes one no reader should buffer, and resuming would meet it
                # again. A listing pages by size instead (etcd_client.range), then the watch
                # starts synced, from after it.
                log.warning("pdxfer directory: %s: %s; re-listing instead of resuming", name, exc)
                revision = 0
                continue
            except DirectoryUnavailable as exc:
                self._problem(name, str(exc))
            except Exception as exc:  # noqa: BLE001 — a follower that dies leaves a frozen view
                log.exception("pdxfer directory: %s failed; retrying", name)
                self._problem(name, repr(exc))
            failures += 1
            self._stop.wait(min(_BACKOFF_CAP, _BACKOFF_FIRST * 2 ** min(failures, 10))
                            * self._rng.uniform(0.5, 1.0))

    def _list(self, model: str, role: str, prefix: str, name: str) -> int:
        header, epoch = self._read_epoch()
        with self._cond:
            known = self._epoch
        if known is not None and epoch != known:
            self._store_changed(f"{name}: the epoch key changed")
            self._take_relist(name)  # this listing is the re-list
        with self._cond:
            self._epoch, self._cluster_id = epoch, header.cluster_id
        revision, kvs = self._client.range(prefix)
        snapshot: dict[Slot, PeerRecord] = {}
        layouts: dict[str, dict] = {}
        for kv in kvs:
            parsed = self._parse(kv.key[len(self.root):], kv.value)
            if isinstance(parsed, PeerRecord):
                snapshot[parsed.slot] = parsed  # type: ignore[index]
            elif isinstance(parsed, tuple):
                layouts[parsed[0]] = parsed[1]
        self.relists += 1
        self._resync(model, role, snapshot, layouts)
        with self._cond:
            self._revisions[name] = revision  # assigned, not maxed: a rebuilt store starts low
        return revision

    def _read_epoch(self) -> tuple[Header, bytes]:
        """The store's epoch value (put-if-absent, random, no lease) and the answer's header.

        It tells one store from another at one URL: a store rebuilt from
        nothing has none (or, once a process put it back, another one).
        """
        header, kv = self._client.probe(self._epoch_key)
        if kv is None:
            self._client.put_if(self._epoch_key, uuid.uuid4().hex.encode())
            header, kv = self._client.probe(self._epoch_key)
            if kv is None:
                raise DirectoryUnavailable(f"etcd: {self._epoch_key} vanished as it was written")
        return header, kv.value

    def _events(self, model: str, role: str, events: Sequence[dict], revision: int) -> int:
        changes: list[tuple[Slot, PeerRecord | None]] = []
        layouts: dict[str, dict] = {}
        for event in events:
            try:
                path = event_key(event)[len(self.root):]
                revision = max(revision, int(event["kv"].get("mod_revision", revision)))
            except Exception as exc:  # noqa: BLE001 — not an event etcd would send; skip it
                self._skip(f"(an event: {str(event)[:100]})", exc)
                continue
            if event.get("type") == "DELETE":
                if "/peers/" in path:
                    try:
                        changes.append((Slot.from_path(path), None))
                    except Exception:  # noqa: BLE001 — a bad key going away; it was skipped
                        log.debug("pdxfer directory: ignoring the deletion of %r", path)
                continue
            parsed = self._parse(path, event_value(event))
            if isinstance(parsed, PeerRecord):
                changes.append((parsed.slot, parsed))  # type: ignore[arg-type]
            elif isinstance(parsed, Slot):
                changes.append((parsed, None))  # its value is unreadable now: no record
            elif parsed is not None:
                layouts[parsed[0]] = parsed[1]
        if changes or layouts:
            self._apply(changes, layouts)
        return revision

    def _parse(self, path: str, value: bytes) -> PeerRecord | tuple[str, dict] | Slot | None:
        """A record or (fingerprint, description) from a key below the root.

        A bad value is skipped (counted, logged once per key): None, or the
        slot when the key names one (that slot then has no record). Never
        raises: whatever one value trips is that value's fault.
        """
        try:
            if "/layouts/" in path:
                fp = path.rsplit("/", 1)[1]
                return fp, decode_layout(fp, value)
            slot = Slot.from_path(path)
        except Exception as exc:  # noqa: BLE001 — see the docstring
            self._skip(path, exc)
            return None
        try:
            return PeerRecord.decode(slot, value)
        except Exception as exc:  # noqa: BLE001 — see the docstring
            self._skip(path, exc)
            return slot

    def _skip(self, path: str, exc: BaseException) -> None:
        with self._cond:
            self.skipped += 1
            first = path not in self._warned and len(self._warned) < _MAX_WARNED
            if first:
                self._warned.add(path)
        if first:
            log.warning("pdxfer directory: skipping the value at %r (logged once per key): %s",
                        path, exc if isinstance(exc, RecordError) else repr(exc)[:300])

    # -- is the view current? ------------------------------------------------------------
    def _probe_loop(self) -> None:
        """Probe etcd every `probe` s (jittered): degraded when it does not answer, re-list when
        it is another store. Never raises."""
        failures = 0
        while not self._stop.wait(self.probe * self._rng.uniform(0.8, 1.0)):
            with self._cond:  # before the call: anything seen after it is newer than the answer
                epoch, seen = self._epoch, max(self._revisions.values(), default=0)
            try:
                header, kv = self._client.probe(self._epoch_key)
            except DirectoryUnavailable as exc:
                failures += 1
                self._problem("probe", f"etcd did not answer a probe within {self._client.timeout:g} "
                              f"s ({failures} in a row): {exc}")
                if failures == 1:  # a frozen member may hold the watch open: reconnect it
                    for stream in list(self._streams.values()):
                        stream.close()
                continue
            except DirectoryError:  # closed under us
                return
            failures = 0
            self._ok("probe")
            with self._cond:
                if epoch is None or self._epoch != epoch:
                    continue  # not listed yet, or re-listed meanwhile: the next probe judges
            if kv is None or kv.value != epoch:
                self._store_changed("its epoch key is " + ("gone" if kv is None else "another"))
            elif why := self._foreign(header, seen):
                self._store_changed(why)

    def _foreign(self, header: Header, seen: int) -> str | None:
        """Why an answer comes from another store than the view's (revision behind, other
        cluster id), or None."""
        with self._cond:
            cluster_id = self._cluster_id
        if header.revision < seen:
            return f"answered at revision {header.revision}, behind the view's {seen}"
        if cluster_id and header.cluster_id and header.cluster_id != cluster_id:
            return f"answered from cluster {header.cluster_id}, not {cluster_id}"
        return None

    def _store_changed(self, why: str) -> None:
        """etcd is not the store the view came from (rebuilt, or wiped): every follower re-lists."""
        log.warning("pdxfer directory: etcd was rebuilt or wiped (%s); re-listing every followed "
                    "prefix", why)
        with self._cond:
            self.rebuilds += 1
            self._relist.update(f"watch {m}/{r}" for m, r in self.follow)
            self._epoch, self._cluster_id = None, ""
            self._revisions.clear()
        for stream in list(self._streams.values()):
            stream.close()

    def _take_relist(self, name: str) -> bool:
        with self._cond:
            if name in self._relist:
                self._relist.discard(name)
                return True
            return False

    def _note_revision(self, name: str, revision: int) -> None:
        with self._cond:
            if name not in self._relist:  # a late message of a store being left behind
                self._revisions[name] = max(self._revisions.get(name, 0), revision)

    # -- health, close -----------------------------------------------------------------
    def _ok(self, what: str) -> None:
        with self._cond:
            if self._problems.pop(what, None) is not None and not self._problems:
                self._since = time.monotonic()
                log.info("pdxfer directory: connected to etcd again")
            self._cond.notify_all()

    def _problem(self, what: str, reason: str) -> None:
        with self._cond:
            if not self._problems:
                self._since = time.monotonic()
                log.warning("pdxfer directory: degraded: %s: %s", what, reason)
            self._problems[what] = reason
            self._cond.notify_all()

    def health(self) -> DirectoryHealth:
        with self._cond:
            reason = "; ".join(f"{k}: {v}" for k, v in sorted(self._problems.items()))
            revision = max(self._revisions.values(), default=0)
            if self._closed:
                return DirectoryHealth(False, revision, self._since, "closed", self.skipped)
            return DirectoryHealth(not self._problems, revision, self._since, reason, self.skipped)

    def wait_connected(self, timeout: float) -> bool:
        """Until every follower has listed and watches and the lease (if any) is current."""
        return self.wait_for(lambda: not self._problems, timeout)

    def close(self, *, revoke: bool = True) -> None:
        """Stop following and keeping alive; revoke the lease (peers see "down" at once)."""
        if self._closed:
            return
        super().close()
        self._stop.set()
        for stream in list(self._streams.values()):
            stream.close()
        with self._reg_lock:
            lease, self._lease = self._lease, 0
            self._mine.clear()
        if revoke and lease:
            try:
                self._client.revoke(lease)
            except DirectoryUnavailable as exc:  # it will expire by itself within the TTL
                log.info("pdxfer directory: lease not revoked (expires within %d s): %s",
                         self.ttl, exc)
        for thread in self._threads:
            thread.join(self._client.timeout + 1.0)
        self._client.close()

    def _spawn(self, target, name: str, *args) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()


def _decode_or_none(slot: Slot, value: bytes) -> PeerRecord | None:
    try:
        return PeerRecord.decode(slot, value)
    except RecordError:
        return None
