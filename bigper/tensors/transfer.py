"""``batch_to_torch``: a ``Batch`` as tensors on a device (``Batch.to_torch``).

CPU: a field whose array is writable, in native byte order and has no
negative strides is shared with ``torch.from_numpy`` (no copy, also for the
strided ``obs``/``next_obs`` views of one frame gather); any other array is
copied once, into a host array reused from earlier calls once no tensor holds
it any more (``_reuse.ReusedArrays``).

CUDA: one pinned block and one copy a batch (``tensors/pinned.py``).
``obs`` and ``next_obs`` of a batch gathered as ``k + 1`` frames a row
(``FrameStore.pair``) travel once, as that gather; a batch of sequences
carries each row's distinct frames once, and its stacks are rebuilt on the
device by one gather there. A batch a sampler gathered straight into a
pinned block (``Staged``) is sent as it is (``send_staged``); a device tier's
batch is on its device already.
"""

from __future__ import annotations

import numpy as np

from ..common.reuse import ReusedArrays
from ..errors import InvalidTypeError
from ..frames.distinct import distinct_frames, frames_of_stacks
from .lazy import as_device, as_numpy, load_torch
from .pinned import MAX_KEYS, POOL_DEPTH, Staged, to_cuda
from .transport import TensorBatch, carried


# The CPU copies' arrays (a batch's fields, a few batches held at once).
_HOST = ReusedArrays(depth=POOL_DEPTH + 1, max_keys=MAX_KEYS)


def _shareable(arr: np.ndarray) -> bool:
    """Whether ``torch.from_numpy`` can share ``arr`` as it is."""
    return arr.dtype.isnative and arr.flags.writeable and all(s >= 0 for s in arr.strides)


def _host_array(arr: np.ndarray) -> np.ndarray:
    """``arr`` as an array torch can share: writable, native byte order, no
    negative strides. A copy (one) only where ``arr`` is not already that."""
    arr = np.asarray(arr)
    if not arr.dtype.isnative:
        return arr.astype(arr.dtype.newbyteorder("="), order="C")
    if _shareable(arr):
        return arr
    out = _HOST.take(arr.shape, arr.dtype)
    np.copyto(out, arr)
    return out


def pair_base(obs: np.ndarray, nxt: np.ndarray) -> np.ndarray | None:
    """The ``(B, k + 1, ...)`` frame gather that ``obs`` (its first ``k``
    frames a row) and ``nxt`` (its last ``k``) are views of, or None when
    they are not such a pair (``FrameStore.pair``)."""
    if not (isinstance(obs, np.ndarray) and isinstance(nxt, np.ndarray)) or obs.ndim < 2 \
            or obs.shape != nxt.shape or obs.strides != nxt.strides or obs.dtype != nxt.dtype:
        return None
    b, k = obs.shape[0], obs.shape[1]
    step = obs.strides[1]
    rest = obs.shape[2:]
    inner = obs.dtype.itemsize * int(np.prod(rest, dtype=np.int64))
    if step != inner or obs.strides[0] != (k + 1) * step or b == 0 or k == 0:
        return None
    if nxt.__array_interface__["data"][0] - obs.__array_interface__["data"][0] != step:
        return None
    if obs.strides[2:] != np.empty(rest, obs.dtype).strides:
        return None
    return np.lib.stride_tricks.as_strided(obs, shape=(b, k + 1, *rest), strides=obs.strides,
                                           writeable=False)


