"""Hostile files on disk (issue 23, section 5): sparse data files that claim a
terabyte, storages on a read-only filesystem, numbers of the wrong type or
range in a recorded state. Each refusal is bigper's error, in bounded time,
with the files on disk exactly as before."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper.config import Config
from bigper.errors import CorruptSnapshotError
from bigper.snapshot import verify

load = bigper.PrioritizedReplayBuffer.load
from bigper.snapshot.manifest import digest

from tests._hostile_snapshot_cases import deadline, fingerprint as _fingerprint, refused, resign, small
from tests._snapshot_cases import Stream, feed, make

ROOT = Path(__file__).resolve().parents[2]
TIB = 1 << 40


def run_bigper(*args, timeout: float = 60, code: str | None = None):
    """``python -m bigper ARGS`` (or ``python -c CODE``) in a real subprocess
    with this checkout first on the path; a hang past ``timeout`` fails the test."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", code] if code is not None else [sys.executable, "-m", "bigper", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(map(str, args)) or code} still ran after {timeout} s")


def fingerprint(*roots) -> dict:
    """``_hostile_snapshot_cases.fingerprint``, except that a regular file of
    more than 64 MiB (a terabyte of holes cannot be read) is its size,
    allocated blocks, inode and mtime."""
    out = {}
    for root in map(str, roots):
        if not os.path.lexists(root) or not os.path.isdir(root) or os.path.islink(root):
            out.update(_fingerprint(root))
            continue
        for dirpath, dirs, names in os.walk(root):
            out[dirpath] = ("dir", None)
            for n in dirs + names:
                p = os.path.join(dirpath, n)
                st = os.lstat(p)
                if stat.S_ISREG(st.st_mode) and st.st_size > (64 << 20):
                    out[p] = ("big", st.st_size, st.st_blocks, st.st_ino, st.st_mtime_ns)
                elif not stat.S_ISDIR(st.st_mode):
                    out[p] = _fingerprint(p)[p]
    return out


# -- 1. sparse data files ------------------------------------------------------------------
def inflate(snap: Path, field: str, shape: list) -> dict:
    """Re-sign ``snap`` as an attacker would: ``field`` gets ``shape`` in the
    config, and every data file is rewritten with the size the new config
    needs, as a sparse file (holes) where it is large. Sizes and layout are
    consistent with the config; small files get their true checksum."""
    from bigper.buffer import PrioritizedReplayBuffer

    sizes = {}

    def change(body):
        body["config"]["fields"][field][0] = shape
        specs = PrioritizedReplayBuffer.storage_specs(Config.from_dict(body["config"]))
        for name, rec in body["data"].items():
            rows, shp, dt = specs[name]
            for m in rec["files"]:
                del body["files"][m]
                os.unlink(snap / m)
            member = f"data/{name}.bin"
            size = int(rows) * int(np.prod(shp, dtype=object)) * np.dtype(dt).itemsize
            with open(snap / member, "wb") as f:
                f.truncate(size)
            sizes[member] = size
            ck = digest(b"\0" * size) if size < (1 << 20) else "0" * 16
            body["files"][member] = {"size": size, "xxh3_64": ck}
            body["data"][name] = {"rows": int(rows), "shape": [int(d) for d in shp],
                                  "dtype": np.dtype(dt).str, "chunk_rows": int(rows), "files": [member]}

    resign(snap, change)
    return sizes


@pytest.fixture
def terabyte(tmp_path):
    """A snapshot of a few kilobytes whose obs and next_obs files are 1 TiB of holes each."""
    snap = small("memmap", tmp_path)
    sizes = inflate(snap, "obs", [1 << 18, 1 << 18])  # 16 rows of 64 GiB
    assert sizes["data/obs.bin"] == TIB and os.stat(snap / "data/obs.bin").st_blocks == 0
    return snap


def test_verify_refuses_terabyte_sparse_files_at_once(terabyte):
    before = fingerprint(terabyte)
    r = run_bigper("verify", str(terabyte), timeout=30)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    line = r.stdout.strip()
    assert line.startswith("CORRUPT"), line
    assert "data/next_obs.bin" in line or "data/obs.bin" in line, line
    assert f"{TIB}" in line and "allocated" in line, line
    assert fingerprint(terabyte) == before


