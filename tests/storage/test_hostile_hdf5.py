"""HDF5 storage on a full disk (a real small tmpfs) and the dataset of an offline buffer
opened read-only, checked at the OS level and by a second process.

The fill and close run in a subprocess: a crash of the HDF5 library (what a close
on a full disk used to end in) shows as a failed test, not as a dead pytest.
"""

import json
import os
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

import bigper

PRB = bigper.PrioritizedReplayBuffer

SCRIPT = textwrap.dedent('''
    import json, os, sys
    import numpy as np
    import bigper

    path, free, reopen, compression = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
    opts = {"storage_options": {"compression": compression}} if compression != "none" else {}
    import inspect
    if "mode" in inspect.signature(bigper.PrioritizedReplayBuffer.__init__).parameters:
        opts["mode"] = "resume"  # reopening an existing path is asked for by name
    make = lambda: bigper.PrioritizedReplayBuffer(
        capacity=300, fields={"x": ((32,), np.float32)}, storage="hdf5", path=path, seed=0, **opts)
    buf = make()
    for i in range(40):
        buf.add(x=np.full(32, i, np.float32), terminated=i % 7 == 6)
    if reopen:  # a clean close, then the same file reopened in this process
        buf.close()
        buf = make()
        for i in range(40, 60):
            buf.add(x=np.full(32, i, np.float32), terminated=False)
    added = len(buf)
    st = os.statvfs(os.path.dirname(path))
    fd = os.open(os.path.join(os.path.dirname(path), "filler"), os.O_WRONLY | os.O_CREAT)
    try:  # leave `free` bytes (rounded to pages) on the disk
        left = st.f_bavail * st.f_frsize - free
        while left > 0:
            left -= os.write(fd, b"\\0" * min(left, 1 << 16))
    except OSError:
        pass
    os.close(fd)
    try:
        buf.close()
        out = {"closed": True}
    except OSError as e:
        out = {"closed": False, "error": str(e)}
    except Exception as e:
        out = {"closed": None, "error": f"{type(e).__name__}: {e}"}
    import gc
    gc.collect()
    out["len"] = added
    # the same process goes on: the disk has room again, the file is reopened
    os.unlink(os.path.join(os.path.dirname(path), "filler"))
    try:
        again = make()
    except bigper.UncleanStorageError as e:
        out["reopen"] = {"unclean": str(e)}
    else:
        xs = again.storage.read("x", np.arange(len(again)))
        ok = bool((xs[:, 0] == np.arange(len(again))).all() and (xs == xs[:, :1]).all())
        out["reopen"] = {"len": len(again), "rows_ok": ok}
        again.close()
    print("RESULT " + json.dumps(out))
''')

@pytest.fixture
def small_disk(tmp_path):
    d = tmp_path / "disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.decode().strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def run(code, *args):
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, f"exit {r.returncode} (a negative one is a signal)\n{r.stdout}\n{r.stderr[-3000:]}"
    assert "Exception ignored" not in r.stderr, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, r.stdout + r.stderr[-3000:]
    return json.loads(line[-1][7:])


@pytest.mark.parametrize("compression", ["none", "lzf"])
@pytest.mark.parametrize("reopen", [False, True], ids=["first-close", "reopened"])
@pytest.mark.parametrize("free", [0, 65536, pytest.param(8192, marks=pytest.mark.slow),
                                  pytest.param(300_000, marks=pytest.mark.slow)])
def test_close_on_a_full_disk_raises_or_records(small_disk, free, reopen, compression):
    """close() on a full disk: an OSError when the state was not recorded, and the file
    refused as unclean on reopen; or a clean close whose state reopens with every row.
    Never a crash, never "Exception ignored" from h5py's destructors."""
    path = small_disk / "replay.h5"
    got = run(SCRIPT, path, free, int(reopen), compression)
    assert got["closed"] is not None, got  # an OSError or a clean close, nothing else
    if got["closed"]:
        assert got["reopen"] == {"len": got["len"], "rows_ok": True}
    else:
        assert "close could not record" in got["error"] and "unclean" in got["error"]
        assert "unclean" in got["reopen"], got  # refused on reopen, never a silent half state
    assert not (small_disk / "filler").exists()


def test_close_with_room_records_the_state(tmp_path):
    """The same script with a disk that has room: close records, reopen resumes every row."""
    path = tmp_path / "r.h5"
    got = run(SCRIPT.replace("left = st.f_bavail * st.f_frsize - free", "left = 0"), path, 0, 1, "none")
    assert got["closed"] is True and got["reopen"] == {"len": 60, "rows_ok": True}


# -- what is at the storage path ----------------------------------------------------------------------
def fingerprint(root) -> dict:
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            out[p] = (stat_kind(st), open(p, "rb").read() if os.path.isfile(p) and not os.path.islink(p) else None)
    return out


def stat_kind(st):
    import stat

    return stat.S_IFMT(st.st_mode)


