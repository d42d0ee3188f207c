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
  Every backend's write then waits in its link's ordered post queue
  (`transport.posting`) until that event is reached — asked with
  `event.query()` by one readiness thread per engine, no thread blocks, no
  lock is held, later writes on the link keep their order behind it and
  other links are not held up — and only then is it submitted. Copy-based
  backends (loopback, tcp's bounce) also make their copy stream wait on it
  (`stream.wait_event`, by then a no-op).
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

No function here synchronises a device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .errors import CapabilityError

# What a caller may pass as `ready`.
Ready = Any  # torch.cuda.Event | torch.cuda.Stream | None


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
