"""Side-by-side benchmarks of bigper against other replay buffers.

Every workload runs bigper and the installed peers (cpprb, Tianshou, TorchRL)
on the same data in one process and reports times plus ratios
``peer time / bigper time``. Absolute numbers move with the machine and its
load; ratios taken in the same run are what the targets in DESIGN.md use.

Usage::

    python tools/bench.py tree [--quick] [--libs bigper,cpprb]

Each workload prints a table and, last, one JSON line with every number
(``{"bench": "<workload>", ...}``). A peer that is not installed is reported as
such; a library that fails (bigper while it is being written, say) is reported
with its error and the others still run.

Layout: shared helpers (versions, timing, table), then one section per
workload (its data, one small adapter per library, its ``run_*`` function),
then the command line. To add a workload, add a section and a subparser;
when this file grows past a few workloads, move each section to its own
``tools/bench_<workload>.py`` and keep this file as the command line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable

import numpy as np

ALL_LIBS = ("bigper", "cpprb", "tianshou", "torchrl")
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Versions of the interpreter and libraries, read without importing the peers."""
    import numba

    out: dict[str, str | None] = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
    }
    for dist in ("bigper", "cpprb", "tianshou", "torchrl", "tensordict", "torch"):
        out[dist] = _dist_version(dist)
    return out


def _import_bigper():
    """Import bigper, preferring the checkout this script lives in."""
    if _REPO_ROOT not in sys.path:
        sys.path.insert(0, _REPO_ROOT)
    import bigper

    return bigper


def print_header(title: str) -> dict[str, str | None]:
    v = versions()
    libs = ", ".join(f"{k} {v[k] or 'not installed'}" for k in ("cpprb", "tianshou", "torchrl", "tensordict", "torch"))
    print(f"== bench {title} ==")
    print(f"python {v['python']}, numpy {v['numpy']}, numba {v['numba']}")
    print(f"peers: {libs}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, {platform.platform()}")
    return v


def time_blocks(fn: Callable[[int], None], n: int) -> float:
    """Seconds per call of ``fn(i)`` for ``i in range(n)``, with the GC off."""
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        return (time.perf_counter() - t0) / n
    finally:
        if gc_was_on:
            gc.enable()


def interleaved_blocks(
    fns: dict[str, Callable[[int], None]], n: int, repeats: int, warmup: int
) -> dict[str, list[float]]:
    """Time ``repeats`` blocks of ``n`` calls for every function, interleaved.

    The order of the functions rotates each repeat, so slow drifts of the
    machine (another process, thermal state) spread over all libraries instead
    of landing on one. Returns the per-call seconds of every block.
    """
    names = list(fns)
    for name in names:
        for i in range(warmup):
            fns[name](i)
    blocks: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            blocks[name].append(time_blocks(fns[name], n))
    return blocks


