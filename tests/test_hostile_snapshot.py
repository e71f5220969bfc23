"""Hostile snapshots: crafted and re-signed manifests, lying state arrays,
special files and symlinks in place of members, foreign files where a load
writes, full disks, and the caller's metadata and files.

Every refusal is checked against a fingerprint of the snapshot and of the
load path (names, types and bytes of every entry) taken before it: a refused
load changes nothing. Re-signing is possible because the manifest's checksum
is a plain xxh3 (``snapshot/_manifest.py``): these tests play an attacker
who can write any bytes.
"""

from __future__ import annotations

import errno
import io
import json
import os
import resource
import signal
import stat
import time
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bigper
from bigper import CorruptSnapshotError, IncompatibleSnapshotError, PathExistsError, Snapshots
from bigper.errors import BigperError, InvalidArgumentError, InvalidTypeError, PathNotFoundError
from bigper.snapshot import load, verify
from bigper.snapshot._manifest import MANIFEST, decode, digest, encode

from ._snapshot_cases import Stream, feed, make
from .test_snapshot_faults import tmpfs

DATA = Path(__file__).parent / "data"


# -- helpers ------------------------------------------------------------------------------------
def fingerprint(*roots) -> dict:
    """path -> (kind, bytes or link target) for every entry under ``roots`` (lstat: links not followed)."""
    out = {}
    for root in roots:
        root = Path(root)
        if not os.path.lexists(root):
            out[str(root)] = None
            continue
        todo = [root]
        while todo:
            p = todo.pop()
            m = os.lstat(p).st_mode
            if stat.S_ISLNK(m):
                out[str(p)] = ("link", os.readlink(p))
            elif stat.S_ISDIR(m):
                out[str(p)] = ("dir", None)
                todo += sorted(p.iterdir())
            elif stat.S_ISREG(m):
                out[str(p)] = ("file", p.read_bytes())
            else:
                out[str(p)] = ("special", stat.S_IFMT(m))
    return out


