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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._torch import _torch


@dataclass
class Pending:
    """One update in flight: where it goes (host arrays) and its values."""

    indices: np.ndarray
    stamps: np.ndarray
    use_stamps: bool
    mask: np.ndarray | None
    values: Any       # pinned host tensor, filled by a copy that may still run
    event: Any        # recorded after that copy (None: already complete)


class Deferred:
    """Updates in flight, oldest first."""

    def __init__(self) -> None:
        self._q: deque[Pending] = deque()

    def __bool__(self) -> bool:
        return bool(self._q)

    def __len__(self) -> int:
        return len(self._q)

    def push(self, indices: np.ndarray, stamps: np.ndarray, use_stamps: bool, mask, values) -> None:
        """Start copying ``values`` (a device tensor) to the host and keep the update."""
        torch = _torch()
        t = values.detach()
        if not (t.is_floating_point() and t.dtype in (torch.float32, torch.float64)):
            t = t.to(torch.float64 if t.dtype == torch.int64 else torch.float32)  # on the device
        cuda = t.device.type == "cuda"
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
        host.copy_(t, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(t.device))
        self._q.append(Pending(indices, stamps, use_stamps, mask, host, event))

    def pop(self) -> tuple[Pending, np.ndarray] | None:
        """The oldest update and its values (waiting for its copy), or None."""
        if not self._q:
            return None
        p = self._q.popleft()
        if p.event is not None:
            p.event.synchronize()  # releases the GIL while it waits
        return p, p.values.numpy()

    def clear(self) -> None:
        self._q.clear()
