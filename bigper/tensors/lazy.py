"""Torch, imported only when asked for (``load_torch``), and what bigper takes
from users in torch's terms: a device (``as_device``), a dtype
(``torch_dtype``), a tensor or array as numpy (``as_numpy``, ``as_array``,
``is_device_tensor``). Nothing here imports torch at import time."""

from __future__ import annotations

import sys

import numpy as np

from ..errors import InvalidArgumentError, InvalidTypeError


def load_torch():
    """The torch module (``ImportError`` saying how to install it where it is missing)."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("Batch.to_torch needs PyTorch: pip install torch (or pip install -e '.[torch]' "
                          "from a checkout)") from e
    return torch


def as_device(device):
    """``device`` as a ``torch.device`` the feed supports ("cpu", "cuda",
    "cuda:N"); ``InvalidArgumentError`` naming it otherwise (an unknown name, a
    device type this torch has no backend for, ``"meta"``: tensors without data)."""
    torch = load_torch()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise InvalidArgumentError(f"device must name a torch device ('cuda', 'cuda:1', 'cpu'), "
                                   f"got {device!r} ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"device={device!r}: bigper feeds 'cpu' and 'cuda' devices, got type {dev.type!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(f"device={device!r}: this torch has no CUDA device "
                                       f"(torch {torch.__version__})")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise InvalidArgumentError(f"device={device!r}: there are {torch.cuda.device_count()} CUDA devices")
    return dev


def torch_dtype(torch, dtype: np.dtype, key: str):
    """The torch dtype of numpy ``dtype`` (``InvalidTypeError`` naming field ``key`` where torch has none)."""
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype.newbyteorder("="))).dtype
    except TypeError:
        raise InvalidTypeError(f"field {key!r} has dtype {dtype}, which torch cannot hold") from None


def as_array(x, what: str) -> np.ndarray:
    """User input ``x`` (numpy, torch, nested lists) as a numpy array;
    ``InvalidTypeError`` naming ``what`` where numpy cannot make one (a
    ragged list, an object whose ``__array__`` fails), not numpy's own error."""
    try:
        return np.asarray(as_numpy(x))
    except (ValueError, TypeError, OverflowError, NotImplementedError, RuntimeError) as e:  # (a meta tensor: no data)
        raise InvalidTypeError(f"{what} is not an array of numbers ({type(e).__name__}: {str(e)[:120]})") from None


def is_device_tensor(x) -> bool:
    """Whether ``x`` is a torch tensor whose memory is not the host's (reading
    it would wait for the device)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and x.device.type not in ("cpu", "meta")


def as_numpy(x):
    """``x`` as numpy when it is a torch tensor (any device, any grad), else ``x`` unchanged.

    A CPU tensor without grad is shared, not copied; a CUDA tensor is copied
    to the host (which waits for the kernels that produce it). Dtypes numpy
    lacks (bfloat16, float8) become float32.
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return x
    t = x.detach()
    try:  # the common case (a CPU tensor, numpy's dtypes, no conj/neg bit) in one call
        return t.numpy()
    except (TypeError, RuntimeError):
        pass
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.resolve_conj().resolve_neg()
    try:
        return t.numpy()
    except TypeError:
        return t.to(torch.float32 if t.is_floating_point() else torch.int64).numpy()
