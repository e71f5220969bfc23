"""Batch: what ``sample`` returns."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .tensors.transport import Transport
from .errors import InvalidTypeError, UnknownFieldError


@dataclass(frozen=True, eq=False)
class Batch(Mapping[str, np.ndarray]):
    """A sampled batch: data by field name, plus the sampling bookkeeping.

    Each parameter is also an attribute of the same name. ``sample`` makes
    batches; a user rarely builds one.

    Data is reached by mapping access (``batch["obs"]``), so no data field can
    collide with ``indices`` or ``weights``.

    With a device tier (a buffer made with ``device=...``), what a loss
    reads is a ``torch.Tensor`` on that device: every field in ``data``,
    ``weights`` (float32) and, with sequences, ``mask`` (bool). What names
    the draw for the host's tree stays numpy: ``indices``, ``generations``
    and ``probabilities``. So a loss written from the batch,
    ``(batch.weights * td.pow(2)).mean()``, needs no conversion, and
    ``update_priorities(batch, td)`` reads nothing back from the device.
    The batch's tensors are its own: changing those of the ``to_torch()``
    dict in place leaves them as drawn.

    Parameters
    ----------
    data : dict[str, np.ndarray or torch.Tensor]
        Every field with a leading batch axis, plus ``next_<name>`` for the
        fields in ``next_of``, ``terminated``, ``truncated`` and ``discount``.
        The arrays are the caller's (nothing in the buffer writes to them
        later); with frame stacks, ``obs`` and ``next_obs`` may be two views
        of one array, not contiguous along the batch axis.
    indices : np.ndarray, (B,) int64
        Slots the transitions were drawn from.
    weights : np.ndarray or torch.Tensor, (B,) float32
        Importance-sampling weights, normalized as the buffer's ``weight_norm``
        says, never below float32's smallest normal number (1.2e-38: where
        priorities lie so far apart that a weight would be 0 or subnormal, it
        is that); a tensor on the device with a device tier.
    probabilities : np.ndarray, (B,) float64
        ``P(i)`` of each draw at sampling time.
    generations : np.ndarray, (B,) int64
        How many times each slot had been written when it was sampled; lets
        ``update_priorities`` skip slots overwritten since.
    mask : np.ndarray or torch.Tensor, (B, T) bool, or None
        With ``sequence=...`` only (every field is then ``(B, T, ...)``, with
        ``T = burn_in + length``): which steps are real. Padded steps (before
        an episode's start in the burn-in, after its end) hold zeros. A
        tensor on the device with a device tier.
    burn_in : int
        With sequences: the first ``burn_in`` steps of each row are burn-in
        (to warm up a recurrent state), the rest the learning part; else 0.
    """

    data: dict[str, np.ndarray]
    indices: np.ndarray
    weights: np.ndarray
    probabilities: np.ndarray
    generations: np.ndarray
    mask: np.ndarray | None = None
    burn_in: int = 0
    # (not a parameter: what the draw prepared for the trip to a device; see ``Transport``)
    transport: Transport | None = field(default=None, init=False, repr=False, compare=False)

    def __getitem__(self, key: str) -> np.ndarray:
        try:
            return self.data[key]
        except KeyError:
            if key == "mask" and self.mask is not None:  # spelt as in to_torch()
                return self.mask
            raise UnknownFieldError(f"batch has no field {key!r}; it has {sorted(self.data)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}: {v.dtype}{list(v.shape)}" for n, v in self.data.items())
        return f"Batch(size={self.size}, {{{fields}}}, indices, weights, probabilities, generations)"

    @classmethod
    def make(cls, data: dict[str, np.ndarray], indices: np.ndarray, weights: np.ndarray,
             probabilities: np.ndarray, generations: np.ndarray, mask: np.ndarray | None = None,
             burn_in: int = 0, transport: Transport | None = None) -> "Batch":
        """``Batch(...)`` for the buffer's hot path: the same object, without the
        frozen dataclass's per-field ``object.__setattr__`` calls.

        Parameters
        ----------
        data, indices, weights, probabilities, generations
            As for ``Batch``.
        mask : np.ndarray of bool (B, T), optional
            With sequences: which steps are real.
        burn_in : int
            With sequences: the burn-in steps at the front of each row.
        transport : Transport, optional
            What the draw prepared for the trip to a device.

        Returns
        -------
        Batch
        """
        if not _pytree[0] and "jax" in sys.modules:
            _as_pytree()
        b = object.__new__(cls)
        b.__dict__.update(data=data, indices=indices, weights=weights, probabilities=probabilities,
                          generations=generations, mask=mask, burn_in=burn_in, transport=transport)
        return b

    def carrying(self, transport: Transport | None) -> "Batch":
        """This batch with ``transport`` (a new ``Batch`` over the same arrays).

        Parameters
        ----------
        transport : Transport or None
            What the draw prepared for the trip to a device (None: nothing).

        Returns
        -------
        Batch
        """
        if transport is not None and not isinstance(transport, Transport):
            raise InvalidTypeError(f"transport must be a bigper.tensors.transport.Transport or None, "
                                   f"not {type(transport).__name__}")
        return Batch.make(self.data, self.indices, self.weights, self.probabilities, self.generations,
                          self.mask, self.burn_in, transport)

    def __post_init__(self) -> None:
        if not _pytree[0] and "jax" in sys.modules:
            _as_pytree()

    @property
    def size(self) -> int:
        """Number of items (transitions, or sequences) in the batch."""
        return int(self.indices.shape[0])

    def to_torch(self, device: Any = None, non_blocking: bool = True) -> dict[str, Any]:
        """Tensors keyed like the batch, plus ``weights`` (float32), ``indices`` and
        ``generations`` (int64), and ``mask`` (bool) with sequences;
        ``update_priorities`` takes this dict as a target.

        Parameters
        ----------
        device : str or torch.device, optional
            Where the tensors go (default: the CPU). On the CPU each field costs
            at most one copy (none where numpy's memory can be shared); with a
            CUDA device the copy goes through pinned host memory.
        non_blocking : bool
            With a CUDA device, copy without waiting for the host.

        Returns
        -------
        TensorBatch
            A ``dict[str, torch.Tensor]`` (``bigper.tensors.transport.TensorBatch``) that
            also keeps host copies of ``indices``, ``generations`` and
            ``mask`` in its ``host`` attribute, so that
            ``update_priorities(tensors, td)`` reads nothing back from the
            device; a key the caller replaces is read as given.
        """
        from .tensors.transfer import batch_to_torch

        return batch_to_torch(self, device=device, non_blocking=non_blocking)

    def to_jax(self, device: Any = None) -> dict[str, Any]:
        """``jax.Array``s keyed like the batch, plus ``weights`` (float32),
        ``indices`` and ``generations`` (int64; int32 while JAX's
        ``jax_enable_x64`` is off, as every 64-bit dtype), and ``mask`` (bool)
        with sequences; ``update_priorities`` takes this dict as a target.

        Parameters
        ----------
        device : jax.Device or str, optional
            Where the arrays go: None (default) or ``"cpu"``: JAX's CPU device,
            sharing the batch's memory where XLA can (a C-contiguous,
            writable, native-order array at a 64-byte aligned address: no
            copy, the jax array's buffer is the numpy array's); any other
            array is copied once, into an aligned array that JAX shares. A GPU or TPU (a ``jax.Device``, or ``"gpu"``, ``"cuda:1"``,
            ``"tpu"``): the batch is packed into one host block and sent with
            one transfer, then cut into its arrays on the device by one jitted
            call (``obs``/``next_obs`` of a frame gather travel once).

        Returns
        -------
        JaxBatch
            A ``dict[str, jax.Array]`` (``bigper.tensors.jax.JaxBatch``) that, like
            ``to_torch``'s dict, keeps host copies of ``indices``,
            ``generations`` and ``mask`` so that ``update_priorities(arrays,
            td)`` reads nothing back from a device. Arrays shared with the
            batch change if the batch's arrays are written to: leave them as
            drawn while JAX uses them. A batch of a buffer with a torch
            device tier (``device=``) hands its tensors to JAX through DLPack
            (shared where JAX can: contiguous, on a device this JAX has).

        Raises
        ------
        InvalidArgumentError
            ``device`` names no device JAX has, or an int64/float64 value
            would change in JAX's 32-bit dtype (``jax_enable_x64`` off).
        """
        from .tensors.jax import batch_to_jax

        return batch_to_jax(self, device=device)


# Whether Batch is a JAX pytree yet: it becomes one as soon as jax is loaded (at bigper's import,
# at the first batch made after jax's, at the first to_jax), without bigper ever importing jax.
_pytree = [False]


def _as_pytree() -> None:
    _pytree[0] = True  # one try: a broken jax install must not cost every batch a retry
    from .tensors.jax import register_batch

    try:
        register_batch(Batch)
    except Exception:  # noqa: BLE001  # pragma: no cover - a broken jax: no pytree, batches unaffected
        pass


if "jax" in sys.modules:
    _as_pytree()
