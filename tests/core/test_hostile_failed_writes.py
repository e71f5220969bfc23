"""Issue 40, cause 2: a failed write changes nothing (promises 9 and 16).

A write is injected a failure at every call it makes, one at a time: every
storage member the core reaches (a ``StorageBase`` that forwards each call to
a real storage, memory, memmap, HDF5 or a user's, and raises ``OSError`` at
its ``n``-th call) and every frame-store step (the same on the frame store's
and the compressed log's methods). ``n`` runs from 1 until the write goes
through. After each failure the buffer's full fingerprint (its state, the
tree, every stored array, the log's slots, the files) is what it was, and at
the end a twin that never saw a failed call holds the same and draws the
same batches. A real full disk (a small tmpfs) gives the same.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os

import numpy as np
import pytest

import bigper
from bigper.config import Config
from bigper.core.layout import allocate
from bigper.storage import open_storage
from bigper.storage.base import StorageBase

from tests import hook
from tests.conftest import fill_disk

PRB = bigper.PrioritizedReplayBuffer
SHAPE = (8, 8)


class Injected(OSError):
    """The failure a test injects (an ``OSError``, as a full disk gives)."""


class Calls:
    """Counts the calls of one write and raises ``Injected`` at the ``at``-th."""

    def __init__(self):
        self.at, self.n, self.fired = None, 0, None

    def arm(self, at: int) -> None:
        self.at, self.n, self.fired = at, 0, None

    def disarm(self) -> None:
        self.at = None

    def __call__(self, what: str) -> None:
        if self.at is None:
            return
        self.n += 1
        if self.n == self.at:
            self.fired = what
            raise Injected(errno.ENOSPC, f"No space left on device (injected at call {self.n}: {what})")


class Failing(StorageBase):
    """A real storage behind every member the core calls; ``calls`` decides
    which call fails (before it reaches the storage)."""

    kind = "failing"

    def __init__(self, inner, calls: Calls):
        self.inner, self.calls = inner, calls
        self.path = inner.path

    def _c(self, what):
        self.calls(what)

    @property
    def arrays(self):
        self._c("arrays")
        return self.inner.arrays

    @property
    def writable_arrays(self):
        self._c("writable_arrays")
        return self.inner.writable_arrays

    @property
    def shared_chunks(self):
        self._c("shared_chunks")
        return self.inner.shared_chunks

    def prepare(self, writes):
        self._c("prepare")
        return self.inner.prepare(writes)

    def open(self, config):
        return self.inner.open(config)

    def saved_state(self):
        return self.inner.saved_state()

    def allocate(self, specs, growth=None):
        return self.inner.allocate(specs, growth)

    def read(self, name, rows):
        self._c(f"read {name}")
        return self.inner.read(name, rows)

    def write(self, name, rows, values):
        self._c(f"write {name}")
        return self.inner.write(name, rows, values)

    def rows(self, name):
        self._c(f"rows {name}")
        return self.inner.rows(name)

    def grow(self, name, rows):
        self._c(f"grow {name}")
        return self.inner.grow(name, rows)

    def shrink(self, name, rows):
        self._c(f"shrink {name}")
        return self.inner.shrink(name, rows)

    def flush(self):
        self._c("flush")
        return self.inner.flush()

    def nbytes(self):
        return self.inner.nbytes()

    def check_present(self, what="cannot go on"):
        return self.inner.check_present(what)

    def abort(self):
        return self.inner.abort()

    def close(self, state=None):
        return self.inner.close(state)


class UserStore(StorageBase):
    """A user's storage written on ``StorageBase``: read and write only (no
    arrays to write in place), and the growing members for the log."""

    kind = "user"

    def __init__(self):
        self.d = {}

    def open(self, config):
        return None

    def allocate(self, specs, growth=None):
        growth = growth or {}
        self.d = {n: np.zeros((min(r, growth[n]) if n in growth else r, *sh), dt)
                  for n, (r, sh, dt) in specs.items()}

    def read(self, name, rows):
        return self.d[name][rows]

    def write(self, name, rows, values):
        self.d[name][rows] = values

    def rows(self, name):
        return self.d[name].shape[0]

    def grow(self, name, rows):
        a = self.d[name]
        b = np.zeros((rows, *a.shape[1:]), a.dtype)
        b[:a.shape[0]] = a
        self.d[name] = b

    def shrink(self, name, rows):
        self.d[name] = self.d[name][:rows].copy()

    def flush(self):
        pass

    def close(self, state=None):
        pass

    def nbytes(self):
        return sum(a.nbytes for a in self.d.values())


class FailingSteps:
    """Wraps the methods of the frame store and the compressed log that a
    write calls: each call counts on ``calls`` (a failure there is one in the
    middle of the frame store's work)."""

    FRAMES = ("write", "logged_args", "kernel_args", "rows_touched")
    LOG = ("append", "staged_args", "touched", "maybe_train", "_open_ahead", "_put_through", "_write_bytes")

    @classmethod
    def install(cls, buf, calls: Calls) -> None:
        frames = hook.frames(buf)
        if frames is None:
            return
        cls._wrap(frames, cls.FRAMES, calls, "frames")
        if frames.log is not None:
            cls._wrap(frames.log, cls.LOG, calls, "log")

    @staticmethod
    def _wrap(obj, names, calls, who):
        for name in names:
            meth = getattr(obj, name)

            def wrapped(*a, _m=meth, _n=name, **k):
                calls(f"{who}.{_n}")
                return _m(*a, **k)
            setattr(obj, name, wrapped)


def _inner(kind, cfg, path):
    if kind == "user":
        store = UserStore()
    else:
        store = open_storage(kind, path) if kind != "memory" else open_storage("memory")
        store.open(cfg.to_dict())
    allocate(store, cfg)
    return store


def build(kind, kw, path):
    """A buffer over ``Failing(real storage of kind)``, its calls and the inner storage."""
    cfg = Config.build(**kw)
    inner = _inner(kind, cfg, path)
    calls = Calls()
    buf = PRB.from_parts(cfg, Failing(inner, calls))
    FailingSteps.install(buf, calls)
    return buf, calls, inner


def _data(kind, inner, cfg) -> dict:
    if kind == "user":
        return {n: a.copy() for n, a in inner.d.items()}
    if kind == "hdf5":
        return {n: d[...] for n, d in inner.dsets.items()}
    return {n: np.array(a, copy=True) for n, a in inner.arrays.items()}


def _files(kind, inner) -> dict:
    if kind not in ("memmap", "hdf5"):
        return {}
    root = str(inner.path)
    out = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            if f.startswith(".lock"):
                continue
            p = os.path.join(d, f)
            # HDF5 keeps its pages to itself until a flush: its datasets are compared as data.
            out[os.path.relpath(p, root)] = os.stat(p).st_size if kind == "hdf5" else \
                hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def fingerprint(buf, kind, inner) -> dict:
    """Everything a write could change: the state, the tree, the data, the log's slots, the files."""
    meta, arrays = buf.state_dict()
    fp = {"meta": json.dumps(meta, sort_keys=True, default=str), "len": len(buf),
          "total": buf.total_priority}
    fp.update({"state." + k: np.array(v, copy=True) for k, v in arrays.items()})
    tree = getattr(buf.prioritization, "tree", None)
    if tree is not None:
        fp["tree.sums"] = tree.sums.copy()
        fp["tree.mins"] = tree.mins.copy()
    fp["leaves"] = buf.leaves(np.arange(buf.capacity))
    fp.update({"data." + k: v for k, v in _data(kind, inner, buf.config).items()})
    frames = hook.frames(buf)
    if frames is not None and frames.log is not None:
        fp["log.st"] = frames.log.st.copy()
        fp["log.used"] = frames.log.used.copy()
        fp["log.dicts"] = repr(frames.log.dicts.state()[0])
    fp.update({"file." + k: v for k, v in _files(kind, inner).items()})
    return fp


def assert_same(a, b, where=""):
    assert a.keys() == b.keys(), (where, sorted(set(a) ^ set(b)))
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (where, k)
            assert np.array_equal(a[k], b[k], equal_nan=True), (where, k)
        else:
            assert a[k] == b[k], (where, k, a[k], b[k])


def step_of(t: int, cfg, rng_frames: np.random.Generator):
    """Step ``t`` of a fixed run: random (incompressible) frames, episodes of
    7 (with several envs, one such step of each, stacked on the env axis)."""
    if cfg.num_envs > 1:
        steps = [_one_step(t, cfg, rng_frames) for _ in range(cfg.num_envs)]
        return {k: np.stack([np.asarray(s[k]) for s in steps]) for k in steps[0]}
    return _one_step(t, cfg, rng_frames)


def _one_step(t: int, cfg, rng_frames: np.random.Generator):
    step = {"reward": np.float32(t % 5), "terminated": t % 7 == 6, "truncated": False}
    if cfg.frame_stack:
        k = cfg.frame_stack
        f = rng_frames.integers(0, 256, size=(k + 1, *SHAPE), dtype=np.uint8)
        step["obs"], step["next_obs"] = f[:k], f[1:]
    else:
        step["obs"] = np.full(4, t, np.float32)
        step["next_obs"] = np.full(4, t + 1, np.float32)
    return step


def writes(cfg, start: int):
    """The writes the failures are injected into: plain adds over a full,
    wrapped ring (an episode end among them), a ``valid=False`` reset after
    an end, an extend of several rows and one of more rows than slots."""
    rng = np.random.default_rng(1000 + start)
    out = []
    for t in range(start, start + 5):
        out.append(("add", step_of(t, cfg, rng), {}))
    t = start + 5
    end = step_of(t, cfg, rng)
    end["terminated"] = np.ones_like(end["terminated"])
    out.append(("add", end, {}))
    placeholder = np.zeros(cfg.num_envs, bool) if cfg.num_envs > 1 else False
    out.append(("add", step_of(t + 1, cfg, rng), {"valid": placeholder}))
    many = [step_of(t + 2 + i, cfg, rng) for i in range(3)]
    out.append(("extend", {k: np.stack([np.asarray(s[k]) for s in many]) for k in many[0]}, {}))
    # More rows than slots: written in chunks, the first committed before the next can fail.
    many = [step_of(t + 5 + i, cfg, rng) for i in range(cfg.capacity + 4)]
    out.append(("extend", {k: np.stack([np.asarray(s[k]) for s in many]) for k in many[0]}, {}))
    return out


def do(buf, write):
    what, data, kw = write
    if what == "add":
        buf.add(**data, **kw)
    else:
        buf.extend(data, **kw)


def fill(buf, cfg, n):
    rng = np.random.default_rng(7)
    for t in range(n):
        buf.add(**step_of(t, cfg, rng))


def same_batches(a, b, rounds=3):
    rng = np.random.default_rng(3)
    for _ in range(rounds):
        x, y = a.sample(8), b.sample(8)
        assert np.array_equal(x.indices, y.indices)
        assert np.array_equal(x.weights, y.weights)
        for k in x.keys():
            assert np.array_equal(np.asarray(x[k]), np.asarray(y[k])), k
        p = rng.random(8) * 2
        a.update_priorities(x, p)
        b.update_priorities(y, p)


FRAMED = dict(fields={"obs": ((2, *SHAPE), np.uint8), "reward": ((), np.float32)}, frame_stack=2)
PLAIN = dict(fields={"obs": ((4,), np.float32), "reward": ((), np.float32)})
CASES = [
    # (storage, config)
    ("memory", dict(FRAMED)),
    ("memory", dict(FRAMED, compression="zstd", n_step=3)),
    ("memory", dict(FRAMED, prioritization="rank")),
    ("memory", dict(PLAIN, n_step=3)),
    ("memory", dict(FRAMED, compression="zstd", sequence=bigper.Sequence(length=3, burn_in=1))),
    ("memmap", dict(FRAMED)),
    ("memmap", dict(FRAMED, compression="zstd")),
    ("memmap", dict(FRAMED, compression="zstd", n_step=3, prioritization="rank")),
    ("hdf5", dict(FRAMED, n_step=3)),
    ("hdf5", dict(FRAMED, compression="zstd")),
    ("hdf5", dict(PLAIN, sequence=bigper.Sequence(length=3, burn_in=1))),
    ("user", dict(FRAMED)),
    ("user", dict(FRAMED, compression="zstd", n_step=3)),
    ("user", dict(FRAMED, sequence=bigper.Sequence(length=3, burn_in=1))),
    ("user", dict(PLAIN, n_step=3)),
    ("memory", dict(FRAMED, compression="zstd", n_step=3, num_envs=2)),
    ("hdf5", dict(FRAMED, num_envs=2)),
    ("user", dict(FRAMED, compression="zstd", num_envs=2)),
]


def _id(case):
    kind, kw = case
    bits = [kind, "frames" if kw.get("frame_stack") else "plain"]
    bits += [f"{k}={v}" for k, v in kw.items() if k in ("compression", "n_step", "prioritization", "num_envs")]
    bits += ["sequence"] if "sequence" in kw else []
    return "-".join(str(b) for b in bits)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_a_failure_at_any_call_of_a_write_changes_nothing(tmp_path, case):
    kind, kw = case
    kw = dict(capacity=16, seed=5, **kw)
    name = "b.h5" if kind == "hdf5" else "b"
    buf, calls, inner = build(kind, kw, tmp_path / "a" / name)
    twin, _, twin_inner = build(kind, kw, tmp_path / "twin" / name)
    cfg = buf.config
    fill(buf, cfg, 40)
    fill(twin, cfg, 40)
    failed = 0
    for w, write in enumerate(writes(cfg, 40)):
        n = 0
        while True:
            n += 1
            before = fingerprint(buf, kind, inner)
            calls.arm(n)
            try:
                do(buf, write)
            except Injected:
                calls.disarm()
                failed += 1
                assert_same(before, fingerprint(buf, kind, inner), f"write {w}, failure at {calls.fired!r}")
                continue
            finally:
                calls.disarm()
            assert calls.fired is None, f"write {w}: the failure at {calls.fired!r} was swallowed"
            break
        do(twin, write)
        assert_same(fingerprint(twin, kind, twin_inner), {**fingerprint(buf, kind, inner), **{
            k: v for k, v in fingerprint(twin, kind, twin_inner).items() if k.startswith("file.")}},
            f"after write {w}")
    assert failed > 0
    same_batches(buf, twin)
    buf.close()
    twin.close()


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_a_full_disk_while_the_compressed_log_grows_changes_nothing(small_tmpfs, storage):
    """A real full disk: the log's growth fails with ``OSError`` and the
    buffer, ``env_ended`` included, is as a twin that never tried; the same
    ``add(valid=False)`` is then refused (or taken) by both alike."""
    kw = dict(capacity=64, seed=5, **FRAMED, compression="zstd")
    live = PRB(**kw, storage=storage, path=small_tmpfs / ("live.h5" if storage == "hdf5" else "live"))
    twin = PRB(**kw)
    cfg = live.config
    rng = np.random.default_rng(0)
    fill_disk(small_tmpfs / "filler")
    t = 0
    err = None
    while t < 2000:
        step = step_of(t, cfg, rng)
        step["terminated"] = True  # every step ends an episode: a failed one must not leave env_ended set
        try:
            live.add(**step)
        except OSError as e:
            err = e
            break
        twin.add(**step)
        t += 1
    assert err is not None, "the log never grew past the full disk"
    # The failed step ended an episode, the one before it too: a placeholder row is right for both.
    meta_live, meta_twin = live.state_dict()[0], twin.state_dict()[0]
    assert meta_live["env_ended"] == meta_twin["env_ended"] and meta_live["count"] == meta_twin["count"]
    # A step that does not end its episode, failing, must leave env_ended as it was: True.
    step = step_of(t, cfg, rng)
    step["terminated"] = False
    with pytest.raises(OSError):
        live.add(**step)
    assert live.state_dict()[0]["env_ended"] == twin.state_dict()[0]["env_ended"] == [True]
    placeholder = step_of(t + 1, cfg, rng)
    live.add(**placeholder, valid=False)  # accepted by both: the last stored step ended its episode
    twin.add(**placeholder, valid=False)
    assert live.state_dict()[0]["env_ended"] == twin.state_dict()[0]["env_ended"]
    same_batches(live, twin)
    (small_tmpfs / "filler").unlink()
    live.close()
    twin.close()