@contextmanager
def deadline(seconds: int = 5):
    """Fail instead of hanging (a FIFO read blocks forever)."""
    def boom(*_):
        raise TimeoutError(f"blocked for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def resign(snap: Path, change) -> None:
    """Apply ``change(body)`` to the manifest and sign it again."""
    body = decode((snap / MANIFEST).read_bytes(), snap)
    change(body)
    (snap / MANIFEST).write_bytes(encode(body))


def sign_raw(snap: Path, text: str) -> None:
    """Write ``text`` (a JSON object without its checksum key) as a signed manifest."""
    head = text.rstrip().rstrip("}").rstrip().encode()
    (snap / MANIFEST).write_bytes(head + f',\n "manifest_xxh3_64": "{digest(head)}"\n}}\n'.encode())


def put_state(snap: Path, name: str, arr) -> None:
    """Replace state array ``name`` with ``arr`` and re-sign (an attacker's snapshot)."""
    bio = io.BytesIO()
    np.save(bio, np.asarray(arr), allow_pickle=False)
    raw = bio.getvalue()
    member = f"state/{name}.npy"
    os.unlink(snap / member)
    (snap / member).write_bytes(raw)
    resign(snap, lambda b: b["files"].__setitem__(member, {"size": len(raw), "xxh3_64": digest(raw)}))


_PRISTINE: dict = {}


def small(kind: str, tmp: Path, k=None, n_step=1, capacity=16, name="snap") -> Path:
    """A fresh copy of a small snapshot (each kind and shape is built once per session)."""
    import shutil
    import tempfile

    key = (kind, k, n_step, capacity)
    if key not in _PRISTINE:
        where = Path(tempfile.mkdtemp(prefix="bigper-hostile-"))
        stream = Stream(k=k, seed=3)
        path = None if kind == "memory" else (where / "live.h5" if kind == "hdf5" else where / "live")
        buf = make(kind, path, stream, capacity=capacity, n_step=n_step)
        feed(buf, stream, capacity + 5)
        _PRISTINE[key] = buf.save(where / "snap")
        buf.close()
    dst = tmp / name
    shutil.copytree(_PRISTINE[key], dst)
    return dst


def refused(exc, snap: Path, *others, path=None):
    """load(snap, path=path) raises ``exc`` and changes nothing on disk."""
    before = fingerprint(snap, *others)
    with deadline():
        with pytest.raises(exc) as e:
            load(snap, path=path)
    assert fingerprint(snap, *others) == before
    return e.value


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
    put_state(snap, name, change(np.load(snap / "state" / f"{name}.npy")))
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
    good = {n: np.load(snap / "state" / f"frames_{n}.npy") for n in ("ptr", "minref", "last")}
    for name, bad in (("ptr", good["ptr"] - 10**6), ("ptr", good["ptr"] + 10**6),
                      ("minref", good["minref"] + 10**6), ("last", good["last"][:, :1])):
        put_state(snap, f"frames_{name}", bad)
        refused(CorruptSnapshotError, snap)
        put_state(snap, f"frames_{name}", good[name])
    load(snap).close()


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


# -- special files and symlinks in place of members (item 5) -------------------------------------
def _members(snap: Path) -> list[str]:
    return sorted(decode((snap / MANIFEST).read_bytes(), snap)["files"])


@pytest.mark.parametrize("kind", ["memory", "memmap"])
def test_a_fifo_or_symlink_in_place_of_any_member_is_refused_at_once(kind, tmp_path):
    snap = small(kind, tmp_path, k=2)
    outside = tmp_path / "outside"
    outside.mkdir()
    for member in _members(snap):
        p = snap / member
        keep = p.read_bytes()
        for plant in ("fifo", "symlink", "dir"):
            os.unlink(p)
            if plant == "fifo":
                os.mkfifo(p)
            elif plant == "dir":
                os.mkdir(p)
            else:  # the very same bytes, reached through a link: still refused
                (outside / p.name).write_bytes(keep)
                os.symlink(outside / p.name, p)
            t0 = time.monotonic()
            refused(CorruptSnapshotError, snap, path=None if kind == "memory" else tmp_path / "live2")
            with deadline():
                with pytest.raises(CorruptSnapshotError):
                    verify(snap)
            assert time.monotonic() - t0 < 2, (member, plant)
            os.rmdir(p) if plant == "dir" else os.unlink(p)
            p.write_bytes(keep)
    load(snap, path=None if kind == "memory" else tmp_path / "live2").close()


def test_load_latest_falls_back_past_a_fifo_without_hanging_holding_the_lock(tmp_path):
    stream = Stream(k=None, seed=2)
    buf = make("memory", None, stream, capacity=16)
    feed(buf, stream, 10)
    snaps = Snapshots(tmp_path / "snaps", keep=None)
    first = snaps.save(buf, metadata={"step": 10})
    feed(buf, stream, 3)
    second = snaps.save(buf, metadata={"step": 13})
    victim = second / "state" / "leaves.npy"
    os.unlink(victim)
    os.mkfifo(victim)
    with deadline():
        with pytest.warns(RuntimeWarning, match="falling back"):
            got = snaps.load_latest()
    assert snaps.last_loaded.path == first and snaps.last_loaded.step == 10
    assert len(got) == 10
    snaps.save(got)  # the root's lock was released


def test_a_snapshot_name_that_is_a_symlink_is_not_a_snapshot(tmp_path):
    stream = Stream(k=None, seed=2)
    buf = make("memory", None, stream, capacity=16)
    feed(buf, stream, 10)
    elsewhere = buf.save(tmp_path / "elsewhere")
    snaps = Snapshots(tmp_path / "snaps")
    os.symlink(elsewhere, snaps.root / "snap-00000009")
    assert snaps.list() == [] and snaps.latest() is None
    with pytest.raises(PathNotFoundError):
        snaps.load_latest()


# -- foreign files where a load writes (items 1 and 2) -----------------------------------------
def _hdf5_snap(tmp: Path) -> Path:
    return small("hdf5", tmp)


def test_hdf5_load_never_replaces_a_file_it_did_not_write(tmp_path):
    snap = _hdf5_snap(tmp_path)
    target = tmp_path / "target.h5"
    plants = {
        "text": lambda: target.write_text("my notes\n"),
        "empty": lambda: target.write_bytes(b""),
        "foreign hdf5": lambda: h5py.File(target, "w").create_dataset("x", data=np.arange(3)),
        "hdf5 with a fake group": lambda: h5py.File(target, "w").create_group("_bigper").attrs.__setitem__(
            "meta", json.dumps({"format": "not-bigper"})),
        "hdf5 signature then junk": lambda: target.write_bytes(b"\x89HDF\r\n\x1a\n" + b"junk" * 100),
        "fifo": lambda: os.mkfifo(target),
        "symlink to a file": lambda: os.symlink(tmp_path / "real.txt", target),
        "directory": lambda: target.mkdir(),
    }
    (tmp_path / "real.txt").write_text("x")
    for name, plant in plants.items():
        plant()
        refused(PathExistsError, snap, target, tmp_path / "real.txt", tmp_path / "target.h5.lock", path=target)
        assert not list(tmp_path.glob(".target.h5.trash-*")), name
        if target.is_dir() and not target.is_symlink():
            target.rmdir()
        else:
            target.unlink()
    load(snap, path=target).close()  # an empty place: loads


def test_a_resigned_storage_path_naming_another_file_does_not_wipe_it(tmp_path):
    snap = _hdf5_snap(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    resign(snap, lambda b: b["storage"].__setitem__("path", str(victim)))
    refused(PathExistsError, snap, victim)
    assert victim.read_text() == "precious"


def test_hdf5_load_replaces_its_own_dead_writers_file(tmp_path):
    snap = _hdf5_snap(tmp_path)
    live = tmp_path / "live.h5"
    buf = load(snap, path=live)
    buf._store._lock.release()  # the writer "dies" (its lock goes with the process)
    buf._store._lock = None
    b2 = load(snap, path=live)
    assert len(b2) == 16
    b2.close()


MEMMAP_FOREIGN = {
    "data/train.csv and state/model.pt": {"data/train.csv": b"a,b\n", "state/model.pt": b"w"},
    "a subdirectory in data": {"data/sub/x.bin": b"x"},
    "a chunk-like name no record names": {"meta.json": None, "data/zzz.bin": b"x"},
    "a foreign meta.json": {"meta.json": b'{"format": "something-else"}'},
    "meta.json not JSON": {"meta.json": b"\x00\x01"},
    "a top-level file": {"notes.txt": b"x"},
    "a trash-like name": {".trash-notours": b"x"},
    "a state file never recorded": {"meta.json": None, "state/model.npy": b"x"},
}


@pytest.mark.parametrize("case", sorted(MEMMAP_FOREIGN))
def test_memmap_load_never_deletes_what_it_did_not_write(case, tmp_path):
    snap = small("memmap", tmp_path)
    live = tmp_path / "target"
    for rel, raw in MEMMAP_FOREIGN[case].items():
        p = live / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if raw is None:  # a genuine bigper record of this very config
            load(snap, path=live).close()
            continue
        p.write_bytes(raw)
    refused(PathExistsError, snap, live, path=live)


def test_memmap_load_refuses_symlinks_and_fifos_in_its_directory(tmp_path):
    snap = small("memmap", tmp_path)
    live = tmp_path / "target"
    load(snap, path=live).close()
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "x").write_text("mine")
    chunk = sorted((live / "data").iterdir())[0]
    for plant in ("symlink", "fifo"):
        os.unlink(chunk)
        os.symlink(keep / "x", chunk) if plant == "symlink" else os.mkfifo(chunk)
        refused(PathExistsError, snap, live, keep, path=live)
    os.unlink(chunk)
    os.rename(live / "data", tmp_path / "data-aside")
    os.symlink(keep, live / "data")
    refused(PathExistsError, snap, live, keep, path=live)


def test_memmap_load_takes_over_its_own_leftovers(tmp_path):
    """What bigper wrote itself is replaced: a dead writer's directory, an
    interrupted takeover's trash, copy-on-write leftovers."""
    snap = small("memmap", tmp_path)
    live = tmp_path / "target"
    buf = load(snap, path=live)
    buf._store._lock.release()
    buf._store._lock = None
    (live / ".trash-0123456789ab").mkdir()
    (live / ".trash-0123456789ab" / "x.bin").write_bytes(b"x")
    chunk = sorted((live / "data").iterdir())[0]
    (chunk.parent / (chunk.name + ".cow")).write_bytes(b"partial copy")
    b2 = load(snap, path=live)
    assert len(b2) == 16
    assert sorted(p.name for p in live.iterdir()) == [".lock", "data", "meta.json"]
    b2.close()


# -- full disk at every write of save and load (real tmpfs) ------------------------------------
def _fill(fs: Path, leave: int) -> None:
    """Leave about ``leave`` bytes free on the tmpfs ``fs``."""
    free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
    with open(fs / "filler", "wb") as f:
        if free - leave > 0:
            f.write(b"\0" * (free - leave))


def test_full_disk_at_every_point_of_load_leaves_the_snapshot_and_path_as_they_were(tmp_path):
    snap = small("memmap", tmp_path, k=2, capacity=64)
    size = sum(p.stat().st_size for p in snap.rglob("*") if p.is_file())
    with tmpfs(tmp_path / "fs", "1m") as fs:
        failures = 0
        for leave in np.linspace(0, size + 64 << 10, 12).astype(int):
            _fill(fs, int(leave))
            for kind_path in (fs / "live", fs / "live.h5"):
                if kind_path.suffix == ".h5":
                    continue  # the snapshot's kind decides the storage; memmap here
                before = fingerprint(snap)
                try:
                    with deadline(20):
                        buf = load(snap, path=kind_path)
                except OSError as e:
                    failures += 1
                    assert e.errno == errno.ENOSPC or isinstance(e, BigperError), e
                    assert fingerprint(snap) == before
                    assert not kind_path.exists() or not any(kind_path.iterdir()) \
                        or (kind_path / "meta.json").exists(), "what is left is marked as bigper's"
                else:
                    assert len(buf) == 64
                    buf.close()
                import shutil

                shutil.rmtree(kind_path, ignore_errors=True)
            os.unlink(fs / "filler")
        assert failures, "the smallest free space must make the load fail"


def test_full_disk_at_every_point_of_a_snapshot_save(tmp_path):
    stream = Stream(k=None, frame=(8, 8), seed=2)
    buf = make("memory", None, stream, capacity=256)
    feed(buf, stream, 300)
    (tmp_path / "model.pt").write_bytes(os.urandom(50_000))
    with tmpfs(tmp_path / "fs", "1m") as fs:
        snaps = Snapshots(fs / "snaps", keep=None)  # a successful save must not retire the first
        first = snaps.save(buf, metadata={"step": 1})
        want = fingerprint(first)
        outcomes = set()
        for leave in np.linspace(0, 120_000, 10).astype(int):
            _fill(fs, int(leave))
            try:
                got = snaps.save(buf, metadata={"step": 2}, files={"model.pt": tmp_path / "model.pt"})
            except OSError as e:
                assert e.errno == errno.ENOSPC
                outcomes.add("failed")
                assert fingerprint(first) == want
                assert sorted(os.listdir(snaps.root)) == [".lock", first.name], "no temporary left"
            else:
                outcomes.add("saved")
                os.unlink(fs / "filler")
                import shutil

                shutil.rmtree(got)
                continue
            os.unlink(fs / "filler")
        assert "failed" in outcomes
        b = snaps.load_latest()
        assert snaps.last_loaded.path == first and len(b) == 256


# -- the caller's metadata and files (issue 15) -----------------------------------------------
def test_metadata_and_files_are_kept_checksummed_and_retained_with_their_snapshot(tmp_path):
    stream = Stream(k=None, seed=5)
    buf = make("memmap", tmp_path / "live", stream, capacity=16)
    snaps = Snapshots(tmp_path / "snaps", keep=2)
    model = tmp_path / "model.pt"
    saved = []
    for step in range(3):
        feed(buf, stream, 4)
        model.write_bytes(f"weights at {step}".encode() * 100)
        saved.append(snaps.save(buf, metadata={"step": step, "run": "pong"}, files={"model.pt": model}))
    buf.close()
    assert snaps.list() == saved[1:], "retention removed the oldest with its files"
    got, info = snaps.load_latest(path=tmp_path / "live2", with_info=True)
    assert info == snaps.last_loaded and info.path == saved[2] and info.number == 3
    assert info.metadata == {"step": 2, "run": "pong"} and info.step == 2
    assert info.files["model.pt"].read_bytes() == model.read_bytes()
    assert len(got) == 12
    got.close()
    # a damaged user file makes its snapshot corrupt: load_latest falls back to the one before
    raw = bytearray(info.files["model.pt"].read_bytes())
    raw[5] ^= 1
    info.files["model.pt"].write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match="falling back"):
        snaps.load_latest(path=tmp_path / "live3").close()
    assert snaps.last_loaded.path == saved[1] and snaps.last_loaded.step == 1
    with pytest.raises(CorruptSnapshotError, match="model.pt"):
        verify(saved[2])


