"""`transport.gpudirect`: a failed GPU registration names what the host lacks, from faked host facts."""

from __future__ import annotations

import pytest
from pdxfer.transport import CapabilityError, DeviceRegistrationError, RegistrationError, gpudirect

MiB = 1 << 20


def test_a_memlock_limit_below_the_pin_is_named_with_its_numbers() -> None:
    host = gpudirect.Host(peermem=True, kernel="6.8.0", memlock=64 * 1024)
    err = gpudirect.registration_error("NIXL", MiB, "nixlBackendError", found=host)
    assert err.missing == ("memlock",)
    assert isinstance(err, RegistrationError) and isinstance(err, CapabilityError)
    with pytest.raises(DeviceRegistrationError,
                       match=r"cannot register 1048576 B of GPU memory for NIXL \(nixlBackendError\): "
                             r"missing on this host: RLIMIT_MEMLOCK is 65536 B, below the 1048576 B "
                             r"to pin \(`ulimit -l unlimited`"):
        raise err


def test_no_peermem_on_a_kernel_before_dma_buf_names_both_paths() -> None:
    host = gpudirect.Host(peermem=False, kernel="5.4.0-150-generic", memlock=None)
    err = gpudirect.registration_error("the verbs NIC", MiB, "ibv_reg_mr: Bad address", found=host)
    assert err.missing == ("nvidia_peermem", "dma-buf")
    assert "`modprobe nvidia-peermem`" in str(err) and "kernel 5.4.0-150-generic predates dma-buf" in str(err)


def test_either_gpu_path_is_enough() -> None:
    assert gpudirect.missing(gpudirect.Host(True, "5.4.0", None), MiB) == []  # peermem alone
    assert gpudirect.missing(gpudirect.Host(False, "6.8.0", None), MiB) == []  # dma-buf alone
    failed = gpudirect.missing(gpudirect.Host(False, "6.8.0", None), MiB, "CUresult 801")
    assert [p for p, _ in failed] == ["nvidia_peermem", "dma-buf"] and "CUresult 801" in failed[1][1]


def test_nothing_missing_says_the_driver_refused() -> None:
    err = gpudirect.registration_error("NIXL", MiB, "boom", found=gpudirect.Host(True, "6.8.0", None))
    assert err.missing == () and "all look right here" in str(err) and "dmesg" in str(err)


def test_host_reads_the_module_tree_it_is_given(tmp_path) -> None:
    assert gpudirect.host(tmp_path, "6.1.0").peermem is False
    (tmp_path / "nvidia_peermem").mkdir()
    found = gpudirect.host(tmp_path, "6.1.0", memlock=None)
    assert (found.peermem, found.dmabuf_kernel, found.memlock) == (True, True, None)
