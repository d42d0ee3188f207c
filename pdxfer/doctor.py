"""`pdxfer doctor`: what this host can run, and for each thing it cannot, why and what to do.

The questions an operator asks before the first request — will verbs work
here, will a registration of this size pin, does this torch see the GPU, which
transports will UCX pick, can I reach etcd — each have an answer that is
already known somewhere: the transport registry knows why a backend does not
import (`transport.why_unavailable`), the kernel exposes RDMA ports, GIDs and
NUMA nodes under `/sys/class/infiniband`, `RLIMIT_MEMLOCK` bounds what a
registration may pin, UCXX's bundled `ucx_info` lists UCX's transports, and
the directory's own etcd client can ask etcd for its status. This module asks
each of them and words the answer as a `Finding`; it decides nothing a
transport would decide differently (it never re-implements a backend's
availability rule, it asks the registry).

Each finding is `ok` True (usable), False (asked for or needed, and not
usable: `fix` says what to do) or None (information: nothing was asked of
it, e.g. no RDMA device on a host that does not want one). The exit status
is 1 when a finding the caller *asked about* is False (`--need`, `--pin`,
`--etcd`), 0 otherwise, 2 for a usage error: a script can gate a deployment
on `pdxfer doctor --need verbs --pin 80GiB`.

Deliberately absent: NIXL's plugin list (it needs a NIXL agent, i.e. a
worker with its own threads, to answer; NIXL's availability is reported
through the registry like every backend) and a write over a real link (that
is `pdxfer probe`'s job: it needs a peer).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdxfer.cliargs import byte_size, etcd_url, positive_float

__all__ = ["Finding", "backends", "cuda", "etcd", "main", "memlock", "rdma", "ucx"]

# Where the kernel lists RDMA devices; a parameter of `rdma()` so a test can hand it a tree.
SYSFS_RDMA = Path("/sys/class/infiniband")
_MEMLOCK_FIX = ("raise the locked-memory limit: `ulimit -l unlimited` in the launching shell, "
                "`memlock` in /etc/security/limits.conf, `LimitMEMLOCK=infinity` for a systemd "
                "unit, or `--ulimit memlock=-1` for docker")


@dataclass(frozen=True)
class Finding:
    """One answer: `topic` (backend, memlock, rdma, cuda, ucx, etcd), what it is about, and why.

    `ok`: True usable, False not usable (see `fix`), None information only.
    """

    topic: str
    name: str
    ok: bool | None
    detail: str
    fix: str = ""


def backends() -> list[Finding]:
    """Each transport backend and variant: usable here, or the registry's reason it is not."""
    from pdxfer import transport

    out = []
    for name in transport.known():
        reason = transport.why_unavailable(name)
        if reason is None:
            out.append(Finding("backend", name, True, "imports here"))
        else:
            out.append(Finding("backend", name, False, reason,
                               fix="see the reason: install what it names, or pick another transport"))
    return out


