"""Issue 34 attacks: a compressed log that grows by segments (no
compression_budget). Crafted snapshots and live folders claiming rows, slots
or segments the log does not hold are refused with a bigper error and
nothing changed on disk; growing under threads, in big extends, on a full
disk, through HDF5 and convert keeps every live transition exact."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper.errors import CorruptSnapshotError, IncompatibleSnapshotError
from bigper.snapshot.manifest import digest

from tests._child_batch import prepare_and_run, run_batch, selected
from tests._hostile_snapshot_cases import fingerprint, put_state, refused, resign
from tests.conftest import fill_disk
from tests.frames.test_compression import Feed, check_all_live, check_sample, make, noise
from tests import hook

ROOT = Path(__file__).resolve().parents[2]
BAD = (CorruptSnapshotError, IncompatibleSnapshotError)
SHAPE = (32, 32)  # 1 KB frames of noise: 4 a segment, so the log grows by many segments


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT)}


_PRISTINE: dict = {}


def grown(kind: str, tmp: Path, steps=100) -> tuple[Path, dict]:
    """A copy of a snapshot of a grown log (noise frames) and facts about it."""
    key = (kind, steps)
    if key not in _PRISTINE:
        import atexit
        import tempfile
        where = Path(tempfile.mkdtemp(prefix="bigper-grow-"))
        atexit.register(shutil.rmtree, where, True)  # (the session's copy: gone with it, not left in /tmp)
        buf = make(kind, where, SHAPE, k=2, capacity=30, name="live")
        Feed(noise(np.random.default_rng(0), 300, SHAPE, np.uint8), 2).run(buf, steps)
        lg = hook.log(buf)
        facts = {"S": lg.S, "slots": lg.slots, "seg_rows": lg.seg_rows, "g": lg.g, "lo": int(lg.st[2]),
                 "seg_slot": lg.seg_slot.copy(), "seg_first": lg.seg_first.copy(), "block": lg.block}
        assert lg.slots > 2 and lg.g > lg.S  # grown, and wrapped around its segment ring
        _PRISTINE[key] = (buf.save(where / "snap"), facts)
        buf.close()
    src, facts = _PRISTINE[key]
    dst = tmp / "snap"
    shutil.copytree(src, dst)
    return dst, facts


def _meta(snap: Path, **frames) -> None:
    def change(b):
        for k, v in frames.items():
            if v is None:
                b["state"]["meta"]["frames"].pop(k, None)
            else:
                b["state"]["meta"]["frames"][k] = v
    resign(snap, change)


def _log_rows(snap: Path, rows: int, facts: dict) -> None:
    """Claim ``rows`` rows of frame_log (memory snapshot: one data file, resized to match)."""
    member = "data/frame_log.bin"
    raw = (snap / member).read_bytes()
    want = rows * facts["block"]
    raw = raw[:want] + b"\0" * max(0, want - len(raw))
    os.unlink(snap / member)
    (snap / member).write_bytes(raw)

    def change(b):
        b["data"]["frame_log"]["rows"] = rows
        b["data"]["frame_log"]["chunk_rows"] = rows
        b["files"][member] = {"size": len(raw), "xxh3_64": digest(raw)}
    resign(snap, change)


def _slot(facts, change):
    s = facts["seg_slot"].copy()
    change(s, facts)
    return s


def _live(facts):
    return [g % facts["S"] for g in range(facts["lo"], facts["g"] + 1)]


# -- 1. crafted snapshots ------------------------------------------------------

LOG_ROWS = {
    "not_a_segment_multiple": lambda f: f["slots"] * f["seg_rows"] + 1,
    "one_segment_short_of_live": lambda f: (f["slots"] - 1) * f["seg_rows"],
    "one_segment": lambda f: f["seg_rows"],
    "zero": lambda f: 0,
    "over_the_most": lambda f: (f["S"] + 1) * f["seg_rows"],
    "half_a_segment": lambda f: f["seg_rows"] // 2,
}


@pytest.mark.parametrize("case", sorted(LOG_ROWS))
def test_snapshot_log_rows_refused(case, tmp_path):
    snap, facts = grown("memory", tmp_path)
    rows = LOG_ROWS[case](facts)
    if case == "one_segment_short_of_live":
        assert max(facts["seg_slot"][_live(facts)]) == facts["slots"] - 1  # the last slot is live
    _log_rows(snap, rows, facts)
    refused(BAD, snap)


def test_snapshot_log_rows_more_than_grown_but_allowed_loads_exact(tmp_path):
    """Spare (zero) segments beyond what the log used are within the rules: the load keeps them, exact."""
    snap, facts = grown("memory", tmp_path)
    _log_rows(snap, facts["S"] * facts["seg_rows"], facts)
    buf = bigper.PrioritizedReplayBuffer.load(snap)
    assert hook.log(buf).slots == facts["S"]
    buf.sample(8)
    Feed(noise(np.random.default_rng(9), 50, SHAPE, np.uint8), 2).run(buf, 60)
    buf.sample(8)
    buf.close()


SLOT_CASES = {
    "duplicate": lambda s, f: s.__setitem__(_live(f)[0], s[_live(f)[1]]),
    "negative": lambda s, f: s.__setitem__(_live(f)[0], -1),
    "huge_negative": lambda s, f: s.__setitem__(_live(f)[0], np.iinfo(np.int64).min),
    "at_S": lambda s, f: s.__setitem__(_live(f)[0], f["S"]),
    "huge": lambda s, f: s.__setitem__(_live(f)[-1], np.iinfo(np.int64).max),
    "beyond_grown": lambda s, f: s.__setitem__(_live(f)[-1], f["slots"]),
    "swapped": lambda s, f: s.__setitem__(_live(f)[:2], s[_live(f)[:2]][::-1]),
}


@pytest.mark.parametrize("kind", ["memory", "memmap"])
@pytest.mark.parametrize("case", sorted(SLOT_CASES))
def test_snapshot_seg_slot_refused(kind, case, tmp_path):
    snap, facts = grown(kind, tmp_path)
    put_state(snap, "frames_seg_slot", _slot(facts, SLOT_CASES[case]))
    refused(BAD, snap, path=None if kind == "memory" else tmp_path / "out")


BAD_ARRAYS = {
    "wrong_dtype": lambda f: f["seg_slot"].astype(np.int32),
    "float": lambda f: f["seg_slot"].astype(np.float64),
    "short": lambda f: f["seg_slot"][:-1],
    "long": lambda f: np.concatenate([f["seg_slot"], [0]]),
    "2d": lambda f: f["seg_slot"][None],
    "scalar": lambda f: np.int64(0),
}


@pytest.mark.parametrize("case", sorted(BAD_ARRAYS))
def test_snapshot_seg_slot_array_refused(case, tmp_path):
    snap, facts = grown("memory", tmp_path)
    put_state(snap, "frames_seg_slot", BAD_ARRAYS[case](facts))
    refused(BAD, snap)


def test_snapshot_seg_slot_missing_refused(tmp_path):
    snap, facts = grown("memory", tmp_path)

    def change(b):
        b["state"]["arrays"].pop("frames_seg_slot")
        b["files"].pop("state/frames_seg_slot.npy")
    os.unlink(snap / "state/frames_seg_slot.npy")
    resign(snap, change)
    refused(BAD, snap)


SEG_LO = {
    "above_g": lambda f: f["g"] + 1,
    "below_window": lambda f: f["g"] - f["S"],
    "negative": lambda f: -1,
    "huge": lambda f: 2 ** 63 - 1,
    "too_huge": lambda f: 2 ** 70,
    "float": lambda f: float(f["lo"]),
    "string": lambda f: str(f["lo"]),
    "bool": lambda f: True,
    "list": lambda f: [f["lo"]],
    "null": lambda f: None,  # (removed)
    "one_older": lambda f: f["lo"] - 1,  # claims an expired segment is still live
    "one_newer": lambda f: f["lo"] + 1,  # drops a live segment
    "g": lambda f: f["g"],
}


@pytest.mark.parametrize("case", sorted(SEG_LO))
def test_snapshot_seg_lo_refused(case, tmp_path):
    snap, facts = grown("memory", tmp_path)
    _meta(snap, seg_lo=SEG_LO[case](facts))
    refused(BAD, snap)


@pytest.mark.parametrize("seg", ["g_plus_one", "g_minus_one", "huge"])
def test_snapshot_seg_refused(seg, tmp_path):
    snap, facts = grown("memory", tmp_path)
    v = {"g_plus_one": facts["g"] + 1, "g_minus_one": facts["g"] - 1, "huge": 2 ** 62}[seg]
    _meta(snap, seg=v)
    refused(BAD, snap)


def test_snapshot_budget_config_with_grown_state_refused(tmp_path):
    """A config that says capped (a budget) over the state and data of a grown log."""
    snap, facts = grown("memory", tmp_path)
    resign(snap, lambda b: b["config"].__setitem__("compression_budget", 300))
    refused(BAD, snap)


def test_snapshot_budget_config_same_geometry_grown_state_refused(tmp_path):
    """A budget that gives the same S as the grown log's most (so the rows fit): the
    slots the state records are not the capped log's ``g % S`` ones."""
    snap, facts = grown("memory", tmp_path)
    _log_rows(snap, facts["S"] * facts["seg_rows"], facts)
    from bigper.frames.budget import log_geometry
    budget = None
    for b in range(1, 1092):
        try:
            if log_geometry(34, 1024, b)[2] == facts["S"]:
                budget = b
                break
        except Exception:
            continue
    if budget is None:
        pytest.skip("no budget gives this S")
    resign(snap, lambda b: b["config"].__setitem__("compression_budget", budget))
    before = fingerprint(snap)
    try:
        buf = bigper.PrioritizedReplayBuffer.load(snap)
    except BAD:
        assert fingerprint(snap) == before
        return
    # accepted: then it must be exact (every live transition decodes to what was added)
    fs = hook.frames(buf)
    live = np.flatnonzero(buf.status == 1)
    fs.stacks("obs_ref", live)  # raises CorruptSnapshotError at worst, never garbage
    buf.close()


