"""bigper on a Ray cluster: a sharded buffer whose sampling stays exactly
proportional across shards.

Needs the ``ray`` extra (``pip install 'bigper[ray]'``)::

    from bigper.distributed import ShardedPrioritizedBuffer

See ``bigper.distributed.ray`` for the design and its guarantees.
"""

try:
    import ray as _ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "bigper.distributed needs Ray, which is not installed; "
        "install the extra with: pip install 'bigper[ray]'") from exc

from .ray import ShardedPrioritizedBuffer
from ._writer import ShardWriter

__all__ = ["ShardedPrioritizedBuffer", "ShardWriter"]
