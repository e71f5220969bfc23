"""Starting and stopping the shard actors: one placement-group bundle per shard.

``cpus=None`` (the default) reserves no CPU, as Ray does for actors: each
bundle asks for one byte of the ``memory`` resource, which every node has,
so the placement strategy (PACK, SPREAD, ...) still decides where shards go
and a 2-CPU laptop holds any number of shards. An explicit ``cpus`` that the
cluster cannot give is refused at once (the figures are known before asking),
or after ``timeout`` seconds when other work holds the CPUs.
"""

from __future__ import annotations

import ray

from ._shard import Shard
from .. import errors
from ..errors import ShardUnavailableError

PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_REMOTE_SHARD = None
# A bundle must ask for something: one byte of memory reserves nothing anyone feels.
_NO_RESERVATION = {"memory": 1}


def _remote_shard():
    global _REMOTE_SHARD
    if _REMOTE_SHARD is None:
        _REMOTE_SHARD = ray.remote(Shard)
    return _REMOTE_SHARD


def _node_cpus() -> list:
    """Total CPU of each alive node, largest first."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    totals = [float(n.get("Resources", {}).get("CPU", 0.0)) for n in nodes]
    return sorted(totals, reverse=True)


def check_fits(n: int, cpus: float, placement: str) -> None:
    """Refuse at once a reservation the cluster's nodes cannot hold even when idle."""
    per_node = _node_cpus()
    total = sum(per_node)
    free = float(ray.available_resources().get("CPU", 0.0))
    need = n * cpus
    figures = (f"asked {n} shard(s) x {cpus:g} CPU = {need:g} CPU ({placement}); the cluster has "
               f"{free:g} CPU free of {total:g} on {len(per_node)} node(s) {per_node}")
    fits = {
        "PACK": need <= total + 1e-9 and (not per_node or cpus <= per_node[0] + 1e-9),
        "SPREAD": need <= total + 1e-9 and (not per_node or cpus <= per_node[0] + 1e-9),
        "STRICT_PACK": bool(per_node) and need <= per_node[0] + 1e-9,
        "STRICT_SPREAD": len([c for c in per_node if c >= cpus - 1e-9]) >= n,
    }[placement]
    if not fits or need > free + 1e-9:
        raise ShardUnavailableError(f"cannot place the shards: {figures}. "
                                    "Lower num_cpus_per_shard (None reserves none) or add nodes.")


def start_shards(specs: list, *, placement: str, cpus, max_restarts: int,
                 actor_options: dict, timeout: float):
    """One actor per spec (see ``Shard``), each in its own bundle (``cpus`` CPUs, or
    none when ``cpus`` is None) placed with ``placement``; returns
    ``(placement_group, actors)`` once every shard has answered (its
    constructor's error is raised here)."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    n = len(specs)
    nodes = len(_node_cpus())
    if placement == "STRICT_SPREAD" and n > nodes:
        raise ShardUnavailableError(f"cannot place {n} shard(s) STRICT_SPREAD (one a node) on the "
                                    f"{nodes} alive node(s); use SPREAD or add nodes")
    if cpus is None:
        bundle, actor_res = dict(_NO_RESERVATION), {"num_cpus": 0, "memory": 1}
    else:
        check_fits(n, cpus, placement)
        bundle, actor_res = {"CPU": cpus}, {"num_cpus": cpus}
    pg = placement_group([bundle] * n, strategy=placement)
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        remove_placement_group(pg)
        asked = "no CPU" if cpus is None else f"{cpus:g} CPU each"
        raise ShardUnavailableError(
            f"could not place {n} shard(s) of {asked} ({placement}) within {timeout:g} s; "
            f"the cluster has {ray.available_resources().get('CPU', 0):g} CPU free on "
            f"{len(_node_cpus())} node(s). Lower num_cpus_per_shard or add nodes.")
    remote = _remote_shard()
    actors = []
    for k, spec in enumerate(specs):
        opts = dict(actor_res, max_restarts=max_restarts, max_task_retries=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k))
        opts.update(actor_options)
        actors.append(remote.options(**opts).remote(spec))
    try:
        failed = [f for f in ray.get([a.ready.remote() for a in actors]) if f is not None]
        if failed:
            name, msg = failed[0]
            cls = getattr(errors, name, None)
            if not (isinstance(cls, type) and issubclass(cls, errors.BigperError)):
                cls = ShardUnavailableError
            raise cls(msg)
    except BaseException:
        stop_shards(actors, pg)
        raise
    return pg, actors


def stop_shards(actors: list, pg) -> None:
    from ray.util.placement_group import remove_placement_group

    for a in actors:
        ray.kill(a, no_restart=True)
    remove_placement_group(pg)
