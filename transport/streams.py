"""The stream contract: how a CUDA producer hands bytes to a transport, and how they land.

Why it exists: CUDA work is asynchronous. A forward pass that wrote the
cache on some stream may still be running when `write()` is called, and a
copy launched on another stream would ship stale bytes; waiting for the
whole device (`torch.cuda.synchronize`) would wait for the model's next
forward pass and its CUDA graphs too. So readiness is handed over
explicitly and waited on exactly:

- Sending. `write(..., ready=)` (and the engine's `send(..., ready=)`)
  takes a `torch.cuda.Event` the caller recorded after the work that
  produced the source bytes, or a `torch.cuda.Stream` (an event is then
  recorded on it at call time). `ready=None` for CUDA memory records an
  event on the caller's *current stream* at call time — right when the
  forward pass ran on that stream, wrong when it ran on a side stream the
  caller did not pass. `capture` does this, on the caller's thread.
  Copy-based backends (loopback, tcp's bounce) make their copy stream wait
  on that event (`stream.wait_event`: the GPU waits, no thread does);
  where UCX or the NIC reads the memory itself, nixl keeps the post in its
  progress thread's queue until the event is reached (`event.query()` each
  round, no thread blocks), and verbs waits on the caller's thread before
  posting (`host_wait`, bounded by `connect_timeout`; moving it off that
  thread as nixl does is the deletion condition of `host_wait`).
- Host memory needs no readiness: `ready` with a CPU region is refused
  with `CapabilityError`, because it signals a caller who believes its CPU
  tensor is produced asynchronously — a bug to surface, not to ignore.
- Landing. A copy into CUDA memory runs on the engine's own copy stream
  (`CopyStream`), and the transport waits for *that stream's* event before
  it reports the bytes landed (notify, handle, the engine's Success). So
  after Success the bytes are visible to any stream the consumer launches
  on afterwards — the consumer needs no event of ours. Bytes written by a
  peer's NIC or UCX (nixl, verbs) are placed before the notify that
  completes them, the same promise.

No function here synchronises a device; `host_wait` polls one event.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .errors import CapabilityError, TransferTimeout

# What a caller may pass as `ready`.
Ready = Any  # torch.cuda.Event | torch.cuda.Stream | None
# host_wait's polling interval: an event query costs ~1 us.
_POLL = 50e-6


def capture(ready: Ready, device: torch.device | str) -> Any:
    """The event a transfer of memory on `device` waits for, resolved on the caller's thread.

    None for host memory (and `CapabilityError` if `ready` was given for it);
    for CUDA memory the caller's event, an event recorded now on the
    caller's stream, or — `ready=None` — one recorded now on the current stream.
    """
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda":  # every host write passes here: no allocation on this path
        if ready is not None:
            raise CapabilityError(
                f"ready={type(ready).__name__} was given for {device.type} memory; readiness "
                "applies to CUDA memory only — pass ready=None for host tensors"
            )
        return None
    if ready is None:
        ready = torch.cuda.current_stream(device)
    if isinstance(ready, torch.cuda.Stream):
        event = torch.cuda.Event()
        event.record(ready)
        return event
    if isinstance(ready, torch.cuda.Event):
        return ready
    raise CapabilityError(
        f"ready must be a torch.cuda.Event, a torch.cuda.Stream or None, got {type(ready).__name__}"
    )


def host_wait(event: Any, timeout: float, what: str) -> None:
    """Block this thread until `event` completed, at most `timeout` s (`TransferTimeout`).

    For backends whose hardware reads the source itself: they cannot make a
    stream wait, so the host does — on this one event, never the device.
    """
    if event is None or event.query():
        return
    deadline = time.monotonic() + timeout
    while not event.query():
        if time.monotonic() > deadline:
            raise TransferTimeout(
                f"{what}: the producer's CUDA event was not reached within {timeout} s; record "
                "`ready` after the work that writes the source entries"
            )
        time.sleep(_POLL)


class CopyStream:
    """One dedicated CUDA stream per device for one I/O thread's copies.

    `run` makes the stream wait on the producer's event, enqueues the
    copies, and returns when exactly those copies finished (their own
    event, not the device). On host memory it just runs the copies.
    """

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}

    def stream(self, device: torch.device) -> Any:
        """This thread's copy stream on `device`, created on first use (once per device)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        s = self._streams.get(index)
        if s is None:
            s = self._streams[index] = torch.cuda.Stream(device=index)
        return s

    def run(self, device: torch.device, ready: Any, copies: Callable[[], None]) -> None:
        """Run `copies` ordered after `ready` on `device`'s copy stream; return once they landed."""
        if device.type != "cuda":
            copies()
            return
        s = self.stream(device)
        with torch.cuda.stream(s):
            if ready is not None:
                s.wait_event(ready)
            copies()
            done = torch.cuda.Event()
            done.record(s)
        done.synchronize()


def cuda_device(*tensors: torch.Tensor) -> torch.device:
    """The device a copy between `tensors` runs on: the first CUDA one, else cpu."""
    for t in tensors:
        if t.device.type == "cuda":
            return t.device
    return torch.device("cpu")
