"""Priority updates from device tensors, applied without stalling the learner.

Reading a CUDA tensor on the host waits for every kernel queued before it:
``update_priorities(batch, td)`` right after the backward pass would make the
learner's Python thread wait for its own step. Instead the values are copied
without blocking into pinned host memory, an event is recorded behind the
copy, and the update is applied later, in order, by the next call that needs
the tree (``sample``, the sampler's thread, ``add``, ``save``, ``close``, a
read of the priorities), which waits on the event if the copy is not done::

    learner   loss -> td -> update_priorities(b, td)  [returns at once]  -> backward ...
    stream                  [copy td -> pinned] (event)
    sampler/next sample      wait(event) -> apply the update -> draw

A ``jax.Array`` on an accelerator takes the same path: ``jax.device_put`` to
the CPU device starts its copy without blocking (JAX orders it after the
computation that makes the array), and the next call that needs the tree
waits for that copy. The host copy is its own: the learner may delete or
donate the array meanwhile.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..tensors.jax import host_values, is_jax_array, to_host_async
from ..tensors.pinned import POOL
from ..tensors.lazy import load_torch
from ..tensors.streams import current_stream
from ..errors import BigperError, InvalidArgumentError


@dataclass
class Pending:
    """One update in flight: where it goes (host arrays) and its values."""

    indices: np.ndarray
    stamps: np.ndarray
    use_stamps: bool
    mask: np.ndarray | None
    values: Any       # (pool key, pinned slot) filled by a copy that may still run, (None, host tensor),
    #                   or ("jax", host jax.Array whose copy may still run)
    event: Any        # recorded after that copy (None: already complete)


class Deferred:
    """Updates in flight, oldest first."""

    def __init__(self) -> None:
        # (public: a feed's thread tests it without a Python call a batch)
        self.items: deque[Pending] = deque()

    def __bool__(self) -> bool:
        return bool(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def push(self, indices: np.ndarray, stamps: np.ndarray, use_stamps: bool, mask, values) -> None:
        """Start copying ``values`` (a device tensor or ``jax.Array``) to the host and keep the update."""
        if is_jax_array(values):
            self.items.append(Pending(indices, stamps, use_stamps, mask, ("jax", to_host_async(values)), None))
            return
        torch = load_torch()
        t = values.detach()
        if not (t.is_floating_point() and t.dtype in (torch.float32, torch.float64)):
            t = t.to(torch.float64 if t.dtype == torch.int64 else torch.float32)  # on the device
        if t.device.type == "cuda":  # into a reused pinned buffer, behind the kernels that make t
            key = ("deferred", t.device.index, tuple(t.shape), str(t.dtype))
            slot = POOL.acquire(key, tuple(t.shape), t.dtype)
            slot.host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            torch._C._CudaEventBase.record(event, current_stream(torch, t.device))
            self.items.append(Pending(indices, stamps, use_stamps, mask, (key, slot), event))
        else:
            self.items.append(Pending(indices, stamps, use_stamps, mask, (None, t.to("cpu")), None))

    def wait(self) -> None:
        """Wait for the copies of the updates in flight now (no state changes:
        callable without the buffer's lock, so its other callers go on)."""
        for p in list(self.items):
            if p.event is not None:
                p.event.synchronize()
            elif p.values[0] == "jax":
                try:
                    p.values[1].block_until_ready()  # (releases the GIL while it waits)
                except Exception:  # noqa: BLE001 (a failed copy: reported when the update is applied)
                    pass

    def pop(self) -> tuple[Pending, np.ndarray] | None:
        """The oldest update and its values (waiting for its copy), or None."""
        if not self.items:
            return None
        p = self.items.popleft()
        if p.event is not None:
            p.event.synchronize()  # releases the GIL while it waits
        key, held = p.values
        if key == "jax":
            return p, held  # read by settle, where a failed read is that update's error
        if key is None:
            return p, held.numpy()
        values = held.view.copy()
        POOL.release(key, held, None)
        return p, values

    def settle(self, apply, arrived: bool = False) -> BigperError | None:
        """Apply every update in flight, oldest first (waiting for its copy),
        with ``apply(indices, stamps, use_stamps, mask, values)``. One whose
        values ``apply`` refuses changes nothing; the error of the first is
        returned (after the valid ones are applied) for the buffer to report.
        ``arrived``: only the oldest ones whose copies are done, waiting for
        none (a feed's draw: it must not wait for the learner's device work)."""
        first = None
        items = self.items
        while not (arrived and items and items[0].event is not None and not items[0].event.query()) \
                and (got := self.pop()) is not None:
            p, values = got
            try:
                if is_jax_array(values):
                    values = host_values(values)
                apply(p.indices, p.stamps, p.use_stamps, p.mask, values)
            except BigperError as e:
                first = first or e
        if first is None:
            return None
        e = InvalidArgumentError(f"an earlier update_priorities call with priorities on a device was not "
                                 f"applied (nothing of it changed): {first}")
        e.__cause__ = first
        return e
