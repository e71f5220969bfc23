"""Output arrays reused between calls once nobody holds them.

A batch's frame stacks are about a megabyte. A fresh array of that size
costs a page fault per 4 KB page each time the allocator has given the
pages back to the system, ten times the copy that fills it. So the frame
gathers (``frames/store.py``) and the CPU copies of ``to_torch`` (``tensors/transfer.py``)
take their arrays from a ``ReusedArrays``: one handed out before, if nothing
else refers to it any more, else a new one.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict

import numpy as np


class ReusedArrays:
    """Arrays by (shape, dtype), handed out again only when nothing but this
    pool refers to them; thread-safe.

    A reference is anything that keeps the array alive: a variable, a numpy
    view (through its ``.base``), a tensor of ``torch.from_numpy`` or any view
    of its storage. At most ``depth`` arrays are kept per (shape, dtype), for
    the ``max_keys`` most recently asked for.
    """

    def __init__(self, depth: int, max_keys: int):
        self.depth, self.max_keys = depth, max_keys
        self._lock = threading.Lock()
        self._arrays: OrderedDict = OrderedDict()  # (shape, dtype) -> list, most recent first

    def take(self, shape: tuple, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        key = (shape, dtype.str)
        with self._lock:
            arrays = self._arrays.get(key)
            if arrays is None:
                arrays = self._arrays[key] = []
                while len(self._arrays) > self.max_keys:
                    self._arrays.popitem(last=False)
            self._arrays.move_to_end(key)
            for a in arrays:
                # The list, the loop variable and getrefcount's argument: nobody else.
                if sys.getrefcount(a) == 3:
                    return a
            a = np.empty(shape, dtype=dtype)
            arrays.insert(0, a)
            del arrays[self.depth:]
            return a
