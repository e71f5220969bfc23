"""A batch made on a sampler thread's CUDA stream, handed to the learner's:
``mark_ready`` records where it was made, ``handover`` makes the learner's
stream wait for it (no host wait)."""

from __future__ import annotations

import threading

from .lazy import load_torch
from .transport import TensorBatch

_LAST = threading.local()  # (this thread's last current stream: its key and its Stream object)


def current_stream(torch, device):
    """``torch.cuda.current_stream(device)`` in three C calls where this
    thread's current stream is the one it last had (the usual case: torch's
    own builds a ``Stream`` through tens of Python calls, each one a launch-bound
    learner waits for the GIL). A ``device`` without an index: the current device."""
    index = device.index
    if index is None:
        index = torch._C._cuda_getDevice()
    key = torch._C._cuda_getCurrentStream(index)
    last = getattr(_LAST, "stream", None)
    if last is not None and last[0] == key:
        return last[1]
    stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    _LAST.stream = (key, stream)
    return stream


def mark_ready(tensors: TensorBatch) -> TensorBatch:
    """In a sampler's thread: record, on its current stream, the event after
    the work that makes ``tensors`` (for ``handover`` in the learner's thread)."""
    t = tensors.get("indices")
    if t is not None and t.device.type == "cuda":
        torch = load_torch()
        stream = torch.cuda.current_stream(t.device)
        event = torch.cuda.Event()
        event.record(stream)
        tensors.host["ready"] = (event, stream)
    return tensors


def handover(tensors: TensorBatch) -> TensorBatch:
    """In the learner's thread, as it takes a batch from a sampler: where its
    current stream is not the one the batch was made on, that stream waits for
    the batch (no host wait) and the tensors are marked used on it (the caching
    allocator then keeps their memory until its work is done)."""
    ready = tensors.host.pop("ready", None)
    if ready is None:
        return tensors
    event, made_on = ready
    torch = load_torch()
    here = torch.cuda.current_stream(made_on.device)
    if here != made_on:
        here.wait_event(event)
        for t in tensors.values():
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                t.record_stream(here)
    return tensors
