"""A node of an engine's resource tree: closing a parent closes its children first, newest first.

What it is for: a registered region is a parent whose children are the
registrations backends make over its memory — nixl's NIXL registration on the
initiating agent and one per inbound link's agent, verbs' engine-wide MR and
one MR per inbound link. Deregistering the region (or closing the engine)
must close every one of them, in the reverse order they were made (a
per-link MR before the engine-wide one it was made after), and then let go
of the memory: after `close()` returns the node holds no child and no
reference that keeps the tensor alive. Writing that once here is what keeps a
backend from growing its own "retired" list of regions it never frees.

The shape follows pyverbs' and ucx-py's objects (a Context closes its PDs,
a PD its MRs and QPs) without their global registry: a child is adopted
under a key its owner chooses (the link it belongs to), so the owner can
close just that child early (`drop`) when the link goes first.

Rules a child must keep: `close()` is idempotent and never raises for a
resource already gone; it may take its own owner's locks, never the
parent's tree lock (the parent releases that before calling it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from typing import Any, Protocol

from .errors import ClosedError

log = logging.getLogger(__name__)


class Closeable(Protocol):
    def close(self) -> None: ...


class Resource:
    """A parent of closeable children, closed in reverse adoption order by `close()`."""

    def __init__(self) -> None:
        self._children: dict[Hashable, Closeable] = {}
        self._tree_lock = threading.Lock()
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether `close()` has begun (no child can be adopted any more)."""
        return self._closed

    def adopt(self, key: Hashable, child: Any) -> Any:
        """Make `child` this node's child under `key`; `ClosedError` (child closed) if we are closed.

        A second child under the same key replaces (and closes) the first.
        """
        with self._tree_lock:
            old = None
            if not self._closed:
                old = self._children.pop(key, None)
                self._children[key] = child
        if old is not None:
            self._close_child(old)
        if self._closed and self._children.get(key) is not child:
            self._close_child(child)
            raise ClosedError(f"{self!r} was closed; nothing more can be attached to it")
        return child

    def child(self, key: Hashable) -> Any:
        """The child adopted under `key`, or None."""
        return self._children.get(key)

    def drop(self, key: Hashable) -> bool:
        """Close and forget the child under `key`; False if there was none."""
        with self._tree_lock:
            child = self._children.pop(key, None)
        if child is None:
            return False
        self._close_child(child)
        return True

    def close(self) -> None:
        """Close every child, newest first, then `release()` this node. Idempotent."""
        with self._tree_lock:
            if self._closed:
                return
            self._closed = True
            children = list(self._children.values())[::-1]
            self._children.clear()
        for child in children:
            self._close_child(child)
        self.release()

    def release(self) -> None:
        """What this node frees itself once its children are closed (subclasses)."""

    @staticmethod
    def _close_child(child: Closeable) -> None:
        try:
            child.close()
        except Exception:  # one child's failure must not keep its siblings open
            log.exception("closing %r failed", child)
