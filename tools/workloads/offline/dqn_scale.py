"""``python tools/bench.py offline --dqn-replay --scale``: the DQN Replay scale run (issue 43 §4).

A synthetic run of ``--checkpoints`` checkpoints of ``--slots`` slots (the
dataset's are 50 of 1,000,000) is written in the format: a pool of real ALE
frames (``--pool`` steps of random play of several games, 84x84 grayscale) is
recorded the way Dopamine records adds (``Recorder``: pads before each
episode, a ring of ``slots``), cycling through the pool, and saved
as gzip-wrapped ``.npy`` files (``--gzip-level``; the reader does not care);
``--distinct`` checkpoints are written, the others are hard links to them
(the same bytes: every checkpoint is read on its own, so the convert does all
the work it would do for distinct ones; disk and write time are saved).

Then, each step a child interpreter, so that a kill is a real ``SIGKILL``:

1. ``convert_dqn_replay`` is killed (kill -9) in the middle of the checkpoint
   after half of them finished, and run again: it resumes after the last
   finished one. Reported: the convert's transitions a second (the resumed
   run's own rate, and all transitions over both runs' wall time).
2. The converted file, opened with ``from_hdf5``: bytes a transition, and
   the sample + ``update_priorities`` round at B = 32 and 256 (median of
   200 rounds after 2,000 (``--warm-rounds``), and of the first 200), beside the same round on a one-checkpoint convert
   (``--slots`` transitions: the dataset's 1M).
3. ``reprioritize`` with a score of the index alone is killed in the middle
   and run again (it resumes from the sidecar); reported: transitions a second
   of the resumed run and over both runs.
4. Checked: the resumed convert holds every sampleable transition (as many as
   the format's rules give, each live), and sampled transitions of the
   checkpoint the kill hit and of the last one equal a reference built from the
   gzip files by the format's rules (all of them with ``--check-all``); every
   priority after the resumed reprioritize is the one its score gives.

Peak RSS: of each child (``VmHWM``, polled from ``/proc`` and read before a
kill); the rounds run in a child too, so theirs is the sampling process's own.
The share of each file in the page cache before its rounds is reported
(``mincore``): a sampled frame that is not there is a disk read.
"""

from __future__ import annotations

import gzip
import os
import resource
import time
from pathlib import Path

import numpy as np

from workloads.offline.dqn_child import child
from workloads.offline.pagecache import cached

K = 4
GAMES = ("Breakout", "Pong", "Seaquest", "MsPacman")  # the pool's default games
ALPHA, EPS = 0.6, 1e-6  # from_hdf5's defaults

CONVERT = r"""
import json, sys, time
import bigper.convert_dqn as c
save, extend, at = c.Snapshots.save, c.PrioritizedReplayBuffer.extend, [0, 0]
stop = [int(x) for x in sys.argv[3:5]] if len(sys.argv) > 4 else None  # (checkpoints done, extends into the next)
def said(self, buf, **k):
    out = save(self, buf, **k)
    at[:] = [k["metadata"]["done"], 0]
    print("saved", at[0], flush=True)
    return out
def counted(self, *a, **k):
    out = extend(self, *a, **k)
    at[1] += 1
    if stop and at == stop:  # a point in the middle of a checkpoint: the parent kills -9 here
        print("mid", flush=True)
        time.sleep(3600)
    return out
c.Snapshots.save, c.PrioritizedReplayBuffer.extend = said, counted
t0 = time.perf_counter()
r = c.convert_dqn_replay(sys.argv[1], sys.argv[2], progress=False)
r["seconds"] = time.perf_counter() - t0
r["rss_mb"] = [int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM")][0] / 1024
print("result", json.dumps(r), flush=True)
"""

SCORE = r"""
import json, sys, time
import numpy as np
import bigper
stop, past = (int(sys.argv[2]) if len(sys.argv) > 2 else None), []
def score(batch):
    if stop is not None and batch.indices[-1] >= stop:
        if past:  # the parent kills -9 here, in the middle of the pass
            print("mid", flush=True)
            time.sleep(3600)
        past.append(1)
        time.sleep(1.5)  # (so that the scores so far are committed after this batch: commit_seconds=1)
    return ((batch.indices.astype(np.int64) * 2654435761) % 1009) / 1009.0 + 0.01
with bigper.PrioritizedReplayBuffer.from_hdf5(sys.argv[1]) as ds:
    part = (ds.storage.sidecar.meta or {}).get("partial") or {}
    t0 = time.perf_counter()
    ds.reprioritize(score, batch_size=4096, progress=False, commit_seconds=1.0)
    dt = time.perf_counter() - t0
    rss = [int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM")][0] / 1024
    print("result", json.dumps({"seconds": dt, "resumed_at": int(part.get("done", 0)), "rss_mb": rss}), flush=True)
"""


