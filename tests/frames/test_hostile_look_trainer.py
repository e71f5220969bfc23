"""Hostile tests of the dictionary look's trainer (bigper/frames/look.py
``LOOK_STEPS``, bigper/frames/zstd.py ``train(..., k=, steps=)``, which
passes ``ZDICT_fastCover_params_t`` through ctypes). (Written against a
fixed-k pair of candidates, since replaced by zstd's search in fewer steps;
the direct calls at fixed k still reach the same entry point.)

Attacked: ``train`` called directly with k = 0, 1, 7, 8, k > size, k > the
samples' total bytes, k past 2**32, negative k, dictionary sizes 256 and
16384, exactly 10 and 11 rows of 8 and 9 bytes, all-equal and noise rows;
``look.work`` on crafted inputs of 10 and 11 training frames; compressed
buffers fed hostile frames (1, 8, 9, 12, 16, 24, 63 and 21168 bytes a frame;
shapes (1,), (8,), (9,), (2,), (63,), (2, 3), (84, 84, 3); uint8, uint16,
float32, int64 and bool at their limits, all-equal, noise, slow drift) with a
look forced every few frames and every candidate adopted, at dictionary sizes
16384 and 256, training on exactly 10 and 11 frames at the first look. Each
feed runs in a child process (a SIGSEGV in the trainer is a failed case, not
a dead pytest); each is fed twice (the same dictionaries at the same frames:
determinism) and once with the trainer forced back to zstd's search over k
(``LOOK_STEPS = 4``, ZDICT_trainFromBuffer's); every live transition and a sample are compared byte
for byte with what was added.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from bigper.frames import look as _look
from bigper.frames import zstd as _zstd

ROOT = Path(__file__).resolve().parents[2]


# -- train() called directly, in a child (a crash is a failed case) -------------------------------

DIRECT = r"""
import json, sys
import numpy as np
from bigper.frames import zstd as Z

def accepted(d):
    if d is None:
        return None
    if not isinstance(d, np.ndarray) or d.dtype != np.uint8 or d.ndim != 1:
        return "not a uint8 vector"
    co = Z.Codec(level=3)
    try:
        co.set_dictionary(1, d)
        rows = np.zeros((3, 64), np.uint8)
        blob, lengths = co.compress(rows, 1)  # the dictionary compresses, and what it writes decodes
        out = np.empty_like(rows)
        offs = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        bad = Z.decompress_rows(co.dctx(), co.ddicts, blob, offs, lengths, np.ones(3, np.int64), out, 0, 3)
        return int(d.size) if bad < 0 and np.array_equal(out, rows) else "does not round-trip"
    finally:
        co.close()

rng = np.random.default_rng(7)
for line in sys.stdin:
    name, m, n, fill, size, k = json.loads(line)
    rows = np.zeros((m, n), np.uint8) if fill == "equal" else rng.integers(0, 256, (m, n), dtype=np.uint8)
    print("BEGIN", name, flush=True)
    try:
        r = accepted(Z.train(rows, size, **({"steps": k[1]} if isinstance(k, list) else {"k": k})))
    except Exception as e:  # a clean refusal is fine; recorded for the assertion
        r = "raised " + type(e).__name__
    print("RESULT", name, json.dumps(r), flush=True)
