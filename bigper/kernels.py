"""The options every compiled kernel of bigper shares (``kernel``): one
decorator, so that every kernel lands in the same on-disk cache entries in
every process. The kernels live with what they serve: the tree's in
``prioritization/_tree_kernels.py``, the rank heap's in
``prioritization/_rank_kernels.py``, the ring's in ``core/ring.py``, the
frames' in ``frames/``.

Nothing a kernel takes is validated by it: the Python layer checks everything
once at the public boundary and hands over arrays of the right dtype. Every
kernel works on a whole batch a call.
"""

from numba import njit

kernel = njit(cache=True, nogil=True)