ROUNDS = r"""
import json, os, sys
sys.path.insert(0, sys.argv[2])  # (tools/: the rounds below are the bench's own)
from pathlib import Path
from workloads.offline.dqn_scale import rounds
from workloads.offline.pagecache import read_through
warm = int(sys.argv[3])
r = {"round_us": rounds(Path(sys.argv[1]), warm=warm)}
r["cached_read"] = read_through(Path(sys.argv[1]))  # (then again, the whole file in the page cache)
r["round_us_read"] = rounds(Path(sys.argv[1]), warm=warm, first=False)
r["rss_mb"] = [int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM")][0] / 1024
print("result", json.dumps(r), flush=True)
"""


def expected_score(idx: np.ndarray) -> np.ndarray:
    return ((idx.astype(np.int64) * 2654435761) % 1009) / 1009.0 + 0.01


# -- the run directory ------------------------------------------------------------------
def write_npy_gz(path: Path, a: np.ndarray, level: int) -> None:
    with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", compresslevel=level, mtime=0) as g:
        np.save(g, a, allow_pickle=False)


def make_run(run: Path, slots: int, checkpoints: int, distinct: int, pool: int, level: int, games, say) -> dict:
    from tests.offline._dqn_replay_files import Recorder, play

    t0 = time.perf_counter()
    parts = [play(g, max(K + 2, pool // len(games)), seed=i) for i, g in enumerate(games)]
    frames = np.concatenate([p[0] for p in parts])
    act, rew = np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts])
    ends = np.concatenate([p[3] for p in parts])
    for p in np.cumsum([p[0].shape[0] for p in parts]) - 1:
        ends[p] = True  # each game's last step ends its episode (and the pool's wrap too)
    played = time.perf_counter() - t0
    run.mkdir(parents=True)
    rec, t, logged = Recorder(slots), 0, 0
    distinct = min(distinct, checkpoints)
    while logged < distinct:
        i = t % frames.shape[0]
        rec.add(frames[i], act[i], rew[i], ends[i])
        t += 1
        if rec.add_count % slots == slots - 1:
            arrays = {"$store$_observation": rec.obs, "$store$_action": rec.action, "$store$_reward": rec.reward,
                      "$store$_terminal": rec.terminal, "add_count": np.array(rec.add_count),
                      "invalid_range": rec.invalid_range()}
            for name, a in arrays.items():
                write_npy_gz(run / f"{name}_ckpt.{logged}.gz", a, level)
            logged += 1
    for n in range(distinct, checkpoints):
        for name in ("$store$_observation", "$store$_action", "$store$_reward", "$store$_terminal",
                     "add_count", "invalid_range"):
            os.link(run / f"{name}_ckpt.{n % distinct}.gz", run / f"{name}_ckpt.{n}.gz")
    say(f"wrote {distinct} distinct checkpoints of {slots:,} slots ({checkpoints} with links) from "
        f"{frames.shape[0]:,} frames of {', '.join(games)} in {time.perf_counter() - t0:.0f} s "
        f"(play {played:.0f} s)")
    return {"pool_frames": int(frames.shape[0]), "distinct": distinct, "write_s": round(time.perf_counter() - t0, 1)}


# -- the format's rules, restated (tests/offline/_dqn_replay_files.reference, vectorized) ----
def _ld(run: Path, name: str, n: int) -> np.ndarray:
    with gzip.open(run / f"{name}_ckpt.{n}.gz", "rb") as g:
        return np.load(g, allow_pickle=False)


def ref_slots(run: Path, n: int) -> dict:
    """Slot of each sampleable transition of checkpoint ``n`` in the order added, and the small arrays."""
    term, inv = _ld(run, "$store$_terminal", n), _ld(run, "invalid_range", n)
    add_count, c = int(_ld(run, "add_count", n)), term.shape[0]
    h, cur, full = inv.shape[0] - K, add_count % c, add_count >= c
    order = (cur + np.arange(c)) % c if full else np.arange(add_count)
    ok = np.ones(order.shape[0], bool) if full else (order >= K - 1) & (order < cur - h)
    ok &= ~np.isin(order, inv.astype(np.int64) % c)
    for j in range(1, K):
        ok &= term[(order - j) % c] == 0
    return {"slots": order[ok], "terminal": term, "action": _ld(run, "$store$_action", n),
            "reward": _ld(run, "$store$_reward", n), "c": c}


def read_frames(run: Path, n: int, want: np.ndarray, shape=(84, 84)) -> dict:
    """Frames at the sorted slots ``want`` of checkpoint ``n``, streamed (never the whole array)."""
    row = shape[0] * shape[1]
    out = {}
    with gzip.open(run / f"$store$_observation_ckpt.{n}.gz", "rb") as g:
        np.lib.format.read_magic(g)
        np.lib.format.read_array_header_1_0(g)
        at = 0
        for s in np.unique(want):
            g.seek(g.tell() + (int(s) - at) * row)
            out[int(s)] = np.frombuffer(g.read(row), np.uint8).reshape(shape)
            at = int(s) + 1
    return out


def references(run: Path) -> list:
    """``(first buffer index, ref_slots, checkpoint)`` of each checkpoint (links read once)."""
    base, refs, n = [], {}, 0
    for ck in range(len(list(run.glob("add_count_ckpt.*.gz")))):
        ident = os.stat(run / f"add_count_ckpt.{ck}.gz").st_ino
        if ident not in refs:
            refs[ident] = ref_slots(run, ck)
        base.append((n, refs[ident], ck))
        n += refs[ident]["slots"].shape[0]
    return base


def check_convert(dst: Path, run: Path, cks: list, sample: int, check_all: bool, rng) -> dict:
    """Every transition there and live; sampled ones (all with ``check_all``) of the checkpoints
    in ``cks`` equal to the reference."""
    import bigper

    base = references(run)
    n = base[-1][0] + base[-1][1]["slots"].shape[0]
    checked = 0
    with bigper.PrioritizedReplayBuffer.from_hdf5(dst) as ds:
        assert len(ds) == n, f"{len(ds):,} transitions, the format's rules give {n:,}"
        live = np.flatnonzero(ds.status == 1)
        assert live.shape[0] == n and live[-1] == n - 1, "not every transition is live, in order"
        for b0, ref, ck in (base[i] for i in sorted(set(cks))):
            m = ref["slots"].shape[0]
            pick = np.arange(m) if check_all else np.sort(rng.choice(m, min(sample, m), replace=False))
            for lo in range(0, pick.shape[0], 4096):
                p = pick[lo:lo + 4096]
                s, c = ref["slots"][p], ref["c"]
                need = (s[:, None] + np.arange(-K + 1, 2)[None, :]) % c
                fr = read_frames(run, ck, need.reshape(-1))
                got = ds.gather(b0 + p)
                for name, off in (("obs", 0), ("next_obs", 1)):
                    want = np.stack([np.stack([fr[int(x)] for x in row]) for row in need[:, off:off + K]])
                    assert np.array_equal(got[name], want), f"checkpoint {ck}: {name} differs"
                assert np.array_equal(got["action"], ref["action"][s]), f"checkpoint {ck}: action differs"
                assert np.array_equal(got["reward"], ref["reward"][s]), f"checkpoint {ck}: reward differs"
                assert np.array_equal(got["terminated"], ref["terminal"][s] != 0), f"checkpoint {ck}: terminal"
                checked += p.shape[0]
    return {"transitions": n, "checked": checked}


# -- children -----------------------------------------------------------------------------
def rounds(dst: Path, batches=(32, 256), warm: int = 2000, iters: int = 200, seed: int = 0,
           first: bool = True) -> dict:
    """Median sample + update round (us) at each batch size, ``iters`` rounds after
    ``warm`` (a learner's steady state: the pages of a 50M tree that sampling
    touches are faulted in over the first thousand rounds; a 1M tree's in a few),
    and (``first``) as ``"<B> first"`` the median of the first ``iters`` rounds
    of the first batch size (just opened)."""
    import bigper

    out = {}
    rng = np.random.default_rng(seed)
    with bigper.PrioritizedReplayBuffer.from_hdf5(dst, seed=seed) as ds:
        for k, b in enumerate(batches):
            times = []
            for i in range(warm + iters):
                t0 = time.perf_counter()
                batch = ds.sample(b)
                ds.update_priorities(batch, rng.random(b) + 0.01)
                times.append(time.perf_counter() - t0)
            out[str(b)] = round(float(np.median(times[warm:])) * 1e6, 1)
            if k == 0 and first:
                out[f"{b} first"] = round(float(np.median(times[:iters])) * 1e6, 1)
    return out


def run_scale(root: Path, slots: int, checkpoints: int, *, distinct: int = 2, pool: int = 100_000,
              level: int = 1, sample: int = 2000, check_all: bool = False, games=GAMES, say=print,
              reuse: Path | None = None, warm_rounds: int = 2000) -> dict:
    if checkpoints < 2:
        raise SystemExit("--scale needs --checkpoints >= 2 (the kill lands after half of them)")
    rep: dict = {"slots": slots, "checkpoints": checkpoints, "warm_rounds": warm_rounds}
    child.peaks.clear()
    child.anon.clear()
    run, dst = reuse or root / "run", root / "out.h5"
    if reuse is None:
        rep.update(make_run(run, slots, checkpoints, distinct, pool, level, games, say))
        rep["games"] = list(games)
    else:  # (a run written before: its checkpoints must be the ones asked for)
        have = len(list(run.glob("$store$_observation_ckpt.*.gz")))
        if have != checkpoints:
            raise SystemExit(f"--run {run} holds {have} checkpoints, not --checkpoints {checkpoints}")
        rep["reused_run"] = str(run)
        say(f"converting the run written before at {run}")
    src = sum(os.stat(p).st_size for p in run.iterdir())  # (links counted as the files they stand for)
    log = open(root / "children.log", "w")
    # 1. convert, killed in the middle of the checkpoint after half of them finished, then resumed
    half = checkpoints // 2
    mid = max(1, slots // 1024 // 2)  # extends of 1,024 transitions into checkpoint `half`
    _, killed, t1, _ = child(CONVERT, run, dst, half, mid, kill_after=lambda line, el: 0.0 if line == "mid" else None,
                             log=log)
    assert killed and not dst.exists() and (root / "out.h5.partial.d").is_dir(), "the convert was not killed midway"
    say(f"convert killed (kill -9) {t1:.0f} s in, during checkpoint {half} of {checkpoints}; resuming")
    r, _, t2, _ = child(CONVERT, run, dst, log=log)
    n = r["transitions"]
    assert r["resumed_after"] == half, f"resumed after {r['resumed_after']} checkpoints, not {half}"
    done = references(run)[half][0]  # transitions of the checkpoints the resume found done
    rep["convert"] = {"transitions": n, "killed_after_s": round(t1, 1), "resumed_s": round(r["seconds"], 1),
                      "rate_resumed": round((n - done) / r["seconds"]), "rate_overall": round(n / (t1 + t2)),
                      "rss_mb": round(r["rss_mb"])}
    rep["src_bytes_per_tr"] = round(src / n, 1)
    rep["dst_bytes_per_tr"] = round(os.stat(dst).st_size / n, 1)
    rep["dst_gb"] = round(os.stat(dst).st_size / 1e9, 2)
    # 2. its check against the format's rules (the killed checkpoint and the last)
    t0 = time.perf_counter()
    rep["check"] = check_convert(dst, run, [half, checkpoints - 1], sample, check_all, np.random.default_rng(0))
    rep["check"]["seconds"] = round(time.perf_counter() - t0, 1)
    say(f"converted {n:,} transitions; {rep['check']['checked']:,} checked against the format's rules")
    # 3. reprioritize, killed midway through the pass, then resumed
    _, killed, t1, _ = child(SCORE, dst, n // 2, kill_after=lambda line, el: 0.0 if line == "mid" else None,
                             log=log)
    assert killed, "reprioritize was not killed midway"
    r, _, t2, _ = child(SCORE, dst, log=log)
    assert 0 < r["resumed_at"] < n, f"reprioritize resumed at {r['resumed_at']:,} of {n:,}"
    rep["reprioritize"] = {"killed_after_s": round(t1, 1), "resumed_at": r["resumed_at"],
                           "resumed_s": round(r["seconds"], 1),
                           "rate_resumed": round((n - r["resumed_at"]) / r["seconds"]),
                           "rate_overall": round(n / (t1 - 1.5 + t2)), "rss_mb": round(r["rss_mb"])}
    import bigper

    with bigper.PrioritizedReplayBuffer.from_hdf5(dst) as ds:
        live = np.flatnonzero(ds.status == 1)
        got, want = ds.prioritization.key_at(live), (expected_score(live) + EPS) ** ALPHA
        assert live.shape[0] == n and np.allclose(got, want, rtol=1e-9, atol=0), "priorities after the resume"
    say(f"reprioritized {n:,} (killed at {r['resumed_at']:,} scored, resumed); every priority checked")
    # 4. the sample + update round, beside a one-checkpoint convert (the 1M of the dataset's checkpoints)
    # (in a child: the RSS is the sampling process's own, not this one's with the checks' arrays)
    tools = str(Path(__file__).resolve().parents[2])
    rep["cached"] = round(cached(dst), 3)  # (a sampled frame not in the page cache is a disk read)
    r, _, _, _ = child(ROUNDS, dst, tools, warm_rounds, log=log)
    rep["round_us"], rep["round_rss_mb"] = r["round_us"], round(child.peaks[-1])
    rep["cached_read"], rep["round_us_read"] = r["cached_read"], r["round_us_read"]
    rep["round_rss_anon_mb"] = round(child.anon[-1])
    one = root / "run1"
    one.mkdir()
    for p in run.glob("*_ckpt.0.gz"):
        os.link(p, one / p.name)
    r1, _, _, _ = child(CONVERT, one, root / "one.h5", log=log)
    rep["cached_one_checkpoint"] = round(cached(root / "one.h5"), 3)
    r1r = child(ROUNDS, root / "one.h5", tools, warm_rounds, log=log)[0]
    rep["round_us_one_checkpoint"], rep["round_us_read_one_checkpoint"] = r1r["round_us"], r1r["round_us_read"]
    rep["one_checkpoint_transitions"] = r1["transitions"]
    rep["rss_anon_mb"] = {"convert": round(max(child.anon[:2])), "reprioritize": round(max(child.anon[2:4]))}
    rep["rss_mb"] = {"convert": round(max(child.peaks[:2])), "reprioritize": round(max(child.peaks[2:4])),
                     "sample_update": rep["round_rss_mb"],
                     "bench_peak": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    log.close()
    return rep


def print_scale(rep: dict) -> None:
    from benchkit import print_table

    c, p = rep["convert"], rep["reprioritize"]
    n = c["transitions"]
    ratio = {b: rep["round_us"][b] / rep["round_us_one_checkpoint"][b] for b in rep["round_us"]}
    pool = ", ".join(rep.get("games", ["the run's games"]))
    rows = [["transitions", f"{n:,} ({rep['checkpoints']} x {rep['slots']:,} slots; {pool})", "50M"],
            ["convert (resumed run), tr/s", f"{c['rate_resumed']:,}", ">= 30,000"],
            ["convert incl. kill -9 + resume, tr/s", f"{c['rate_overall']:,}", ""],
            ["bytes on disk a transition", f"{rep['dst_bytes_per_tr']} ({rep['dst_gb']} GB)",
             f"<= 300 (15 GB at 50M); gzip source {rep['src_bytes_per_tr']}"],
            ["peak RSS of the convert, MB", f"{rep['rss_mb']['convert']:,} (anonymous "
             f"{rep['rss_anon_mb']['convert']:,})", "<= 4,096"],
            ["peak RSS while sampling (from_hdf5), MB", f"{rep['rss_mb']['sample_update']:,} (anonymous "
             f"{rep['round_rss_anon_mb']:,})", "<= 4,096"]]
    rows.append(["file in the page cache before the rounds", f"{rep['cached']:.1%} (one checkpoint "
                 f"{rep['cached_one_checkpoint']:.1%})", ""])
    for b in rep["round_us"]:
        what = f"B={b.split()[0]}, the first 200" if b.endswith(" first") else f"B={b}, after {rep.get('warm_rounds', 2000):,}"
        rows.append([f"sample + update round {what}, us", f"{rep['round_us'][b]} (one checkpoint "
                     f"{rep['round_us_one_checkpoint'][b]}: {ratio[b]:.2f}x)", "<= 2x the 1M round"])
    if "round_us_read" in rep:  # (results before it was measured have none)
        rows.append(["file in the page cache after it was read once", f"{rep['cached_read']:.1%}", ""])
        for b, us in rep["round_us_read"].items():
            one = rep["round_us_read_one_checkpoint"][b]
            rows.append([f"  then the round B={b}, after {rep.get('warm_rounds', 2000):,}, us", f"{us} (one checkpoint {one}: "
                         f"{us / one:.2f}x)", "<= 2x the 1M round"])
    rows += [["reprioritize (resumed run), tr/s", f"{p['rate_resumed']:,}", ""],
             ["reprioritize incl. kill -9 + resume, tr/s", f"{p['rate_overall']:,}", ""],
             ["peak RSS of reprioritize, MB", f"{rep['rss_mb']['reprioritize']:,} (anonymous "
              f"{rep['rss_anon_mb']['reprioritize']:,})", "<= 4,096"]]
    print_table(["measure", "value", "target"], rows)
    print(f"resume after kill -9: the convert during checkpoint {rep['checkpoints'] // 2}, reprioritize after "
          f"{p['resumed_at']:,} scored; both complete: {rep['check']['checked']:,} transitions equal to the "
          "reference, every priority its score. Rates incl. kill + resume: wall time of both runs (interpreter "
          "starts included, the kill's deliberate pause not)")
