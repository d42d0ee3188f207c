"""What a process holds right now: resident memory and threads, read from /proc.

`pdxfer bench peers` reports how memory and threads grow with the number of
peers; the thread count is the kernel's (every native thread counts: UCX's,
torch's, ours), not `threading.active_count()`, which sees Python's only.
"""

from __future__ import annotations

import resource


def usage() -> dict[str, int]:
    """`{"rss": bytes resident now, "threads": threads now}` of this process (Linux)."""
    out = {"rss": 0, "threads": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["rss"] = int(line.split()[1]) * 1024
                elif line.startswith("Threads:"):
                    out["threads"] = int(line.split()[1])
    except OSError:  # not Linux: the peak, in the units getrusage gives there
        out["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return out
