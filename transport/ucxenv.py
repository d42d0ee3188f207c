"""What every UCX-based backend (nixl, ucx) must settle about UCX before it starts: log and interface.

Two facts, each needed by both backends and each easy to get wrong:

* **where UCX logs.** UCX reads its global log options once, from the
  environment, when libucs loads, and they cannot be passed as a context or
  backend parameter. Its default destination is stdout — a worker process's
  protocol channel (our peer processes speak on it). `route_ucx_log` is the
  one place the library writes to `os.environ`, only `UCX_LOG_FILE`, and
  only when it is unset or `stdout`: anyone who chose a file keeps it. Each
  backend calls it before its UCX loads (nixl bundles one libucs, UCXX
  another; each reads the variable when it loads).
* **which interface UCX may use.** UCX's tcp transport listens on every
  interface it is allowed; limiting it (`NET_DEVICES`) to the interface of
  the host an engine was given keeps a loopback-only engine off the cluster
  network (`interface_of`).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from typing import Any


def route_ucx_log() -> None:
    """Send UCX's own log lines to stderr, never to stdout, unless the user chose a file."""
    if os.environ.get("UCX_LOG_FILE", "stdout") in ("", "stdout"):
        os.environ["UCX_LOG_FILE"] = "stderr"


def interface_of(host: str) -> str | None:
    """The network interface holding address `host`, or None (a wildcard, or not found)."""
    if host in ("", "0.0.0.0", "::"):
        return None
    try:
        wanted = {ipaddress.ip_address(info[4][0].split("%")[0])
                  for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, ValueError):
        return None
    for _, name in socket.if_nameindex():
        if any(ip.is_loopback for ip in wanted) and _addresses(name) & {
                ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}:
            return name
        if _addresses(name) & wanted:
            return name
    return None


def _addresses(name: str) -> set[Any]:
    """The IPv4 address (ioctl SIOCGIFADDR) and IPv6 addresses (/proc) of interface `name`."""
    out: set[Any] = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            out.add(ipaddress.ip_address(raw[20:24]))
        except OSError:
            pass
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                cols = line.split()
                if len(cols) == 6 and cols[5] == name:
                    out.add(ipaddress.ip_address(int(cols[0], 16)))
    except OSError:
        pass
    return out