def test_memmap_load_refuses_terabyte_sparse_files_at_once(terabyte, tmp_path):
    _load_refused_at_once(terabyte, tmp_path / "live")


@pytest.mark.parametrize("kind", ["memory", "hdf5"])
def test_every_load_path_refuses_terabyte_sparse_files_at_once(kind, tmp_path):
    snap = small(kind, tmp_path)
    inflate(snap, "obs", [1 << 18, 1 << 18])
    _load_refused_at_once(snap, None if kind == "memory" else tmp_path / "live.h5")


def _load_refused_at_once(snap: Path, live):
    """``load`` in a subprocess (a regression would read a terabyte in threads)."""
    before = fingerprint(snap)
    code = ("import bigper, sys\n"
            "try:\n"
            f"    bigper.PrioritizedReplayBuffer.load({str(snap)!r}, path={None if live is None else str(live)!r})\n"
            "except bigper.errors.CorruptSnapshotError as e:\n"
            "    print('REFUSED', e); sys.exit(0)\n"
            "print('LOADED'); sys.exit(1)\n")
    r = run_bigper(code=code, timeout=30)
    assert r.returncode == 0 and r.stdout.startswith("REFUSED"), r.stdout + r.stderr
    assert "obs.bin" in r.stdout and f"{TIB}" in r.stdout
    assert fingerprint(snap) == before
    if live is not None:
        assert not os.path.lexists(live / "data") and not os.path.lexists(live)


def test_a_sparse_state_file_is_refused_in_process(tmp_path):
    """The same check on the in-process path, for a file below the terabyte: a
    state array of 256 MiB of holes is refused by size checks before any read."""
    snap = small("memory", tmp_path)
    member = "state/pending.npy"
    with open(snap / member, "wb") as f:
        f.truncate(256 << 20)
    resign(snap, lambda b: (b["files"].__setitem__(member, {"size": 256 << 20, "xxh3_64": "0" * 16}),
                            b["state"]["arrays"].__setitem__("pending", member)))
    with deadline(20):
        e = refused(CorruptSnapshotError, snap)
        with pytest.raises(CorruptSnapshotError, match="allocated"):
            verify(snap)
    assert "pending.npy" in str(e) and str(256 << 20) in str(e)


def test_size_check_and_checksum_check_each_refuse_a_sparse_member(terabyte):
    """Both readers of a member check it: the size check that runs before any
    allocation, and the checksum read (a file swapped in between is caught)."""
    from bigper.snapshot.manifest import check_file, member_sizes, read_manifest

    body = read_manifest(terabyte)
    item = ("data/obs.bin", body["files"]["data/obs.bin"])
    with deadline(10):
        with pytest.raises(CorruptSnapshotError, match=f"{TIB} bytes, of which 0 allocated"):
            member_sizes(terabyte, [item])
        with pytest.raises(CorruptSnapshotError, match=f"{TIB} bytes, of which 0 allocated"):
            check_file(terabyte, *item)


MIB = 1 << 20


@pytest.mark.parametrize("size_mib,hole_mib,refused_", [
    (60, 60, False),    # all holes, but below the slack: reads in well under a second
    (256, 100, False),  # holes under half the size
    (256, 200, True),   # mostly holes
    (300, 150 + 65, True),
])
def test_check_dense_on_real_files(tmp_path, size_mib, hole_mib, refused_):
    """The threshold: holes beyond both half the size and HOLE_SLACK are refused,
    whatever st_size claims; written bytes count as data."""
    from bigper.common.files import HOLE_SLACK, check_dense

    assert HOLE_SLACK == 64 * MIB
    p = tmp_path / "f"
    with open(p, "wb") as f:
        f.seek(hole_mib * MIB)
        block = b"\x01" * MIB
        for _ in range(size_mib - hole_mib):
            f.write(block)
        f.truncate(size_mib * MIB)
    fd = os.open(p, os.O_RDONLY)
    try:
        if refused_:
            with pytest.raises(CorruptSnapshotError, match=f"{size_mib * MIB} bytes"):
                check_dense(fd, p)
        else:
            check_dense(fd, p)
    finally:
        os.close(fd)
        os.unlink(p)


