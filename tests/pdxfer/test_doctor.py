"""`pdxfer doctor`: each finding tells the truth about this host, and the exit status follows what was asked.

The checks that depend on a limit (locked memory) run the command in a child
whose limit the test sets, so the answer is known in advance; RDMA is tested
against a sysfs tree the test builds (the kernel's layout), since this host
has no device. The etcd half is in tests/directory/test_doctor_etcd.py, beside
the suite's etcd.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from pdxfer import cli, doctor, transport
from pdxfer.cliargs import byte_size


def _run(*argv: str, memlock: int | None = None) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        if memlock is not None:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (memlock, memlock))

    return subprocess.run([sys.executable, "-m", "pdxfer", "doctor", *argv], capture_output=True,
                          text=True, timeout=120, preexec_fn=limit, check=False)


def _findings(run: subprocess.CompletedProcess[str]) -> dict[tuple[str, str], dict]:
    return {(f["topic"], f["name"]): f for f in json.loads(run.stdout)["findings"]}


def test_every_backend_is_reported_with_the_registrys_verdict() -> None:
    found = {f.name: f for f in doctor.backends()}
    assert sorted(found) == sorted(transport.known())
    usable = set(transport.available()) | set(transport.variants())
    for name, finding in found.items():
        assert finding.ok is (name in usable), name
        if not finding.ok:  # the reason names the backend and how to install it
            assert name in finding.detail and finding.fix


def test_why_unavailable_refuses_an_unknown_name() -> None:
    with pytest.raises(transport.CapabilityError, match=r"unknown transport 'nosuch'; known: .*tcp"):
        transport.why_unavailable("nosuch")


def test_memlock_too_small_for_the_pin_fails_with_the_fix() -> None:
    run = _run("--json", "--pin", "1GiB", memlock=64 * 1024)
    assert run.returncode == 1, run.stderr
    finding = _findings(run)[("memlock", "RLIMIT_MEMLOCK")]
    assert finding["ok"] is False
    assert "soft limit 65536 bytes" in finding["detail"]
    assert f"needs {2**30 - 65536} more" in finding["detail"]
    assert "ulimit -l" in finding["fix"]
    assert json.loads(run.stdout)["failed"] == ["memlock RLIMIT_MEMLOCK"]


def test_memlock_that_fits_passes_and_without_pin_is_information() -> None:
    assert doctor.memlock(None).ok is None
    run = _run("--json", "--pin", "4KiB", memlock=64 * 1024)
    assert run.returncode == 0, run.stderr
    assert _findings(run)[("memlock", "RLIMIT_MEMLOCK")]["ok"] is True


def test_need_exit_status_follows_the_backend() -> None:
    assert _run("--need", "tcp").returncode == 0
    missing = [n for n in transport.known() if transport.why_unavailable(n)]
    if not missing:
        pytest.skip("every backend is usable on this host; no missing one to ask for")
    run = _run("--need", missing[0])
    assert run.returncode == 1
    assert f"failed: backend {missing[0]}" in run.stdout


@pytest.mark.parametrize(("argv", "message"), [
    (["--need", "nosuch"], "--need 'nosuch': unknown transport"),
    (["--pin", "lots"], "expected a size like 4096"),
    (["--pin", "0"], "out of range"),
    (["--etcd", "localhost"], "not an etcd client URL"),
    (["--timeout", "-1"], "out of range"),
])
def test_bad_flags_are_one_line_usage_errors(argv: list[str], message: str, capsys) -> None:
    # The console script's own entry (`pdxfer.cli.main`), in this process: a usage error is
    # decided before anything is probed, and each child process would only add a torch import
    # (the process-level exit path is the other tests' `_run`). A raise other than the usage
    # error's SystemExit(2) — the traceback a user would see — fails the test.
    with pytest.raises(SystemExit) as exit_:
        cli.main(["doctor", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_rdma_reads_ports_gids_and_numa_from_sysfs(tmp_path) -> None:
    port = tmp_path / "mlx5_0" / "ports" / "1"
    (port / "gids").mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("Ethernet\n")
    (port / "gids" / "0").write_text("fe80:0000:0000:0000:0000:0000:0000:0001\n")
    (port / "gids" / "1").write_text("0000:0000:0000:0000:0000:0000:0000:0000\n")  # unset slot
    (tmp_path / "mlx5_0" / "device").mkdir()
    (tmp_path / "mlx5_0" / "device" / "numa_node").write_text("1\n")
    down = tmp_path / "mlx5_1" / "ports" / "1"
    down.mkdir(parents=True)
    (down / "state").write_text("1: DOWN\n")
    up, dead = doctor.rdma(tmp_path)
    assert (up.name, up.ok) == ("mlx5_0/1", True)
    assert up.detail == "state 4: ACTIVE, link layer Ethernet, 1 GID(s) set, NUMA node 1"
    assert (dead.name, dead.ok) == ("mlx5_1/1", False) and "bring the port up" in dead.fix
    assert doctor.rdma(tmp_path / "absent")[0].ok is None


def test_ucx_lists_the_transports_ucx_reports() -> None:
    finding = doctor.ucx()
    if finding.ok is None:
        pytest.skip(f"UCXX's UCX is not installed here: {finding.detail}")
    assert finding.ok is True
    assert "tcp(" in finding.detail and "self(" in finding.detail  # UCX always lists both


@pytest.mark.parametrize(("text", "value"), [
    ("4096", 4096), ("512MiB", 512 * 2**20), ("80GiB", 80 * 2**30), ("1T", 2**40), ("2k", 2048),
    ("1.5G", 3 * 2**29),
])
def test_byte_size_units(text: str, value: int) -> None:
    assert byte_size(text) == value


def test_on_this_host_every_topic_is_reported_as_the_host_is() -> None:
    """What doctor finds here (docs/troubleshooting.md states it): each topic, matching the host."""
    import torch

    run = _run("--json")
    assert run.returncode == 0, run.stderr
    found = _findings(run)
    assert {name for topic, name in found if topic == "backend"} == set(transport.known())
    assert found[("backend", "tcp")]["ok"] is True
    assert found[("memlock", "RLIMIT_MEMLOCK")]["ok"] is None  # no --pin: information
    rdma = [f for (topic, _), f in found.items() if topic == "rdma"]
    if not doctor.SYSFS_RDMA.is_dir():
        assert [f["ok"] for f in rdma] == [None] and "is absent" in rdma[0]["detail"]
    else:
        assert rdma and all(f["ok"] in (True, False, None) for f in rdma)
    assert (found[("cuda", "torch")]["ok"] is True) is torch.cuda.is_available()
    assert ("cuda", "gpu-direct") in found or not torch.cuda.is_available()
    assert ("ucx", "transports") in found


def _fake_gpu_host(tmp_path, *, peermem: bool) -> tuple:
    """A two-NIC RDMA host's sysfs (ports, GIDs, NUMA) and its module tree (driver, peermem)."""
    ib = tmp_path / "infiniband"
    for dev, layer, numa, gids in (("mlx5_0", "Ethernet", "0", 2), ("mlx5_1", "InfiniBand", "1", 1)):
        port = ib / dev / "ports" / "1"
        (port / "gids").mkdir(parents=True)
        (port / "state").write_text("4: ACTIVE\n")
        (port / "link_layer").write_text(f"{layer}\n")
        for i in range(4):
            (port / "gids" / str(i)).write_text(
                f"fe80:0000:0000:0000:0000:0000:0000:000{i + 1}\n" if i < gids else "0000:" * 7 + "0000\n")
        (ib / dev / "device").mkdir()
        (ib / dev / "device" / "numa_node").write_text(f"{numa}\n")
    modules = tmp_path / "module"
    (modules / "nvidia").mkdir(parents=True)
    (modules / "nvidia" / "version").write_text("550.54.15\n")
    if peermem:
        (modules / "nvidia_peermem").mkdir()
    return ib, modules


