"""Looking at a snapshot without loading it: ``verify`` and ``describe``
(``bigper verify SNAP`` and ``bigper info SNAP``)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from ..errors import BigperError, CorruptSnapshotError
from ._frames import check_frames
from ._load import _config, _state_arrays, inspect
from .manifest import check_files, read_manifest
from ..common.status import LIVE
from ..core.units import unit_class



def kind_of(cfg: dict) -> str:
    """The snapshot's prioritization (``"proportional"`` for snapshots that predate the key)."""
    kind = cfg.get("prioritization", "proportional")
    return kind if isinstance(kind, str) else "proportional"


def _gid_problems(cap: int, meta: dict, state: dict) -> list[str]:
    out = []
    gid = state.get("gid")
    count = meta.get("count")
    if gid is not None and gid.shape == (cap,):
        slots = np.flatnonzero(gid >= 0)
        if (gid[slots] % cap != slots).any():
            out.append("gid: a slot holds a transition number that does not map to it")
        if isinstance(count, int) and slots.size and gid[slots].max() >= count:
            out.append(f"gid: a transition number is >= count ({count})")
    return out


def _rank(cfg: dict):
    from ..prioritization import make

    mp = cfg.get("max_priority")
    return make("rank", cfg["capacity"], alpha=cfg["alpha"], eps=cfg["eps"],
                max_priority=np.inf if mp is None else mp, weight_norm=cfg.get("weight_norm", "global"))


def _status(body: dict, state: dict):
    """The status that says which slots hold a leaf: the transitions', or
    with sequences the items' (at their start slots)."""
    return state.get(unit_class(_config(body, "the snapshot")).status_key)  # (its config checked already)


def _rank_invariants(body: dict, state: dict) -> list[str]:
    """The rank heap's own checks: recorded state (restore validates every
    field), heap order, slot positions, ticks; and the slot numbering."""
    cfg, meta = body["config"], body["state"]["meta"]
    cap = cfg["capacity"]
    status = _status(body, state)
    if status is None or status.shape != (cap,):
        return [f"status: expected shape ({cap},), got {None if status is None else status.shape}"]
    strat = _rank(cfg)
    try:
        strat.restore(meta.get("prioritization", {}), state, status)
    except CorruptSnapshotError as e:
        return [str(e)]
    return [f"rank heap: {p}" for p in strat.check(status)] + _gid_problems(cap, meta, state)


def _invariants(body: dict, state: dict) -> list[str]:
    """Problems of the recorded bookkeeping (empty when healthy)."""
    from ..prioritization.tree import PriorityTree

    if kind_of(body["config"]) == "rank":
        return _rank_invariants(body, state)
    cap = body["config"]["capacity"]
    meta = body["state"]["meta"]
    out = []
    leaves = state.get("leaves")
    if leaves is None or leaves.shape != (cap,) or leaves.dtype != np.float64:
        return [f"leaves: expected float64 of shape ({cap},), got "
                f"{None if leaves is None else (leaves.dtype, leaves.shape)}"]
    if not np.isfinite(leaves).all() or (leaves < 0).any():
        out.append("leaves: a leaf is negative or not finite")
        return out
    status = _status(body, state)
    if status is not None and status.shape == (cap,):
        bad = np.flatnonzero((leaves > 0) & (status != LIVE))
        if bad.size:
            out.append(f"leaves: slot {bad[0]} has a priority but is not sampleable (status {status[bad[0]]})")
    out += _gid_problems(cap, meta, state)
    top = meta.get("max_leaf")
    if isinstance(top, (int, float)) and leaves.size and leaves.max() > top:
        out.append(f"max_leaf {top} is below the largest leaf {leaves.max()}")
    tree = PriorityTree(cap, track_min=body["config"].get("weight_norm") != "batch")
    tree.set_all(leaves)
    out += [f"tree: {p}" for p in tree.check()]
    recorded = body.get("summary", {}).get("total_priority")
    if isinstance(recorded, float) and tree.total != recorded:
        out.append(f"tree: rebuilt total {tree.total!r} != recorded total {recorded!r}")
    return out