"""


def _direct_cases():
    out = []
    for m, n in ((10, 8), (11, 8), (10, 9), (12, 16), (10, 63), (40, 300)):
        for fill in ("equal", "noise"):
            for size in (256, 16384):
                # k: none (the search), 0 (falsy: the search), 1 and 7 (< d = 8), 8 (= d), the look's
                # two, > size, > the samples' total bytes, at and past 2**32, negative
                for k in (None, 0, 1, 7, 8, 50, 2000, size + 1, m * n + 1, 2 ** 32 - 1, 2 ** 32, 2 ** 40, -1):
                    out.append((f"m{m}-n{n}-{fill}-size{size}-k{k}", m, n, fill, size, k))
                for steps in (1, 2, 4):  # the look's search in fewer steps (LOOK_STEPS), and the default's
                    out.append((f"m{m}-n{n}-{fill}-size{size}-steps{steps}", m, n, fill, size, ["steps", steps]))
    return out


def _run_lines(script: str, cases: list, timeout=60) -> dict:
    """Run ``script`` in children over ``cases`` (one JSON line each on stdin);
    name -> the parsed result, or ``("crashed", returncode)`` for the case a
    child died in (the cases after it run in a new child)."""
    results: dict = {}
    todo = list(cases)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    while todo:
        p = subprocess.run([sys.executable, "-c", script], input="".join(json.dumps(c) + "\n" for c in todo),
                           capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
        began = None
        for line in p.stdout.splitlines():
            if line.startswith("BEGIN "):
                began = line.split(" ", 2)[1]
            elif line.startswith("RESULT "):
                _, name, rest = line.split(" ", 2)
                results[name] = json.loads(rest)
                began = None
        if began is not None:
            results[began] = ("crashed", p.returncode, p.stderr[-2000:])
        elif p.returncode != 0:
            for c in todo:
                results.setdefault(c[0], ("crashed", p.returncode, p.stderr[-2000:]))
        todo = [c for c in todo if c[0] not in results]
    return results


@pytest.fixture(scope="module")
def direct():
    return _run_lines(DIRECT, _direct_cases())


@pytest.mark.parametrize("case", _direct_cases(), ids=lambda c: c[0])
def test_train_returns_none_or_a_dictionary_zstd_accepts_never_crashes(direct, case):
    name, m, n, fill, size, k = case
    r = direct.get(name, ("missing",))
    assert not isinstance(r, tuple), f"{name}: the trainer crashed the child: {r}"
    assert r is None or (isinstance(r, int) and 0 < r <= size), f"{name}: {r}"


def test_train_refuses_a_size_below_zstds_minimum_before_calling_zstd():
    rows = np.random.default_rng(0).integers(0, 256, (20, 64), dtype=np.uint8)
    for k in (None, 50, 2000):
        with pytest.raises(ValueError, match="256"):
            _zstd.train(rows, 255, k=k)


def test_train_never_calls_the_trainer_on_rows_it_crashes_on():
    """Fewer than 10 rows, or rows shorter than 8 bytes: None, whatever k."""
    rng = np.random.default_rng(1)
    for m, n in ((9, 64), (5, 8), (100, 7), (100, 1)):
        for k in (None, 50, 2000, 8):
            assert _zstd.train(rng.integers(0, 256, (m, n), dtype=np.uint8), 1024, k=k) is None


# -- look.work on crafted inputs of 10 and 11 training frames --------------------------------------

def _inputs(frames: np.ndarray, split: int, dict_bytes: int) -> _look.Inputs:
    codec = _zstd.Codec(level=3)
    try:
        blob, lengths = codec.compress(frames, 0)
    finally:
        codec.close()
    offs = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    n = frames.shape[0]
    return _look.Inputs(fw=n, split=split, blob=blob.copy(), offsets=offs, lengths=lengths.astype(np.int64),
                        slots=np.zeros(n, np.int64), dicts={}, current=0, row_bytes=frames.shape[1],
                        dict_bytes=dict_bytes)


@pytest.mark.parametrize("split", [10, 11])
@pytest.mark.parametrize("row", [8, 9, 16, 63, 2000])
@pytest.mark.parametrize("fill", ["equal", "noise", "two-valued"])
@pytest.mark.parametrize("dict_bytes", [256, 16384])
def test_work_on_ten_or_eleven_training_frames(split, row, fill, dict_bytes):
    """Runs in this process on purpose: ``direct`` showed the same calls are
    crash-free in a child first (this ordering is by file: the child test
    runs before). Its candidate, if any, is no larger than asked, zstd takes
    it, and it is the trainer's own output at ``LOOK_STEPS``
    (recomputed here: training is deterministic)."""
    rng = np.random.default_rng(row + split)
    n = split + 12
    frames = {"equal": np.full((n, row), 7, np.uint8), "noise": rng.integers(0, 256, (n, row), dtype=np.uint8),
              "two-valued": (rng.integers(0, 2, (n, row)) * 255).astype(np.uint8)}[fill]
    inp = _inputs(frames, split, dict_bytes)
    out = _look.work(inp)
    assert out.measured == n - split
    # 'now' is the measured frames' bytes with no dictionary: recompute independently
    codec = _zstd.Codec(level=3)
    try:
        _, lengths = codec.compress(np.ascontiguousarray(frames[split:]), 0)
    finally:
        codec.close()
    assert out.now == int(lengths.sum())
    if out.candidate is None:
        assert out.new is None
        return
    assert _zstd.DICT_MIN_BYTES <= out.candidate.size <= dict_bytes
    own = [_zstd.train(frames[:split], dict_bytes, steps=_look.LOOK_STEPS)]
    assert any(d is not None and np.array_equal(d, out.candidate) for d in own)
    assert _look.work(inp).candidate.tobytes() == out.candidate.tobytes()  # pure: the same inputs, the same


# -- buffers fed hostile frames, looks forced every few frames, in children ------------------------

FEED = r"""
import json, sys
import numpy as np
import bigper
import bigper.frames.segments as S, bigper.frames.dictionaries as D, bigper.frames.look as L
from tests import hook