def test_snapshot_capped_state_under_growing_config_refused(tmp_path):
    """A capped log's snapshot (no seg_lo, no frames_seg_slot) with its budget removed from the config."""
    buf = make("memory", tmp_path, SHAPE, k=2, capacity=30, budget=300)
    with pytest.warns(RuntimeWarning):
        Feed(noise(np.random.default_rng(0), 300, SHAPE, np.uint8), 2).run(buf, 100)
    snap = buf.save(tmp_path / "snap")
    buf.close()
    resign(snap, lambda b: b["config"].__setitem__("compression_budget", None))
    refused(BAD, snap)


# -- 2. a live memmap folder whose record and chunk files disagree -----------------

_RESUME = """
import sys, numpy as np
from pathlib import Path
from tests.frames.test_compression import make
from bigper.errors import CorruptSnapshotError, IncompatibleSnapshotError, BigperError
tmp = Path(sys.argv[1])
try:
    buf = make("memmap", tmp, (32, 32), k=2, capacity=30, name="live", mode="resume")
except BigperError as e:
    print("REFUSED", type(e).__name__, str(e)[:300]); sys.exit(0)
live = np.flatnonzero(buf.status == 1)
buf._frames.stacks("obs_ref", live); buf._frames.stacks("next_obs_ref", live)
print("OPENED", buf._frames.log.slots); buf.close()
"""


def _live_folder(tmp: Path, steps=100) -> tuple[Path, dict]:
    buf = make("memmap", tmp, SHAPE, k=2, capacity=30, name="live")
    feed = Feed(noise(np.random.default_rng(0), 300, SHAPE, np.uint8), 2)
    feed.run(buf, steps)
    lg = hook.log(buf)
    facts = {"slots": lg.slots, "seg_rows": lg.seg_rows, "S": lg.S,
             "feed": feed, "live_slots": sorted(int(x) for x in lg.seg_slot[np.arange(int(lg.st[2]), lg.g + 1) % lg.S])}
    buf.close()
    return tmp / "live", facts