@pytest.mark.parametrize("kind", ["memory", "memmap"])
def test_dense_snapshots_and_their_hard_links_still_load(kind, tmp_path):
    """bigper's own files are never sparse: a fresh snapshot (memmap chunks
    hard-linked from fallocated live files), larger than the slack, loads."""
    stream = Stream(k=None, seed=5, frame=(64, 64))
    path = None if kind == "memory" else tmp_path / "live"
    buf = make(kind, path, stream, capacity=40_000, chunk_bytes=1 << 26)
    feed(buf, stream, 50)  # 50 of 40,000 rows written: the rest of every file is zeros
    snap = buf.save(tmp_path / "snap")
    buf.close()
    assert sum(p.stat().st_size for p in (snap / "data").iterdir()) > (256 << 20)
    assert verify(snap)["problems"] == []
    back = load(snap, path=None if kind == "memory" else tmp_path / "again")
    assert len(back) == 50
    back.close()


# -- 2. a read-only filesystem ---------------------------------------------------------------
def _mount(cmd: list) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise OSError(f"{' '.join(cmd)}: {r.stderr.strip()}")


@pytest.fixture
def readonly_fs(tmp_path):
    """A real tmpfs at ``tmp_path/fs`` holding a closed memmap storage
    (``mm``), the same without its lock file (``mm-nolock``), and an HDF5
    storage (``h5.h5``, with and without lock), remounted read-only."""
    fs = tmp_path / "fs"
    fs.mkdir()
    try:
        _mount(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(fs)])
    except OSError as e:  # not root, or no mount in this sandbox: nothing to test on
        pytest.skip(f"a read-only filesystem needs mount (root): {e}")
    try:
        for kind, name in (("memmap", "mm"), ("memmap", "mm-nolock"), ("hdf5", "h5.h5"), ("hdf5", "h5n.h5")):
            stream = Stream(k=None, seed=7)
            buf = make(kind, fs / name, stream, capacity=16)
            feed(buf, stream, 20)
            buf.close()
        os.unlink(fs / "mm-nolock" / ".lock")
        os.unlink(fs / "h5n.h5.lock")
        import h5py

        with h5py.File(fs / "foreign.h5", "w") as f:  # an HDF5 file bigper did not write
            f["x"] = np.arange(4)
        _mount(["mount", "-o", "remount,ro", str(fs)])
        yield fs
    finally:
        if subprocess.run(["umount", str(fs)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(fs)], capture_output=True)


@pytest.mark.parametrize("name", ["mm", "mm-nolock", "h5.h5", "h5n.h5"])
def test_a_reader_opens_a_storage_on_a_read_only_filesystem(readonly_fs, name):
    path = readonly_fs / name
    with pytest.raises(OSError):  # the filesystem really is read-only
        open(readonly_fs / "probe", "w")
    before = fingerprint(readonly_fs)
    kind = "hdf5" if name.endswith(".h5") else "memmap"
    stream = Stream(k=None, seed=7)
    buf = bigper.PrioritizedReplayBuffer(16, stream.fields(), storage=kind, path=path, read_only=True)
    try:
        assert len(buf) == 16
        batch = buf.sample(8)
        assert batch["obs"].shape == (8, 8, 8)
        # a second reader shares it; the lock (where there is one) is held read-only
        other = bigper.PrioritizedReplayBuffer(16, stream.fields(), storage=kind, path=path, read_only=True)
        other.close()
    finally:
        buf.close()
    assert fingerprint(readonly_fs) == before


def test_a_reader_refuses_a_foreign_hdf5_file_on_a_read_only_filesystem(readonly_fs):
    """With no lock file to take (none can be made there), the refusal is
    bigper's error naming the file, not the filesystem's EROFS from removing one."""
    before = fingerprint(readonly_fs)
    stream = Stream(k=None, seed=7)
    with pytest.raises(bigper.BigperError, match="foreign.h5"):
        bigper.PrioritizedReplayBuffer(16, stream.fields(), storage="hdf5", path=readonly_fs / "foreign.h5",
                                       read_only=True)
    assert fingerprint(readonly_fs) == before


@pytest.mark.parametrize("name", ["mm", "mm-nolock", "h5.h5", "h5n.h5"])
def test_verify_a_storage_on_a_read_only_filesystem(readonly_fs, name):
    before = fingerprint(readonly_fs)
    r = run_bigper("verify", str(readonly_fs / name))
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr
    assert fingerprint(readonly_fs) == before


