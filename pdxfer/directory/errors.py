"""Directory failures, children of pdxfer's one error root, split by cause.

`DirectoryUnavailable` is the one a serving process meets in operation (the
store cannot be reached); it never fails a transfer — the engines do not ask
the store on the request path — only a call that must write or read the
store now (`register`, a first list). The others are refusals of bad input
or of a slot held by someone else, raised before anything is written.
"""

from __future__ import annotations

from pdxfer.layout.errors import PdxferError


class DirectoryError(PdxferError):
    """A directory call that cannot work as asked (bad slot, bad URL, closed)."""


class RecordError(DirectoryError):
    """A stored value that is not a record (or description) this pdxfer reads; names the key."""


class SlotTakenError(DirectoryError):
    """The slot is held by another live process; names it and what to do."""


class DirectoryUnavailable(DirectoryError):
    """The store did not answer (refused, timed out, or answered with an error); says which."""
