"""The options every compiled kernel of bigper shares (``kernel``): one
decorator, so that every kernel lands in the same on-disk cache entries in
every process; and ``ring_rows``, the slots and end bits of rows, which the
frames and the core's ring both use. The other kernels live with what they
serve: the tree's in ``prioritization/_tree_kernels.py``, the rank heap's in
``prioritization/_rank_kernels.py``, the ring's in ``core/ring.py``, the
frames' in ``frames/``.

Nothing a kernel takes is validated by it: the Python layer checks everything
once at the public boundary and hands over arrays of the right dtype. Every
kernel works on a whole batch a call.
"""

from numba import njit

kernel = njit(cache=True, nogil=True)


@kernel
def ring_rows(g0, capacity, terminated, truncated, slots, ends):
    """Slots and end bits of ``m`` rows numbered from ``g0``: ``slots[r] =
    (g0 + r) % capacity``, ``ends[r]`` bit 0 terminated, bit 1 truncated."""
    for r in range(terminated.shape[0]):
        slots[r] = (g0 + r) % capacity
        ends[r] = (1 if terminated[r] else 0) | (2 if truncated[r] else 0)
