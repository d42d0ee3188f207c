"""Layout (filled in by the layout work)."""