def verify(snapshot) -> dict:
    """Check every file of ``snapshot`` and the invariants of its bookkeeping.

    Returns
    -------
    dict
        ``files``, ``bytes`` checked and ``problems`` (a list; empty when the
        snapshot is sound).

    Raises
    ------
    CorruptSnapshotError, IncompatibleSnapshotError
        As ``load`` would.
    """
    snap = Path(os.path.abspath(snapshot))
    problems: list[str] = []
    body, cfg, _, state = inspect(snap, problems)
    check_files(snap, [(n, r) for n, r in body["files"].items() if not n.startswith("state/")])
    if not problems:  # the state passed its checks: the tree's own invariants
        problems = _invariants(body, state)
    frames = None
    if not problems and getattr(cfg, "compression", None):  # every live compressed frame decoded
        try:
            frames = check_frames(snap, body, cfg, state)
        except BigperError as e:
            problems.append(f"compressed frames: {e}")
    return {"snapshot": str(snap), "files": len(body["files"]),
            "bytes": sum(r["size"] for r in body["files"].values()),
            "prioritization": kind_of(body["config"]), "problems": problems, "frames_checked": frames}


def _shown(v) -> bool:
    """A recorded number fit to print: an int (not a bool) a counter can reach,
    or a finite float (a 2**2000 would overflow a percentage or a format)."""
    if isinstance(v, bool):
        return False
    return (isinstance(v, int) and -(1 << 62) < v < (1 << 62)) or (isinstance(v, float) and math.isfinite(v))


def describe(snapshot) -> dict:
    """A summary of ``snapshot`` for people: config, size, fill, priorities.

    Reads the manifest and the leaf priorities only (both checked); the data
    files are not read (``verify`` does that).
    """
    snap = Path(os.path.abspath(snapshot))
    body = read_manifest(snap)
    _config(body, snap)  # a crafted config is refused here, not half-printed
    cfg, meta, summary = body["config"], body["state"]["meta"], body.get("summary", {})
    # Only what has the type and range a writer gives it is shown (the rest is untrusted noise).
    summary = {k: v for k, v in summary.items() if _shown(v)}
    meta = {k: v for k, v in meta.items() if k in ("count", "beta_step", "max_leaf") and _shown(v)}
    files = body["files"]
    shared = 0
    for name, rec in files.items():
        try:
            if os.stat(snap / name).st_nlink > 1:
                shared += rec["size"]
        except OSError:
            pass
    out = {
        "snapshot": str(snap), "format": body["format"], "bigper_version": body.get("bigper_version"),
        "created": body.get("created"), "storage": body["storage"],
        "config": cfg, "prioritization": kind_of(cfg), "len": summary.get("len"),
        "sequence": cfg.get("sequence"),
        "capacity": cfg.get("capacity"),
        "count": meta.get("count"), "beta_step": meta.get("beta_step"),
        "files": len(files), "bytes": sum(r["size"] for r in files.values()), "bytes_shared": shared,
        "arrays": {n: {"rows": r["rows"], "shape": r["shape"], "dtype": r["dtype"], "files": len(r["files"])}
                   for n, r in body["data"].items()},
    }
    if body.get("user"):
        out["user"] = {"metadata": body["user"].get("metadata"),
                       "files": {n: str(snap / m) for n, m in body["user"].get("files", {}).items()}}
    if out["prioritization"] == "rank":
        out["priorities"] = _rank_summary(body, snap, files)
        return out
    member = body["state"]["arrays"].get("leaves")
    if member is not None:
        try:
            leaves = _state_arrays({"state": {"arrays": {"leaves": member}}, "files": files}, snap)["leaves"]
        except CorruptSnapshotError as e:
            out["priorities"] = {"error": str(e)}
        else:
            nz = leaves[leaves > 0]
            out["priorities"] = {
                "total": summary.get("total_priority", float(leaves.sum())), "sampleable": int(nz.size),
                "min": float(nz.min()) if nz.size else None, "mean": float(nz.mean()) if nz.size else None,
                "max": float(nz.max()) if nz.size else None, "max_leaf": meta.get("max_leaf")}
    return out


def _rank_summary(body: dict, snap: Path, files: dict) -> dict:
    """Sampleable count, the priorities' spread and the re-sort clock of a rank
    snapshot, read from its heap (checked against its recorded counters)."""
    pm = body["state"]["meta"].get("prioritization")
    member = body["state"]["arrays"].get("rank_heap")
    if not isinstance(pm, dict) or member is None:
        return {"error": "no rank heap recorded"}
    counters = {k: pm.get(k) for k in ("n", "writes", "sort_every")}
    cap = body["config"].get("capacity")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in counters.values()) \
            or not isinstance(cap, int) or counters["n"] > cap:
        return {"error": f"rank counters not valid: {counters}"}
    try:
        heap = _state_arrays({"state": {"arrays": {"rank_heap": member}}, "files": files}, snap)["rank_heap"]
    except CorruptSnapshotError as e:
        return {"error": str(e)}
    if heap.dtype != np.int64 or heap.ndim != 2 or heap.shape[0] < counters["n"] or heap.shape[1] != 2:
        return {"error": f"rank heap of dtype {heap.dtype} and shape {heap.shape}"}
    keys = np.ascontiguousarray(heap[:counters["n"], 0]).view(np.float64)
    ok = keys[np.isfinite(keys)]
    return {"kind": "rank", "sampleable": counters["n"], "writes": counters["writes"],
            "sort_every": counters["sort_every"],
            "min": float(ok.min()) if ok.size else None, "mean": float(ok.mean()) if ok.size else None,
            "max": float(ok.max()) if ok.size else None}