def test_a_reader_holds_its_lock_file_read_only(tmp_path):
    """A reader's lock fd is opened O_RDONLY (flock works on it): it cannot
    write the file a writer records its PID in."""
    stream = Stream(k=None, seed=7)
    buf = make("memmap", tmp_path / "mm", stream, capacity=16)
    feed(buf, stream, 3)
    buf.close()
    reader = bigper.PrioritizedReplayBuffer(16, stream.fields(), storage="memmap", path=tmp_path / "mm",
                                            read_only=True)
    try:
        lock = os.stat(tmp_path / "mm" / ".lock")
        fds = [int(f) for f in os.listdir("/proc/self/fd")]
        mine = []
        for fd in fds:
            try:
                st = os.fstat(fd)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (lock.st_dev, lock.st_ino):
                flags = int(Path(f"/proc/self/fdinfo/{fd}").read_text().split("flags:")[1].split()[0], 8)
                mine.append(flags & os.O_ACCMODE)
        assert mine == [os.O_RDONLY]
    finally:
        reader.close()


# -- 3. numbers read from disk: type and range -------------------------------------------------
HUGE = 2**70
STATE_META = [  # (key, value) written into state.meta of a snapshot or meta.json's state
    ("max_leaf", HUGE), ("max_leaf", 2**1100), ("max_leaf", True), ("max_leaf", "1.5"),
    ("max_leaf", [1.5]), ("max_leaf", {"v": 1.5}), ("max_leaf", float("nan")), ("max_leaf", -1.0),
    ("max_leaf", None), ("count", HUGE), ("count", 20.0), ("count", True), ("count", -1),
    ("count", {"n": 20}), ("count", float("inf")), ("beta_step", 2**64), ("beta_step", 1.5),
    ("beta_step", False), ("env_ended", [1]), ("env_ended", [[True]]), ("env_ended", "x"),
    ("prioritization", []), ("prioritization", 3),
    ("rng", {"bit_generator": "PCG64", "state": {"state": 2**300, "inc": 1}, "has_uint32": 0, "uinteger": 0}),
    ("rng", {"bit_generator": "PCG64", "state": {"state": 1.5, "inc": 1}, "has_uint32": 0, "uinteger": 0}),
]
FRAMES_META = [{"fw": HUGE}, {"fw": 3.0}, {"fw": True}, {"fw": -1}, {"fw": [3]}, [3], None]


def _set(key, value):
    return lambda b: b["state"]["meta"].__setitem__(key, value)


@pytest.mark.parametrize("key,value", STATE_META + [("frames", v) for v in FRAMES_META],
                         ids=lambda v: str(v)[:24])
def test_a_snapshot_with_a_number_of_the_wrong_type_or_range(tmp_path, key, value):
    snap = small("memmap", tmp_path, k=4 if key == "frames" else None)
    resign(snap, _set(key, value))
    e = refused(CorruptSnapshotError, snap, tmp_path / "live", path=tmp_path / "live")
    assert key in str(e)
    before = fingerprint(snap)
    try:
        rep = verify(snap)
    except CorruptSnapshotError:
        pass
    else:
        assert rep["problems"] and any(key in p for p in rep["problems"]), rep
    assert fingerprint(snap) == before


def _storage(tmp_path, k=None) -> Path:
    stream = Stream(k=k, seed=11)
    path = tmp_path / "mm"
    buf = make("memmap", path, stream, capacity=16)
    feed(buf, stream, 20)
    buf.close()
    return path


def _resume(path, k=None):
    return make("memmap", path, Stream(k=k, seed=11), capacity=16)


@pytest.mark.parametrize("key,value", STATE_META + [("frames", v) for v in FRAMES_META],
                         ids=lambda v: str(v)[:24])
def test_a_memmap_meta_json_with_a_number_of_the_wrong_type_or_range(tmp_path, key, value):
    k = 4 if key == "frames" else None
    path = _storage(tmp_path, k)
    meta = json.loads((path / "meta.json").read_text())
    meta["state"][key] = value
    (path / "meta.json").write_text(json.dumps(meta))
    before = fingerprint(path)
    with deadline(20), pytest.raises(bigper.BigperError) as e:
        _resume(path, k)
    assert key in str(e.value)
    assert fingerprint(path) == before


