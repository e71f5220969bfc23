"""What a batch carries for its trip to a device (``Transport``,
``Batch.transport``), and what the trip gives back (``TensorBatch``)."""

from __future__ import annotations

from typing import Any


class Transport:
    """How a batch's draw prepared its trip to a device, read by ``to_torch``
    and ``to_jax`` (``Batch.transport``; None for a batch made by hand).

    Parameters
    ----------
    staged : Staged, optional
        A pinned block that already holds the batch as its device takes it,
        sent by the first ``to_torch`` to that device (``take_staged``).
    tensors : TensorBatch, optional
        A device tier's batch: its tensors already on the device.
    frames : tuple, optional
        A sequence batch's frames once: ``("refs", refs)`` or ``("frames",
        frames, index)``.
    """

    __slots__ = ("staged", "tensors", "frames")
    staged: Any
    tensors: Any
    frames: Any

    def __init__(self, staged: Any = None, tensors: Any = None, frames: Any = None) -> None:
        self.staged, self.tensors, self.frames = staged, tensors, frames

    def take_staged(self) -> Any:
        """The staged block, once (a second ``to_torch`` takes the general path)."""
        staged, self.staged = self.staged, None
        return staged


_NOTHING = Transport()  # (a batch made by hand carries nothing; never written: take_staged finds None)


def carried(batch) -> Transport:
    """What ``batch`` (a ``Batch``) carries for its trip to a device (an empty ``Transport`` for none)."""
    return batch.transport or _NOTHING


class TensorBatch(dict):
    """What ``Batch.to_torch`` returns: a plain ``dict`` of tensors that also
    keeps the host copies of the bookkeeping (``indices``, ``generations``,
    ``mask``), so that ``update_priorities(tensors, td)`` reads no tensor back
    from the device (which would wait for the learner's stream)."""

    __slots__ = ("host",)

    def __init__(self, tensors: dict, host: dict):
        super().__init__(tensors)
        # The host copies stand for these very tensors: a key the caller replaced is read as given.
        host.setdefault("of", (tensors.get("indices"), tensors.get("generations")))
        self.host = host

    def host_target(self):
        """``(indices, generations, mask)`` as host arrays while the dict holds
        the tensors they were made with (a key deleted keeps its host copy);
        None once the caller replaced one (the dict is then read as it is)."""
        host = getattr(self, "host", None)
        if not isinstance(host, dict) or not isinstance(host.get("of"), tuple) or len(host["of"]) != 2:
            return None  # (host copies the caller changed: the dict is read as it is)
        idx, gen = host["of"]
        if idx is None or self.get("indices") is not idx or self.get("generations", gen) is not gen:
            return None
        return host.get("indices"), host.get("generations"), host.get("mask")