# Keys of what travels besides the batch's own (a frame gather, its indices) start with "." so that
# no field can take them (a field name starts with a letter or "_": config.check_name).
def fields_of(batch, copies: bool = True) -> tuple[dict, dict]:
    """``(arrays, derived)``: the arrays that travel (by key), and how the
    keys that do not travel are rebuilt from them on the device
    (``key -> (source key, rule)``). ``copies``: the arrays are copied (to a
    device), so frames shared by two stacks travel once; else (the CPU) the
    stacks are shared as they are, where the batch has them."""
    arrays = dict(batch.data)
    derived: dict = {}
    seq = carried(batch).frames
    if not copies and seq is not None and "obs" in arrays:
        seq = None
    if seq is not None:  # sequences: each row's distinct frames once, and the stacks' indices into them
        if seq[0] == "refs":  # taken from the batch's own stacks
            ids, index, first = distinct_frames(seq[1], batch.mask)
            frames = frames_of_stacks([arrays[name] for name in index], first)
        else:
            _, frames, index = seq
        arrays[".frames"] = frames
        arrays[".frame_index"] = index
        for name in ("obs", "next_obs"):
            if name in index:
                arrays.pop(name, None)
                derived[name] = (".frames", name)
    elif copies and "obs" in arrays and "next_obs" in arrays:
        base = pair_base(arrays["obs"], arrays["next_obs"])
        if base is not None:  # obs and next_obs: two views of one (B, k + 1) gather, sent once
            del arrays["obs"], arrays["next_obs"]
            arrays[".pair"] = base
            derived["obs"] = (".pair", "first")
            derived["next_obs"] = (".pair", "last")
    # Copies (B numbers): a learner's in-place op on its tensors never reaches the batch.
    arrays["weights"] = np.array(batch.weights, dtype=np.float32)
    arrays["indices"] = np.array(batch.indices, dtype=np.int64)
    # With the indices, update_priorities(tensors, td) skips slots overwritten since sampling.
    arrays["generations"] = np.array(batch.generations, dtype=np.int64)
    if getattr(batch, "mask", None) is not None:  # sequences: which steps are real
        arrays["mask"] = batch.mask
    return arrays, derived


def _tier_to_torch(torch, batch, ready: TensorBatch, device, non_blocking: bool) -> TensorBatch:
    """``to_torch`` of a device tier's batch (``ready``: the tensors the tier
    gathered). Each call gets a dict, bookkeeping tensors (``weights``,
    ``indices``, ``generations``) and host copies of its own, as a host batch's
    calls do: the first call takes the tier's, a later one new ones made from
    the batch's host values (a learner may have changed the first ones in place)."""
    dev = next(iter(ready.values())).device
    if device is not None and device != dev:
        return TensorBatch({k: v.to(device, non_blocking=non_blocking) for k, v in ready.items()}, host_of(batch))
    tensors = dict(ready)
    if ready.host.get("given"):
        own = {"indices": np.array(batch.indices, dtype=np.int64),
               "generations": np.array(batch.generations, dtype=np.int64)}
        w = batch.weights
        if isinstance(w, torch.Tensor):  # the batch's own device weights: copied there, no read back
            tensors["weights"] = w.to(dev).clone()
        else:
            own["weights"] = np.array(w, dtype=np.float32)
        tensors.update(move(torch, own, dev, non_blocking))
    ready.host["given"] = True
    return TensorBatch(tensors, host_of(batch))


def host_of(batch) -> dict:
    """The host copies ``update_priorities`` reads: copies (the tensors of a CPU
    batch share the batch's arrays, which a learner may change in place)."""
    mask = getattr(batch, "mask", None)
    if mask is not None and not isinstance(mask, np.ndarray):  # a tier's device mask: the host copy it kept
        host = getattr(carried(batch).tensors, "host", None)
        kept = host.get("mask") if isinstance(host, dict) else None
        mask = kept if isinstance(kept, np.ndarray) else as_numpy(mask)
    return {"indices": np.array(batch.indices, dtype=np.int64), "generations": np.array(batch.generations, np.int64),
            "mask": None if mask is None else np.array(mask)}


def batch_to_torch(batch, device=None, non_blocking: bool = True) -> TensorBatch:
    """Tensors keyed like ``batch``, plus ``weights`` (float32), ``indices`` and
    ``generations`` (int64); the dict can be passed to ``update_priorities``.

    Parameters
    ----------
    batch : Batch
    device : str or torch.device, optional
        Default the CPU (or, for a batch of a buffer with a device tier, that device).
    non_blocking : bool
        With a CUDA device, return before the copy finishes (it is ordered
        on the current stream, so kernels launched on it after this call see
        the data).

    Returns
    -------
    TensorBatch
        A dict: every data field with its own dtype (uint8 frames stay uint8,
        bool flags stay bool), shape ``(B, ...)``, on ``device``.
    """
    torch = load_torch()
    if device is not None:
        device = as_device(device)
    staged = carried(batch).take_staged()
    if staged is not None and device is not None and torch.device(device) == staged.dev:
        return send_staged(batch, staged, non_blocking)
    if staged is not None:
        staged.drop()
    ready = carried(batch).tensors
    if ready is not None:  # a device tier's batch: its tensors are on its device already
        return _tier_to_torch(torch, batch, ready, device, non_blocking)
    dev = torch.device("cpu") if device is None else torch.device(device)
    arrays, derived = fields_of(batch, copies=dev.type != "cpu")
    tensors = _derive(torch, move(torch, arrays, dev, non_blocking), derived)
    if derived or dev.type == "cuda":  # the batch's key order on every device, then weights, indices,
        # generations (rebuilt stacks come back first; a CUDA copy's block lays the arrays out by dtype)
        tensors = {key: tensors[key] for key in dict.fromkeys((*batch.data, *arrays, *tensors)) if key in tensors}
    return TensorBatch(tensors, host_of(batch))