def test_bad_metadata_or_files_are_refused_before_anything_is_written(tmp_path):
    stream = Stream(k=None, seed=5)
    buf = make("memory", None, stream, capacity=16)
    feed(buf, stream, 4)
    snaps = Snapshots(tmp_path / "snaps")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "ok.bin").write_bytes(b"x")
    bad = [
        (InvalidTypeError, {"metadata": {"x": object()}}),
        (InvalidTypeError, {"metadata": {"x": float("nan")}}),
        (InvalidArgumentError, {"metadata": {"x": "y" * (2 << 20)}}),
        (InvalidArgumentError, {"files": {"../escape": tmp_path / "ok.bin"}}),
        (InvalidArgumentError, {"files": {".hidden": tmp_path / "ok.bin"}}),
        (InvalidArgumentError, {"files": {"a/b": tmp_path / "ok.bin"}}),
        (InvalidTypeError, {"files": [tmp_path / "ok.bin"]}),
        (InvalidTypeError, {"files": {"x": 3}}),
        (PathNotFoundError, {"files": {"x": tmp_path / "missing"}}),
        (InvalidArgumentError, {"files": {"x": tmp_path / "fifo"}}),
        (InvalidArgumentError, {"files": {"x": tmp_path}}),
    ]
    before = fingerprint(snaps.root)
    for exc, kw in bad:
        with deadline():
            with pytest.raises(exc):
                snaps.save(buf, **kw)
        assert fingerprint(snaps.root) == before, kw