def memlock(pin: int | None) -> Finding:
    """`RLIMIT_MEMLOCK` against `pin` bytes (what a registration would pin), or just the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    shown = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
    hard_shown = "unlimited" if hard == resource.RLIM_INFINITY else f"{hard} bytes"
    limits = f"soft limit {shown}, hard {hard_shown}"
    if pin is None:
        return Finding("memlock", "RLIMIT_MEMLOCK", None,
                       f"{limits}; RDMA registration (verbs, and UCX/NIXL over an RDMA NIC) pins "
                       "every registered byte — pass --pin BYTES to check a size")
    if soft == resource.RLIM_INFINITY or pin <= soft:
        return Finding("memlock", "RLIMIT_MEMLOCK", True, f"{limits}; pinning {pin} bytes fits")
    return Finding("memlock", "RLIMIT_MEMLOCK", False,
                   f"{limits}; pinning {pin} bytes needs {pin - soft} more", fix=_MEMLOCK_FIX)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def rdma(root: Path = SYSFS_RDMA) -> list[Finding]:
    """Each RDMA device port under `root`: state, link layer, GIDs in use, NUMA node."""
    if not root.is_dir():
        return [Finding("rdma", "devices", None,
                        f"no RDMA devices ({root} is absent): verbs needs a NIC with an RDMA "
                        "driver; verbs-sim (the software fabric) runs anywhere")]
    out = []
    for dev in sorted(root.iterdir()):
        numa = _read(dev / "device" / "numa_node") or "unknown"
        ports = sorted((dev / "ports").glob("*")) if (dev / "ports").is_dir() else []
        if not ports:
            out.append(Finding("rdma", dev.name, False, "device lists no ports",
                               fix="check the driver (ibv_devinfo)"))
        for port in ports:
            state = _read(port / "state")  # e.g. "4: ACTIVE"
            layer = _read(port / "link_layer") or "unknown"
            gids = [g for g in (_read(p) for p in sorted((port / "gids").glob("*")))
                    if g and g.strip("0:")] if (port / "gids").is_dir() else []
            active = state.endswith("ACTIVE")
            out.append(Finding(
                "rdma", f"{dev.name}/{port.name}", active,
                f"state {state or 'unknown'}, link layer {layer}, {len(gids)} GID(s) set, "
                f"NUMA node {numa}",
                fix="" if active else "bring the port up (cable, subnet manager, or `ip link set "
                                      "up` on the RoCE netdev)"))
    return out or [Finding("rdma", "devices", None, f"{root} lists no devices")]


def cuda(devices: list[str] | None = None, modules: Path | None = None,
         release: str | None = None) -> list[Finding]:
    """What this torch sees of CUDA, and whether the GPU-direct RDMA paths have their kernel parts.

    `devices` (the CUDA device names), `modules` (the kernel's module tree,
    `/sys/module`) and `release` (the kernel release) replace what is asked
    of torch and the host: a test hands in a GPU host's. The kernel parts are
    `transport.gpudirect`'s — the same facts a failed GPU registration names.
    """
    from pdxfer.transport import gpudirect

    if devices is None:
        import torch  # here: `pdxfer doctor --help` should not pay for torch

        if not torch.cuda.is_available():
            return [Finding("cuda", "torch", None,
                            f"this torch ({torch.__version__}) sees no CUDA device: GPU pools and "
                            "the VRAM paths of nixl-all/ucx-all/verbs are unavailable; CPU pools work")]
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        seen = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    else:
        seen = "given"
    if not devices:
        return [Finding("cuda", "torch", None, "no CUDA device")]
    out = [Finding("cuda", "torch", True, f"{seen}: {len(devices)} device(s): {', '.join(devices)}")]
    root = gpudirect.SYSFS_MODULES if modules is None else modules
    found = gpudirect.host(root, release)
    driver = _read(root / "nvidia" / "version")
    gaps = gpudirect.missing(found, 0)
    out.append(Finding(
        "cuda", "gpu-direct", not gaps,
        f"nvidia_peermem {'loaded' if found.peermem else 'not loaded'}; kernel {found.kernel} "
        f"{'supports' if found.dmabuf_kernel else 'predates'} dma-buf MRs (5.12+); NVIDIA driver "
        f"{driver or 'not loaded'}",
        fix="; ".join(sentence for _, sentence in gaps)
        + ("; without GPU-direct, GPU pools go through a host bounce (or EngineConfig(fallback='tcp'))"
           if gaps else "")))
    return out


def ucx(timeout: float = 10.0) -> Finding:
    """UCX's transports and devices as UCXX's bundled UCX lists them (`ucx_info -d`)."""
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return Finding("ucx", "transports", None,
                       "UCXX's UCX (libucx) is not installed: pip install 'pdxfer[ucx]'")
    root = Path(next(iter(spec.submodule_search_locations)))
    tool = root / "bin" / "ucx_info"
    if not tool.exists():
        return Finding("ucx", "transports", None, f"libucx at {root} ships no ucx_info")
    # The wheel's tool finds its libraries only through the loader path: set for the child only.
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(
        p for p in (str(root / "lib"), os.environ.get("LD_LIBRARY_PATH", "")) if p)}
    try:
        run = subprocess.run([str(tool), "-d"], capture_output=True, text=True, env=env,
                             timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Finding("ucx", "transports", False, f"{tool} -d did not answer: {exc}",
                       fix="run it by hand to see why")
    pairs: dict[str, list[str]] = {}
    transport_name = None
    for line in run.stdout.splitlines():
        words = line.strip("# \t").split(":", 1)
        if len(words) == 2 and words[0].strip() == "Transport":
            transport_name = words[1].strip()
            pairs.setdefault(transport_name, [])
        elif len(words) == 2 and words[0].strip() == "Device" and transport_name:
            pairs[transport_name].append(words[1].strip())
    if run.returncode != 0 or not pairs:
        return Finding("ucx", "transports", False,
                       f"ucx_info -d exited {run.returncode}: {run.stderr.strip()[:200]}",
                       fix="run it by hand to see why")
    shown = ", ".join(f"{t}({','.join(d)})" for t, d in pairs.items())
    rdma_tls = sorted(t for t in pairs if t.startswith(("rc", "dc", "ud")))
    return Finding("ucx", "transports", True,
                   f"{shown}; RDMA transports: {', '.join(rdma_tls) or 'none'} "
                   f"(UCX_TLS={os.environ.get('UCX_TLS', 'unset')})")


def etcd(url: str, timeout: float) -> Finding:
    """Whether the etcd at `url` answers within `timeout`, with its version and cluster id."""
    from pdxfer.directory.errors import DirectoryError
    from pdxfer.directory.etcd_client import EtcdClient

    client = EtcdClient(url, timeout=timeout)
    start = time.monotonic()
    try:
        answer = client.call("maintenance/status", {})
    except DirectoryError as exc:
        return Finding("etcd", url, False, f"no answer in {time.monotonic() - start:.2f} s: {exc}",
                       fix="check the URL, that etcd runs there, and the network between")
    finally:
        client.close()
    cluster = answer.get("header", {}).get("cluster_id", "?")
    return Finding("etcd", url, True,
                   f"etcd {answer.get('version', '?')}, cluster {cluster}, answered in "
                   f"{(time.monotonic() - start) * 1e3:.1f} ms")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdxfer doctor",
        description="what this host can run: transports, locked memory, RDMA, CUDA, UCX, etcd")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--need", action="append", default=[], metavar="TRANSPORT",
                        help="exit 1 unless this transport is usable here (repeatable)")
    parser.add_argument("--pin", type=byte_size, metavar="BYTES",
                        help="check that a registration pinning this much fits RLIMIT_MEMLOCK "
                             "(e.g. 80GiB)")
    parser.add_argument("--etcd", type=etcd_url, metavar="URL",
                        help="check that the peer directory's etcd answers")
    parser.add_argument("--timeout", type=positive_float, default=3.0,
                        help="seconds to wait for etcd or ucx_info (default 3)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `pdxfer doctor`: print the findings; exit 1 if one asked about fails."""
    from pdxfer import transport

    parser = _parser()
    args = parser.parse_args(argv)
    known = transport.known()
    for name in args.need:
        if name not in known:
            parser.error(f"--need {name!r}: unknown transport; known: {', '.join(known)}")
    findings = [*backends(), memlock(args.pin), *rdma(SYSFS_RDMA), *cuda(), ucx(args.timeout)]
    if args.etcd:
        findings.append(etcd(args.etcd, args.timeout))
    asked = [f for f in findings
             if (f.topic == "backend" and f.name in args.need)
             or (f.topic == "memlock" and args.pin is not None) or f.topic == "etcd"]
    failed = [f for f in asked if f.ok is False]
    if args.json:
        json.dump({"findings": [asdict(f) for f in findings],
                   "failed": [f"{f.topic} {f.name}" for f in failed]}, sys.stdout, indent=1)
        print()
    else:
        for f in findings:
            mark = {True: "ok  ", False: "NO  ", None: "--  "}[f.ok]
            print(f"{mark}{f.topic} {f.name}: {f.detail}")
            if f.fix and f.ok is False:
                print(f"      fix: {f.fix}")
        if failed:
            print(f"doctor: {len(failed)} asked-for check(s) failed: "
                  + "; ".join(f"{f.topic} {f.name}" for f in failed))
    return 1 if failed else 0
