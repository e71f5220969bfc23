"""Workload "tree": capacity 2**20, sample + IS weights + gather + update.

bigper against cpprb, Tianshou and TorchRL on the same data in one process;
each library's adapter is in peers.py (tools/workloads/tree/). Blocks of rounds are
interleaved across libraries (benchkit.interleaved_blocks) and the table
gives medians and ratios ``peer time / bigper time``.

Usage::

    python tools/bench.py tree [--quick] [--libs bigper,cpprb]

Prints a table and, last, one JSON line ``{"bench": "tree", ...}``.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from typing import Any

import numpy as np

from workloads.tree.peers import (
    TREE_ADAPTERS,
    TREE_ALPHA,
    TREE_BATCHES,
    TREE_BETA,
    TREE_CAPACITY,
    TreeSubject,
    tree_data,
    tree_priorities,
)
from benchkit import PeerUnavailable, fmt, interleaved_blocks, print_header, print_table, ratio, short_error, versions

ALL_LIBS = tuple(TREE_ADAPTERS)


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
        if subj.law == "rank":  # right after a full sort: P(rank r) ~ r ** -alpha, rank 1 the largest
            leaf = np.arange(1, p0.shape[0] + 1, dtype=np.float64) ** -TREE_ALPHA
            expect = float((np.sort(p0)[::-1] * leaf).sum() / leaf.sum())
        else:
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
            subj = TREE_ADAPTERS[name](data, p0)
        except ImportError as exc:
            status = "import failed" if name == "bigper" else "not installed"
            results[name] = {"status": status, "error": short_error(exc)}
            continue
        except PeerUnavailable as exc:
            results[name] = {"status": "unavailable", "error": short_error(exc)}
            continue
        except Exception as exc:  # a library under construction must not stop the others
            results[name] = {"status": "error", "error": short_error(exc)}
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
            if subj.law == "rank":  # the full re-sort, after a bulk update shuffled the heap
                sorts = []
                for _ in range(bulk_repeats):
                    subj.bulk_update(p_bulk)
                    t0 = time.perf_counter()
                    subj.buffer.prioritization.sort()
                    sorts.append(time.perf_counter() - t0)
                results[name]["sort_ms"] = float(np.median(sorts)) * 1e3
            subj.bulk_update(p0)
            results[name]["bulk_ms"] = float(np.median(times)) * 1e3
            results[name]["bulk_ms_all"] = [t * 1e3 for t in times]
            results[name]["check"] = _tree_check(subj, p0, cap)
        except Exception as exc:
            results[name].update(status="error", error=short_error(exc))
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
                results[name].update(status="error", error=short_error(exc))
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
        row = [name, str(r.get("version")), fmt(r.get("fill_s"), ".2f")]
        for b in report["batches"]:
            us = r.get("round_us", {}).get(str(b))
            row += [fmt(us, ".1f"), fmt(ratio(us, ours.get("round_us", {}).get(str(b))), ".2f")]
        row += [fmt(r.get("bulk_ms"), ".1f"), fmt(ratio(r.get("bulk_ms"), ours.get("bulk_ms")), ".2f")]
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
        if r.get("sort_ms") is not None:
            print(f"  {name}: full re-sort of 2^20 priorities {r['sort_ms']:.1f} ms (target < 150 ms); "
                  f"rounds are within 2x of bigper proportional when the ratios above are >= 0.5")
    for name, r in res.items():
        blocks = r.get("round_us_blocks", {})
        if blocks:
            spread = ", ".join(f"B={b}: {min(v):.1f}-{max(v):.1f}" for b, v in blocks.items())
            print(f"  {name} block range us: {spread}")


def cmd_tree(args: argparse.Namespace) -> int:
    libs = parse_libs(args.libs)
    print_header("tree")
    report = run_tree(args.quick, libs=libs)
    print_tree(report)
    if not args.no_extra:
        from workloads.tree.more import print_extra, run_extra

        report["extra"] = run_extra(args.quick, sweep_max=args.sweep_max, libs=libs,
                                    plot=args.plot)
        print_extra(report["extra"])
    print(json.dumps(report, separators=(",", ":")))
    failed = [n for n, r in report["results"].items()
              if r.get("status") in ("error", "import failed") or (r.get("check") and not r["check"]["ok"])]
    return 1 if failed else 0


def parse_libs(text: str | None) -> tuple[str, ...]:
    """The ``--libs`` list: a subset of ALL_LIBS, in the order given."""
    if not text:
        return ALL_LIBS
    libs = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in libs if s not in ALL_LIBS]
    if unknown:
        raise SystemExit(f"--libs: unknown {unknown}, expected a subset of {list(ALL_LIBS)}")
    return libs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer rounds and repeats (a smoke run)")
    p.add_argument("--libs", help=f"comma-separated subset of {','.join(ALL_LIBS)}")
    p.add_argument("--sweep-max", type=int, default=22, metavar="LOG2",
                   help="largest capacity of the sweep, as a power of two (16..26; default 22)")
    # No plot unless asked: the committed figure (tools/results/bench-tree-sweep.png, the docs') changes
    # only when a maintainer writes it on purpose, never as a side effect of a run.
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="write the sweep's plot to PNG (default: none; the docs' figure is "
                        "tools/results/bench-tree-sweep.png)")
    p.add_argument("--no-extra", action="store_true",
                   help="only the 2^20 table: no capacity sweep, no first-call row")
    p.set_defaults(func=cmd_tree)
