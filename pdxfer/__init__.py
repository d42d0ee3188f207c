"""PD engine (filled in by the engine work)."""
