"""JAX conversion, imported only when asked for (bigper never imports jax itself).

``batch_to_jax`` turns a ``Batch`` into ``jax.Array``s; ``register_batch``
makes ``Batch`` a pytree; ``host_values`` reads a learner's ``jax.Array``
(priorities) into numpy.

Host (JAX's CPU device, the default without ``device=``): an array reaches
JAX **without a copy** (XLA's CPU client adopts its buffer, as it does for
``jax.dlpack.from_dlpack`` of a numpy array: the jax array's buffer is the
numpy array's) when it is C-contiguous, writable, in native byte order, of a dtype
DLPack carries (bool, integers, floats, complex) that JAX keeps as it is (with
``jax_enable_x64`` off, 64-bit dtypes become 32-bit ones), and 64-byte
aligned (XLA's CPU minimum: a less aligned buffer is copied by XLA anyway).
Any other array is copied exactly once, into a 64-byte aligned array that
JAX then shares. numpy aligns its allocations to 16 bytes only, so in a
batch from ``sample`` a field is shared about one time in four, and the
``obs``/``next_obs`` frame stacks (strided views of one frame gather) are
always copied once; ``sample(out=...)`` with 64-byte aligned arrays makes
every field shared. All of a batch's arrays go to JAX in one ``device_put``:
JAX's own cost is per call and per array (about 20 us an array here).

Accelerator (``device=`` a GPU or TPU, or another JAX device): **one
host-to-device transfer a batch**, as ``to_torch`` does on CUDA: every array
is packed into one 64-byte aligned host block (``obs``/``next_obs`` of a
frame gather once, as that gather; a batch of sequences as each row's
distinct frames), the block goes over with one ``jax.device_put``, and one
jitted function (compiled once per layout) cuts it into the batch's arrays
on the device and rebuilds the stacks there::

    host    [ .pair | action | reward | ... | weights | indices | generations ]  one aligned block
              -- one device_put -->
    device  block -> unpack (jit, cached by layout) -> {"obs", "next_obs", ..., "indices"}
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
import numpy as np

from .transport import carried, TensorBatch
from .transfer import fields_of, host_of
from .pinned import flat_arrays
from ..errors import InvalidArgumentError, InvalidTypeError

# XLA's CPU client shares a host buffer only at this alignment (it copies a less aligned one).
ALIGN = 64
# Platforms whose arrays ``update_priorities`` reads at once (host memory); an array on any
# other platform is copied to the host without blocking and applied later (``device.deferred``).
HOST_PLATFORMS = frozenset({"cpu"})
# Unpack functions kept (one per layout and device; a sampler repeats one).
MAX_LAYOUTS = 64

_LOCK = threading.Lock()
_REGISTERED: set = set()
_UNPACK: OrderedDict = OrderedDict()


def _jax():
    try:
        import jax
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("Batch.to_jax needs JAX: pip install 'jax[cpu]' (or pip install -e '.[jax]' "
                          "from a checkout)") from e
    return jax


def is_jax_array(x) -> bool:
    """Whether ``x`` is a ``jax.Array`` (or a tracer of one); never imports jax."""
    jax = sys.modules.get("jax")
    array = getattr(jax, "Array", None)
    return array is not None and isinstance(x, array)


def _check_concrete(x, what: str) -> None:
    """Refuse what cannot be read: a tracer (inside ``jit``/``grad``), a deleted
    or donated array, an array of PRNG keys."""
    jax = sys.modules["jax"]
    if isinstance(x, jax.core.Tracer):
        raise InvalidTypeError(f"{what} is a traced jax value ({type(x).__name__}, inside jit/vmap/grad): "
                               f"pass the concrete jax.Array the jitted step returns")
    if x.is_deleted():
        raise InvalidArgumentError(f"{what} is a jax.Array that was deleted or donated "
                                   f"(shape {tuple(x.shape)}, dtype {x.dtype}): its values are gone")
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        raise InvalidTypeError(f"{what} must be numbers, got a jax.Array of dtype {x.dtype}")


def on_host(x) -> bool:
    """Whether every device of the ``jax.Array`` ``x`` is on a host platform
    (reading it does not wait for an accelerator's copy)."""
    try:
        return all(d.platform in HOST_PLATFORMS for d in x.devices())
    except Exception:  # noqa: BLE001 (a tracer or a deleted array: read at once, refused there)
        return True


def host_values(x, what: str = "priorities") -> np.ndarray:
    """The values of the ``jax.Array`` ``x`` as numpy: on the host a read-only
    view of its buffer (no copy), else a copy to the host (which waits for it).
    Dtypes numpy has no arithmetic for (bfloat16, float8, int4) become float32;
    a tracer, a deleted or donated array, or a key array is ``InvalidTypeError``
    or ``InvalidArgumentError`` naming ``what``."""
    _check_concrete(x, what)
    try:
        a = np.asarray(x)
    except (RuntimeError, TypeError, ValueError) as e:  # deleted meanwhile, a failed computation
        raise InvalidArgumentError(f"{what}: the jax.Array could not be read ({type(e).__name__}: "
                                   f"{str(e)[:160]})") from None
    if a.dtype.kind == "V":  # ml_dtypes' bfloat16, float8_*, int4: numpy holds them as opaque records
        a = a.astype(np.float32)
    return a


def check_deferred(x, what: str = "priorities") -> None:
    """What the host can check of an accelerator's array without reading it."""
    _check_concrete(x, what)
    kind = np.dtype(x.dtype).kind
    if kind == "c":
        raise InvalidTypeError(f"{what} must be real numbers, got dtype {x.dtype}")
    if kind not in "fiubV":
        raise InvalidTypeError(f"{what} must be numbers, got dtype {x.dtype}")


def to_host_async(x):
    """A host copy of the accelerator's array ``x`` on its way (JAX dispatches
    it without blocking); it outlives ``x`` being deleted or donated."""
    jax = sys.modules["jax"]
    try:
        return jax.device_put(x, jax.devices("cpu")[0])
    except RuntimeError:  # no CPU backend (an unusual JAX build): JAX's own async host copy
        x.copy_to_host_async()
        return x


# -- the pytree --------------------------------------------------------------------------------

_BOOKKEEPING = ("indices", "weights", "probabilities", "generations", "mask")


def register_batch(cls) -> None:
    """Register ``cls`` (``Batch``) as a JAX pytree, once: its leaves are the
    data fields in order, then ``indices``, ``weights``, ``probabilities``,
    ``generations`` and ``mask`` (None, no leaf, without sequences); the field
    names and ``burn_in`` are its static part."""
    if cls in _REGISTERED:
        return
    from jax import tree_util as tu

    def flatten_with_keys(b):
        d = b.data
        children = [(tu.DictKey(k), v) for k, v in d.items()]
        children += [(tu.GetAttrKey(n), getattr(b, n)) for n in _BOOKKEEPING]
        return children, (tuple(d), b.burn_in)

    def flatten(b):
        d = b.data
        return (*d.values(), b.indices, b.weights, b.probabilities, b.generations, b.mask), (tuple(d), b.burn_in)

    def unflatten(aux, children):
        names, burn_in = aux
        children = tuple(children)
        n = len(names)
        idx, w, prob, gen, mask = children[n:]
        return cls.make(dict(zip(names, children[:n])), idx, w, prob, gen, mask, burn_in)

    with _LOCK:
        if cls in _REGISTERED:
            return
        try:
            tu.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
        except ValueError as e:  # registered already (by the user, say): theirs stays
            if "egist" not in str(e):
                raise
        _REGISTERED.add(cls)


# -- Batch.to_jax --------------------------------------------------------------------------------

class JaxBatch(TensorBatch):
    """What ``Batch.to_jax`` returns: a plain ``dict`` of ``jax.Array`` that,
    like ``to_torch``'s dict, keeps host copies of ``indices``,
    ``generations`` and ``mask``, so ``update_priorities(arrays, td)`` reads
    nothing back from an accelerator. A pytree like a dict (``jax.jit``
    takes it); what a pytree function rebuilds is a plain dict."""

    __slots__ = ()


def _register_dict(jax) -> None:
    if JaxBatch in _REGISTERED:
        return
    tu = jax.tree_util
    with _LOCK:
        if JaxBatch in _REGISTERED:
            return
        tu.register_pytree_with_keys(
            JaxBatch, lambda d: ([(tu.DictKey(k), v) for k, v in d.items()], tuple(d)),
            lambda keys, children: dict(zip(keys, children)), lambda d: (tuple(d.values()), tuple(d)))
        _REGISTERED.add(JaxBatch)


def as_device(device):
    """``device`` (None, a ``jax.Device``, or a platform name with an optional
    index: ``"cpu"``, ``"gpu"``, ``"cuda:1"``, ``"tpu"``) as a ``jax.Device``
    (None: the host path); ``InvalidArgumentError`` naming it otherwise."""
    jax = _jax()
    if device is None or isinstance(device, jax.Device):
        return device
    if not isinstance(device, str):
        raise InvalidArgumentError(f"device must be a jax.Device or a name like 'gpu', 'cuda:1', 'cpu', "
                                   f"got {device!r}")
    name, _, num = device.partition(":")
    if num and not num.isdigit():
        raise InvalidArgumentError(f"device={device!r}: the index after ':' must be a number")
    try:
        devices = jax.devices(name)
    except RuntimeError as e:
        raise InvalidArgumentError(f"device={device!r}: JAX has no such backend here "
                                   f"(its devices: {jax.devices()}; {str(e)[:120]})") from None
    i = int(num or 0)
    if i >= len(devices):
        raise InvalidArgumentError(f"device={device!r}: JAX has {len(devices)} {name} device(s): {devices}")
    return devices[i]


def _target_dtype(jax, dtype: np.dtype) -> np.dtype:
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def _canonical(jax, key: str, a: np.ndarray) -> np.ndarray | None:
    """``a`` in the dtype JAX keeps (with ``jax_enable_x64`` off, 64-bit dtypes
    are 32-bit), or None when it is that already; a value that would change is
    refused, naming the field."""
    want = _target_dtype(jax, a.dtype)
    if want == a.dtype.newbyteorder("="):
        return None
    with np.errstate(over="ignore", invalid="ignore"):  # (an overflow is checked for below)
        out = a.astype(want)
    if a.size and a.dtype.kind in "iu":
        lo, hi = a.min(), a.max()
        info = np.iinfo(want)
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise InvalidArgumentError(f"{key} holds {bad}, which JAX's {want} cannot (jax_enable_x64 is off); "
                                       f"turn it on with jax.config.update('jax_enable_x64', True)")
    elif a.size and a.dtype.kind in "fc":
        for was, now in ((a, out),) if a.dtype.kind == "f" else ((a.real, out.real), (a.imag, out.imag)):
            grew = np.isinf(now) & np.isfinite(was)  # (an overflow)
            lost = (now == 0) & (was != 0)  # (an underflow: a nonzero value that would read 0)
            for bad, as_ in ((grew, "inf"), (lost, "0")):
                if bad.any():
                    at = int(np.flatnonzero(bad.reshape(-1))[0])
                    raise InvalidArgumentError(f"{key} holds {a.reshape(-1)[at]}, which JAX's {want} holds as "
                                               f"{as_} (jax_enable_x64 is off); turn it on with "
                                               f"jax.config.update('jax_enable_x64', True)")
    return out


def aligned_empty(shape, dtype) -> np.ndarray:
    """A C-contiguous array whose buffer starts at a multiple of 64 bytes (XLA
    shares such a buffer without a copy; numpy's own arrays are 16-aligned)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + ALIGN, np.uint8)
    off = -raw.ctypes.data % ALIGN
    return raw[off:off + n].view(dtype).reshape(shape)


def _shared(a: np.ndarray) -> bool:
    """Whether JAX can share ``a`` as it is (see the module's docstring)."""
    return (a.flags.c_contiguous and a.flags.writeable and a.dtype.isnative and a.ctypes.data % ALIGN == 0
            and a.dtype.kind in "biufc")


def _host_ready(jax, key: str, a) -> np.ndarray:
    """``a`` as an array XLA's CPU client adopts as it is: ``a`` itself where
    it can be (see the module's docstring), else one copy that can."""
    a = np.asarray(a)
    if a.dtype.kind not in "biufcV":
        raise InvalidTypeError(f"field {key!r} has dtype {a.dtype}, which JAX cannot hold")
    conv = _canonical(jax, key, a)
    if conv is not None:
        a = conv
    if not _shared(a) and a.dtype.kind != "V":  # (ml_dtypes' bfloat16 and co.: JAX copies them itself)
        out = aligned_empty(a.shape, a.dtype.newbyteorder("="))
        np.copyto(out, a, casting="equiv" if not a.dtype.isnative else "no")
        a = out
    return a


def host_arrays(jax, arrays: dict, device=None) -> dict:
    """numpy ``arrays`` (by key) as ``jax.Array``s on a host device, adopted
    without a copy where XLA can, in one ``device_put`` (JAX's own cost is per
    call and per array: ``jax.dlpack.from_dlpack`` of a numpy array takes the
    same path one array at a time)."""
    ready = {k: _host_ready(jax, k, a) for k, a in arrays.items()}
    if device is None:
        device = jax.devices("cpu")[0]
    return dict(zip(ready, jax.device_put(list(ready.values()), device)))


def host_array(jax, key: str, a, device=None):
    """One array as ``host_arrays`` makes it."""
    return host_arrays(jax, {key: a}, device)[key]


def _from_torch(jax, key: str, t, device):
    """A tier's tensor as a ``jax.Array``, through DLPack (shared where JAX
    can: contiguous, on a device JAX has); moved to ``device`` when given."""
    torch = sys.modules["torch"]
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    try:
        if t.dtype == torch.int64 or t.dtype == torch.float64:  # (jax_enable_x64 off: JAX copies to 32 bits)
            if _target_dtype(jax, np.dtype(str(t.dtype).split(".")[-1])).itemsize < 8:
                return host_array(jax, key, t.cpu().numpy(), device)
        x = jax.dlpack.from_dlpack(t)
    except (BufferError, TypeError, RuntimeError) as e:
        raise InvalidTypeError(f"field {key!r}: the device tier's tensor ({t.dtype} on {t.device}) cannot "
                               f"reach JAX through DLPack ({type(e).__name__}: {str(e)[:160]}); make the "
                               f"buffer without device= and use to_jax(device=...)") from None
    if device is not None and device not in x.devices():
        x = jax.device_put(x, device)
    return x


def batch_to_jax(batch, device=None) -> JaxBatch:
    """Arrays keyed like ``batch``, plus ``weights`` (float32), ``indices`` and
    ``generations`` (int64, or int32 with ``jax_enable_x64`` off) and ``mask``
    with sequences; see ``Batch.to_jax``."""
    jax = _jax()
    register_batch(type(batch))
    _register_dict(jax)
    device = as_device(device)
    ready = carried(batch).tensors
    if ready is not None:  # a device tier's batch: torch tensors, handed over through DLPack
        out = {k: _from_torch(jax, k, v, device) for k, v in ready.items() if k not in ("indices", "generations")}
        home = device if device is not None or not out else next(iter(next(iter(out.values())).devices()))
        for k in ("indices", "generations"):
            out[k] = host_array(jax, k, np.array(getattr(batch, k), dtype=np.int64), home)
        return JaxBatch({k: out[k] for k in ready if k in out}, host_of(batch))
    if device is None or device == jax.devices("cpu")[0]:
        arrays, _ = fields_of(batch, copies=False)
        # The batch's own bookkeeping, shared like its fields (a jax array is never changed in place).
        arrays.update(weights=np.asarray(batch.weights, np.float32), indices=np.asarray(batch.indices, np.int64),
                      generations=np.asarray(batch.generations, np.int64))
        return JaxBatch(host_arrays(jax, arrays), host_of(batch))
    arrays, derived = fields_of(batch, copies=True)
    order = [*batch.data, *(k for k in ("weights", "indices", "generations", "mask") if k in arrays)]
    parts = _to_device(jax, arrays, derived, device)
    return JaxBatch({k: parts[k] for k in order}, host_of(batch))


def _to_device(jax, arrays: dict, derived: dict, device) -> dict:
    """One aligned host block, one ``device_put``, one jitted unpack (by key)."""
    flat = flat_arrays(arrays)
    members, off = [], 0
    for key, a in flat.items():
        name = key if isinstance(key, str) else f"{key[0]}[{key[1]}]"
        conv = _canonical(jax, name, a)
        if conv is not None:
            flat[key] = a = conv
        if a.dtype.kind not in "biufc":
            raise InvalidTypeError(f"field {name!r} has dtype {a.dtype}, which bigper cannot pack for JAX")
        members.append((key, a.shape, a.dtype.newbyteorder("=").str, off, a.nbytes))
        off += -(-a.nbytes // ALIGN) * ALIGN
    block = aligned_empty((max(off, ALIGN),), np.uint8)
    for (key, shape, dt, o, n) in members:
        np.copyto(block[o:o + n].view(dt).reshape(shape), flat[key], casting="equiv")
    rules = tuple(sorted((name, rule) for name, (_, rule) in derived.items()))
    return _unpacker(jax, tuple(members), rules, device)(jax.device_put(block, device))


def _unpacker(jax, members: tuple, rules: tuple, device):
    key = (members, rules, device)
    with _LOCK:
        fn = _UNPACK.get(key)
        if fn is not None:
            _UNPACK.move_to_end(key)
            return fn
    jnp, lax = jax.numpy, jax.lax

    def unpack(block):
        got: dict = {}
        for k, shape, dt, o, n in members:
            dt = np.dtype(dt)
            raw = block[o:o + n]
            if dt == np.bool_:
                v = raw != 0
            elif dt.itemsize == 1:
                v = lax.bitcast_convert_type(raw, dt)
            else:
                v = lax.bitcast_convert_type(raw.reshape(-1, dt.itemsize), dt)
            v = v.reshape(shape)
            if isinstance(k, tuple):
                got.setdefault(k[0], {})[k[1]] = v
            else:
                got[k] = v
        pair, frames, index = got.pop(".pair", None), got.pop(".frames", None), got.pop(".frame_index", None)
        for name, rule in rules:
            if rule == "first":
                got[name] = pair[:, :-1]
            elif rule == "last":
                got[name] = pair[:, 1:]
            else:  # a sequence batch's stacks from each row's distinct frames: one gather
                ix = index[name]
                b, n_ = frames.shape[0], frames.shape[1]
                rows = ix + (jnp.arange(b, dtype=ix.dtype) * n_).reshape(b, 1, 1)
                got[name] = frames.reshape(b * n_, *frames.shape[2:])[rows.reshape(-1)].reshape(
                    *ix.shape, *frames.shape[2:])
        return got

    fn = jax.jit(unpack)
    with _LOCK:
        _UNPACK[key] = fn
        while len(_UNPACK) > MAX_LAYOUTS:
            _UNPACK.popitem(last=False)
    return fn
