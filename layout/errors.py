"""The root of every error pdxfer raises, and the one layout raises itself.

The root lives here, at the bottom of the dependency chain, because it is the
only package everything else may import: `transport` and `pdxfer` derive their
own families from `PdxferError`, so a serving engine can catch one class and
know it caught all of ours and nothing of anyone else's.

`LayoutError` is also a `ValueError`: the entry-arena design's arithmetic refuses bad
declarations with `ValueError`, and callers written against that keep working.
"""

from __future__ import annotations


class PdxferError(Exception):
    """Root of every exception raised by layout, transport and pdxfer."""


class LayoutError(PdxferError, ValueError):
    """A declaration, buffer or index array the layout arithmetic refuses."""
