"""Torch conversion, imported only when asked for."""

from __future__ import annotations

import numpy as np


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("Batch.to_torch needs PyTorch: pip install 'bigper[torch]'") from e
    return torch


# Pinned host buffers reused between calls, keyed by (field, shape, dtype).
_PINNED: dict = {}


def batch_to_torch(batch, device=None, non_blocking: bool = True) -> dict:
    torch = _torch()
    dev = torch.device(device) if device is not None else torch.device("cpu")
    arrays = dict(batch.data)
    arrays["weights"] = batch.weights
    arrays["indices"] = batch.indices
    out = {}
    for key, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        if dev.type == "cuda":
            pkey = (key, arr.shape, arr.dtype.str)
            host = _PINNED.get(pkey)
            if host is None:
                host = torch.empty(arr.shape, dtype=torch.from_numpy(arr[:0]).dtype).pin_memory()
                _PINNED[pkey] = host
            host.numpy()[...] = arr
            # Note: a pinned buffer is reused by the next call; the copy below
            # is queued on the current stream before that call can touch it.
            out[key] = host.to(dev, non_blocking=non_blocking)
        else:
            t = torch.from_numpy(arr)
            out[key] = t if dev.type == "cpu" else t.to(dev, non_blocking=non_blocking)
    return out


def as_numpy(x) -> np.ndarray:
    """A numpy view or copy of ``x``, which may be a torch tensor on any device."""
    if type(x).__module__.startswith("torch"):
        return x.detach().to("cpu").numpy()
    return x