def test_a_faked_rdma_gpu_host_with_peermem_is_ready_for_gpu_direct(tmp_path) -> None:
    ib, modules = _fake_gpu_host(tmp_path, peermem=True)
    rdma = {f.name: f for f in doctor.rdma(ib)}
    assert rdma["mlx5_0/1"].ok and rdma["mlx5_0/1"].detail == (
        "state 4: ACTIVE, link layer Ethernet, 2 GID(s) set, NUMA node 0")
    assert rdma["mlx5_1/1"].ok and rdma["mlx5_1/1"].detail == (
        "state 4: ACTIVE, link layer InfiniBand, 1 GID(s) set, NUMA node 1")
    gpus, direct = doctor.cuda(["NVIDIA H100 80GB HBM3"] * 2, modules, "5.15.0-91-generic")
    assert gpus.ok and "2 device(s): NVIDIA H100 80GB HBM3" in gpus.detail
    assert direct.ok is True and direct.fix == ""
    assert direct.detail == ("nvidia_peermem loaded; kernel 5.15.0-91-generic supports dma-buf MRs "
                             "(5.12+); NVIDIA driver 550.54.15")
    # dma-buf alone (a 5.12+ kernel, no peermem) is a path too
    assert doctor.cuda(["NVIDIA H100"], _fake_gpu_host(tmp_path / "b", peermem=False)[1], "6.8.0")[1].ok


def test_a_faked_gpu_host_without_peermem_on_an_old_kernel_names_both_fixes(tmp_path) -> None:
    _, modules = _fake_gpu_host(tmp_path, peermem=False)
    _, direct = doctor.cuda(["NVIDIA A100"], modules, "5.4.0-150-generic")
    assert direct.ok is False
    assert "nvidia_peermem not loaded; kernel 5.4.0-150-generic predates dma-buf" in direct.detail
    assert "`modprobe nvidia-peermem`" in direct.fix and "predates dma-buf MRs (5.12+)" in direct.fix
