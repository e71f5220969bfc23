"""Workload "ray": the sharded buffer on a local Ray cluster, next to one local buffer.

Transitions are Ape-X-sized vectors (obs and next_obs of 64 float32, action,
reward; about 530 bytes). For 1, 2 and 4 shards, on one Ray cluster that this
script starts (``--cpus``, default 2) and stops:

- **inserts/s from 2 writer actors**: each calls ``writer.add`` once per step
  (the writer handle batches steps into chunks of ``--chunk`` and sends them
  round robin), then ``flush``; the rate is all steps over the wall time from
  the first start to the last flush.
- **samples/s at the learner**: ``sample(256)`` + ``update_priorities`` rounds
  on a full buffer, for ``fresh_totals=True`` (exact: a totals round trip,
  then the sample round trip) and ``False`` (pipelined: one round trip).
- **both at once**: the 2 writers add while the learner samples (exact mode).

Then a multi-node run simulated on this machine (``ray.cluster_utils.Cluster``:
a head and ``N - 1`` more raylet nodes of 1 CPU each, ``--nodes``, default
2 and 4), one shard a node placed ``SPREAD``: samples/s at the learner on a
full buffer, then a snapshot, and the time from ``cluster.remove_node`` of a
node holding a shard to that shard answering again (restarted on another
node from the snapshot), with the samples/s the learner kept meanwhile.
The nodes share this machine's cores: it measures the protocol, not a
network or more hardware.

Next to it, the same work on one local ``PrioritizedReplayBuffer`` in the
driver: ``add`` per step, and sample + update rounds. Ratios are taken in
the same run; absolute numbers depend on the machine and its load.

Usage::

    python tools/bench.py ray [--quick] [--shards 1,2,4] [--cpus 2] [--nodes 2,4]

Prints a table and, last, one JSON line ``{"bench": "ray", ...}``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from benchkit import REPO_ROOT as _REPO_ROOT, fmt as _fmt, import_bigper as _import_bigper  # noqa: I001
from benchkit import print_header, print_table, versions

OBS = 64
BATCH = 256


def fields():
    return {"obs": ((OBS,), np.float32), "action": ((), np.int64), "reward": ((), np.float32)}


def steps(n: int, seed: int) -> dict:
    """``n`` steps of random transitions, an episode end every 500."""
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((n + 1, OBS)).astype(np.float32)
    return {"obs": obs[:-1], "next_obs": obs[1:], "action": rng.integers(0, 18, n),
            "reward": rng.standard_normal(n).astype(np.float32),
            "terminated": (np.arange(n) % 500) == 499}


class _WriterActor:
    """A Ray actor that adds pregenerated steps one at a time, like an env loop."""

    def __init__(self, n: int, seed: int):
        self.d = steps(n, seed)
        self.n = n

    def write(self, writer, n: int | None = None) -> tuple:
        d, t0 = self.d, time.time()
        obs, nxt, act, rew, term = d["obs"], d["next_obs"], d["action"], d["reward"], d["terminated"]
        for i in range(self.n if n is None else n):
            writer.add(obs=obs[i], next_obs=nxt[i], action=act[i], reward=rew[i], terminated=term[i])
        writer.flush()
        return t0, time.time()


def _rounds(buf, secs: float, seed: int = 0) -> tuple[float, int]:
    """sample(BATCH) + update rounds for about ``secs``: (rounds per second, rounds)."""
    rng = np.random.default_rng(seed)
    td = rng.random((64, BATCH))
    for k in range(3):  # warm: every shard compiles or loads its kernels
        buf.update_priorities(buf.sample(BATCH), td[k])
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < secs:
        buf.update_priorities(buf.sample(BATCH), td[n % 64])
        n += 1
    return n / (time.perf_counter() - t0), n


def run_local(bigper, cap: int, per_writer: int, secs: float) -> dict:
    d = steps(2 * per_writer, 1)
    buf = bigper.PrioritizedReplayBuffer(cap, fields(), seed=0)
    obs, nxt, act, rew, term = d["obs"], d["next_obs"], d["action"], d["reward"], d["terminated"]
    warm = bigper.PrioritizedReplayBuffer(16, fields(), seed=0)
    for i in range(32):  # numba loads its kernels on the first calls
        warm.add(obs=obs[i], next_obs=nxt[i], action=act[i], reward=rew[i], terminated=term[i])
    warm.close()
    t0 = time.perf_counter()
    for i in range(2 * per_writer):
        buf.add(obs=obs[i], next_obs=nxt[i], action=act[i], reward=rew[i], terminated=term[i])
    ins = 2 * per_writer / (time.perf_counter() - t0)
    fill = steps(cap, 2)
    buf.extend(fill)
    rate, n = _rounds(buf, secs)
    buf.close()
    return {"inserts_per_s": ins, "rounds_per_s": rate, "samples_per_s": rate * BATCH, "rounds": n}


def run_sharded(ray, Sharded, writers, shards: int, cap: int, per_writer: int, secs: float,
                chunk: int) -> dict:
    out = {}
    with Sharded(shards, cap, fields(), seed=0, chunk_size=chunk) as buf:
        warm = chunk * shards  # untimed: each shard and writer process loads its kernels
        ray.get([w.write.remote(buf.writer(), warm) for w in writers])
        spans = ray.get([w.write.remote(buf.writer()) for w in writers])
        out["inserts_per_s"] = 2 * per_writer / (max(s[1] for s in spans) - min(s[0] for s in spans))
        assert len(buf) == 2 * (per_writer + warm), (len(buf), 2 * (per_writer + warm))
        buf.extend(steps(cap - 2 * (per_writer + warm), 2))
        for fresh in (True, False):
            buf.fresh_totals = fresh
            rate, n = _rounds(buf, secs)
            key = "exact" if fresh else "pipelined"
            out[f"rounds_per_s_{key}"], out[f"samples_per_s_{key}"] = rate, rate * BATCH
        buf.fresh_totals = True
        # Both at once: the writers add while the learner samples.
        runs = [w.write.remote(buf.writer()) for w in writers]
        rng, n, t0 = np.random.default_rng(1), 0, time.perf_counter()
        while len(ray.wait(runs, num_returns=len(runs), timeout=0)[0]) < len(runs):
            buf.update_priorities(buf.sample(BATCH), rng.random(BATCH))
            n += 1
        dt = time.perf_counter() - t0
        spans = ray.get(runs)
        out["both_inserts_per_s"] = 2 * per_writer / (max(s[1] for s in spans) - min(s[0] for s in spans))
        out["both_samples_per_s"] = n * BATCH / dt
    return out


def run_ray(quick: bool, shard_counts: list, cpus: int, chunk: int, node_counts: list = ()) -> dict:
    bigper = _import_bigper()
    import ray
    from ray import cloudpickle

    from bigper.distributed import ShardedPrioritizedBuffer

    cap = 2**15 if quick else 2**17
    per_writer = 3000 if quick else 20000
    secs = 1.0 if quick else 3.0
    report = {"bench": "ray", "capacity": cap, "batch": BATCH, "per_writer": per_writer,
              "chunk": chunk, "cpus": cpus, "machine_cpus": os.cpu_count(), "versions": versions()}
    report["load_average"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    report["local"] = run_local(bigper, cap, per_writer, secs)
    # Workers import bigper from this checkout, and this module by value.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    t0 = time.perf_counter()
    ray.init(num_cpus=cpus, include_dashboard=False, object_store_memory=512 * 2**20,
             log_to_driver=False, configure_logging=False)
    report["ray_init_s"] = time.perf_counter() - t0
    try:
        Writer = ray.remote(num_cpus=0.1)(_WriterActor)
        writers = [Writer.remote(per_writer, 10 + k) for k in range(2)]
        ray.get([w.__ray_ready__.remote() for w in writers])
        for _ in range(50):
            ray.get(writers[0].__ray_ready__.remote())
        t0, n = time.perf_counter(), 300
        for _ in range(n):  # the floor: an empty actor call, sent and waited for
            ray.get(writers[0].__ray_ready__.remote())
        report["noop_round_trip_ms"] = (time.perf_counter() - t0) / n * 1e3
        report["sharded"] = {}
        for s in shard_counts:
            report["sharded"][str(s)] = run_sharded(ray, ShardedPrioritizedBuffer, writers, s, cap,
                                                    per_writer, secs, chunk)
    finally:
        ray.shutdown()
    if node_counts:
        report["nodes"] = run_nodes(node_counts, cap, secs, chunk)
    return report


def run_nodes(node_counts: list, cap: int, secs: float, chunk: int) -> dict:
    """Simulated multi-node runs (see the module docstring); one cluster per node count."""
    import tempfile

    import ray
    from ray.cluster_utils import Cluster

    from bigper.distributed import ShardedPrioritizedBuffer

    out = {}
    node = dict(num_cpus=1, object_store_memory=128 * 2**20)
    for n in node_counts:
        r, t0 = {}, time.perf_counter()
        cluster = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
        others = [cluster.add_node(**node) for _ in range(n - 1)]
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        cluster.wait_for_nodes()
        r["start_s"] = time.perf_counter() - t0
        try:
            with tempfile.TemporaryDirectory(prefix="bigper-bench-nodes-") as tmp, \
                    ShardedPrioritizedBuffer(n, cap, fields(), seed=0, placement="SPREAD", chunk_size=chunk,
                                             recovery_dir=tmp) as buf:
                info = buf.shard_info()
                r["distinct_nodes"] = len({i["node"] for i in info})
                buf.extend(steps(cap, 3))
                rate, rounds = _rounds(buf, secs)
                r["rounds_per_s"], r["samples_per_s"], r["rounds"] = rate, rate * BATCH, rounds
                # Shards run warm now: the learner may give up on one after 1 s.
                buf.shard_timeout_s = 1.0
                t1 = time.perf_counter()
                buf.save(os.path.join(tmp, "snap"))
                r["save_s"] = time.perf_counter() - t1
                on = {i["node"]: i["shard"] for i in info}
                victim_node = next(x for x in others if x.node_id in on)
                victim = on[victim_node.node_id]
                rng, k, t1 = np.random.default_rng(2), 0, time.perf_counter()
                cluster.remove_node(victim_node)
                r["remove_node_s"] = time.perf_counter() - t1
                back, probe, actor = None, None, buf.shard_actors[victim]
                while time.perf_counter() - t1 < 300:
                    buf.update_priorities(buf.sample(BATCH), rng.random(BATCH))
                    k += 1
                    # Ask the lost shard without waiting on it: the learner keeps sampling.
                    probe = probe or actor.info.remote()
                    if ray.wait([probe], timeout=0)[0]:
                        try:
                            i = ray.get(probe)
                        except ray.exceptions.RayActorError:
                            i = None
                        probe = None
                        if i is not None and i["epoch"]:
                            back = time.perf_counter() - t1
                            break
                r["recovery_s"] = back
                r["samples_per_s_while_down"] = k * BATCH / (time.perf_counter() - t1)
                r["restored_len"] = None if back is None else i["len"]
        finally:
            ray.shutdown()
            cluster.shutdown()
        out[str(n)] = r
    return out


def print_ray(report: dict) -> None:
    loc = report["local"]
    print(f"capacity {report['capacity']}, batch {report['batch']}, 2 writers x {report['per_writer']} "
          f"steps (add per step, chunks of {report['chunk']}), Ray cluster of {report['cpus']} CPUs "
          f"on a {report['machine_cpus']}-CPU machine (ray.init {report['ray_init_s']:.1f} s); "
          f"an empty actor call takes {report['noop_round_trip_ms']:.2f} ms here, "
          f"load average {report['load_average']}")
    rows = [["local buffer (driver)", _fmt(loc["inserts_per_s"], ",.0f"), _fmt(loc["samples_per_s"], ",.0f"),
             "-", "-", "-", f"{1e3 / loc['rounds_per_s']:.3f}"]]
    for s, r in report["sharded"].items():
        rows.append([f"{s} shard{'s' if s != '1' else ''}", _fmt(r["inserts_per_s"], ",.0f"),
                     _fmt(r["samples_per_s_exact"], ",.0f"), _fmt(r["samples_per_s_pipelined"], ",.0f"),
                     _fmt(r["both_inserts_per_s"], ",.0f"), _fmt(r["both_samples_per_s"], ",.0f"),
                     f"{1e3 / r['rounds_per_s_exact']:.3f}"])
    print_table(["", "inserts/s", "samples/s", "samples/s pipelined", "both: inserts/s", "both: samples/s",
                 "ms/round"], rows)
    print("samples/s = sample(256)+update rounds x 256; 'both': writers and learner at once (exact mode)")
    if report.get("nodes"):
        rows = []
        for n, r in report["nodes"].items():
            rec = r["recovery_s"]
            rows.append([f"{n} nodes, {n} shards", str(r["distinct_nodes"]), _fmt(r["samples_per_s"], ",.0f"),
                         f"{r['save_s']:.2f}", f"{r['remove_node_s']:.2f}",
                         "never" if rec is None else f"{rec:.2f}", _fmt(r["samples_per_s_while_down"], ",.0f")])
        print()
        print("simulated multi-node (ray.cluster_utils.Cluster on this machine, 1 CPU a node, SPREAD):")
        print_table(["", "nodes used", "samples/s", "save s", "remove_node s", "shard back after s",
                     "samples/s meanwhile"], rows)
    for s, r in report["sharded"].items():
        print(f"  {s} shard(s) vs local: inserts x{r['inserts_per_s'] / loc['inserts_per_s']:.2f}, "
              f"samples x{r['samples_per_s_exact'] / loc['samples_per_s']:.3f} (exact), "
              f"x{r['samples_per_s_pipelined'] / loc['samples_per_s']:.3f} (pipelined)")


def cmd_ray(args) -> int:
    try:
        import ray  # noqa: F401
    except ImportError:
        print("bench ray needs Ray: pip install 'bigper[ray]'", file=sys.stderr)
        return 2
    shard_counts = [int(s) for s in args.shards.split(",") if s.strip()]
    print_header("ray")
    node_counts = [int(s) for s in args.nodes.split(",") if s.strip()]
    report = run_ray(args.quick, shard_counts, args.cpus, args.chunk, node_counts)
    print_ray(report)
    print(json.dumps(report, separators=(",", ":"), default=str))
    return 0


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="smaller buffer, fewer steps and rounds")
    p.add_argument("--shards", default="1,2,4", help="comma-separated shard counts (default 1,2,4)")
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray cluster (default 2)")
    p.add_argument("--chunk", type=int, default=256, help="steps per write call (default 256)")
    p.add_argument("--nodes", default="2,4",
                   help="simulated node counts for the multi-node rows (default 2,4; '' skips them)")
    p.set_defaults(func=cmd_ray)