def test_snapshots_written_before_user_data_load_with_empty_info(tmp_path):
    import shutil

    root = tmp_path / "snaps"
    root.mkdir()
    shutil.copytree(DATA / "snapshot-v1-memory", root / "snap-00000001")
    snaps = Snapshots(root)
    buf = snaps.load_latest()
    assert snaps.last_loaded.metadata is None and dict(snaps.last_loaded.files) == {}
    assert snaps.last_loaded.number == 1 and snaps.last_loaded.step is None
    buf.close()


def test_a_snapshots_root_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(PathExistsError):
        Snapshots(tmp_path / "f")
    assert (tmp_path / "f").read_text() == "x"


def test_every_refusal_is_a_bigper_error():
    for exc in (CorruptSnapshotError, IncompatibleSnapshotError, PathExistsError):
        assert issubclass(exc, bigper.BigperError)


# -- check_state accepts every state a buffer writes ----------------------------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(envs=st.integers(1, 3), k=st.sampled_from([None, 1, 2, 4]), n_step=st.integers(1, 3),
       capacity=st.integers(1, 12), seed=st.integers(0, 2**16), steps=st.integers(0, 50),
       autoreset=st.booleans())
def test_every_state_a_buffer_writes_passes_check_state(envs, k, n_step, capacity, seed, steps, autoreset):
    """The checks are not stricter than the buffer: frame stacks that do and do
    not continue, episode ends, next-step autoreset rows (valid=False), n-step
    windows, wrap-around, priority updates of every magnitude."""
    from bigper._statecheck import check_state

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
