"""Workload "torchrl": bigper's TorchRL drop-in beside TorchRL's own prioritized buffer.

The same TorchRL DQN-style loop on both: TensorDicts shaped as TorchRL's
collector gives them over an Atari env with ``CatFrames(N=4, dim=-3)``
(``"pixels"`` (4, 84, 84) uint8, ``("next", "pixels")``, a one-hot
``"action"``, ``("next", "reward")``, the done / terminated / truncated flags
at the root and under ``"next"``), cut from real ALE Pong frames
(``workloads.atari.data.real_frames``; ``--frames FILE.npy`` to bring them),
extended in chunks of 1,000 steps (a collector's ``frames_per_batch``); then
rounds of ``sample`` -> the learner writes ``"td_error"`` into the sample ->
``update_tensordict_priority``.

  (a) TorchRL   ``TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4,
                priority_key="td_error", storage=LazyMemmapStorage(N))``
  (b) bigper    ``bigper.integrations.torchrl.PrioritizedReplayBuffer`` with
                the same arguments plus ``frame_stack=4`` (each frame stored once)

Reported for B = 32 and 256 over ``--transitions`` (default 100k):

  sample+update   µs a round of ``sample(B)`` + ``update_tensordict_priority``
                  (median of ``--repeats`` blocks of ``--iters`` rounds; wall
                  and this process's CPU time)
  proxy share     the launch-bound proxy learner (``workloads.learner.proxy``,
                  ``--proxy-ops`` tiny torch ops an update) fed by the buffer,
                  as a share of the same learner on one batch reused (its
                  ceiling, measured in the same process)
  bytes/transition  blocks on disk of the memmap folder / transitions held
  resume after kill -9  a process fills ``--resume-transitions``, trains a
                  few rounds, ``dumps``, draws one more batch, prints it, goes
                  on writing and sampling and is killed with SIGKILL; a fresh
                  process builds the buffer again, ``loads`` the dump and
                  draws: the same indices, weights and rows (exact), and the
                  same priorities on every slot? TorchRL gets a seeded
                  ``generator=`` (its ``dumps`` saves a generator's state;
                  without one it draws from torch's global RNG, which no dump holds).

Each side runs in a process of its own. TorchRL's prioritized buffer needs its
compiled extension (its sum trees), which does not load beside the torch this
project installs (2.13.0): its side runs in a venv of its own
(``--torchrl-python``, default /tmp/trl-venv/bin/python) with the torch its
0.14.1 release was built for, 2.14.1 (its release notes). Make it with::

    sh tools/dev/trl_venv.sh            # /tmp/trl-venv: torch 2.14.1, torchrl 0.14.1, tensordict 0.14.3

Where that venv is missing or its extension does not load, TorchRL's side
falls back to its ``TensorDictReplayBuffer`` with the uniform
``RandomSampler`` (no sum tree; its ``update_tensordict_priority`` does
nothing) in this venv, and the JSON says why (``torchrl_error``).

``--seq-steps N`` also runs TorchRL's ``PrioritizedSliceSampler`` against
bigper's sequences (R2D2's 32 x (40 + 80) steps) at capacity N through the
``sequences`` workload's code (``workloads.sequences.main``); TorchRL's side needs the
same venv.

Usage::

    python tools/bench.py torchrl                          # 100k transitions
    python tools/bench.py torchrl --transitions 20000 --seq-steps 20000
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchkit import TOOLS_DIR
from workloads.torchrl.side import CHUNK, DEFAULT_TRL_PYTHON, K, TARGET_BYTES, TARGET_SPEED

SIDE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "side.py")  # each side's process runs it by path


def add_arguments(p):
    p.add_argument("--transitions", type=int, default=100_000, help="transitions in each buffer (default 100k)")
    p.add_argument("--batches", default="32,256", help="batch sizes (default 32,256)")
    p.add_argument("--iters", type=int, default=100, help="rounds a timed block")
    p.add_argument("--repeats", type=int, default=5, help="timed blocks per batch size (the median is reported)")
    p.add_argument("--proxy-ops", type=int, default=300, help="tiny torch ops an update of the proxy learner")
    p.add_argument("--proxy-iters", type=int, default=100, help="learner updates timed per feed")
    p.add_argument("--resume-transitions", type=int, default=5000, help="transitions in the kill -9 check (0: skip)")
    p.add_argument("--frames", default=None, help="an .npy (or .npz with 'frames') of (n, 84, 84) uint8 frames "
                                                  "(default: ALE Pong, workloads.atari.data.real_frames)")
    p.add_argument("--torchrl-python", default=DEFAULT_TRL_PYTHON,
                   help="a Python where torchrl's compiled extension loads (tools/dev/trl_venv.sh makes it)")
    p.add_argument("--seq-steps", type=int, default=0,
                   help="also PrioritizedSliceSampler vs bigper sequences at this capacity (default 0: skip)")
    p.add_argument("--seq-rounds", type=int, default=10, help="sequence rounds timed")
    p.add_argument("--dir", default=None, help="where the memmap folders go (default: a temp dir, removed)")


# -- the parent ---------------------------------------------------------------------------------------------------


def _child(py: str, what: str, cfg: dict, timeout: float = 1800) -> dict:
    r = subprocess.run([py, SIDE, what, json.dumps(cfg)], capture_output=True, text=True,
                       timeout=timeout, cwd=TOOLS_DIR)
    if r.returncode != 0:
        raise RuntimeError(_last_error(r.stderr) or f"exit {r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _last_error(stderr: str) -> str:
    """The exception line of a child's traceback (not a warning printed after it), cut to 300 characters."""
    lines = [x for x in stderr.strip().splitlines() if x.strip()]
    for x in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", x):
            return x[:300]
    return lines[-1][:300] if lines else ""


