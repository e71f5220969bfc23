"""Hostile snapshots, their records: crafted and re-signed manifests (every
field, under Hypothesis), lying state arrays, arguments of the wrong type; and
the converse, that every state a buffer writes passes the checks.

Every refusal is checked against a fingerprint of the snapshot and of the
load path taken before it: a refused load changes nothing. Special files,
foreign files, full disks and the caller's files are in
``test_hostile_snapshot_files.py``.
"""

from __future__ import annotations

import io
import json
import os
import resource
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bigper
from bigper import CorruptSnapshotError, IncompatibleSnapshotError
from bigper.errors import BigperError, InvalidTypeError
from bigper.snapshot import verify

load = bigper.PrioritizedReplayBuffer.load
from bigper.core.ring import expected_gid
from bigper.snapshot.manifest import MANIFEST, decode, digest, encode

from tests._snapshot_cases import Stream, feed, make
from tests._hostile_snapshot_cases import (
    deadline,
    fingerprint,
    put_state,
    refused,
    resign,
    sign_raw,
    small,
)


# -- crafted manifests (issue 12, items 14 and 15) ---------------------------------------------
def _data0(b):
    return b["data"][sorted(b["data"])[0]]


CRAFTED = {
    "shape that wraps to 0 in int64": lambda b: _data0(b).__setitem__("shape", [2**32, 2**32]),
    "shape of 10**30": lambda b: _data0(b).__setitem__("shape", [10**30]),
    "rows of 2**70": lambda b: _data0(b).__setitem__("rows", 2**70),
    "chunk_bytes 'abc'": lambda b: b["storage"].__setitem__("options", {"chunk_bytes": "abc"}),
    "options as a list": lambda b: b["storage"].__setitem__("options", [1, 2]),
    "storage as a list": lambda b: b.__setitem__("storage", ["memmap"]),
    "dtype 'abc'": lambda b: _data0(b).__setitem__("dtype", "abc"),
    "dtype object": lambda b: _data0(b).__setitem__("dtype", "|O"),
    "dtype subarray": lambda b: _data0(b).__setitem__("dtype", "(2,)<i4"),
    "files entry a list": lambda b: _data0(b).__setitem__("files", [["data/x"]]),
    "state array file a list": lambda b: b["state"]["arrays"].__setitem__("leaves", ["state/leaves.npy"]),
    "file size a bool": lambda b: next(iter(b["files"].values())).__setitem__("size", True),
    "file size 2**40": lambda b: next(iter(b["files"].values())).__setitem__("size", 2**40),
    "member outside": lambda b: b["files"].__setitem__("../../etc/passwd", {"size": 1, "xxh3_64": "0" * 16}),
    "member absolute": lambda b: b["files"].__setitem__("/etc/passwd", {"size": 1, "xxh3_64": "0" * 16}),
    "member three deep": lambda b: b["files"].__setitem__("data/a/b", {"size": 1, "xxh3_64": "0" * 16}),
    "capacity 2**27": lambda b: b["config"].__setitem__("capacity", 2**27),
    "capacity as a string": lambda b: b["config"].__setitem__("capacity", "16"),
    "config a list": lambda b: b.__setitem__("config", [1]),
    "summary a list": lambda b: b.__setitem__("summary", [1]),
    "meta count -5": lambda b: b["state"]["meta"].__setitem__("count", -5),
    "meta count 2**70": lambda b: b["state"]["meta"].__setitem__("count", 2**70),
    "meta count a float": lambda b: b["state"]["meta"].__setitem__("count", 21.0),
    "meta max_leaf -1": lambda b: b["state"]["meta"].__setitem__("max_leaf", -1.0),
    "meta max_leaf a string": lambda b: b["state"]["meta"].__setitem__("max_leaf", "1"),
    "meta beta_step -1": lambda b: b["state"]["meta"].__setitem__("beta_step", -1),
    "meta rng a list": lambda b: b["state"]["meta"].__setitem__("rng", [1]),
    "meta rng state 2**200": lambda b: b["state"]["meta"]["rng"]["state"].__setitem__("state", 2**200),
    "meta env_ended too long": lambda b: b["state"]["meta"].__setitem__("env_ended", [True, True]),
    "meta a list": lambda b: b["state"].__setitem__("meta", [1]),
    "user files outside": lambda b: b.__setitem__("user", {"files": {"x": "state/leaves.npy"}}),
    "user a list": lambda b: b.__setitem__("user", [1]),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
@pytest.mark.parametrize("kind", ["memory", "memmap"])
def test_a_crafted_manifest_gets_bigpers_error_and_changes_nothing(kind, case, tmp_path):
    snap = small(kind, tmp_path)
    resign(snap, CRAFTED[case])
    live = tmp_path / "elsewhere"
    t0, rss0 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused((CorruptSnapshotError, IncompatibleSnapshotError), snap, live,
            path=None if kind == "memory" else live)
    assert time.monotonic() - t0 < 5
    # item 15: nothing is allocated from a declared size (2**27 slots would be gigabytes)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 200_000  # KB
    assert not live.exists()
    with deadline():
        with pytest.raises((CorruptSnapshotError, IncompatibleSnapshotError)):
            rep = verify(snap)
            if rep["problems"]:
                raise CorruptSnapshotError(rep["problems"][0])
        from bigper.cli import main

        assert main(["verify", str(snap)]) == 1
        assert main(["info", str(snap)]) in (0, 1)  # an answer, never a traceback


def test_a_deeply_nested_manifest_is_corrupt_not_a_recursion_error(tmp_path):
    snap = small("memory", tmp_path)
    text = (snap / MANIFEST).read_text()
    head = text[:text.rindex(',\n "manifest_xxh3_64"')]
    sign_raw(snap, head + ',\n "zz": ' + "[" * 100_000 + "]" * 100_000 + "\n}")
    refused(CorruptSnapshotError, snap)


def test_a_huge_or_special_manifest_is_refused_without_reading_it(tmp_path):
    snap = small("memory", tmp_path)
    os.unlink(snap / MANIFEST)
    os.mkfifo(snap / MANIFEST)
    refused(CorruptSnapshotError, snap)
    os.unlink(snap / MANIFEST)
    os.symlink("/dev/zero", snap / MANIFEST)
    refused(CorruptSnapshotError, snap)


# -- lying state arrays (item 13) --------------------------------------------------------------
def _leaves(v):
    def f(a):
        a = a.copy()
        a[3] = v
        return a
    return f


LIES = {
    "leaf -1": ("leaves", _leaves(-1.0)),
    "leaf nan": ("leaves", _leaves(np.nan)),
    "leaf inf": ("leaves", _leaves(np.inf)),
    "leaf above max_leaf": ("leaves", _leaves(1e9)),
    "leaves sum to inf": ("leaves", lambda a: np.where(a > 0, 1e308, 0.0)),
    "leaves int8": ("leaves", lambda a: a.astype(np.int8)),
    "leaves short": ("leaves", lambda a: a[:-1]),
    "leaves 2-d": ("leaves", lambda a: a.reshape(2, -1)),
    "status 7": ("status", lambda a: np.where(np.arange(a.size) == 2, 7, a).astype(np.uint8)),
    "status pending with n_step 1": ("status", lambda a: np.where(np.arange(a.size) == 2, 2, a).astype(np.uint8)),
    "status empty on a written slot": ("status", lambda a: np.where(np.arange(a.size) == 2, 0, a).astype(np.uint8)),
    "gid -2**60": ("gid", lambda a: np.where(np.arange(a.size) == 1, -2**60, a)),
    "gid off by capacity": ("gid", lambda a: np.where(np.arange(a.size) == 1, a - a.size, a)),
    "gid float": ("gid", lambda a: a.astype(np.float64)),
    "ends 9": ("ends", lambda a: np.where(np.arange(a.size) == 1, 9, a).astype(np.uint8)),
    "pending of n_step 1 not empty": ("pending", lambda a: np.zeros(16)),
}


@pytest.mark.parametrize("case", sorted(LIES))
def test_a_lying_state_array_is_corrupt(case, tmp_path):
    snap = small("memory", tmp_path)
    name, change = LIES[case]
    if name == "gid":  # not written since issue 43 (it follows from count): one added is checked all the same
        count = decode((snap / MANIFEST).read_bytes(), snap)["state"]["meta"]["count"]
        assert not (snap / "state" / "gid.npy").exists()
        was = expected_gid(count, 16)
    else:
        was = np.load(snap / "state" / f"{name}.npy")
    put_state(snap, name, change(was))
    refused(CorruptSnapshotError, snap)
    assert verify(snap)["problems"], "verify reports it too"


def test_a_never_written_slot_with_a_leaf_is_corrupt(tmp_path):
    stream = Stream(k=None, seed=1)
    buf = make("memory", None, stream, capacity=16)
    feed(buf, stream, 5)
    snap = buf.save(tmp_path / "snap")
    leaves = np.load(snap / "state" / "leaves.npy")
    leaves[12] = 0.5  # below max_leaf: only the status tells it apart
    put_state(snap, "leaves", leaves)
    e = refused(CorruptSnapshotError, snap)
    assert "slot 12" in str(e)


def test_an_npy_header_that_lies_about_its_size_is_corrupt(tmp_path):
    snap = small("memory", tmp_path)
    raw = (snap / "state" / "leaves.npy").read_bytes()
    fake = raw.replace(b"(16,)", b"(99999999999,)").replace(b"     \n", b"\n")[:len(raw)]
    fake = fake + b" " * (len(raw) - len(fake))
    member = "state/leaves.npy"
    os.unlink(snap / member)
    (snap / member).write_bytes(fake)
    resign(snap, lambda b: b["files"].__setitem__(member, {"size": len(fake), "xxh3_64": digest(fake)}))
    refused(CorruptSnapshotError, snap)


def test_frame_state_lies_are_corrupt(tmp_path):
    snap = small("memory", tmp_path, k=2)
    good = {n: np.load(snap / "state" / f"frames_{n}.npy") for n in ("ptr", "last")}
    for name, bad in (("ptr", good["ptr"] - 10**6), ("ptr", good["ptr"] + 10**6),
                      ("last", good["last"][:, :1])):
        put_state(snap, f"frames_{name}", bad)
        refused(CorruptSnapshotError, snap)
        put_state(snap, f"frames_{name}", good[name])
    load(snap).close()


@pytest.mark.parametrize("value", [-5.0, -1e-300, np.nan, np.inf, 1e308, "above"])
@pytest.mark.parametrize("where", ["pending", "live"])
def test_a_pending_leaf_that_is_negative_or_not_finite_is_corrupt(value, where, tmp_path):
    """n-step loads keep ``pending`` for the slots that wait for their window; a
    crafted one would become a leaf of -5 (or NaN) once the window closes, or one
    above every key the buffer ever wrote (``max_leaf``: 1e308 is past the tree's limit)."""
    if value == "above":
        snap0 = small("memory", tmp_path / "probe", n_step=3)
        value = decode((snap0 / MANIFEST).read_bytes(), snap0)["state"]["meta"]["max_leaf"] * 1.5
    snap = small("memory", tmp_path, n_step=3)
    status = np.load(snap / "state" / "status.npy")
    pending = np.load(snap / "state" / "pending.npy")
    slot = int(np.flatnonzero(status == (2 if where == "pending" else 1))[0])
    pending[slot] = value
    put_state(snap, "pending", pending)
    e = refused(CorruptSnapshotError, snap)
    assert f"pending[{slot}]" in str(e)
    assert verify(snap)["problems"], "verify reports it too"


# (a live transition on frames the ring overwrote: its references are data since issue 43, no longer
# the recorded frames_minref: tests/snapshot/test_hostile_refs.py)


# -- Hypothesis over manifest fields ------------------------------------------------------------
def _paths(obj, prefix=()):
    """Every (key path) in a JSON body, depth first."""
    yield prefix
    if isinstance(obj, dict):
        for k in sorted(obj):
            yield from _paths(obj[k], prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**80, max_value=2**80)
    | st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63, 2**64, 10**30])
    | st.floats(allow_nan=False) | st.text(max_size=8) | st.sampled_from(["<f8", "|u1", "../x", "data/x"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pristine")
    return {kind: small(kind, tmp, k=2 if kind == "memmap" else None, n_step=2, name=kind)
            for kind in ("memory", "memmap")}


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_resigned_manifest_field_loads_or_gets_bigpers_error(pristine, tmp_path_factory, data):
    import shutil

    kind = data.draw(st.sampled_from(sorted(pristine)))
    tmp = tmp_path_factory.mktemp("h")
    snap = tmp / "snap"
    shutil.copytree(pristine[kind], snap)
    body = decode((snap / MANIFEST).read_bytes(), snap)
    paths = [p for p in _paths(body) if p]
    target = data.draw(st.sampled_from(paths))
    value = data.draw(JSON)
    node = body
    for k in target[:-1]:
        node = node[k]
    if data.draw(st.booleans()) and isinstance(node, dict):
        node.pop(target[-1])
    else:
        node[target[-1]] = value
    (snap / MANIFEST).write_bytes(encode(body))
    before = fingerprint(snap)
    live = tmp / "live"
    with deadline(20):
        try:
            buf = load(snap, path=None if kind == "memory" else live)
        except BigperError:
            pass  # bigper's own error, whatever the field
        else:
            buf.sample(4) if buf.total_priority > 0 else None
            buf.close()
        from contextlib import redirect_stdout

        from bigper.cli import main

        with redirect_stdout(io.StringIO()):
            assert main(["info", str(snap)]) in (0, 1)  # an answer, never a traceback
            assert main(["verify", str(snap)]) in (0, 1)
    assert fingerprint(snap) == before


# -- check_state accepts every state a buffer writes ----------------------------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(envs=st.integers(1, 3), k=st.sampled_from([None, 1, 2, 4]), n_step=st.integers(1, 3),
       capacity=st.integers(1, 12), seed=st.integers(0, 2**16), steps=st.integers(0, 50),
       autoreset=st.booleans())
def test_every_state_a_buffer_writes_passes_check_state(envs, k, n_step, capacity, seed, steps, autoreset):
    """The checks are not stricter than the buffer: frame stacks that do and do
    not continue, episode ends, next-step autoreset rows (valid=False), n-step
    windows, wrap-around, priority updates of every magnitude."""
    from bigper.core.statecheck import check_state

    rng = np.random.default_rng(seed)
    frame = (k, 2, 2) if k else (2, 2)
    fields = {"obs": (frame, np.uint8), "reward": ((), np.float32)}
    buf = bigper.PrioritizedReplayBuffer(capacity, fields, frame_stack=k, n_step=n_step, num_envs=envs,
                                         seed=seed)
    ended = np.ones(envs, dtype=bool)
    for _ in range(steps):
        o = rng.integers(0, 3, (envs, *frame)).astype(np.uint8)
        o2 = rng.integers(0, 3, (envs, *frame)).astype(np.uint8)
        if k and rng.random() < 0.8:
            o2[:, :-1] = o[:, 1:]
        term, trunc = rng.random(envs) < 0.15, rng.random(envs) < 0.1
        valid = ~(ended & (rng.random(envs) < 0.5)) if autoreset else None
        if valid is not None:
            term, trunc = term | ~valid, trunc & valid
        step = dict(obs=o, next_obs=o2, reward=np.ones(envs, np.float32), terminated=term, truncated=trunc)
        if envs == 1:
            step = {n: v[0] for n, v in step.items()}
            valid = None if valid is None else valid[0]
        buf.add(**step, **({} if valid is None else {"valid": valid}))
        ended = np.atleast_1d(term | trunc)
        if buf.total_priority > 0 and rng.random() < 0.3:
            b = buf.sample(3)
            buf.update_priorities(b, rng.random(3) * 10.0 ** rng.integers(-3, 4))
        meta, arrays = buf.state_dict()
        check_state(buf.config, json.loads(json.dumps(meta)), {n: np.array(a) for n, a in arrays.items()})


def test_load_arguments_of_the_wrong_type_are_bigpers_errors(tmp_path):
    snap = small("memmap", tmp_path)
    for kw in ({"snapshot": 3}, {"snapshot": snap, "path": 3}, {"snapshot": None}):
        with pytest.raises(InvalidTypeError):
            load(kw.pop("snapshot"), **kw)
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    with pytest.raises(BigperError):
        load(snap, path=tmp_path / "loop" / "x")