def frames_for(kind, shape, dtype, n, seed):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    size = int(np.prod(shape, dtype=np.int64))
    if kind == "equal":
        return np.zeros((n, *shape), dt)
    if kind in ("max", "min"):
        if dt == bool:
            v = kind == "max"
        elif dt.kind == "f":
            v = getattr(np.finfo(dt), kind)
        else:
            v = getattr(np.iinfo(dt), kind)
        return np.full((n, *shape), v, dt)
    if kind == "noise":
        raw = np.frombuffer(rng.bytes(n * size * dt.itemsize), np.uint8).copy()
        return (raw & 1).astype(bool).reshape(n, *shape) if dt == bool else raw.view(dt).reshape(n, *shape)
    if kind == "limits":  # each element one of min, max, 0, inf/1 (nan-free: compared as bytes anyway)
        raw = rng.integers(0, 4, (n, *shape))
        if dt == bool:
            return raw % 2 == 1
        vals = (np.array([np.finfo(dt).min, np.finfo(dt).max, 0, np.inf], dt) if dt.kind == "f"
                else np.array([np.iinfo(dt).min, np.iinfo(dt).max, 0, 1], dt))
        return vals[raw]
    base = np.arange(size) % 5  # "drift": a slowly moving pattern (a dictionary pays)
    f = np.stack([np.roll(base, i // 3) for i in range(n)]).reshape(n, *shape)
    return (f % 2 == 1) if dt == bool else f.astype(dt)

def steps(frames, k, seed):
    rng = np.random.default_rng(seed + 1)
    out, added, i, start, s = [], {}, 0, 0, 0
    while i + 1 < len(frames):
        o = frames[[max(start, i - k + 1 + j) for j in range(k)]]
        o2 = frames[[max(start, i + 2 - k + j) for j in range(k)]]
        term = bool(rng.random() < 0.04)
        out.append((o, o2, term, s))
        added[s] = (o.tobytes(), o2.tobytes())
        s += 1
        i += 2 if term else 1
        start = i if term else start
    return out, added

def run(shape, dtype, k, cap, st, storage, path, look_steps, seed=3):
    L.LOOK_STEPS = look_steps
    b = bigper.PrioritizedReplayBuffer(cap, {"obs": ((k, *shape), dtype), "step": ((), np.int64)}, frame_stack=k,
                                       compression="zstd", seed=seed, storage=storage, path=path)
    for o, o2, term, s in st:
        b.add(obs=o, next_obs=o2, step=s, terminated=term, truncated=False)
    return b

def exact(b, added, dtype):
    live = np.flatnonzero(b.status == 1)
    assert live.size > 0, "nothing sampleable"
    g = b.gather(live)
    for j in range(live.size):
        o, o2 = added[int(g["step"][j])]
        assert g["obs"][j].dtype == np.dtype(dtype)
        assert g["obs"][j].tobytes() == o, ("obs", int(g["step"][j]))
        assert g["next_obs"][j].tobytes() == o2, ("next_obs", int(g["step"][j]))
    sm = b.sample(min(32, live.size))
    for j in range(len(sm.indices)):
        o, o2 = added[int(sm["step"][j])]
        assert sm["obs"][j].tobytes() == o and sm["next_obs"][j].tobytes() == o2, ("sample", int(sm["step"][j]))
    return int(live.size)

def log_state(b):
    fs, log = hook.frames(b), hook.log(b)
    ids = np.arange(max(log.oldest(), fs.fw - fs.F, 0), fs.fw, dtype=np.int64)
    meta, blob = log.dicts.state()
    return json.dumps(meta, sort_keys=True, default=str), blob.tobytes(), log._entries(ids).tobytes()

import tempfile, pathlib
tmp = pathlib.Path(tempfile.mkdtemp())
for line in sys.stdin:
    name, shape, dtype, kind, n, W, dict_bytes, storage = json.loads(line)
    print("BEGIN", name, flush=True)
    S.TRAIN_FRAMES, D.PAYS, D.DRIFT, S.DICT_BYTES = W, -100.0, -100.0, dict_bytes
    try:
        st, added = steps(frames_for(kind, tuple(shape), dtype, n, 0), 3, 0)
        res = {}
        bufs = []
        for tag, look_steps in (("a", 2), ("b", 2), ("search", 4)):
            path = None if storage == "memory" else tmp / f"{name}-{tag}{'.h5' if storage == 'hdf5' else ''}"
            b = run(tuple(shape), dtype, 3, 48, st, storage, path, look_steps)
            res[tag] = {"live": exact(b, added, dtype), "hi": int(hook.log(b).dicts.hi),
                        "sizes": [int(x) for x in b.state_dict()[0]["frames"].get("dict_sizes", [])]}
            bufs.append(b)
        res["same"] = log_state(bufs[0]) == log_state(bufs[1])
        a, b2 = bufs[0].sample(16), bufs[1].sample(16)
        res["same_sample"] = bool(np.array_equal(a.indices, b2.indices) and a["obs"].tobytes() == b2["obs"].tobytes())
        for b in bufs:
            b.close()
        print("RESULT", name, json.dumps(res), flush=True)
    except AssertionError as e:
        print("RESULT", name, json.dumps({"error": "AssertionError " + repr(e.args)[:300]}), flush=True)
    except Exception as e:
        print("RESULT", name, json.dumps({"error": type(e).__name__ + " " + str(e)[:300]}), flush=True)
"""

SHAPES = [  # (shape, dtype): bytes a frame
    ((1,), "uint8"),  # 1
    ((8,), "uint8"),  # 8: the trainer's shortest row
    ((9,), "uint8"),  # 9
    ((8,), "bool"),  # 8
    ((2, 3), "uint16"),  # 12
    ((2,), "int64"),  # 16
    ((2, 3), "float32"),  # 24
    ((63,), "uint8"),  # 63
]


def _nm(shape) -> str:
    return "x".join(map(str, shape))


def _feed_cases():
    out = []
    for shape, dtype in SHAPES:
        for kind in ("equal", "max", "noise", "limits", "drift"):
            out.append((f"{dtype}[{_nm(shape)}]-{kind}", list(shape), dtype, kind, 150, 20, 16384, "memory"))
    for shape, dtype in (((8,), "uint8"), ((63,), "uint8"), ((2, 3), "float32")):
        for kind in ("noise", "drift"):
            out.append((f"{dtype}[{_nm(shape)}]-{kind}-dict256", list(shape), dtype, kind, 150, 20, 256, "memory"))
    for W in (20, 22):  # the first look trains on exactly 10, then 11 frames
        for kind in ("noise", "equal"):
            out.append((f"uint8[8]-{kind}-W{W}", [8], "uint8", kind, 90, W, 16384, "memory"))
            out.append((f"uint8[9]-{kind}-W{W}-memmap", [9], "uint8", kind, 90, W, 256, "memmap"))
    for kind in ("drift", "noise", "min"):  # Atari-sized RGB frames, few of them (21168 bytes each)
        out.append((f"uint8[84x84x3]-{kind}", [84, 84, 3], "uint8", kind, 70, 20, 16384, "memory"))
    out.append(("uint16[2x3]-limits-hdf5", [2, 3], "uint16", "limits", 120, 20, 16384, "hdf5"))
    return out


@pytest.fixture(scope="module")
def fed():
    return _run_lines(FEED, _feed_cases(), timeout=240)


@pytest.mark.parametrize("case", _feed_cases(), ids=lambda c: c[0])
def test_hostile_frames_round_trip_exactly_deterministically_and_with_the_search(fed, case):
    name = case[0]
    r = fed.get(name, ("missing",))
    assert isinstance(r, dict), f"{name}: the child crashed in this case: {r}"
    assert "error" not in r, f"{name}: {r['error']}"
    for tag in ("a", "b", "search"):
        assert r[tag]["live"] > 0
        assert all(256 <= s <= case[6] for s in r[tag]["sizes"]), (tag, r[tag]["sizes"])
    assert r["same"], f"{name}: two buffers fed the same adds hold different dictionaries or index entries"
    assert r["a"]["hi"] == r["b"]["hi"] and r["a"]["sizes"] == r["b"]["sizes"]
    assert r["same_sample"], f"{name}: two buffers fed the same adds sampled differently"


def test_the_feeds_did_train_where_training_is_possible(fed):
    """Guards the cases above against testing nothing: where rows are more
    than 16 bytes and not all equal, the forced looks adopted dictionaries.
    (On rows of 8 or 16 bytes zstd's search, in the look's two steps as in
    its default four, trains none: the look then keeps no dictionary.)"""
    trained = [c[0] for c in _feed_cases()
               if c[3] in ("noise", "limits") and np.prod(c[1]) * np.dtype(c[2]).itemsize > 16]
    none = []
    for name in trained:
        r = fed.get(name)
        assert isinstance(r, dict) and "error" not in r, (name, r)
        if r["a"]["hi"] < 1:
            none.append(name)
    assert not none, f"no dictionary was adopted (the look never ran) in {none}"