def move(torch, arrays: dict, dev, non_blocking: bool = True) -> dict:
    """Numpy ``arrays`` (by key; a value may be a dict of arrays) as tensors
    on ``dev``: on CUDA one pinned block and one copy, on the CPU shared
    where torch can share them."""
    if dev.type == "cuda":
        return to_cuda(torch, arrays, dev, non_blocking)
    out = {key: _from_numpy(torch, key, arr) for key, arr in arrays.items()}
    if dev.type != "cpu":  # other accelerators: torch handles pinning (or not) itself
        out = {key: (t.to(dev, non_blocking=non_blocking) if not isinstance(t, dict) else
                     {n: v.to(dev, non_blocking=non_blocking) for n, v in t.items()}) for key, t in out.items()}
    return out


def _derive(torch, out: dict, derived: dict) -> dict:
    """Rebuild the derived keys from what travelled, in the batch's key order:
    ``obs``/``next_obs`` as views of the pair gather, or the stacks of a
    sequence batch gathered from its rows' distinct frames."""
    if not derived:
        return out
    res = {}
    src = out.pop(".pair", None)
    frames, index = out.pop(".frames", None), out.pop(".frame_index", None)
    for name, (_, rule) in derived.items():
        if rule == "first":
            res[name] = src[:, :-1]
        elif rule == "last":
            res[name] = src[:, 1:]
        else:
            res[name] = stacks_from(torch, frames, index[name])
    res.update(out)
    return res


def stacks_from(torch, frames, index):
    """``(B, T, k, *frame)`` stacks from a row's frames: ``frames`` is
    ``(B, n, *frame)``, ``index`` ``(B, T, k)`` positions into each row
    (one gather on the tensors' device)."""
    b, n = frames.shape[0], frames.shape[1]
    flat = frames.reshape(b * n, *frames.shape[2:])
    rows = index + (torch.arange(b, device=index.device, dtype=index.dtype) * n).view(b, 1, 1)
    return flat.index_select(0, rows.reshape(-1)).view(*index.shape, *frames.shape[2:])


def _from_numpy(torch, key: str, arr):
    if type(arr) is np.ndarray and arr.flags.writeable and arr.dtype.isnative:
        try:  # the common case: shared as it is
            return torch.from_numpy(arr)
        except ValueError:  # negative strides: copied below
            pass
        except TypeError:
            raise InvalidTypeError(f"field {key!r} has dtype {arr.dtype}, which torch cannot hold") from None
    if isinstance(arr, dict):  # a sequence batch's frame indices, by stack name
        return {n: _from_numpy(torch, key, a) for n, a in arr.items()}
    try:
        return torch.from_numpy(_host_array(arr))
    except TypeError:
        raise InvalidTypeError(f"field {key!r} has dtype {np.asarray(arr).dtype}, which torch cannot hold") from None


def send_staged(batch, staged: "Staged", non_blocking: bool = True) -> TensorBatch:
    """``to_torch`` of a batch gathered into ``staged``: its block moved with
    one copy; a field that did not land in the block (``obs``/``next_obs``
    when they were not one pair gather) travels in a second one."""
    torch = staged.torch
    data = batch.data
    rest = {}
    derived = {}
    for key in data:
        if key in staged.views:
            if data[key] is not staged.views[key]:
                rest[key] = data[key]
    if ".pair" in staged.views:
        base = pair_base(data["obs"], data["next_obs"])
        if base is not None and base.ctypes.data == staged.views[".pair"].ctypes.data:
            derived = {"obs": (".pair", "first"), "next_obs": (".pair", "last")}
        else:
            rest["obs"], rest["next_obs"] = data["obs"], data["next_obs"]
    out = staged.send(non_blocking)
    if ".pair" not in derived.get("obs", ("",)):
        out.pop(".pair", None)
    if rest:
        out.update(to_cuda(torch, rest, staged.dev, non_blocking))
    out = _derive(torch, out, derived)
    ordered = {key: out[key] for key in data}
    for key in ("weights", "indices", "generations"):
        ordered[key] = out[key]
    return TensorBatch(ordered, host_of(batch))
