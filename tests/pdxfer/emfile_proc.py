"""A prefill (tcp transport) in a process whose descriptor limit is low, for the EMFILE test.

Lowers `RLIMIT_NOFILE` to 128, starts a `PrefillEngine` over tcp and prints
`READY <bootstrap host:port> <transport port>`. Then one command per line,
one flushed line back:

    exhaust  -> opens /dev/null until EMFILE; `HELD <n>`
    cpu      -> `CPU <user+system seconds of this process so far>`
    free     -> closes what `exhaust` held; `FREED`
    quit
"""

from __future__ import annotations

import os
import resource
import sys

from pdxfer_testkit import build_pools

from pdxfer import EngineConfig, PrefillEngine


def main() -> int:
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    engine = PrefillEngine(build_pools(16, 4), EngineConfig(transport="tcp", timeout=30.0))
    print(f"READY {engine.bootstrap_address} {engine._transport.address()['port']}", flush=True)
    held: list[int] = []
    for line in sys.stdin:
        word = line.strip()
        if word == "exhaust":
            try:
                while True:
                    held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
            reply = f"HELD {len(held)}"
        elif word == "cpu":
            times = os.times()
            reply = f"CPU {times.user + times.system:.4f}"
        elif word == "free":
            for fd in held:
                os.close(fd)
            held.clear()
            reply = "FREED"
        else:
            break
        print(reply, flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
