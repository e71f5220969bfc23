"""bigper on a Ray cluster: a sharded buffer whose sampling stays exactly
proportional across shards.

Needs the ``ray`` extra (``pip install 'bigper[ray]'``)::

    from bigper.distributed import ShardedPrioritizedBuffer

What it guarantees
------------------
* **Exact proportional sampling across shards.** The coordinator draws every
  uniform; the ``B`` stratified draws are laid over the shard totals end to
  end (``_sampling``), so ``P(i) = leaf_i / T`` over all shards, the law of
  one buffer. IS weights use the global ``T`` and, for ``weight_norm="global"``,
  the smallest leaf over all shards (``N`` cancels, as in a local buffer).
  With one live shard, the shard lays the draws out itself from the
  coordinator's uniforms: one round trip, and the batches of a local buffer
  with the same seed and data, bit for bit.
* **Totals: fresh (default) or pipelined.** ``fresh_totals=True`` asks every
  shard for its total, then samples: two round trips, exact unless a writer
  lands a chunk between the two. ``fresh_totals=False`` lays the draws over
  the totals the shards' previous replies carried: one round trip, and the
  split between shards lags by what changed since (the learner's last update,
  other writers' chunks). Either way a shard whose total moved rescales its
  targets onto its current leaves, so the draw inside it is exactly
  proportional, and ``probabilities``/``weights`` are those of the law the
  draw really followed.
* **Priority updates** are grouped by shard and ride on the next call to it
  (the next ``sample``'s first round trip), so a sample-update loop costs
  no extra round trip; past ``max_pending_updates`` rows they go on their own,
  at most ``max_updates_in_flight`` unacknowledged. New transitions get the
  largest leaf any shard reported, as of the last call to their shard.
* **Indices** are global slots: shard ``k`` owns ``[offsets[k], offsets[k+1])``.
  Generations carry the shard's restart epoch in their top bits, so an update
  by batch skips slots rewritten since sampling, also across a restart.
* **Writes** go in chunks; with ``n_step > 1`` or ``frame_stack``, chunks end
  at episode ends (an unfinished episode stays with its writer). A chunk goes
  to the shard with the most room while any has room (cut to fit where it
  may be cut), then to the shard whose rows it would overwrite are oldest
  (``_routing``): one writer fills exactly ``min(added, capacity)`` and
  evicts oldest first across shards to chunk granularity; in episode mode
  the buffer holds ``min(added, capacity)`` minus less than one chunk per
  shard. Nothing is lost or stored twice while shards live; a chunk whose
  shard died is sent to another one (if the shard was only unreachable, that
  chunk may be stored twice).
* **Placement.** ``num_cpus_per_shard=None`` (default) reserves no CPU, as
  Ray does for actors; the placement strategy still applies (``SPREAD``: a
  shard a node where there are enough). A reservation the cluster cannot
  hold is refused within 5 s with what was asked and what is free.
* **Faults.** ``save`` commits a snapshot of every shard plus a manifest
  atomically and points ``recovery_dir/latest.json`` at it. Shards run with
  ``max_restarts``; a restarted shard reloads that snapshot (what it took in
  since is lost). While a shard is down, sampling goes on over the live
  shards, ``P(i) = leaf_i / T_live``: exact over what can be drawn; ``len``
  and ``total_priority`` count live shards only. A whole node lost (run with
  ``ray.cluster_utils.Cluster`` on one machine, not on real machines yet):
  its shards restart on the remaining nodes from ``recovery_dir``, which
  must be storage every node reaches.

The coordinator is ``bigper.distributed.ray`` (its keywords checked in
``_options``); the shard actor ``_shard`` and its placement ``_placement``;
writers ``_writer`` and where their chunks go ``_routing``; one sample call
``_draw`` and the arithmetic of draws and batches ``_sampling``; liveness and
update routing ``_shardset`` (updates checked and split by shard in
``_updates``); sharded snapshots ``_manifest``.
"""

try:
    import ray as _ray  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "bigper.distributed needs Ray, which is not installed; "
        "install the extra: in a bigper checkout, pip install -e '.[ray]' (from an index: "
        "pip install 'bigper[ray]')") from _exc

from .ray import ShardedPrioritizedBuffer
from ._writer import ShardWriter

__all__ = ["ShardedPrioritizedBuffer", "ShardWriter"]
