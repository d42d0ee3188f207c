"""The real CUDA driver calls of the verbs backend (`verbs/cuda.py`), against a stand-in libcuda.

No GPU here, and the fabric's tests use a CUDA double with the driver's *methods*; this
checks the ctypes layer under them: which libcuda function each method calls, with which
handles (a CUdevice from `cuDeviceGet`, never the ordinal itself), that results come back
through the pointers, and that a failing CUresult becomes `CapabilityError` naming the call.
The stand-in keeps CUDA's signatures (cuda.h) and writes through the `byref` pointers it
is handed, as the driver does.
"""

from __future__ import annotations

import ctypes
import os
import types

import pytest
from pdxfer.transport import CapabilityError
from pdxfer.transport.verbs import cuda

ORDINAL, HANDLE = 1, 101  # CUdevice handles need not equal ordinals


class FakeCu:
    def __init__(self, ordering: int = 0, options: int = 1) -> None:
        self.calls: list[tuple] = []
        self.attrs = {cuda.CU_DEVICE_ATTRIBUTE_WRITES_ORDERING: ordering,
                      cuda.CU_DEVICE_ATTRIBUTE_FLUSH_WRITES_OPTIONS: options}
        self.fail: str | None = None

    def __getattr__(self, name: str):
        if not name.startswith("cu"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, *args))
            return 700 if name == self.fail else getattr(self, f"do_{name}", lambda *a: 0)(*args)
        return call

    def do_cuMemGetAddressRange_v2(self, base, size, ptr) -> int:
        base._obj.value, size._obj.value = 0x7000_0000, 1 << 21
        return 0

    def do_cuPointerGetAttribute(self, out, attr, ptr) -> int:
        out._obj.value = {cuda.CU_POINTER_ATTRIBUTE_BUFFER_ID: 42,
                          cuda.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: ORDINAL}[attr]
        return 0

    def do_cuMemGetHandleForAddressRange(self, fd, base, size, kind, flags) -> int:
        fd._obj.value = os.open(os.devnull, os.O_RDONLY)
        return 0

    def do_cuDeviceGet(self, dev, ordinal) -> int:
        dev._obj.value = ordinal + 100
        return 0

    def do_cuDeviceGetPCIBusId(self, buf, length, dev) -> int:
        buf.value = b"0000:1B:00.0"
        return 0

    def do_cuDeviceGetAttribute(self, out, attr, dev) -> int:
        out._obj.value = self.attrs[attr]
        return 0

    def do_cuDevicePrimaryCtxRetain(self, ctx, dev) -> int:
        ctx._obj.value = 0xC0DE
        return 0


def _driver(monkeypatch: pytest.MonkeyPatch, **attrs: int) -> tuple[cuda.CudaDriver, FakeCu]:
    fake = FakeCu(**attrs)
    monkeypatch.setattr(cuda.ctypes, "CDLL", lambda name: fake)
    return cuda.CudaDriver(), fake


def _args(fake: FakeCu, name: str) -> list[tuple]:
    return [c[1:] for c in fake.calls if c[0] == name]


def _value(arg):
    return arg.value if isinstance(arg, ctypes._SimpleCData) else arg


def test_locate_export_and_bus_id_go_through_the_right_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    driver, fake = _driver(monkeypatch)
    assert driver.locate(types.SimpleNamespace(device="cpu", start=1)) is None and fake.calls == []
    alloc = driver.locate(types.SimpleNamespace(device="cuda", start=0x7000_0100))
    assert alloc == cuda.Allocation(gpu=ORDINAL, base=0x7000_0000, size=1 << 21, ident=42)
    ((_, _, ptr),) = _args(fake, "cuMemGetAddressRange_v2")
    assert ptr.value == 0x7000_0100
    fd = driver.export(alloc)
    try:
        ((_, base, size, kind, flags),) = _args(fake, "cuMemGetHandleForAddressRange")
        assert (base.value, size.value, kind, flags.value) == (0x7000_0000, 1 << 21, 1, 0)
    finally:
        os.close(fd)
    assert driver.bus_id(ORDINAL) == "0000:1b:00.0"  # sysfs spells bus ids in lower case
    assert _value(_args(fake, "cuDeviceGetPCIBusId")[0][2]) == HANDLE


def test_flush_uses_the_primary_context_of_the_device_handle(monkeypatch: pytest.MonkeyPatch) -> None:
    driver, fake = _driver(monkeypatch)
    assert driver.flush_needed(ORDINAL) is True
    ((_, dev),) = _args(fake, "cuDevicePrimaryCtxRetain")
    assert _value(dev) == HANDLE
    driver.flush(ORDINAL)
    ((ctx,),) = _args(fake, "cuCtxSetCurrent")
    assert ctx.value == 0xC0DE
    assert _args(fake, "cuFlushGPUDirectRDMAWrites") == [(cuda.FLUSH_TARGET_CURRENT_CTX, cuda.FLUSH_TO_OWNER)]
    driver.close()
    assert [_value(d) for (d,) in _args(fake, "cuDevicePrimaryCtxRelease_v2")] == [HANDLE]


def test_ordered_gpus_need_no_flush_and_gpus_without_either_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    driver, fake = _driver(monkeypatch, ordering=cuda.ORDERING_OWNER)
    assert driver.flush_needed(0) is False and not _args(fake, "cuDevicePrimaryCtxRetain")
    driver, _ = _driver(monkeypatch, ordering=0, options=0)
    with pytest.raises(CapabilityError, match=r"GPU 0 neither orders GPUDirect RDMA writes"):
        driver.flush_needed(0)


def test_a_failing_cuda_call_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    driver, fake = _driver(monkeypatch)
    fake.fail = "cuMemGetHandleForAddressRange"
    with pytest.raises(CapabilityError, match=r"cuMemGetHandleForAddressRange failed: CUresult 700"):
        driver.export(cuda.Allocation(0, 0x7000_0000, 4096, 1))
