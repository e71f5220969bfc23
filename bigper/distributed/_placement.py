"""Starting and stopping the shard actors: one placement-group bundle per shard."""

from __future__ import annotations

import ray

from ._shard import Shard
from ..errors import ShardUnavailableError

PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_REMOTE_SHARD = None


def _remote_shard():
    global _REMOTE_SHARD
    if _REMOTE_SHARD is None:
        _REMOTE_SHARD = ray.remote(Shard)
    return _REMOTE_SHARD


def start_shards(specs: list, *, placement: str, cpus: float, max_restarts: int,
                 actor_options: dict, timeout: float):
    """One actor per spec (see ``Shard``), each in its own bundle of ``cpus`` CPUs
    placed with ``placement``; returns ``(placement_group, actors)`` once every
    shard has answered (its constructor's error is raised here)."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    n = len(specs)
    pg = placement_group([{"CPU": cpus}] * n, strategy=placement)
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        remove_placement_group(pg)
        raise ShardUnavailableError(
            f"could not place {n} shard(s) of {cpus} CPU each ({placement}) within {timeout:.0f} s; "
            f"the cluster has {ray.available_resources().get('CPU', 0)} CPU free. "
            "Lower num_cpus_per_shard or add nodes.")
    remote = _remote_shard()
    actors = []
    for k, spec in enumerate(specs):
        opts = dict(num_cpus=cpus, max_restarts=max_restarts, max_task_retries=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k))
        opts.update(actor_options)
        actors.append(remote.options(**opts).remote(spec))
    try:
        ray.get([a.stats.remote(None, 0.0) for a in actors])
    except BaseException:
        stop_shards(actors, pg)
        raise
    return pg, actors


def stop_shards(actors: list, pg) -> None:
    from ray.util.placement_group import remove_placement_group

    for a in actors:
        ray.kill(a, no_restart=True)
    remove_placement_group(pg)