def _resume(tmp: Path) -> str:
    r = subprocess.run([sys.executable, "-c", _RESUME, str(tmp)], capture_output=True, text=True, env=_env(),
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, f"resume crashed (rc {r.returncode}): {r.stderr[-2000:]}"
    return r.stdout


def _chunk(live: Path, k: int) -> Path:
    return live / "data" / ("frame_log.bin" if k == 0 else f"frame_log.{k:06d}.bin")


def _set_meta(live: Path, change) -> None:
    meta = json.loads((live / "meta.json").read_text())
    change(meta["arrays"]["frame_log"])
    (live / "meta.json").write_text(json.dumps(meta))


LIVE_CASES = {
    "live_chunk_missing": lambda live, f: _chunk(live, f["live_slots"][-1]).unlink(),
    "live_chunk_short": lambda live, f: os.truncate(_chunk(live, f["live_slots"][-1]), 100),
    "live_chunk_empty": lambda live, f: os.truncate(_chunk(live, f["live_slots"][0]), 0),
    "first_chunk_short": lambda live, f: os.truncate(_chunk(live, 0), 4000),
    "rows_claim_one_more_no_file": lambda live, f: _set_meta(
        live, lambda a: a.__setitem__("rows", a["rows"] + f["seg_rows"])),
    "rows_not_a_segment_multiple": lambda live, f: _set_meta(live, lambda a: a.__setitem__("rows", a["rows"] - 1)),
    "rows_fewer_than_live": lambda live, f: _set_meta(
        live, lambda a: a.__setitem__("rows", a["rows"] - f["seg_rows"])),
    "rows_over_the_most": lambda live, f: _set_meta(
        live, lambda a: a.__setitem__("rows", (f["S"] + 1) * f["seg_rows"])),
    "rows_zero": lambda live, f: _set_meta(live, lambda a: a.__setitem__("rows", 0)),
    "rows_negative": lambda live, f: _set_meta(live, lambda a: a.__setitem__("rows", -f["seg_rows"])),
    "chunk_rows_changed": lambda live, f: _set_meta(live, lambda a: a.__setitem__("chunk_rows", 2 * a["chunk_rows"])),
    "chunk_is_a_symlink": lambda live, f: (_chunk(live, 1).unlink(), _chunk(live, 1).symlink_to(_chunk(live, 2))),
    "chunk_is_a_fifo": lambda live, f: (_chunk(live, 1).unlink(), os.mkfifo(_chunk(live, 1))),
    "chunk_is_a_dir": lambda live, f: (_chunk(live, 1).unlink(), _chunk(live, 1).mkdir()),
}


@pytest.fixture(scope="module")
def live_cases(request, tmp_path_factory):
    """Every selected LIVE_CASES case's folder, made and broken as a case of its own, and
    what resuming it printed: one child interpreter resumes them all, each case in its own
    folder and reported apart (a child per case cost ~1.5 s of imports each)."""
    prepared, errors = {}, {}
    for case in selected(request, "test_live_folder_refused_on_resume", "case", sorted(LIVE_CASES)):
        tmp = tmp_path_factory.mktemp(f"live-{case}")
        try:
            live, facts = _live_folder(tmp)
            LIVE_CASES[case](live, facts)
            prepared[case] = (tmp, live, facts, _prints(live) if case != "chunk_is_a_fifo" else None)
        except Exception as e:  # noqa: BLE001 -- that case's test raises it
            errors[case] = e
    results = run_batch(_RESUME, {case: [tmp] for case, (tmp, *_) in prepared.items()}, env=_env(), cwd=ROOT,
                        timeout=120)
    return prepared, errors, results


@pytest.mark.parametrize("case", sorted(LIVE_CASES))
def test_live_folder_refused_on_resume(case, live_cases):
    prepared, errors, results = live_cases
    if case in errors:
        raise errors[case]
    tmp, live, facts, before = prepared[case]
    assert facts["slots"] > 3 and facts["live_slots"][-1] > 0
    r = results[case]
    assert r.returncode == 0, f"resume crashed (rc {r.returncode}, timed out {r.timed_out}): {r.stderr[-2000:]}"
    out = r.stdout
    assert out.startswith("REFUSED"), out
    if before is not None:
        assert _prints(live) == before


def _prints(live: Path) -> dict:
    out = {k: v for k, v in fingerprint(live).items() if not k.endswith("/.lock")}  # (the lock names a pid)
    out[str(live / "meta.json")] = json.loads((live / "meta.json").read_text())  # (as recorded, not its bytes)
    return out


def test_live_folder_spare_chunk_file_beyond_rows(tmp_path):
    """A stray chunk file after the recorded rows (a grow that crashed after the file, before the record)."""
    live, facts = _live_folder(tmp_path)
    extra = _chunk(live, facts["slots"])
    extra.write_bytes(b"\xff" * 4096)
    out = _resume(tmp_path)
    assert out.startswith(("OPENED", "REFUSED")), out
    if out.startswith("OPENED"):  # then it grows over it with zeros, exactly
        buf = make("memmap", tmp_path, SHAPE, k=2, capacity=30, name="live", mode="resume")
        feed = facts["feed"]
        check_all_live(buf, feed)
        feed.run(buf, 200)
        check_all_live(buf, feed)
        buf.close()


# -- 3. threads on a growing log ----------------------------------------------------

@pytest.mark.parametrize("kind", ["memmap", "memory"])
def test_threads_add_while_sample_save_update_on_a_growing_log(kind, tmp_path):
    buf = make(kind, tmp_path, SHAPE, k=2, capacity=200, name="live")
    feed = Feed(noise(np.random.default_rng(1), 900, SHAPE, np.uint8), 2, seed=1)
    feed.run(buf, 10)
    errors, stop = [], threading.Event()

    def writer():
        try:
            for _ in range(60):
                o, o2, term, g = zip(*[feed.step() for _ in range(8)])
                buf.extend({"obs": np.concatenate(o), "next_obs": np.concatenate(o2),
                            "step": np.concatenate(g), "terminated": np.concatenate(term),
                            "truncated": np.zeros(8, bool)})
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            stop.set()

    def reader():
        k = 0
        try:
            while not stop.is_set():
                b = check_sample(buf, feed, 16)
                buf.update_priorities(b, np.random.default_rng(k).random(16) + 0.1)
                if k % 10 == 0:
                    buf.save(tmp_path / f"snap{k}")
                k += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert hook.log(buf).slots > 2
    check_all_live(buf, feed)
    snaps = sorted(tmp_path.glob("snap*"))
    assert snaps
    for s in snaps[-2:]:  # each snapshot loads and decodes whatever it holds
        b2 = bigper.PrioritizedReplayBuffer.load(s, path=None if kind == "memory" else tmp_path / f"re{s.name}")
        check_all_live(b2, feed)
        b2.close()
    buf.close()


# -- 4. big extends, many segments opened at once; against an uncompressed twin -------

def _twin_run(tmp, kind, num_envs, n_step, chunks, capacity, seed):
    fields = {"obs": ((2, *SHAPE), np.uint8), "step": ((), np.int64), "reward": ((), np.float32)}
    kw = dict(capacity=capacity, fields=fields, frame_stack=2, num_envs=num_envs, n_step=n_step, seed=seed)
    z = bigper.PrioritizedReplayBuffer(compression="zstd", storage=kind,
                                       path=None if kind == "memory" else (tmp / ("z.h5" if kind == "hdf5" else "z")),
                                       **kw)
    raw = bigper.PrioritizedReplayBuffer(**kw)
    rng = np.random.default_rng(seed)
    frames = np.concatenate([noise(rng, 300, SHAPE, np.uint8), np.zeros((100, *SHAPE), np.uint8)])
    feeds = [Feed(frames, 2, seed=seed, num_envs=num_envs) for _ in range(2)]
    for n in chunks:
        for buf, feed in zip((z, raw), feeds):
            steps = [feed.step() for _ in range(n)]
            o, o2, term, g = (np.stack(x) for x in zip(*steps))
            if num_envs == 1:
                o, o2, term, g = o[:, 0], o2[:, 0], term[:, 0], g[:, 0]
            buf.extend({"obs": o, "next_obs": o2, "step": g, "reward": g.astype(np.float32),
                        "terminated": term, "truncated": np.zeros_like(term)})
        np.testing.assert_array_equal(z.status, raw.status)
    if (raw.status == 1).any():
        a, b = z.sample(32), raw.sample(32)
        for key in ("obs", "next_obs", "step", "reward"):
            np.testing.assert_array_equal(a[key], b[key])
        np.testing.assert_array_equal(a.weights, b.weights)
        assert check_all_live(z, feeds[0]) == int((raw.status == 1).sum())
    return z, raw


@pytest.mark.parametrize("kind", ["memory", "memmap", "hdf5"])
@pytest.mark.parametrize("num_envs,n_step", [(1, 1), (3, 1), (1, 3), (4, 2)])
def test_extend_many_segments_at_once_matches_raw_twin(kind, num_envs, n_step, tmp_path):
    # one extend bigger than the ring (frames beyond F overwrite within the call), then small and mid ones
    z, raw = _twin_run(tmp_path, kind, num_envs, n_step, [1, 120, 3, 57, 200, 1, 1, 64], capacity=60, seed=7)
    assert hook.log(z).slots > 4
    z.close()
    raw.close()


# -- 5. HDF5 growth; convert of frames that do not compress -------------------------

def _noise_d4rl(path: Path, n=400, k=4, seed=0):
    import h5py
    rng = np.random.default_rng(seed)
    frames = noise(rng, n + k, SHAPE, np.uint8)
    idx = np.arange(n)[:, None] + np.arange(k)[None]
    term = np.zeros(n, bool)
    term[rng.choice(n, 5, replace=False)] = True
    trunc = np.zeros(n, bool)
    trunc[-1] = True
    with h5py.File(path, "w") as f:
        f["observations"] = frames[idx]
        f["next_observations"] = frames[idx + 1]
        f["actions"] = rng.integers(0, 4, n).astype(np.int64)
        f["rewards"] = rng.random(n).astype(np.float32)
        f["terminals"], f["timeouts"] = term, trunc


def test_convert_of_frames_that_do_not_compress_keeps_every_transition(tmp_path):
    from bigper.convert import convert

    from tests.offline.test_convert import assert_same_transitions
    src, dst = tmp_path / "src.h5", tmp_path / "z.h5"
    _noise_d4rl(src)
    convert(src, dst, progress=False)
    a = assert_same_transitions(src, dst)
    assert len(a["obs"]) > 380
    with bigper.PrioritizedReplayBuffer.from_hdf5(dst) as b:
        b.sample(16)


def test_convert_cli_of_noise_frames_then_from_hdf5(tmp_path):
    from tests.offline.test_convert import assert_same_transitions, cli
    src, dst = tmp_path / "src.h5", tmp_path / "z.h5"
    _noise_d4rl(src, n=300, seed=3)
    r = cli("convert", src, dst)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_same_transitions(src, dst)


def test_hdf5_grown_log_resumes_and_goes_on_exact(tmp_path):
    path = tmp_path / "z.h5"
    buf = make("hdf5", tmp_path, SHAPE, k=2, capacity=40, name="z")
    feed = Feed(noise(np.random.default_rng(2), 500, SHAPE, np.uint8), 2, seed=2)
    feed.run(buf, 90)
    slots = hook.log(buf).slots
    assert slots > 3
    buf.close()
    buf = make("hdf5", tmp_path, SHAPE, k=2, capacity=40, name="z", mode="resume")
    assert hook.log(buf).slots == slots
    check_all_live(buf, feed)
    feed.run(buf, 200)
    check_all_live(buf, feed)
    check_sample(buf, feed, 32)
    snap = buf.save(tmp_path / "snap")
    buf.close()
    b2 = bigper.PrioritizedReplayBuffer.load(snap, path=tmp_path / "re.h5")
    check_all_live(b2, feed)
    b2.close()


# -- 6. a full disk during an extend that opens several segments ------------------------

@pytest.mark.parametrize("rows", [6, 40])
def test_full_disk_during_an_extend_that_grows_several_segments(rows, small_tmpfs):
    from tests.frames.test_hostile_compression import _full_fingerprint
    from tests.buffer.test_validation import assert_same

    live = small_tmpfs / "live"
    kw = dict(capacity=150, fields={"obs": ((2, *SHAPE), np.uint8), "step": ((), np.int64)}, frame_stack=2,
              storage="memmap", path=live, compression="zstd", seed=0)
    buf = bigper.PrioritizedReplayBuffer(**kw)
    feed = Feed(noise(np.random.default_rng(5), 600, SHAPE, np.uint8), 2, seed=5)
    feed.run(buf, 5)
    filler = small_tmpfs / "filler"
    fill_disk(filler)
    failed = False
    for _ in range(30):
        before = _full_fingerprint(buf, live)
        g0, added0 = feed.g, dict(feed.added)
        state0 = (feed.pos[:], feed.t[:], feed.rng.bit_generator.state)
        steps = [feed.step() for _ in range(rows)]
        o, o2, term, g = (np.concatenate(x) for x in zip(*steps))
        data = {"obs": o, "next_obs": o2, "step": g, "terminated": term, "truncated": np.zeros_like(term)}
        try:
            buf.extend(data)
        except OSError as e:
            assert "frame_log" in str(e) or str(live) in str(e), e
            failed = True
            break
    assert failed, "extends of noise on a full disk never failed"
    assert_same(before, _full_fingerprint(buf, live))
    check_all_live(buf, feed)  # what it held, still exact
    buf.sample(8)
    filler.unlink()
    buf.extend(data)  # the same rows, now that there is room
    feed.run(buf, 100)
    check_all_live(buf, feed)
    check_sample(buf, feed, 32)
    buf.close()
    again = bigper.PrioritizedReplayBuffer(**kw, mode="resume")
    check_all_live(again, feed)
    again.close()


# -- 1b. a memmap snapshot: one chunk file a segment ------------------------------

def _flog(snap: Path, change) -> None:
    def ch(b):
        change(b["data"]["frame_log"], b["files"])
    resign(snap, ch)


def _add_file(snap, name, raw):
    (snap / name).write_bytes(raw)
    return {"size": len(raw), "xxh3_64": digest(raw)}


def _mm_one_more_row_no_file(d, files):
    d["rows"] += 4


def _mm_one_file_too_many(d, files):
    d["rows"] -= 4


def _mm_duplicate_file(d, files):
    d["files"][2] = d["files"][1]


def _mm_not_a_multiple(d, files):
    d["rows"] -= 1


def _mm_files_reordered(d, files):
    d["files"][1], d["files"][2] = d["files"][2], d["files"][1]


MM_CASES = {"one_more_segment_no_file": _mm_one_more_row_no_file, "one_file_too_many": _mm_one_file_too_many,
            "duplicate_file": _mm_duplicate_file, "rows_not_a_multiple": _mm_not_a_multiple,
            }


@pytest.mark.parametrize("case", sorted(MM_CASES))
def test_memmap_snapshot_log_files_refused(case, tmp_path):
    snap, facts = grown("memmap", tmp_path)
    _flog(snap, MM_CASES[case])
    refused(BAD, snap, path=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_memmap_snapshot_with_a_spare_zero_segment_loads_exact(tmp_path):
    """One more segment, its file named and zero: within the rules (a log that grew ahead)."""
    snap, facts = grown("memmap", tmp_path)
    n = len(json.loads("[]")) or facts["slots"]
    name = f"data/frame_log.{n:06d}.bin"
    rec = _add_file(snap, name, b"\0" * facts["seg_rows"] * facts["block"])

    def change(d, files):
        d["rows"] += facts["seg_rows"]
        d["files"].append(name)
        files[name] = rec
    _flog(snap, change)
    try:
        buf = bigper.PrioritizedReplayBuffer.load(snap, path=tmp_path / "out")
    except BAD:
        return
    assert hook.log(buf).slots == facts["slots"] + 1
    live = np.flatnonzero(buf.status == 1)
    hook.frames(buf).stacks("obs_ref", live)
    Feed(noise(np.random.default_rng(3), 300, SHAPE, np.uint8), 2, seed=3).run(buf, 100)
    buf.sample(8)
    buf.close()


def test_memmap_snapshot_merged_chunks_of_two_segments(tmp_path):
    """The log's files regrouped two segments a file (chunk_rows 8): loaded exactly or refused, never garbage."""
    snap, facts = grown("memmap", tmp_path)
    body_files = None

    def change(d, files):
        nonlocal body_files
        old = d["files"]
        raws = [(snap / f).read_bytes() for f in old]
        for f in old:
            os.unlink(snap / f)
            files.pop(f)
        new = []
        for i in range(0, len(raws), 2):
            name = "data/frame_log.bin" if i == 0 else f"data/frame_log.{i // 2:06d}.bin"
            files[name] = _add_file(snap, name, b"".join(raws[i:i + 2]))
            new.append(name)
        d["files"], d["chunk_rows"] = new, 8
        body_files = new
    _flog(snap, change)
    before = fingerprint(snap)
    try:
        buf = bigper.PrioritizedReplayBuffer.load(snap, path=tmp_path / "out")
    except BAD:
        assert fingerprint(snap) == before
        return
    live = np.flatnonzero(buf.status == 1)
    hook.frames(buf).stacks("obs_ref", live)
    Feed(noise(np.random.default_rng(3), 300, SHAPE, np.uint8), 2, seed=3).run(buf, 100)
    buf.sample(8)
    buf.close()


def test_memmap_snapshot_log_files_swapped_never_garbage(tmp_path):
    """Two live segments' files swapped in the list (re-signed): the list says which file is
    segment slot k, so a load takes it (the index is where it should be). Frames of noise
    all have the same length, so each offset in one slot is a whole, checksummed frame in the
    other: the read decodes other frames of the log, not damage (as swapped rows of an
    uncompressed field in a re-signed snapshot would be). What is asked: no crash, the
    frames' shape, and a CorruptSnapshotError where a frame does not decode."""
    snap, facts = grown("memmap", tmp_path)
    good = bigper.PrioritizedReplayBuffer.load(snap, path=tmp_path / "good")
    live = np.flatnonzero(good.status == 1)
    want = hook.frames(good).stacks("obs_ref", live)
    good.close()
    _flog(snap, _mm_files_reordered)
    try:
        buf = bigper.PrioritizedReplayBuffer.load(snap, path=tmp_path / "out")
    except BAD:
        return
    try:
        got = hook.frames(buf).stacks("obs_ref", live)
    except CorruptSnapshotError:
        return
    finally:
        buf.close()
    assert got.shape == want.shape and got.dtype == want.dtype


# -- 4b. sequences with frame stacks: a growing log against an uncompressed twin ------

@pytest.mark.parametrize("storage", ["memory", "memmap"])
@pytest.mark.parametrize("chunk", [1, 7, 40])
def test_sequences_on_a_growing_log_match_the_raw_twin(storage, chunk, tmp_path):
    from tests._sequence_reference import Ref
    from tests.core.test_sequences import build, check_against, feed

    refs = [Ref(0, 2, 3, 2, 2, frame_stack=2, seed=1) for _ in range(2)]
    for r in refs:
        r.c = 48
    z = build(refs[0], 48, storage=storage, path=None if storage == "memory" else tmp_path / "z",
              compression="zstd", seed=3)
    raw = build(refs[1], 48, seed=3)
    rng = np.random.default_rng(2)
    ends = [[int(x) for x in rng.choice(3, 2, p=[0.8, 0.1, 0.1])] for _ in range(160)]
    feed(z, refs[0], ends, chunk=chunk)
    feed(raw, refs[1], ends, chunk=chunk)
    np.testing.assert_array_equal(z.status, raw.status)
    assert hook.log(z).slots > 1
    a, b = z.sample(8), raw.sample(8)
    for key in a.keys():
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)
    check_against(z, refs[0])
    z.close()
    raw.close()


# -- 7. snapshots between extends that grow and reuse slots: each one stays exact -----------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_snapshots_between_growing_and_reusing_extends_stay_exact(seed, tmp_path):
    rng = np.random.default_rng(seed)
    buf = make("memmap", tmp_path, SHAPE, k=2, capacity=50, name="live", seed=seed)
    frames = np.concatenate([noise(rng, 200, SHAPE, np.uint8), np.zeros((200, *SHAPE), np.uint8)])
    feed = Feed(frames, 2, seed=seed)
    snaps = []
    for i in range(12):
        n = int(rng.choice([1, 3, 17, 60]))
        steps = [feed.step() for _ in range(n)]
        o, o2, term, g = (np.concatenate(x) for x in zip(*steps))
        buf.extend({"obs": o, "next_obs": o2, "step": g, "terminated": term, "truncated": np.zeros_like(term)})
        if i % 3 == 2:
            snaps.append(buf.save(tmp_path / f"s{i}"))
    check_all_live(buf, feed)
    buf.close()
    for s in snaps:
        b = bigper.PrioritizedReplayBuffer.load(s, path=tmp_path / f"re{s.name}")
        check_all_live(b, feed)
        b.close()


# -- 8. overwrite a grown folder: no chunk file of the old log stays behind -----------------

def test_overwrite_of_a_grown_folder_leaves_no_stale_segment_files(tmp_path):
    live, facts = _live_folder(tmp_path)
    assert len(list((live / "data").glob("frame_log*"))) == facts["slots"]
    buf = make("memmap", tmp_path, SHAPE, k=2, capacity=30, name="live", mode="overwrite")
    feed = Feed(noise(np.random.default_rng(8), 100, SHAPE, np.uint8), 2, seed=8)
    feed.run(buf, 3)
    n = hook.log(buf).slots
    check_all_live(buf, feed)
    buf.close()
    assert len(list((live / "data").glob("frame_log*"))) == n, sorted(os.listdir(live / "data"))
    again = make("memmap", tmp_path, SHAPE, k=2, capacity=30, name="live", mode="resume")
    check_all_live(again, feed)
    feed.run(again, 100)
    check_all_live(again, feed)
    again.close()


# -- 9. bigper verify on a crafted grown snapshot -------------------------------------------

def _crafted_for_verify(case, tmp_path):
    snap, facts = grown("memory", tmp_path)
    if case == "seg_lo":
        _meta(snap, seg_lo=facts["g"] + 1)
    elif case == "slot":
        put_state(snap, "frames_seg_slot", _slot(facts, SLOT_CASES["duplicate"]))
    else:
        _log_rows(snap, (facts["slots"] - 1) * facts["seg_rows"], facts)
    return snap


@pytest.fixture(scope="module")
def verify_crafted(request, tmp_path_factory):
    """Each case's crafted snapshot and its ``bigper verify``, all in one child (a batch)."""
    return prepare_and_run(request, tmp_path_factory, "test_verify_cli_refuses_a_crafted_grown_snapshot", "case",
                           ["seg_lo", "slot", "rows"], _crafted_for_verify,
                           lambda case, snap: {"": ["verify", snap]}, env=_env(), timeout=120)


@pytest.mark.parametrize("case", ["seg_lo", "slot", "rows"])
def test_verify_cli_refuses_a_crafted_grown_snapshot(case, verify_crafted):
    r = verify_crafted.result(case)
    assert r.returncode not in (0, -11, -7, None) and r.returncode > 0, (r.returncode, r.stdout, r.stderr[-1500:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


# -- 5b. from_hdf5 and convert of an HDF5 buffer file whose compressed log grew ---------------

def _grown_h5(tmp_path, steps=150):
    buf = make("hdf5", tmp_path, SHAPE, k=2, capacity=40, name="z")
    feed = Feed(noise(np.random.default_rng(6), 500, SHAPE, np.uint8), 2, seed=6)
    feed.run(buf, steps)
    assert hook.log(buf).slots > 3
    live = np.flatnonzero(buf.status == 1)
    want = {int(buf.generations[s]) for s in live}
    buf.close()
    return tmp_path / "z.h5", feed, want


def _all_of(b):
    live = np.flatnonzero(b.status == 1)
    return b.gather(live)


def test_from_hdf5_of_a_buffer_file_whose_log_grew_is_exact(tmp_path):
    path, feed, want = _grown_h5(tmp_path)
    with bigper.PrioritizedReplayBuffer.from_hdf5(path) as b:
        data = _all_of(b)
        assert {int(s) for s in data["step"]} == want
        for i, s in enumerate(data["step"]):
            o, o2 = feed.added[int(s)]
            np.testing.assert_array_equal(data["obs"][i], o)
            np.testing.assert_array_equal(data["next_obs"][i], o2)
        b.sample(8)


def test_convert_of_a_buffer_file_whose_log_grew_is_exact(tmp_path):
    from bigper.convert import convert

    from tests.offline.test_convert import assert_same_transitions
    path, feed, want = _grown_h5(tmp_path)
    dst = tmp_path / "c.h5"
    convert(path, dst, progress=False)
    a = assert_same_transitions(path, dst)
    assert {int(s) for s in a["step"]} == want


# -- 5c. a live HDF5 file whose grown frame_log was resized behind bigper's back --------------

def _h5_resize(path: Path, rows_of, meta_too: bool):
    import h5py
    with h5py.File(path, "r+") as f:
        d = f["frame_log"]
        rows = rows_of(int(d.shape[0]))
        d.resize(rows, axis=0)
        if meta_too:
            m = json.loads(f["_bigper"].attrs["meta"])
            m["arrays"]["frame_log"]["rows"] = rows
            f["_bigper"].attrs["meta"] = json.dumps(m)


@pytest.mark.parametrize("meta_too", [False, True])
@pytest.mark.parametrize("case", ["one_segment_fewer", "one_row_fewer", "zero", "one_segment_more"])
def test_hdf5_resized_log_on_resume(case, meta_too, tmp_path):
    path, feed, want = _grown_h5(tmp_path)
    import h5py
    with h5py.File(path, "r") as f:
        seg_rows = f["frame_log"].chunks[0]
    change = {"one_segment_fewer": lambda r: r - seg_rows, "one_row_fewer": lambda r: r - 1,
              "zero": lambda r: 0, "one_segment_more": lambda r: r + seg_rows}[case]
    _h5_resize(path, change, meta_too)
    try:
        buf = make("hdf5", tmp_path, SHAPE, k=2, capacity=40, name="z", mode="resume")
    except BAD:
        assert case != "one_segment_more" or not meta_too, "a spare zero segment is within the rules"
        return
    assert case == "one_segment_more", f"{case} was not refused"
    check_all_live(buf, feed)
    feed.run(buf, 100)
    check_all_live(buf, feed)
    buf.close()


def test_full_disk_at_creation_of_a_growing_log_is_an_oserror_and_nothing_is_made(small_tmpfs):
    fill_disk(small_tmpfs / "filler")
    before = fingerprint(small_tmpfs)
    with pytest.raises(OSError):
        bigper.PrioritizedReplayBuffer(capacity=8000, fields={"obs": ((4, 84, 84), np.uint8)}, frame_stack=4,
                                       storage="memmap", path=small_tmpfs / "live", compression="zstd")
    assert fingerprint(small_tmpfs) == before


# -- 10. kill -9 while the live log grows: the folder is refused as unclean, then overwritable ---

_GROWER = """
import sys, numpy as np
from pathlib import Path
from tests.frames.test_compression import make, Feed, noise
buf = make("memmap", Path(sys.argv[1]), (32, 32), k=2, capacity=3000, name="live")
feed = Feed(noise(np.random.default_rng(0), 4000, (32, 32), np.uint8), 2)
print("ready", flush=True)
while True:
    feed.run(buf, 50)
    print("added", flush=True)
"""


@pytest.mark.parametrize("delay", [0.05, 0.2, 0.6])
def test_kill_9_while_the_live_log_grows_then_resume_and_overwrite(delay, tmp_path):
    import time

    from tests._child import Child

    with Child(_GROWER, tmp_path, env=_env(), cwd=ROOT) as child:
        child.said("ready")
        child.said("added")  # its live log has grown (a busy machine takes seconds to get there)
        time.sleep(delay)
        child.kill()
    from bigper.errors import UncleanStorageError
    with pytest.raises(UncleanStorageError):  # refused, never another error (a missing or short chunk file)
        make("memmap", tmp_path, SHAPE, k=2, capacity=3000, name="live", mode="resume")
    # taken over by a snapshot's load (the documented way back): no chunk file of the dead log stays
    other = make("memmap", tmp_path, SHAPE, k=2, capacity=3000, name="o")
    feed = Feed(noise(np.random.default_rng(1), 300, SHAPE, np.uint8), 2, seed=1)
    feed.run(other, 40)
    snap = other.save(tmp_path / "snap")
    other.close()
    buf = bigper.PrioritizedReplayBuffer.load(snap, path=tmp_path / "live")
    check_all_live(buf, feed)
    feed.run(buf, 40)
    check_all_live(buf, feed)
    n = hook.log(buf).slots
    buf.close()
    assert len(list((tmp_path / "live" / "data").glob("frame_log*"))) == n, sorted(
        os.listdir(tmp_path / "live" / "data"))


# -- 9b. bigper info on crafted grown snapshots: a line, never a traceback ---------------------

INFO_CASES = {
    "seg_lo_huge": lambda snap, f: _meta(snap, seg_lo=2 ** 63 - 1),
    "seg_lo_string": lambda snap, f: _meta(snap, seg_lo="x"),
    "seg_lo_missing": lambda snap, f: _meta(snap, seg_lo=None),
    "seg_negative": lambda snap, f: _meta(snap, seg=-5),
    "pos_huge": lambda snap, f: _meta(snap, pos=2 ** 70),
    "slot_huge": lambda snap, f: put_state(snap, "frames_seg_slot", _slot(f, SLOT_CASES["huge"])),
    "slot_float": lambda snap, f: put_state(snap, "frames_seg_slot", BAD_ARRAYS["float"](f)),
    "rows_zero": lambda snap, f: _log_rows(snap, 0, f),
    "rows_not_multiple": lambda snap, f: _log_rows(snap, f["slots"] * f["seg_rows"] + 1, f),
}


def _crafted_for_info(case, tmp_path):
    snap, facts = grown("memory", tmp_path)
    INFO_CASES[case](snap, facts)
    return snap


@pytest.fixture(scope="module")
def info_crafted(request, tmp_path_factory):
    """Each case's crafted snapshot, then ``bigper info`` and ``bigper verify`` of it, all in one child."""
    return prepare_and_run(request, tmp_path_factory, "test_info_and_verify_on_crafted_grown_snapshots_say_a_line",
                           "case", sorted(INFO_CASES), _crafted_for_info,
                           lambda case, snap: {cmd: [cmd, snap] for cmd in ("info", "verify")}, env=_env(),
                           timeout=120)


@pytest.mark.parametrize("case", sorted(INFO_CASES))
def test_info_and_verify_on_crafted_grown_snapshots_say_a_line(case, info_crafted):
    for cmd in ("info", "verify"):
        r = info_crafted.result(case, cmd)
        assert r.returncode is not None and r.returncode >= 0 and "Traceback" not in r.stderr, (
            cmd, r.returncode, r.timed_out, r.stderr[-2000:])
        if cmd == "verify":
            assert r.returncode != 0, (r.stdout, r.stderr)


# -- 6b. a disk with room for meta.json but not for the next segment's chunk file ------------

@pytest.mark.parametrize("leave", [4096, 8192, 12288, 20480])
def test_room_for_the_record_but_not_the_segment(leave, small_tmpfs):
    from tests._hostile_snapshot_cases import fill
    from tests.frames.test_hostile_compression import _full_fingerprint
    from tests.buffer.test_validation import assert_same

    live = small_tmpfs / "live"
    kw = dict(capacity=150, fields={"obs": ((2, 84, 84), np.uint8), "step": ((), np.int64)}, frame_stack=2,
              storage="memmap", path=live, compression="zstd", seed=0)
    buf = bigper.PrioritizedReplayBuffer(**kw)
    feed = Feed(noise(np.random.default_rng(5), 400, (84, 84), np.uint8), 2, seed=5)
    feed.run(buf, 3)
    fill(small_tmpfs, leave)
    for _ in range(300):
        before = _full_fingerprint(buf, live)
        chunks = sorted(os.listdir(live / "data"))
        o, o2, term, g = feed.step()
        try:
            buf.add(obs=o[0], next_obs=o2[0], step=g[0], terminated=term[0], truncated=False)
        except OSError as e:
            err = str(e)
            break
    else:
        pytest.fail("300 adds of noise never filled the disk")
    assert "frame_log" in err and str(live) in err, err  # (the segment file, or meta.json naming it)
    assert_same(before, _full_fingerprint(buf, live))
    assert sorted(os.listdir(live / "data")) == chunks  # no chunk file of the failed segment stays
    rec = json.loads((live / "meta.json").read_text())["arrays"]["frame_log"]
    assert rec["rows"] == hook.log(buf).slots * hook.log(buf).seg_rows
    os.unlink(small_tmpfs / "filler")
    buf.add(obs=o[0], next_obs=o2[0], step=g[0], terminated=term[0], truncated=False)
    feed.run(buf, 30)
    check_all_live(buf, feed)
    buf.close()
    again = bigper.PrioritizedReplayBuffer(**kw, mode="resume")
    check_all_live(again, feed)
    again.close()


@pytest.mark.parametrize("leave", [0, 8192, 65536])
def test_hdf5_full_disk_while_the_log_grows(leave, small_tmpfs):
    """Found: HDF5Storage.grow let HDF5 run out of space inside resize/flush (h5py's RuntimeError,
    and the library's state broken: every later flush failed, 'slist already enabled?'). Now the
    bytes are reserved past the file's end first: an OSError, nothing changed, usable after."""
    from tests._hostile_snapshot_cases import fill

    path = small_tmpfs / "z.h5"
    kw = dict(capacity=150, fields={"obs": ((2, 84, 84), np.uint8), "step": ((), np.int64)}, frame_stack=2,
              storage="hdf5", path=path, compression="zstd", seed=0)
    buf = bigper.PrioritizedReplayBuffer(**kw)
    feed = Feed(noise(np.random.default_rng(5), 400, (84, 84), np.uint8), 2, seed=5)
    feed.run(buf, 3)
    fill(small_tmpfs, leave)
    for _ in range(400):
        o, o2, term, g = feed.step()
        try:
            buf.add(obs=o[0], next_obs=o2[0], step=g[0], terminated=term[0], truncated=False)
        except OSError as e:  # (a RuntimeError from h5py is not what grow promises)
            assert str(path) in str(e) or "No space" in str(e), e
            break
    else:
        pytest.fail("400 adds of noise never filled the disk")
    del feed.added[int(g[0])]  # (not added)
    check_all_live(buf, feed)
    os.unlink(small_tmpfs / "filler")
    buf.add(obs=o[0], next_obs=o2[0], step=g[0], terminated=term[0], truncated=False)
    feed.added[int(g[0])] = (o[0], o2[0])
    feed.run(buf, 30)
    check_all_live(buf, feed)
    check_sample(buf, feed, 16)
    buf.close()
    again = bigper.PrioritizedReplayBuffer(**kw, mode="resume")
    check_all_live(again, feed)
    again.close()


@pytest.mark.parametrize("leave", [0, 16384, 40960])
def test_load_of_a_grown_snapshot_onto_a_full_disk(leave, tmp_path, small_tmpfs):
    from tests._hostile_snapshot_cases import fill
    snap, facts = grown("memmap", tmp_path)
    fill(small_tmpfs, leave)
    before = fingerprint(snap)
    out = small_tmpfs / "out"
    try:
        buf = bigper.PrioritizedReplayBuffer.load(snap, path=out)
    except OSError:
        assert not out.exists() or not any(out.iterdir()), sorted(os.listdir(out))
        assert fingerprint(snap) == before
        os.unlink(small_tmpfs / "filler")
        buf = bigper.PrioritizedReplayBuffer.load(snap, path=out)
    assert hook.log(buf).slots == facts["slots"]
    live = np.flatnonzero(buf.status == 1)
    hook.frames(buf).stacks("obs_ref", live)
    buf.close()
    assert fingerprint(snap) == before


def _crafted_log_files(case, tmp_path):
    snap, facts = grown("memmap", tmp_path)
    _flog(snap, MM_CASES[case])
    return snap


@pytest.fixture(scope="module")
def verify_log_files(request, tmp_path_factory):
    """Each case's snapshot with crafted log files and its ``bigper verify``, all in one child."""
    return prepare_and_run(request, tmp_path_factory, "test_verify_cli_on_memmap_snapshot_log_files", "case",
                           sorted(MM_CASES), _crafted_log_files, lambda case, snap: {"": ["verify", snap]},
                           env=_env(), timeout=120)


@pytest.mark.parametrize("case", sorted(MM_CASES))
def test_verify_cli_on_memmap_snapshot_log_files(case, verify_log_files):
    r = verify_log_files.result(case)
    assert r.returncode is not None and r.returncode > 0 and "Traceback" not in r.stderr, (
        r.returncode, r.timed_out, r.stdout[-1000:], r.stderr[-2000:])


def test_read_only_open_of_a_grown_folder_is_exact_and_refuses_adds(tmp_path):
    live, facts = _live_folder(tmp_path)
    feed = facts["feed"]
    before = _prints(live)
    buf = make("memmap", tmp_path, SHAPE, k=2, capacity=30, name="live", mode="resume", read_only=True)
    assert hook.log(buf).slots == facts["slots"]
    check_all_live(buf, feed)
    check_sample(buf, feed, 16)
    o, o2, term, g = feed.step()
    with pytest.raises(bigper.errors.BigperError):
        buf.add(obs=o[0], next_obs=o2[0], step=g[0], terminated=term[0], truncated=False)
    buf.close()
    assert _prints(live) == before


# -- 11. random crafted segment states: refused, or loaded and exact ---------------------------

@pytest.mark.parametrize("seed", range(12))
def test_random_segment_state_is_refused_or_exact(seed, tmp_path):
    rng = np.random.default_rng(seed)
    snap, facts = grown("memory", tmp_path)
    good = bigper.PrioritizedReplayBuffer.load(snap)
    live = np.flatnonzero(good.status == 1)
    want = hook.frames(good).stacks("obs_ref", live)
    good.close()
    S, g, lo = facts["S"], facts["g"], facts["lo"]
    slot = facts["seg_slot"].copy()
    first = facts["seg_first"].copy()
    for _ in range(int(rng.integers(1, 4))):
        what = rng.integers(0, 4)
        i = int(rng.integers(0, S))
        if what == 0:
            slot[i] = int(rng.integers(-2, facts["slots"] + 2))
        elif what == 1:
            j = int(rng.integers(0, S))
            slot[i], slot[j] = slot[j], slot[i]
        elif what == 2:
            first[i] += int(rng.integers(-3, 4))
        else:
            lo = int(rng.integers(g - S - 1, g + 2))
    put_state(snap, "frames_seg_slot", slot)
    put_state(snap, "frames_seg_first", first)
    _meta(snap, seg_lo=lo)
    before = fingerprint(snap)
    try:
        buf = bigper.PrioritizedReplayBuffer.load(snap)
    except BAD:
        assert fingerprint(snap) == before
        return
    try:
        got = hook.frames(buf).stacks("obs_ref", np.flatnonzero(buf.status == 1))
    except CorruptSnapshotError:
        return
    finally:
        buf.close()
    if got.shape == want.shape:
        np.testing.assert_array_equal(got, want)
