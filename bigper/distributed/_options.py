"""The sharded buffer's own keywords, checked before any actor starts."""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError
from ..storage import in_memory
from ._placement import PLACEMENTS


def _count(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
    return int(v)


def check(cfg, *, num_shards, placement, num_cpus_per_shard, storage, path, chunk_size,
          max_writes_in_flight, max_updates_in_flight, max_pending_updates, shard_timeout_s,
          max_restarts) -> dict:
    """Validated options, or the ``InvalidArgumentError`` naming the first bad one."""
    num_shards = _count("num_shards", num_shards)
    if cfg.capacity < num_shards:
        raise InvalidArgumentError(f"capacity must be >= num_shards={num_shards}, got {cfg.capacity!r}")
    if placement not in PLACEMENTS:
        raise InvalidArgumentError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    cpus = None
    if num_cpus_per_shard is not None:
        try:
            cpus = float(num_cpus_per_shard)
        except (TypeError, ValueError):
            cpus = float("nan")
        if isinstance(num_cpus_per_shard, bool) or not (0 < cpus < np.inf):
            raise InvalidArgumentError(
                f"num_cpus_per_shard must be None (reserve no CPU) or a number > 0, got {num_cpus_per_shard!r}")
    if (cfg.n_step > 1 or cfg.frame_stack) and cfg.num_envs > 1:
        raise InvalidArgumentError("a sharded buffer with n_step > 1 or frame_stack needs num_envs=1 "
                                   "(chunks must end at episode ends); give each env its own writer(), "
                                   f"got num_envs={cfg.num_envs}")
    if not in_memory(storage) and path is None:
        raise InvalidArgumentError(f"storage={storage!r} needs a path=, got None")
    out = {"num_shards": num_shards, "cpus": cpus}
    for name, v in (("chunk_size", chunk_size), ("max_writes_in_flight", max_writes_in_flight),
                    ("max_updates_in_flight", max_updates_in_flight),
                    ("max_pending_updates", max_pending_updates)):
        out[name] = _count(name, v)
    try:
        timeout = float(shard_timeout_s)
    except (TypeError, ValueError):
        timeout = float("nan")
    if not timeout > 0:
        raise InvalidArgumentError(f"shard_timeout_s must be > 0, got {shard_timeout_s!r}")
    out["shard_timeout_s"] = timeout
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, (int, np.integer)) or max_restarts < -1:
        raise InvalidArgumentError(f"max_restarts must be an int >= -1, got {max_restarts!r}")
    out["max_restarts"] = int(max_restarts)
    return out