def trl_venv_error(py: str) -> str | None:
    """None when ``py`` runs TorchRL's prioritized sampler (its extension loads), else why not."""
    if not Path(py).exists():
        return f"no {py} (make it with: sh tools/dev/trl_venv.sh)"
    r = subprocess.run([py, "-c", "import torchrl._torchrl; from torchrl.data import PrioritizedSampler; "
                                  "PrioritizedSampler(8, 0.6, 0.4)"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        tail = r.stderr.strip().splitlines()
        return f"{py}: " + (tail[-1][:250] if tail else f"exit {r.returncode}")
    return None


def resume_check(py: str, lib: str, cfg: dict, tmp: Path) -> dict:
    """Writer killed with SIGKILL after its dump and one more draw; a reader loads and draws."""
    cfg = {**cfg, "lib": lib, "scratch": str(tmp / f"resume-{lib}"), "snap": str(tmp / f"snap-{lib}"),
           "snap_prio": str(tmp / f"snap-{lib}-prio.npy")}
    proc = subprocess.Popen([py, SIDE, "resume-writer", json.dumps(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=TOOLS_DIR)
    try:
        line = ""
        for line in proc.stdout:  # TorchRL logs to stdout first
            if line.startswith("after "):
                break
        if not line.startswith("after "):
            proc.kill()
            raise RuntimeError(_last_error(proc.stderr.read()) or "the writer said nothing")
        said = json.loads(line[len("after "):])
        time.sleep(0.5)  # it is writing and sampling past its dump now
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    got = _child(py, "resume-reader", cfg, timeout=600)  # TorchRL's: into a new scratch_dir if it must
    notes = {k: got[k] for k in ("same_scratch_dir", "loaded_into") if k in got}
    out = {**notes, "killed_with": "SIGKILL", "transitions": cfg["transitions"], "dumps_s": said["dumps_s"],
           "dump_bytes_per_slot": said["dump_bytes"] / (2 * cfg["transitions"]), "loads_s": got["loads_s"],
           "len_after": got["len"], "same_index": got["index"] == said["index"],
           "same_weights": got["weights"] == said["weights"], "same_rows": got["rows"] == said["rows"],
           "same_priorities": got.get("same_priorities")}
    out["exact"] = bool(out["same_index"] and out["same_weights"] and out["same_rows"]
                        and got["len"] == cfg["transitions"] and out["same_priorities"] is not False)
    return out


def sequences(args, tmp: Path, trl_ok: bool) -> dict:
    """TorchRL's PrioritizedSliceSampler against bigper's sequences (the ``sequences`` workload's code)."""
    import argparse

    import workloads.sequences.main as bs

    ns = argparse.Namespace(steps=args.seq_steps, rounds=args.seq_rounds, torchrl_python=args.torchrl_python,
                            dir=None)
    warm = argparse.Namespace(**{**vars(ns), "steps": 400, "rounds": 1})
    bs.run_bigper(warm, True, tmp / "seq-warm")
    shutil.rmtree(tmp / "seq-warm", ignore_errors=True)
    out = {"steps": args.seq_steps, "B": bs.B, "T": bs.T, "bigper": bs.run_bigper(ns, True, tmp / "seq")}
    shutil.rmtree(tmp / "seq", ignore_errors=True)
    out["torchrl"] = bs.run_torchrl(ns, tmp) if trl_ok else {"unavailable": "no venv where its extension loads"}
    return out


def _load() -> str:
    try:
        return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cpus"
    except OSError:
        return "unknown"


def main(args) -> int:
    from workloads.atari.data import real_frames
    from benchkit import fmt, print_header, print_table, say, short_error

    versions = print_header("torchrl")
    if args.frames:
        frames = np.load(args.frames)
        frames = frames["frames"] if isinstance(frames, np.lib.npyio.NpzFile) else frames
        source = f"{frames.shape[0]} frames from {args.frames}"
    else:
        frames, source = real_frames()
    print(f"data: {source}; {args.transitions:,} transitions, CatFrames-style stacks of {K}")
    tmp = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bigper-bench-torchrl-"))
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(tmp / "frames.npy", np.ascontiguousarray(frames, dtype=np.uint8))
    batches = [int(b) for b in args.batches.split(",")]
    base = {"frames": str(tmp / "frames.npy"), "transitions": args.transitions, "batches": batches,
            "iters": args.iters, "repeats": args.repeats, "proxy_ops": args.proxy_ops,
            "proxy_iters": args.proxy_iters}
    res: dict = {"bench": "torchrl", "transitions": args.transitions, "batches": batches, "versions": versions,
                 "frames": source, "extend_chunk": CHUNK, "proxy_ops": args.proxy_ops}

    err = trl_venv_error(args.torchrl_python)
    trl_py, trl_lib = (args.torchrl_python, "torchrl") if err is None else (sys.executable, "torchrl-uniform")
    if err is not None:
        res["torchrl_error"] = err + "; fell back to TensorDictReplayBuffer + RandomSampler (uniform) in this venv"
        say(f"TorchRL's prioritized buffer unavailable: {err}")
    try:
        sides = {}
        for name, py, lib in (("bigper", sys.executable, "bigper"), ("torchrl", trl_py, trl_lib)):
            say(f"{name}: filling {args.transitions:,} and timing ...")
            t0 = time.perf_counter()
            try:
                sides[name] = _child(py, "side", {**base, "lib": lib, "scratch": str(tmp / f"rb-{name}")})
            except Exception as e:  # noqa: BLE001 (reported; the other side still runs)
                sides[name] = {"error": short_error(e)}
            shutil.rmtree(tmp / f"rb-{name}", ignore_errors=True)
            say(f"  {time.perf_counter() - t0:.0f} s")
        res["sides"] = sides
        if args.resume_transitions > 0:
            rcfg = {**base, "transitions": args.resume_transitions}
            res["resume"] = {}
            runs = [("bigper", sys.executable, "bigper"), ("torchrl", trl_py, trl_lib)]
            if err is None:
                runs.append(("torchrl without generator", trl_py, "torchrl-nogen"))
            for name, py, lib in runs:
                say(f"{name}: resume after kill -9 ...")
                try:
                    res["resume"][name] = resume_check(py, lib, rcfg, tmp)
                except Exception as e:  # noqa: BLE001
                    res["resume"][name] = {"error": short_error(e)}
        if args.seq_steps > 0:
            say(f"sequences at {args.seq_steps:,} steps ...")
            try:
                res["sequences"] = sequences(args, tmp, err is None)
            except Exception as e:  # noqa: BLE001
                res["sequences"] = {"error": short_error(e)}
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)

    ours, theirs = res["sides"]["bigper"], res["sides"]["torchrl"]
    label = "TorchRL PER" if err is None else "TorchRL uniform (fallback)"
    rows = []
    ratios: dict = {}
    for b in batches:
        o = ours.get("round_us", {}).get(str(b))
        t = theirs.get("round_us", {}).get(str(b))
        oc = ours.get("round_cpu_us", {}).get(str(b))
        tc = theirs.get("round_cpu_us", {}).get(str(b))
        r = t / o if o and t else None
        rc = tc / oc if oc and tc else None
        ratios[f"sample_update_{b}"], ratios[f"sample_update_cpu_{b}"] = r, rc
        rows.append([f"sample + update_tensordict_priority, B={b} (µs wall; cpu)",
                     f"{fmt(o, ',.0f')}; {fmt(oc, ',.0f')}", f"{fmt(t, ',.0f')}; {fmt(tc, ',.0f')}",
                     f"{fmt(r, '.1f')}x; {fmt(rc, '.1f')}x", f">= {TARGET_SPEED:.0f}x"])
    for b in batches:
        po = ours.get("proxy", {}).get(str(b), {})
        pt = theirs.get("proxy", {}).get(str(b), {})
        so, st = po.get("share"), pt.get("share")
        ratios[f"proxy_share_{b}"] = so / st if so and st else None
        rows.append([f"proxy learner share of its ceiling, B={b} ({args.proxy_ops} ops)",
                     fmt(None if so is None else 100 * so, '.0f') + "%",
                     fmt(None if st is None else 100 * st, '.0f') + "%",
                     fmt(ratios[f"proxy_share_{b}"], '.2f') + "x", ""])
    bo, bt = ours.get("bytes_per_transition"), theirs.get("bytes_per_transition")
    ratios["bytes"] = bt / bo if bo and bt else None
    rows.append(["bytes on disk a transition", fmt(bo, ',.0f'), fmt(bt, ',.0f'), fmt(ratios["bytes"], '.1f') + "x",
                 f">= {TARGET_BYTES:.0f}x"])
    fo, ft = ours.get("fill_s"), theirs.get("fill_s")
    rows.append([f"fill {args.transitions:,} (extend {CHUNK} a call), s", fmt(fo, '.1f'), fmt(ft, '.1f'),
                 fmt(ft / fo if fo and ft else None, '.1f') + "x", ""])
    if "resume" in res:
        ro, rt = res["resume"]["bigper"], res["resume"]["torchrl"]

        def said(r):
            if "error" in r:
                return "error"
            if r["exact"]:
                return "exact"
            if r.get("same_priorities") and r.get("len_after") == args.resume_transitions:
                return "data back, next draw differs"
            return "not exact"
        rows.append([f"resume after kill -9 ({args.resume_transitions:,}: dumps, loads, next draw)",
                     said(ro), said(rt), "", "exact"])
        rows.append(["  dumps s; bytes in the dump a slot of capacity",
                     f"{fmt(ro.get('dumps_s'), '.2f')}; {fmt(ro.get('dump_bytes_per_slot'), ',.0f')}",
                     f"{fmt(rt.get('dumps_s'), '.2f')}; {fmt(rt.get('dump_bytes_per_slot'), ',.0f')}", "", ""])
        rn = res["resume"].get("torchrl without generator")
        if rn is not None:
            rows.append(["  TorchRL without generator= (torch's global RNG)", "", said(rn), "", ""])
        if "same_scratch_dir" in rt:
            rows.append(["  TorchRL loads into the killed run's scratch_dir", "", "refused", "", ""])
    seq = res.get("sequences")
    if seq and "bigper" in seq:
        sb, st = seq["bigper"].get("round_ms"), seq["torchrl"].get("round_ms")
        ratios["sequences"] = st / sb if sb and st else None
        rows.append([f"sequences 32 x (40+80) at {seq['steps']:,} steps, ms a sample + update",
                     fmt(sb, '.1f'), fmt(st, '.1f') if st else seq["torchrl"].get("unavailable", "-")[:40],
                     fmt(ratios["sequences"], '.1f') + "x", ">= 10x at 1M"])
    res["ratios"] = ratios
    res["load"] = _load()
    print()
    print(f"bigper: {ours.get('buffer', ours.get('error'))} (torch {ours.get('torch')})")
    print(f"TorchRL: {theirs.get('buffer', theirs.get('error'))} (torch {theirs.get('torch')}, "
          f"torchrl {theirs.get('torchrl')})")
    if "torchrl_error" in res:
        print(f"  torchrl_error: {res['torchrl_error']}")
    print_table(["", "bigper", label, "bigper's edge", "target"], rows)
    print("bigper's edge: TorchRL's time or bytes / bigper's; for the learner share, bigper's / TorchRL's. "
          f"Each side in its own process, one after the other; the machine's load: {_load()}")
    print(json.dumps(res))
    return 0
