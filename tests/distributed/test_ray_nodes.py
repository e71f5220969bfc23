"""A multi-node run simulated on this machine (``ray.cluster_utils.Cluster``:
a head and two more raylet nodes, each with its own CPU): shards placed
``SPREAD`` land on distinct nodes; removing a whole node while a learner
samples and writer actors add makes its shard restart on a remaining node
from the latest snapshot, sampling goes on over the live shards meanwhile,
and, counted by ids, nothing is lost but what the lost shard took in after
the snapshot."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from bigper.distributed import ShardedPrioritizedBuffer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = {"x": ((3,), np.float32), "id": ((), np.int64)}
NODE = dict(num_cpus=1, object_store_memory=80 * 2**20)


@pytest.fixture
def nodes():
    """A head and two nodes; raylets inherit PYTHONPATH, so workers import this checkout."""
    ray.shutdown()  # the local instance test_ray and test_ray_laptop share
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, before) if p)
    try:
        # Writers live on the head with the learner (resource "head"); the shards go anywhere.
        c = Cluster(initialize_head=True,
                    head_node_args=dict(NODE, include_dashboard=False, resources={"head": 4}))
        workers = [c.add_node(**NODE) for _ in range(2)]
        ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        c.wait_for_nodes()
        yield c, workers
    finally:
        ray.shutdown()
        c.shutdown()


@ray.remote(num_cpus=0)
class _Writer:
    """Adds ids ``base + i`` in slabs until told to stop; reports per-shard counts."""

    def __init__(self, writer, base: int):
        self.w, self.base, self.i, self.stop = writer, base, 0, False

    def add(self, n: int) -> int:
        for _ in range(n // 25):
            ids = np.arange(self.base + self.i, self.base + self.i + 25)
            self.w.extend({"x": np.zeros((25, 3), np.float32), "id": ids})
            self.i += 25
        self.w.flush()
        return self.i

    def stored(self) -> list:
        return list(self.w.stored)


def test_a_lost_node_restarts_its_shard_elsewhere_and_loses_only_its_new_writes(nodes, tmp_path):
    cluster, workers = nodes
    buf = ShardedPrioritizedBuffer(3, 30_000, FIELDS, alpha=1.0, eps=0.0, placement="SPREAD",
                                   chunk_size=50, recovery_dir=tmp_path / "rec")
    try:
        info = buf.shard_info()
        assert len({i["node"] for i in info}) == 3  # SPREAD: one shard a node
        writers = [_Writer.options(resources={"head": 1}).remote(buf.writer(), base)
                   for base in (0, 1_000_000)]
        ray.get([w.add.remote(600) for w in writers])
        buf.save(tmp_path / "snap")  # what a restarted shard comes back with
        at_snapshot = ray.get([w.stored.remote() for w in writers])
        snap_ids = set(range(600)) | set(range(1_000_000, 1_000_600))

        by_node = {i["node"]: i["shard"] for i in info}
        victim_node = next(n for n in workers if n.node_id in by_node)
        victim = by_node[victim_node.node_id]
        lo, hi = buf.shard_offsets[victim], buf.shard_offsets[victim + 1]

        runs = [w.add.remote(1500) for w in writers]  # writers add while the node goes
        rng = np.random.default_rng(0)
        for _ in range(3):
            buf.update_priorities(b := buf.sample(64), rng.uniform(0.5, 2.0, 64))
        buf.shard_timeout_s = 1.0  # warm shards: the learner gives up on one after 1 s
        t0 = time.monotonic()
        cluster.remove_node(victim_node)
        samples_while_down, back, probe, longest = 0, None, None, 0.0
        while time.monotonic() - t0 < 120:
            t = time.monotonic()
            b = buf.sample(64)  # never fails: the live shards answer
            longest = max(longest, time.monotonic() - t)
            buf.update_priorities(b, rng.uniform(0.5, 2.0, 64))
            samples_while_down += 1
            # Ask the lost shard without waiting on it (shard_info would wait).
            probe = probe or buf.shard_actors[victim].info.remote()
            if ray.wait([probe], timeout=0)[0]:
                try:
                    i = ray.get(probe)
                except ray.exceptions.RayActorError:
                    i = None
                probe = None
                if i is not None and i["epoch"]:
                    back = time.monotonic() - t0
                    break
        assert back is not None, "the lost shard never came back"
        assert i["restored_from"] == str(tmp_path / "snap" / f"shard-{victim}")
        assert i["node"] != victim_node.node_id
        # The learner waited on the lost shard at most once, for about shard_timeout_s
        # (a restarting shard holds its calls), then drew from the live ones.
        assert longest < 1.0 + 3.0
        assert samples_while_down >= 1 and (back < longest + 3.0 or samples_while_down > 3)
        buf.shard_timeout_s = 120.0  # the counting below needs every shard: on a loaded machine one may take > 10 s
        total = sum(ray.get(runs))
        assert total == 2 * 2100
        stored = np.array(ray.get([w.stored.remote() for w in writers])).sum(axis=0)

        # Count by ids: with equal leaves of 1.0 a stratified batch of len(buf)
        # draws visits every held slot once.
        info = buf.shard_info()
        idx = np.concatenate([buf.shard_offsets[k] + np.arange(x["len"]) for k, x in enumerate(info)])
        buf.update_priorities(idx, np.ones(idx.shape[0]))
        batch = buf.sample(idx.shape[0])
        held, where = batch["id"], batch.indices
        assert np.unique(held).shape[0] == held.shape[0]  # nothing twice
        written = set(range(2100)) | set(range(1_000_000, 1_002_100))
        lost = written - set(held.tolist())
        assert snap_ids <= set(held.tolist())  # the snapshot's rows all came back
        for k, x in enumerate(info):  # surviving shards kept every row they acknowledged
            if k != victim:
                assert x["len"] == stored[k]
        # The lost rows are the victim's post-snapshot writes: no more than it acknowledged
        # between the snapshot and its restart, none of them in the snapshot.
        victim_since = stored[victim] - np.array(at_snapshot).sum(axis=0)[victim]
        assert len(lost) <= victim_since
        assert not (lost & snap_ids)
        on_victim = held[(where >= lo) & (where < hi)]
        assert info[victim]["len"] == on_victim.shape[0]
        assert len(lost) + info[victim]["len"] == stored[victim]  # each acknowledged row: held or lost
    finally:
        buf.close()