@pytest.mark.parametrize("kind, err", [
    ("fifo", bigper.errors.PathExistsError), ("text", bigper.errors.PathExistsError),
    ("other-hdf5", bigper.IncompatibleSnapshotError), ("meta-not-json", bigper.CorruptSnapshotError),
    ("meta-deep-json", bigper.CorruptSnapshotError)])
def test_hdf5_storage_path_holding_something_else(tmp_path, kind, err):
    """Opened by the storage itself (the buffer may look first): refused without blocking,
    the file untouched, no lock of bigper's left beside it."""
    import threading

    from bigper.storage.hdf5 import HDF5Storage

    path = tmp_path / "replay.h5"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "text":
        path.write_text("my notes\n")
    else:
        with h5py.File(path, "w") as f:
            f["data"] = np.arange(5)
            if kind != "other-hdf5":
                f.create_group("_bigper").attrs["meta"] = "{oops" if kind == "meta-not-json" else "[" * 100_000
    before = fingerprint(tmp_path)
    box = {}

    def go():
        try:
            HDF5Storage(path).open({})
        except BaseException as e:  # noqa: BLE001
            box["e"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("blocked on a FIFO at the storage path")
    assert isinstance(box.get("e"), err), box
    assert fingerprint(tmp_path) == before


def test_a_storage_whose_data_lives_in_another_file_is_never_opened_for_writing(tmp_path):
    """A crafted storage file with external raw storage for an array: resuming it would
    write rows into the victim. Refused at open; the victim keeps its bytes."""
    from bigper.storage.hdf5 import HDF5Storage

    path = tmp_path / "replay.h5"
    buf = PRB(8, {"x": ((4,), np.float32)}, storage="hdf5", path=path)
    buf.add(x=np.ones(4, np.float32), terminated=False)
    buf.close()
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious" * 100)
    with h5py.File(path, "a") as f:
        shape, dtype = f["x"].shape, f["x"].dtype
        del f["x"]
        f.create_dataset("x", shape=shape, dtype=dtype, external=[(str(victim), 0, h5py.h5f.UNLIMITED)])
    before = fingerprint(tmp_path)
    with pytest.raises(bigper.CorruptSnapshotError, match="'x' keeps its data in external file"):
        HDF5Storage(path).open({})
    assert fingerprint(tmp_path) == before


def test_a_huge_recorded_state_array_is_not_read_by_the_storage(tmp_path):
    from bigper.storage.hdf5 import HDF5Storage

    path = tmp_path / "replay.h5"
    buf = PRB(8, {"x": ((4,), np.float32)}, storage="hdf5", path=path)
    buf.add(x=np.ones(4, np.float32), terminated=False)
    buf.close()
    with h5py.File(path, "a") as f:
        f["_bigper/state"].create_dataset("junk", shape=(1 << 40,), dtype="f8", chunks=(1 << 16,),
                                          compression="gzip")
    store = HDF5Storage(path, read_only=True)
    store.open({})
    try:
        with pytest.raises(bigper.CorruptSnapshotError, match="'junk'.*larger than any state of a 8-slot"):
            store.saved_state()
    finally:
        store.close()


@pytest.mark.parametrize("how", ["fewer-rows", "other-dtype", "group", "meta-arrays"])
def test_a_reopened_storage_whose_arrays_differ_is_refused_before_writing(tmp_path, how):
    """Rows must never land outside a dataset or in another one: the file's datasets and
    records are checked against the buffer's arrays before the reopen writes anything."""
    from bigper.storage.hdf5 import HDF5Storage

    path = tmp_path / "replay.h5"
    buf = PRB(8, {"x": ((4,), np.float32)}, storage="hdf5", path=path)
    buf.add(x=np.ones(4, np.float32), terminated=False)
    buf.close()
    want = {"x": (8, (4,), np.float32)}  # what this buffer's storage is allocated with
    ok = HDF5Storage(path, read_only=True)
    ok.open({})
    ok.allocate(want)  # the untouched file passes
    ok.close()
    with h5py.File(path, "a") as f:
        if how == "fewer-rows":
            del f["x"]
            f.create_dataset("x", shape=(2, 4), dtype="f4")
        elif how == "other-dtype":
            del f["x"]
            f.create_dataset("x", shape=(8, 4), dtype="f8")
        elif how == "group":
            del f["x"]
            f.create_group("x")
        else:
            meta = json.loads(f["_bigper"].attrs["meta"])
            meta["arrays"] = {"y": meta["arrays"]["x"]}
            f["_bigper"].attrs["meta"] = json.dumps(meta)
    before = fingerprint(tmp_path)
    store = HDF5Storage(path)
    store.open({})
    with pytest.raises(bigper.IncompatibleSnapshotError, match="array 'x'|records arrays"):
        store.allocate(want)
    assert fingerprint(tmp_path) == before
