"""The device tier: a copy of a buffer's stored data in a torch device's memory.

The tree stays on the host (numba, float64, exact, snapshotted). The mirror
holds every per-transition field and the frame ring, each frame once (raw
frames also for a compressed buffer), plus one zero row at the end of each
array that padded sequence steps read::

    host  tree -> indices -> small values (ends, discount, n-step reward) + frame ids
                     |  one pinned block, one copy up
    device           v
          fields[name][rows]      frames[ids % F] -> (B, k+1) -> obs, next_obs as views

Writes reach the mirror lazily: ``sync`` copies what was added since the last
sync (slots ``count_synced .. count``, frames ``fw_synced .. fw``) before a
draw, so many adds between two samples cost one copy a field. The disk copy
is the one that counts; a resumed or loaded buffer rebuilds the mirror from it
(``rebuild``).
"""

from __future__ import annotations

import math

import numpy as np

from ..core.layout import plain_fields
from ..tensors.transport import TensorBatch, Transport
from ..tensors.lazy import load_torch, torch_dtype
from ..tensors.transfer import move
from ..batch import Batch
from ..errors import InvalidArgumentError, InvalidTypeError
from ..frames.store import frame_capacity

# Rows a rebuild copies at a time (bounded host memory; progress bar steps).
CHUNK = 8192
# A rebuild of more rows than this shows a progress bar.
PROGRESS_ROWS = 100_000
# Each field's columns in the packed rows start at a multiple of this (any dtype's view of them).
_ROW_ALIGN = 16


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def need(plain: dict, capacity: int, frames: tuple | None) -> int:
    """Bytes of device memory a mirror takes: ``plain`` ``name -> (shape,
    dtype)`` of the per-transition fields, ``frames`` ``(F, frame shape,
    dtype)`` of the frame ring or None."""
    total = 0  # Python ints: a crafted shape must not wrap to a small number
    width = 0  # the packed rows: each field's bytes rounded up to the alignment
    for shape, dtype in plain.values():
        width += -(-math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize // _ROW_ALIGN) * _ROW_ALIGN
    total += (capacity + 1) * width
    if frames is not None:
        f, shape, dtype = frames
        total += (f + 1) * math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize
    return total


def need_of(cfg) -> int:
    """Bytes of device memory the tier of a buffer of ``cfg`` (a ``Config``) takes."""
    return need(plain_fields(cfg), cfg.capacity, frames_of(cfg))


def frames_of(cfg) -> tuple | None:
    """``(F, frame shape, dtype)`` of the frame ring of ``cfg``, or None without frame stacks."""
    if not cfg.frame_stack:
        return None
    shape = cfg.shape("obs")
    return frame_capacity(cfg.capacity, cfg.frame_stack, cfg.num_envs), tuple(shape[1:]), cfg.dtype("obs")


def describe_need(cfg) -> str:
    """One line for ``bigper info``: what the device tier of ``cfg`` takes."""
    n = need_of(cfg)
    return f"device tier (device=...): {_gib(n)} ({n:,} bytes) of device memory, raw frames"


class Mirror:
    """The stored data of one buffer on ``device``.

    Parameters
    ----------
    device : torch.device
    capacity : int
    plain : dict
        ``name -> (shape, dtype)`` of the per-transition fields.
    frames : tuple or None
        ``(F, frame shape, dtype)`` of the frame ring.
    """

    def __init__(self, device, capacity: int, plain: dict, frames: tuple | None):
        torch = load_torch()
        self.device = device
        self.capacity = capacity
        self.nbytes = need(plain, capacity, frames)
        free = total = None
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
        elif device.type == "cpu":
            free, total = _host_memory()
        if free is not None:
            if self.nbytes > free:
                raise InvalidArgumentError(
                    f"device={str(device)!r} cannot hold this buffer's data: it needs {_gib(self.nbytes)} "
                    f"({self.nbytes} bytes) of device memory and {_gib(free)} of {_gib(total)} are free; "
                    "use a smaller capacity, or no device tier (batches then go up through pinned memory)")
        try:
            # Every per-transition field in one array of rows (each at an aligned column), so that
            # one gather takes them all; ``fields[name]`` is its view of them.
            self.columns, width = {}, 0
            for name, (shape, dtype) in plain.items():
                dt = np.dtype(dtype)
                n = math.prod(int(d) for d in shape) * dt.itemsize
                self.columns[name] = (width, width + n, _dtype(torch, dt, name), tuple(shape))
                width += -(-n // _ROW_ALIGN) * _ROW_ALIGN
            self.packed = torch.zeros((capacity + 1, width), dtype=torch.uint8, device=device)
            self.fields = {name: self.packed[:, a:z].view(tdt).view(capacity + 1, *shape)
                           for name, (a, z, tdt, shape) in self.columns.items()}
            self.F = frames[0] if frames is not None else 0
            self.frame_shape = tuple(frames[1]) if frames is not None else ()
            self.frames = None if frames is None else torch.zeros(
                (self.F + 1, *self.frame_shape), dtype=_dtype(torch, frames[2], "obs"), device=device)
        except (RuntimeError, MemoryError, ImportError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise InvalidArgumentError(f"device={str(device)!r} could not allocate this buffer's data "
                                       f"({_gib(self.nbytes)}, {self.nbytes} bytes): {str(e)[:200]}") from None
        self.count = 0  # transitions added when last synced
        self.fw = 0     # frames written when last synced

    # -- writes ------------------------------------------------------------------
    def sync(self, store, framestore, count: int, progress: bool = False) -> None:
        """Copy what was written since the last sync: the slots of
        transitions ``self.count .. count`` and frames ``self.fw .. fw``."""
        c = self.capacity
        lo = max(self.count, count - c)
        fw = framestore.fw if framestore is not None else 0
        first = max(self.fw, fw - self.F, framestore.oldest_frame()) if framestore is not None else 0
        bar = _bar(progress, max(count - lo, 0) + max(fw - first, 0), "rebuilding the device copy")
        for g in range(lo, count, CHUNK):
            hi = min(g + CHUNK, count)
            self._upload([(dev, a, b, _rows(store, name, a, b)) for a, b in _ranges(g, hi, c)
                          for name, dev in self.fields.items()])
            if bar is not None:
                bar.update(hi - g)
        self.count = count
        for g in range(first, fw, CHUNK):
            hi = min(g + CHUNK, fw)
            host = framestore.rows_of(np.arange(g, hi, dtype=np.int64))
            pieces, done = [], 0
            for a, b in _ranges(g, hi, self.F):
                pieces.append((self.frames, a, b, host[done:done + b - a]))
                done += b - a
            self._upload(pieces)
            if bar is not None:
                bar.update(hi - g)
        if bar is not None:
            bar.close()
        self.fw = max(self.fw, fw)

    def _upload(self, pieces: list) -> None:
        """``dest[a:b] = host`` for every piece, through one staging block and
        one host-to-device copy (non-blocking: a copy from pageable memory
        would wait for every kernel the learner queued), then copies on the device."""
        torch = load_torch()
        up = move(torch, {str(i): np.ascontiguousarray(p[3]) for i, p in enumerate(pieces)}, self.device, True)
        for i, (dest, a, b, _) in enumerate(pieces):
            dest[a:b].copy_(up[str(i)], non_blocking=True)

    def forget(self) -> None:
        """Everything is to be copied again at the next sync (a restored state)."""
        self.count = self.fw = 0

    # -- reads -------------------------------------------------------------------
    def batch(self, plan: dict, idx, w, prob, gen, mask=None, burn_in: int = 0) -> Batch:
        """A ``Batch`` whose data are tensors on the device, gathered there
        (``plan``: ``Reader.plan``'s); its ``to_torch()`` is ready too.

        What a loss reads is on the device: the fields, ``weights`` and
        ``mask``; what names the draw for the host's tree (``indices``,
        ``generations``, ``probabilities``) stays numpy, and the host copy of
        the mask that ``update_priorities(batch, ...)`` reads is kept with the
        batch's ``to_torch`` tensors."""
        torch = load_torch()
        up = plan["up"]
        c, F = self.capacity, self.F
        for key in (".slots", ".last"):
            if key in up and up[key].min() < 0:  # padded steps: the zero row
                up[key] = np.where(up[key] >= 0, up[key], c)
        for key, _ in plan["stacks"].values():
            if key in up:
                ids = up[key]
                up[key] = np.where(ids >= 0, ids % F, F) if ids.min() < 0 else ids % F
        tw = w.astype(np.float32, copy=False)
        up["weights"], up["indices"], up["generations"] = tw.copy(), idx.copy(), gen.copy()  # (the tensors' own)
        # The batch's own weights (and mask): what a loss multiplies with is a tensor beside the fields.
        # Copies apart from the to_torch dict's, which a learner may change in place; they ride in the
        # same block, so the batch still costs one copy up.
        up[".weights"] = tw.copy()
        if mask is not None:
            up["mask"], up[".mask"] = mask.copy(), mask.copy()
        t = move(torch, up, self.device, True)
        fields, take, stacks = self.fields, plan["take"], plan["stacks"]
        data = {}
        gathered = {}
        for name in plan["order"]:
            key = take.get(name)
            if key is not None:
                data[name] = _take(fields[name], t[key])
            elif name in stacks:
                key, cols = stacks[name]
                got = gathered.get(key)
                if got is None:
                    got = gathered[key] = _take(self.frames, t[key])
                data[name] = got if cols is None else got[:, cols]
            else:
                data[name] = t[name]
        tensors = dict(data)
        tensors["weights"], tensors["indices"], tensors["generations"] = t["weights"], t["indices"], t["generations"]
        if mask is not None:
            tensors["mask"] = t["mask"]
        ready = TensorBatch(tensors, {"indices": idx.copy(), "generations": gen.copy(),
                                      "mask": None if mask is None else mask.copy()})
        return Batch.make(data, idx, t[".weights"], prob, gen, None if mask is None else t[".mask"], burn_in,
                          Transport(tensors=ready))


def _host_memory() -> tuple[int, int] | tuple[None, None]:
    """``(available, total)`` bytes of host memory (Linux ``/proc/meminfo``), else ``(None, None)``:
    an allocation past it can succeed lazily and end in the kernel's OOM kill, not an error."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1].isdigit()}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        return None, None


def _take(src, rows):
    """``src[rows]`` for an index tensor of any shape: one gather on the device
    (on the CPU numpy's take, which copies whole rows: torch's CPU
    ``index_select`` of uint8 frames was 4x slower, measured)."""
    if src.device.type == "cpu":
        torch = load_torch()
        r = rows.numpy().reshape(-1)
        return torch.from_numpy(src.numpy().take(r, axis=0, mode="clip")).view(*rows.shape, *src.shape[1:])
    return src.index_select(0, rows.reshape(-1)).view(*rows.shape, *src.shape[1:])


def _dtype(torch, dtype, name: str):
    try:
        return torch_dtype(torch, np.dtype(dtype), name)
    except InvalidTypeError as e:  # (a layout the buffer was given: an argument, not a value's type)
        raise InvalidArgumentError(f"{e}, so it cannot live on a device") from None


def _ranges(lo: int, hi: int, n: int):
    """Ring rows of positions ``lo .. hi`` (``hi - lo <= n``) as at most two ``(a, b)`` ranges."""
    a, b = lo % n, (hi - 1) % n + 1
    return [(a, b)] if a < b else [(a, n), (0, b)]


def _rows(store, name: str, a: int, b: int) -> np.ndarray:
    arrays = store.arrays
    if arrays is not None:
        return arrays[name][a:b]
    return store.read(name, np.arange(a, b, dtype=np.int64))


def _bar(progress: bool, n: int, what: str):
    if not progress or n < PROGRESS_ROWS:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=n, desc=f"bigper: {what}", unit="row", leave=False)