def _bytes(n) -> str:
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000


def _sequence(seq) -> str:
    if not isinstance(seq, dict):
        return ""
    return (f"; items are sequences: length {seq.get('length')}, burn_in {seq.get('burn_in')}, "
            f"period {seq.get('period')}, eta {seq.get('eta')}")


def _beta(b: dict) -> str:
    if b.get("kind") == "linear":
        return f"linear {b['start']:g} -> {b['end']:g} over {b['steps']:,} samples"
    return f"{b.get('value', b)}"


def format_description(d: dict) -> str:
    """``describe``'s dict as a few lines for a terminal."""
    cfg, st = d["config"], d["storage"]
    fields = ", ".join(f"{n} {tuple(s)} {dt}" for n, (s, dt) in cfg["fields"].items())
    opts = ", ".join(f"{k} {v}" for k, v in (st.get("options") or {}).items())
    where = f" at {st['path']}" if st.get("path") else ""
    n, cap = d.get("len") or 0, d.get("capacity") or 1
    lines = [
        f"snapshot  {d['snapshot']}  (format {d['format']}, bigper {d['bigper_version']}, {d['created']})",
        f"storage   {st['kind']}{where}" + (f" ({opts})" if opts else ""),
        f"config    capacity {cap:,}; {d.get('prioritization', 'proportional')} prioritization; "
        f"fields {fields}; frame_stack {cfg.get('frame_stack')}, "
        f"n_step {cfg.get('n_step')}, gamma {cfg.get('gamma')}, alpha {cfg.get('alpha')}, "
        f"eps {cfg.get('eps')}, beta {_beta(cfg.get('beta', {}))}, weight_norm {cfg.get('weight_norm')}, "
        f"num_envs {cfg.get('num_envs')}, seed {cfg.get('seed')}" + _sequence(cfg.get("sequence")),
        f"fill      {n:,} / {cap:,} ({100 * n / cap:.1f}%); {d.get('count') or 0:,} steps added; "
        f"beta step {d.get('beta_step')}",
        f"size      {_bytes(d['bytes'])} in {d['files']:,} files"
        + (f" ({_bytes(d['bytes_shared'])} shared by hard links with other snapshots or a live buffer)"
           if d["bytes_shared"] else ""),
    ]
    p = d.get("priorities")
    if p and "error" in p:
        lines.append(f"priority  unreadable: {p['error']}")
    elif p and p.get("kind") == "rank":
        def g(v):
            return "-" if v is None else format(v, ".4g")

        lines.append(f"priority  rank: {p['sampleable']:,} sampleable, ranked by priority (min {g(p['min'])}, "
                     f"mean {g(p['mean'])}, max {g(p['max'])}); {p['writes']:,} writes since the last "
                     f"full sort (re-sorted every {p['sort_every']:,})")
    elif p:
        lines.append(f"priority  total {p['total']:.6g}; {p['sampleable']:,} sampleable; leaf min "
                     f"{p['min'] if p['min'] is None else format(p['min'], '.4g')}, mean "
                     f"{p['mean'] if p['mean'] is None else format(p['mean'], '.4g')}, max "
                     f"{p['max'] if p['max'] is None else format(p['max'], '.4g')} "
                     f"(largest ever {'?' if p['max_leaf'] is None else format(p['max_leaf'], '.4g')})")
    user = d.get("user")
    if user:
        import json

        lines.append(f"user      metadata {json.dumps(user.get('metadata'))[:200]}; files "
                     f"{', '.join(user.get('files', {})) or 'none'}")
    for name, a in d["arrays"].items():
        lines.append(f"array     {name}: {a['rows']:,} x {tuple(a['shape'])} {a['dtype']} in {a['files']} file(s)")
    return "\n".join(lines)
