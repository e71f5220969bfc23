"""Where the frame stack sits in an observation, and the exact reshapes
between that layout and the core's (stack on axis 0).

SB3's ``VecFrameStack`` on images stacks on the last (channel) axis: an
(84, 84, 1) frame becomes (84, 84, 4), oldest frame first. Gymnasium's
``FrameStackObservation`` puts the stack first: (4, 84, 84). The core's
``FrameStore`` takes ``(k, *frame)``::

    channel-first (k*c, H, W)  <-> (k, c, H, W)       a reshape: free both ways
    channel-last  (H, W, k*c)  <-> (k, H, W, c)       a transpose: one copy each way
"""

from __future__ import annotations

import sys

import numpy as np

from ..errors import InvalidArgumentError

AXES = ("auto", "first", "last")


class StackLayout:
    """Maps observations of ``obs_shape`` to the core's ``(k, *frame)`` and back.

    Parameters
    ----------
    obs_shape : tuple of int
        One env's observation shape.
    k : int or None
        Frames per stack; None: observations pass unchanged.
    axis : {"auto", "first", "last"}
        The stacked axis; "auto" takes the one of the first and the last axis
        that ``k`` divides, and where both, the smaller (SB3's rule for
        channel-first images), "first" on a tie.
    """

    obs_shape: tuple[int, ...]
    k: int | None
    axis: str | None
    core_shape: tuple[int, ...]

    def __init__(self, obs_shape: tuple[int, ...], k: int | None, axis: str = "auto") -> None:
        self.obs_shape = tuple(obs_shape)
        self.k = k
        if axis not in AXES:
            raise InvalidArgumentError(f"frame_axis must be one of {AXES}, got {axis!r}")
        if k is None:
            self.axis = None
            self.core_shape = self.obs_shape
            return
        if not self.obs_shape:
            raise InvalidArgumentError(f"frame_stack={k} needs an observation with an axis, got shape ()")
        if axis == "auto":
            first, last = self.obs_shape[0] % k == 0, self.obs_shape[-1] % k == 0
            if first and last:
                axis = "last" if self.obs_shape[-1] < self.obs_shape[0] else "first"
            else:
                axis = "last" if last else "first"
        n = self.obs_shape[0] if axis == "first" else self.obs_shape[-1]
        if n % k:
            raise InvalidArgumentError(
                f"frame_stack={k} does not divide the {axis} axis of observations of shape "
                f"{self.obs_shape} (length {n}); pass frame_axis='first' or 'last'")
        self.axis = axis
        c = n // k
        if axis == "first":
            self.core_shape = (k, c, *self.obs_shape[1:]) if c > 1 else (k, *self.obs_shape[1:])
        else:
            mid = self.obs_shape[:-1]
            self.core_shape = (k, *mid, c) if c > 1 else (k, *mid)
        self._c = c

    def to_core(self, x: np.ndarray, lead: int) -> np.ndarray:
        """``x`` of shape ``(*lead_axes, *obs_shape)`` (``lead`` leading axes) in the core's layout."""
        if self.axis is None:
            return x
        head = x.shape[:lead]
        if self.axis == "first":
            return x.reshape(head + self.core_shape)
        y = x.reshape(head + self.obs_shape[:-1] + (self.k, self._c))
        y = np.moveaxis(y, -2, lead)
        return y if self._c > 1 else y[..., 0]

    def from_core(self, y: np.ndarray) -> np.ndarray:
        """A batch ``(B, *core_shape)`` back in the observation layout ``(B, *obs_shape)``."""
        if self.axis is None:
            return y
        b = y.shape[0]
        if self.axis == "first":
            return y.reshape((b,) + self.obs_shape)
        if self._c == 1 and y.dtype.itemsize == 1 and self.k in _WORDS and sys.byteorder == "little":
            return _interleave(y, _WORDS[self.k]).reshape((b,) + self.obs_shape)
        if self._c == 1:
            y = y[..., None]
        return np.ascontiguousarray(np.moveaxis(y, 1, -2)).reshape((b,) + self.obs_shape)


# k one-byte frames interleaved per pixel are one k-byte word (little-endian: frame 0 lowest).
_WORDS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _interleave(y: np.ndarray, word) -> np.ndarray:
    """``(B, k, *frame)`` one-byte frames as ``(B, *frame, k)``: the k bytes of
    a pixel built as one word with shifts, about 4x faster than numpy's
    strided copy of a moved axis (which goes byte by byte)."""
    k = y.shape[1]
    out = np.empty((y.shape[0], *y.shape[2:]), dtype=word)
    np.copyto(out, y[:, k - 1], casting="unsafe")
    for j in range(k - 2, -1, -1):
        out <<= 8
        out |= y[:, j]
    return out.view(np.uint8).reshape(*out.shape, k).view(y.dtype)


def from_core_tensor(layout: StackLayout, t):
    """``layout.from_core`` for a torch tensor ``(B, *core_shape)`` (a sampler's
    batch): the same values, shape and dtype. On the CPU the numpy path runs
    on a shared view (so both paths give the same bytes); on a device, a
    reshape (channel-first) or one permuting copy (channel-last)."""
    if layout.axis is None:
        return t
    b = t.shape[0]
    if layout.axis == "first":
        return t.reshape((b,) + layout.obs_shape)
    if t.device.type == "cpu":
        import torch

        return torch.from_numpy(layout.from_core(t.numpy()))
    y = t if layout._c > 1 else t.unsqueeze(-1)
    return y.movedim(1, -2).contiguous().reshape((b,) + layout.obs_shape)