RECORD = [  # (key, value) of meta.json itself
    ("clean", "yes"), ("clean", 1), ("state", []), ("state", "x"), ("state_files", [1]),
    ("state_files", "gid"), ("shared_digests", []), ("shared_digests", {"obs": {"0": 5}}),
    ("shared_digests", {"obs": {"0": [HUGE, "ab"]}}), ("shared_digests", {"obs": {"0": ["x", 3]}}),
    ("shared_digests", {"obs": 7}), ("chunk_bytes", "4096"), ("chunk_bytes", 2**70), ("chunk_bytes", True),
]


@pytest.mark.parametrize("key,value", RECORD, ids=lambda v: str(v)[:24])
def test_a_memmap_record_with_a_field_of_the_wrong_type(tmp_path, key, value):
    path = _storage(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    meta[key] = value
    (path / "meta.json").write_text(json.dumps(meta))
    before = fingerprint(path)
    with deadline(20), pytest.raises(bigper.BigperError) as e:
        _resume(path)
    assert key in str(e.value)
    assert fingerprint(path) == before
    r = run_bigper("verify", str(path))
    assert r.returncode == 1 and "Traceback" not in r.stderr and key in r.stdout, r.stdout + r.stderr
    assert fingerprint(path) == before


def test_verify_and_info_on_a_huge_max_leaf(tmp_path):
    """The issue's cases through the CLI: verify reports, info prints what it can, no traceback."""
    snap = small("memory", tmp_path)
    resign(snap, lambda b: (b["state"]["meta"].__setitem__("max_leaf", HUGE),
                            b["summary"].__setitem__("total_priority", 2**2000),
                            b["summary"].__setitem__("len", 2**2000)))
    path = _storage(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    meta["state"]["max_leaf"] = HUGE
    (path / "meta.json").write_text(json.dumps(meta))
    before = fingerprint(snap, path)
    for where in (snap, path):
        r = run_bigper("verify", str(where))
        assert r.returncode == 1 and "Traceback" not in r.stderr and "max_leaf" in r.stdout, r.stdout + r.stderr
    r = run_bigper("info", str(snap))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert str(2**2000) not in r.stdout  # a number no buffer records is not shown as the fill
    assert fingerprint(snap, path) == before


def test_a_sparse_state_file_in_a_memmap_storage_is_refused_unread(tmp_path):
    """The storage's own state files go through read_regular, which reads them
    whole: a file of holes is refused before it is read (not after 256 MiB)."""
    path = _storage(tmp_path)
    os.unlink(path / "state" / "status.npy")
    with open(path / "state" / "status.npy", "wb") as f:
        f.truncate(256 << 20)
    before = fingerprint(path)
    with deadline(20), pytest.raises(CorruptSnapshotError, match="sparse") as e:
        _resume(path)
    assert "status.npy" in str(e.value) and str(256 << 20) in str(e.value)
    r = run_bigper("verify", str(path))
    assert r.returncode == 1 and "sparse" in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert fingerprint(path) == before


@pytest.mark.parametrize("value", [2**1100, -(2**1100), 2**70, True, "0.6", [0.6], float("inf")])
def test_a_sidecar_meta_with_a_number_no_writer_records(tmp_path, value):
    """An offline dataset's priorities sidecar: alpha of its saved keys is
    checked for type and range (2**1100 overflowed math.isfinite)."""
    import h5py

    ds = tmp_path / "ds.h5"
    with h5py.File(ds, "w") as f:
        f["observations"] = np.zeros((10, 3), np.float32)
        f["actions"] = np.zeros((10, 1), np.float32)
        f["rewards"] = np.zeros(10, np.float32)
        f["terminals"] = np.zeros(10, bool)
        f["timeouts"] = np.zeros(10, bool)
    with bigper.PrioritizedReplayBuffer.from_hdf5(ds) as buf:
        buf.update_priorities(np.array([0, 1]), np.array([5.0, 7.0]))
    side = tmp_path / "ds.h5.priorities"
    meta = json.loads((side / "meta.json").read_text())
    meta["leaves"]["alpha"] = value
    (side / "meta.json").write_text(json.dumps(meta))
    before = fingerprint(tmp_path)
    with deadline(20), pytest.raises(CorruptSnapshotError, match="alpha"):
        bigper.PrioritizedReplayBuffer.from_hdf5(ds)
    assert fingerprint(tmp_path) == before
