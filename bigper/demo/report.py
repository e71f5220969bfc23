"""What ``bigper demo`` measures and shows: resident memory split as /proc
reports it, timings by name, the trace of sampled ages, the results table
and the plot of priorities and ages (``demo.py`` runs the game and the buffer)."""

from __future__ import annotations

import resource
import textwrap
import threading
from pathlib import Path

import numpy as np

from ..common.status import LIVE

NAIVE_BYTES = 2 * 4 * 84 * 84  # obs and next_obs, four 84x84 frames each, per transition


class Memory:
    """Resident memory, split as /proc reports it: ``anon`` is the process's
    own memory; ``file`` is page cache of files mapped into it (the memmap
    buffer's pages), shared with the kernel's cache and reclaimable, but
    counted in RSS while mapped."""

    def __init__(self, every_s: float = 0.1):
        self.peak_anon = self.peak_file = 0
        # A sampling thread catches short peaks (a snapshot's checksum pass)
        # that checks between phases would miss.
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(every_s,), daemon=True,
                                        name="bigper-demo-memory")
        self._thread.start()

    def _watch(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.check()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.check()

    @staticmethod
    def now() -> dict:
        out = {}
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    if k in ("RssAnon", "RssFile", "RssShmem"):
                        out[k] = int(v.split()[0]) * 1024
        except OSError:  # not Linux
            pass
        return out

    def check(self) -> None:
        m = self.now()
        self.peak_anon = max(self.peak_anon, m.get("RssAnon", 0))
        self.peak_file = max(self.peak_file, m.get("RssFile", 0) + m.get("RssShmem", 0))

    @staticmethod
    def peak_rss() -> int:
        """The kernel's high-water mark of RSS (anon + file), bytes."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Stopwatch:
    """Seconds and calls, by name. The first call of each name is kept apart
    (``first``): it loads or compiles numba kernels, which is not the steady rate."""

    def __init__(self):
        self.s: dict = {}
        self.n: dict = {}
        self.first: dict = {}

    def add(self, name: str, dt: float, n: int = 1) -> None:
        if name not in self.first:
            self.first[name] = dt
            return
        self.s[name] = self.s.get(name, 0.0) + dt
        self.n[name] = self.n.get(name, 0) + n

    def rate(self, name: str) -> float:
        return self.n.get(name, 0) / max(self.s.get(name, 0.0), 1e-12)

    def mean_us(self, name: str) -> float:
        return 1e6 * self.s.get(name, 0.0) / max(self.n.get(name, 0), 1)


class Trace:
    """What the plot needs: how many times each age was sampled, and what
    uniform sampling would have drawn in expectation."""

    def __init__(self, steps: int, batch: int):
        self.sampled = np.zeros(steps + 1, dtype=np.int64)
        self.uniform = np.zeros(steps + 2, dtype=np.float64)  # a difference array
        self.batch = batch
        self.returns: list = []
        self.episodes = 0
        self.calls = 0  # sample calls
        self.beta = None  # the beta of the last sample call

    def record(self, ages: np.ndarray, lo: int, hi: int) -> None:
        self.calls += 1
        np.add.at(self.sampled, ages, 1)
        if hi > lo:  # uniform over the sampleable ages [lo, hi)
            self.uniform[lo] += self.batch / (hi - lo)
            self.uniform[hi] -= self.batch / (hi - lo)

    def mean_return(self):
        return float(np.mean(self.returns[-10:])) if self.returns else None


def human(n: float) -> str:
    """Bytes as GB, or MB below a tenth of a GB (a short run's buffer is a few MB)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def format_table(r: dict, args) -> str:
    rows = [
        ("env steps/s (ALE + preprocessing)", f"{r['env_steps_per_s']:,.0f}"),
        ("adds/s (buffer.add)", f"{r['adds_per_s']:,.0f}"),
        (f"sample({args.batch_size}) + update_priorities, us",
         f"{r['sample_update_us']:,.0f}  ({r['sample_us']:,.0f} + {r['update_us']:,.0f})"),
        ("first sample + update (kernels load), ms", f"{r['first_sample_update_ms']:,.0f}"),
        ("learner step (tiny CPU Q-net), ms", f"{r['learner_ms']:,.1f}"),
        ("beta at the end", f"{r['beta_end']:.3f}  (0.4 -> 1.0 over the run's {r['sample_calls']:,} sample calls)"),
        ("whole loop, env steps/s", f"{r['loop_steps_per_s']:,.0f}"),
        ("disk allocated (preallocated)", f"{human(r['disk_bytes'])} for {r['capacity']:,} slots"
                                          + ("  (sized to --steps)" if r.get("capacity_sized_to_steps")
                                             and r["capacity"] == r["steps"] else "")),
        ("bytes on disk per slot allocated", f"{r['bytes_per_slot']:,.0f}  "
                                             f"(obs + next_obs stored naively: {NAIVE_BYTES:,})"),
        ("bytes on disk per transition held", f"{r['bytes_per_transition_held']:,.0f}  "
                                              f"({r['held']:,} held in {r['capacity']:,} slots)"),
        ("disk the held transitions use", f"{human(r['disk_used_bytes'])}  "
                                          f"({r['held'] / r['capacity']:.0%} of the slots)"),
        ("snapshot, s", f"{r['snapshot_s']:.2f}"),
        ("restore, s", f"{r['restore_s']:.2f}"),
        ("restored == original", f"{'yes' if r['verify_ok'] else 'NO'}: {r['verified_batches']} of "
                                 f"{args.verify_batches} batches identical (indices, weights, data)"),
    ]
    w = max(len(k) for k, _ in rows)
    title = (f"\nbigper demo: {r['steps']:,} steps of {r['game']}, {r['held']:,} transitions held "
             f"(capacity {r['capacity']:,}, {human(r['disk_bytes'])} on disk, "
             f"{r['prioritization']} prioritization)")
    line = "-" * (w + 2 + max(len(v) for _, v in rows))
    return "\n".join([title, line, *(f"{k:<{w}}  {v}" for k, v in rows), line])


def plot(buf, trace, png: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    live = np.flatnonzero(np.asarray(buf.status) == LIVE)  # sampleable slots
    keys = buf.leaves(live)
    rank = args.prioritization == "rank"
    entry = buf.shard.max_leaf
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
    pos = keys[keys > 0]
    if pos.size:
        lo, hi = pos.min(), pos.max()
        bins = np.geomspace(lo, hi * 1.0001, 60) if hi > lo * 1.01 else 20
        ax1.hist(pos, bins=bins, color="tab:blue")
        if hi > lo * 1.01:
            ax1.set_xscale("log")
        ax1.axvline(entry, color="tab:red", lw=1, ls="--", label=f"entry value {entry:.3g}")
        ax1.legend(loc="upper left")
    ax1.set_yscale("log")
    ax1.set_xlabel("stored priority |TD| (ranked: rank 1 = largest)" if rank
                   else "leaf value (|TD| + eps) ** alpha")
    ax1.set_ylabel("sampleable transitions")
    ax1.set_title(f"priority distribution ({live.size:,} sampleable transitions)")

    n = trace.sampled.shape[0]
    uniform = np.cumsum(trace.uniform)[:n]
    nb = min(60, max(1, n))
    edges = np.linspace(0, n, nb + 1).astype(np.int64)
    per = np.add.reduceat(trace.sampled, edges[:-1])
    uni = np.add.reduceat(uniform, edges[:-1])
    width = edges[1:] - edges[:-1]
    ax2.bar(edges[:-1], per / width, width=width, align="edge", color="tab:orange", alpha=0.8,
            label=f"{args.prioritization} PER (this run)")
    ax2.step(edges[:-1], uni / width, where="post", color="black", label="uniform (expected)")
    ax2.set_xlabel("age at sampling time (env steps since the transition was added)")
    ax2.set_ylabel(f"draws at that age\n(summed over the run's {trace.calls:,} sample calls)")
    ax2.set_title("how often a transition was drawn, by its age")
    ax2.legend()
    fig.suptitle(f"bigper demo: {args.game}, {args.steps:,} steps, capacity {args.capacity:,}, "
                 f"{args.prioritization} prioritization, batch {args.batch_size} every "
                 f"{args.learn_every} steps")
    what = "priority" if rank else "leaf"
    caption = "\n".join(textwrap.fill(t, 190) for t in (
        f"Left: the spike near 1 (dashed line: {entry:.3g}, what a transition added now enters with) is "
        f"the transitions not drawn since they were added. A new transition enters with the largest "
        f"{what} seen so far (1.0 until an update exceeds it) and keeps it until it is sampled; the "
        f"others hold {'|TD|' if rank else '(|TD| + eps) ** alpha'} from their last update.",
        "Right: the draws of transitions of each age, summed over every sample call of the run (per age "
        "step, averaged over the ages a bar covers). The youngest are drawn more often than uniform "
        "sampling would: they still hold the entry value. The newest 2 ages are never drawn (their "
        "3-step window is not complete yet).",
    ))
    fig.text(0.01, 0.01, caption, fontsize=8, va="bottom", ha="left")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(png, dpi=100)
    plt.close(fig)