def ratio(peer: float | None, ours: float | None) -> float | None:
    if peer is None or ours is None or ours <= 0:
        return None
    return peer / ours


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    """Print ``rows`` under ``headers``: first column left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(line(headers))
    print(line(["-" * w for w in widths]))
    for r in rows:
        print(line(r))


class PeerUnavailable(Exception):
    """A peer is installed but cannot run here (a broken compiled extension, say)."""


def _short_error(exc: BaseException) -> str:
    msg = f"{type(exc).__name__}: {exc}"
    return msg if len(msg) <= 200 else msg[:197] + "..."


# ---------------------------------------------------------------------------
# Workload "tree": capacity 2**20, sample + IS weights + gather + update
# ---------------------------------------------------------------------------
#
# Every library gets the same 2**20 transitions (obs (4,) f32, action i64,
# reward f32, next_obs (4,) f32, terminated bool) through its bulk add, then
# the same random priorities |N(0,1)| + 0.01 on all slots through its bulk
# priority update. A round is: sample B transitions with their IS weights and
# data, then update those B priorities with fresh values (precomputed, in each
# library's native type, so no round pays for random numbers or conversions
# the user would not do).

TREE_CAPACITY = 2**20
TREE_ALPHA = 0.6
TREE_BETA = 0.4
TREE_BATCHES = (32, 256)
TREE_POOL = 64  # precomputed priority arrays per batch size, used in turn


@dataclass
class TreeSubject:
    """One library, filled and ready: the calls the tree workload times.

    ``make_round(B)`` returns ``round(i)``: one sample of B plus one update of
    the sampled priorities (the i-th precomputed array). ``bulk_update(p)``
    sets all ``capacity`` priorities at once. ``probe(B)`` samples once and
    returns ``(indices, weights)`` as numpy arrays, for the sanity checks.
    """

    name: str
    version: str | None
    api: str
    fill_s: float
    length: int
    make_round: Callable[[int], Callable[[int], None]]
    bulk_update: Callable[[np.ndarray], None]
    probe: Callable[[int], tuple[np.ndarray, np.ndarray]]
    notes: list[str] = field(default_factory=list)


def tree_data(capacity: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((capacity, 4), dtype=np.float32)
    terminated = rng.random(capacity) < 0.01
    return {
        "obs": obs,
        "action": rng.integers(0, 18, capacity, dtype=np.int64),
        "reward": rng.standard_normal(capacity, dtype=np.float32),
        "next_obs": obs + np.float32(0.01),
        "terminated": terminated,
        "truncated": np.zeros(capacity, dtype=bool),
        "done": terminated.copy(),
    }


def tree_priorities(n: int, seed: int) -> np.ndarray:
    return np.abs(np.random.default_rng(seed).standard_normal(n)) + 0.01


def _td_pool(batch: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 + batch)
    return [np.abs(rng.standard_normal(batch)) + 0.01 for _ in range(TREE_POOL)]


# -- bigper -------------------------------------------------------------------


def _tree_bigper(data: dict[str, np.ndarray], p0: np.ndarray) -> TreeSubject:
    bigper = _import_bigper()
    cap = len(p0)
    buf = bigper.PrioritizedReplayBuffer(
        capacity=cap,
        fields={"obs": ((4,), np.float32), "action": ((), np.int64), "reward": ((), np.float32)},
        alpha=TREE_ALPHA,
        beta=TREE_BETA,
        seed=0,
    )
    t0 = time.perf_counter()
    buf.extend(
        {k: data[k] for k in ("obs", "action", "reward", "next_obs", "terminated")},
        priorities=None,
    )
    fill_s = time.perf_counter() - t0
    all_idx = np.arange(cap)
    buf.update_priorities(all_idx, p0)

    def make_round(batch: int) -> Callable[[int], None]:
        pool = _td_pool(batch)

        def rnd(i: int) -> None:
            b = buf.sample(batch)
            buf.update_priorities(b, pool[i % TREE_POOL])

        return rnd

    def probe(batch: int) -> tuple[np.ndarray, np.ndarray]:
        b = buf.sample(batch)
        return np.array(b.indices), np.array(b.weights)

    return TreeSubject(
        name="bigper",
        version=getattr(bigper, "__version__", None) or _dist_version("bigper") or "checkout",
        api="PrioritizedReplayBuffer.sample / update_priorities(batch, td)",
        fill_s=fill_s,
        length=len(buf),
        make_round=make_round,
        bulk_update=lambda p: buf.update_priorities(all_idx, p),
        probe=probe,
    )


# -- cpprb --------------------------------------------------------------------


def _tree_cpprb(data: dict[str, np.ndarray], p0: np.ndarray) -> TreeSubject:
    import cpprb

    cap = len(p0)
    buf = cpprb.PrioritizedReplayBuffer(
        cap,
        {
            "obs": {"shape": 4, "dtype": np.float32},
            "action": {"dtype": np.int64},
            "reward": {"dtype": np.float32},
            "next_obs": {"shape": 4, "dtype": np.float32},
            "done": {"dtype": np.bool_},
        },
        alpha=TREE_ALPHA,
    )
    t0 = time.perf_counter()
    buf.add(
        obs=data["obs"],
        action=data["action"],
        reward=data["reward"],
        next_obs=data["next_obs"],
        done=data["terminated"],
    )
    fill_s = time.perf_counter() - t0
    all_idx = np.arange(cap)
    buf.update_priorities(all_idx, p0)

    def make_round(batch: int) -> Callable[[int], None]:
        pool = _td_pool(batch)

        def rnd(i: int) -> None:
            s = buf.sample(batch, beta=TREE_BETA)
            buf.update_priorities(s["indexes"], pool[i % TREE_POOL])

        return rnd

    def probe(batch: int) -> tuple[np.ndarray, np.ndarray]:
        s = buf.sample(batch, beta=TREE_BETA)
        # copies: cpprb reuses the "indexes"/"weights" arrays on the next sample()
        return np.array(s["indexes"]), np.array(s["weights"])

    return TreeSubject(
        name="cpprb",
        version=_dist_version("cpprb"),
        api="PrioritizedReplayBuffer.sample(B, beta) / update_priorities(indexes, p)",
        fill_s=fill_s,
        length=buf.get_stored_size(),
        make_round=make_round,
        bulk_update=lambda p: buf.update_priorities(all_idx, p),
        probe=probe,
    )


# -- Tianshou -----------------------------------------------------------------


def _tree_tianshou(data: dict[str, np.ndarray], p0: np.ndarray) -> TreeSubject:
    from tianshou.data import Batch, PrioritizedReplayBuffer

    cap = len(p0)
    np.random.seed(0)  # Tianshou's prioritized sampling draws from the global RNG
    buf = PrioritizedReplayBuffer(cap, alpha=TREE_ALPHA, beta=TREE_BETA)  # compiles its kernels, ~4 s
    t0 = time.perf_counter()
    # Adding 2**20 single steps takes minutes. set_batch is Tianshou's own bulk
    # path (ReplayBuffer.from_data uses it): hand over full-size arrays, then
    # set the fill state and the new-transition weights that add() would set.
    # set_batch keeps the arrays it is given; copy them, as add() would.
    buf.set_batch(
        Batch(
            obs=data["obs"].copy(),
            act=data["action"].copy(),
            rew=data["reward"].copy(),
            terminated=data["terminated"].copy(),
            truncated=data["truncated"].copy(),
            done=data["done"].copy(),
            obs_next=data["next_obs"].copy(),
        )
    )
    buf._size = cap
    buf._insertion_idx = 0
    buf.last_index[0] = cap - 1
    all_idx = np.arange(cap)
    buf.init_weight(all_idx)
    fill_s = time.perf_counter() - t0
    buf.update_weight(all_idx, p0)

    def make_round(batch: int) -> Callable[[int], None]:
        pool = _td_pool(batch)

        def rnd(i: int) -> None:
            b, idx = buf.sample(batch)
            buf.update_weight(idx, pool[i % TREE_POOL])

        return rnd

    def probe(batch: int) -> tuple[np.ndarray, np.ndarray]:
        b, idx = buf.sample(batch)
        return np.array(idx), np.array(b.weight)

    return TreeSubject(
        name="tianshou",
        version=_dist_version("tianshou"),
        api="PrioritizedReplayBuffer.sample(B) / update_weight(idx, p); filled by set_batch",
        fill_s=fill_s,
        length=len(buf),
        make_round=make_round,
        bulk_update=lambda p: buf.update_weight(all_idx, p),
        probe=probe,
        notes=["weights normalized by the batch max (weight_norm=True default)"],
    )


# -- TorchRL ------------------------------------------------------------------


def _tree_torchrl(data: dict[str, np.ndarray], p0: np.ndarray) -> TreeSubject:
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer

    try:  # the sum/min trees live in TorchRL's C++ extension, built against one torch
        import torchrl._torchrl  # noqa: F401
    except ImportError as exc:
        raise PeerUnavailable(f"torchrl._torchrl does not load with torch {torch.__version__}: {exc}") from exc

    cap = len(p0)
    torch.manual_seed(0)
    np.random.seed(0)  # PrioritizedSampler draws from np.random when no generator is set
    buf = TensorDictPrioritizedReplayBuffer(
        alpha=TREE_ALPHA, beta=TREE_BETA, storage=LazyTensorStorage(cap), priority_key="td_error"
    )
    t0 = time.perf_counter()
    td = TensorDict(
        {
            "obs": torch.from_numpy(data["obs"]),
            "action": torch.from_numpy(data["action"]),
            "reward": torch.from_numpy(data["reward"]),
            "next_obs": torch.from_numpy(data["next_obs"]),
            "terminated": torch.from_numpy(data["terminated"]),
        },
        batch_size=[cap],
    )
    buf.extend(td)
    fill_s = time.perf_counter() - t0
    all_idx = torch.arange(cap)
    buf.update_priority(all_idx, torch.from_numpy(p0))

    def make_round(batch: int) -> Callable[[int], None]:
        pool = [torch.from_numpy(p) for p in _td_pool(batch)]

        def rnd(i: int) -> None:
            s = buf.sample(batch)
            buf.update_priority(s["index"], pool[i % TREE_POOL])

        return rnd

    def probe(batch: int) -> tuple[np.ndarray, np.ndarray]:
        s = buf.sample(batch)
        return s["index"].numpy().copy(), s["priority_weight"].numpy().copy()

    return TreeSubject(
        name="torchrl",
        version=_dist_version("torchrl"),
        api="TensorDictPrioritizedReplayBuffer(LazyTensorStorage).sample(B) / update_priority(index, p)",
        fill_s=fill_s,
        length=len(buf),
        make_round=make_round,
        bulk_update=lambda p: buf.update_priority(all_idx, torch.from_numpy(p)),
        probe=probe,
        notes=[f"torch threads {torch.get_num_threads()}"],
    )


_TREE_ADAPTERS: dict[str, Callable[[dict[str, np.ndarray], np.ndarray], TreeSubject]] = {
    "bigper": _tree_bigper,
    "cpprb": _tree_cpprb,
    "tianshou": _tree_tianshou,
    "torchrl": _tree_torchrl,
}


def _tree_check(subj: TreeSubject, p0: np.ndarray, cap: int, draws: int = 8192) -> dict[str, Any]:
    """Sanity checks before timing: full length, sane weights, right distribution.

    With priorities ``p0`` every library should sample slot ``i`` with
    probability ``~ p0[i] ** alpha``; the mean of ``p0`` over the draws must
    match its exact expectation within a few standard errors (the libraries'
    eps terms differ, which moves the expectation far less than that).
    """
    problems = []
    if subj.length != cap:
        problems.append(f"len {subj.length} != {cap}")
    idx_all, batch = [], 256
    for _ in range(draws // batch):
        idx, w = subj.probe(batch)
        if idx.shape != (batch,) or w.reshape(-1).shape != (batch,):
            problems.append(f"shapes idx {idx.shape} w {w.shape}")
            break
        if idx.min() < 0 or idx.max() >= cap:
            problems.append(f"index out of range [{idx.min()}, {idx.max()}]")
            break
        w = w.reshape(-1)
        if not np.all(np.isfinite(w)) or w.min() <= 0 or w.max() > 1 + 1e-5:
            problems.append(f"weights outside (0, 1]: [{w.min()}, {w.max()}]")
            break
        idx_all.append(idx)
    z = None
    if idx_all:
        got = p0[np.concatenate(idx_all)]
        leaf = p0**TREE_ALPHA
        expect = float((p0 * leaf).sum() / leaf.sum())
        z = float((got.mean() - expect) / (got.std() / np.sqrt(got.size)))
        if abs(z) > 5:
            problems.append(f"sampled mean priority {got.mean():.4f} vs exact {expect:.4f} (z={z:.1f})")
    return {"ok": not problems, "problems": problems, "z": z}


def run_tree(quick: bool, *, libs: tuple[str, ...] = ALL_LIBS, verbose: bool = True) -> dict:
    """Run the tree workload; return every number as a JSON-able dict.

    Parameters
    ----------
    quick : bool
        Fewer rounds and repeats (a smoke run, seconds instead of a minute).
    libs : tuple of str
        Which of ``ALL_LIBS`` to run.
    verbose : bool
        Print progress and the table.
    """
    say = print if verbose else (lambda *a, **k: None)
    cap = TREE_CAPACITY
    rounds = {32: 300, 256: 150} if quick else {32: 2000, 256: 1000}
    repeats = 3 if quick else 7
    bulk_repeats = 3 if quick else 5
    warmup = 20 if quick else 100

    data = tree_data(cap)
    p0 = tree_priorities(cap, seed=1)
    p_bulk = tree_priorities(cap, seed=2)

    results: dict[str, dict[str, Any]] = {}
    subjects: dict[str, TreeSubject] = {}
    for name in libs:
        say(f"[tree] filling {name} ...", flush=True)
        try:
            subj = _TREE_ADAPTERS[name](data, p0)
        except ImportError as exc:
            status = "import failed" if name == "bigper" else "not installed"
            results[name] = {"status": status, "error": _short_error(exc)}
            continue
        except PeerUnavailable as exc:
            results[name] = {"status": "unavailable", "error": _short_error(exc)}
            continue
        except Exception as exc:  # a library under construction must not stop the others
            results[name] = {"status": "error", "error": _short_error(exc)}
            if verbose:
                traceback.print_exc(limit=3)
            continue
        subjects[name] = subj
        results[name] = {"status": "ok", "version": subj.version, "api": subj.api,
                         "fill_s": subj.fill_s, "notes": subj.notes}

    # Bulk update, every library in turn; the last call leaves p0 in place
    # (same tree for the distribution check and the rounds).
    for name, subj in list(subjects.items()):
        try:
            subj.bulk_update(p_bulk)  # untimed: first touches, lazy allocations
            times = []
            for _ in range(bulk_repeats):
                t0 = time.perf_counter()
                subj.bulk_update(p_bulk)
                times.append(time.perf_counter() - t0)
            subj.bulk_update(p0)
            results[name]["bulk_ms"] = float(np.median(times)) * 1e3
            results[name]["bulk_ms_all"] = [t * 1e3 for t in times]
            results[name]["check"] = _tree_check(subj, p0, cap)
        except Exception as exc:
            results[name].update(status="error", error=_short_error(exc))
            subjects.pop(name)
            if verbose:
                traceback.print_exc(limit=3)

    for batch in TREE_BATCHES:
        say(f"[tree] timing batch {batch}: {repeats} blocks of {rounds[batch]} rounds ...", flush=True)
        fns = {}
        for name, subj in subjects.items():
            try:
                fns[name] = subj.make_round(batch)
                fns[name](0)  # fail here, not in the middle of the timing loop
            except Exception as exc:
                results[name].update(status="error", error=_short_error(exc))
                if verbose:
                    traceback.print_exc(limit=3)
                fns.pop(name, None)
        for name in [n for n in subjects if n not in fns]:
            subjects.pop(name)
        blocks = interleaved_blocks(fns, rounds[batch], repeats, warmup)
        for name, secs in blocks.items():
            us = [s * 1e6 for s in secs]
            results[name].setdefault("round_us", {})[str(batch)] = float(np.median(us))
            results[name].setdefault("round_us_blocks", {})[str(batch)] = us

    ours = results.get("bigper", {})
    ratios = {}
    for name, res in results.items():
        if res.get("status") != "ok" or name == "bigper":
            continue
        r = {str(b): ratio(res.get("round_us", {}).get(str(b)), ours.get("round_us", {}).get(str(b)))
             for b in TREE_BATCHES}
        r["bulk"] = ratio(res.get("bulk_ms"), ours.get("bulk_ms"))
        ratios[name] = r

    vers = versions()
    if "version" in ours:
        vers["bigper"] = ours["version"]
    return {
        "bench": "tree",
        "quick": quick,
        "capacity": cap,
        "alpha": TREE_ALPHA,
        "beta": TREE_BETA,
        "batches": list(TREE_BATCHES),
        "rounds_per_block": {str(k): v for k, v in rounds.items()},
        "blocks": repeats,
        "versions": vers,
        "ratios": ratios,  # peer time / bigper time, per batch size and for the bulk update
        "results": results,
    }


def print_tree(report: dict) -> None:
    res = report["results"]
    ours = res.get("bigper", {})
    print()
    print(f"tree: capacity 2^20, alpha {report['alpha']}, beta {report['beta']}; one round = "
          f"sample B (IS weights + data) + update B priorities")
    print(f"median of {report['blocks']} blocks, rounds per block {report['rounds_per_block']}; "
          f"ratio = peer / bigper (>1: bigper faster); fill s = the bulk add alone")
    headers = ["library", "version", "fill s"]
    for b in report["batches"]:
        headers += [f"B={b} us", "ratio"]
    headers += ["bulk 2^20 ms", "ratio", "check"]
    rows = []
    for name, r in res.items():
        if r.get("status") != "ok":
            rows.append([name, r["status"]] + [""] * (len(headers) - 2))
            continue
        row = [name, str(r.get("version")), _fmt(r.get("fill_s"), ".2f")]
        for b in report["batches"]:
            us = r.get("round_us", {}).get(str(b))
            row += [_fmt(us, ".1f"), _fmt(ratio(us, ours.get("round_us", {}).get(str(b))), ".2f")]
        row += [_fmt(r.get("bulk_ms"), ".1f"), _fmt(ratio(r.get("bulk_ms"), ours.get("bulk_ms")), ".2f")]
        chk = r.get("check", {})
        row.append("ok" if chk.get("ok") else "FAIL")
        rows.append(row)
    print_table(headers, rows)
    for name, r in res.items():
        if r.get("status") != "ok":
            print(f"  {name}: {r['status']}: {r.get('error')}")
        elif r.get("check") and not r["check"]["ok"]:
            print(f"  {name}: check failed: {'; '.join(r['check']['problems'])}")
    for name, r in res.items():
        blocks = r.get("round_us_blocks", {})
        if blocks:
            spread = ", ".join(f"B={b}: {min(v):.1f}-{max(v):.1f}" for b, v in blocks.items())
            print(f"  {name} block range us: {spread}")


def cmd_tree(args: argparse.Namespace) -> int:
    libs = _parse_libs(args.libs)
    print_header("tree")
    report = run_tree(args.quick, libs=libs)
    print_tree(report)
    print(json.dumps(report, separators=(",", ":")))
    failed = [n for n, r in report["results"].items()
              if r.get("status") in ("error", "import failed") or (r.get("check") and not r["check"]["ok"])]
    return 1 if failed else 0


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _parse_libs(text: str | None) -> tuple[str, ...]:
    if not text:
        return ALL_LIBS
    libs = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in libs if s not in ALL_LIBS]
    if unknown:
        raise SystemExit(f"--libs: unknown {unknown}, expected a subset of {list(ALL_LIBS)}")
    return libs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench", description="bigper side by side with cpprb, Tianshou and TorchRL; prints ratios."
    )
    sub = parser.add_subparsers(dest="workload", required=True, metavar="WORKLOAD")
    # offline: its own module, tools/bench_offline.py (`bigper bench` runs this file through runpy)
    if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_offline

    bench_offline.add_arguments(sub.add_parser(
        "offline", help="HDF5 datasets in place: reprioritize vs h5py streaming, sample(256) vs memmap"))

    p = sub.add_parser("tree", help="capacity 2^20: sample + IS weights + priority update, batch 32 and 256")
    p.add_argument("--quick", action="store_true", help="fewer rounds and repeats (a smoke run)")
    p.add_argument("--libs", help=f"comma-separated subset of {','.join(ALL_LIBS)}")
    p.set_defaults(func=cmd_tree)

    p = sub.add_parser("storage", help="memory vs memmap vs HDF5 on Atari-shaped data: fill, bytes, rounds")
    tools = os.path.dirname(os.path.abspath(__file__))
    if tools not in sys.path:  # `bigper bench` runs this file through runpy
        sys.path.insert(0, tools)
    import bench_storage  # its own module: tools/bench_storage.py

    bench_storage.add_arguments(p)

    p = sub.add_parser("atari", help="Atari-shaped replay, one process per library: add, sample+update, bytes")
    import bench_atari  # its own module: tools/bench_atari.py

    bench_atari.add_arguments(p)

    import bench_snapshot  # its own module: tools/bench_snapshot.py

    bench_snapshot.add_arguments(sub.add_parser(
        "snapshot", help="memmap snapshots of 100k (--million: 1M) Atari frames: first and second "
                         "snapshot, load with verification, each beside its baseline"))

    import bench_ray  # its own module: tools/bench_ray.py (needs the ray extra only to run)

    bench_ray.add_arguments(sub.add_parser(
        "ray", help="sharded buffer on a local Ray cluster: inserts/s from 2 writer actors and "
                    "samples/s at the learner for 1, 2, 4 shards, beside one local buffer"))

    # Each workload: one subparser here, its code in tools/bench_<workload>.py.
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
