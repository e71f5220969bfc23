"""Issue 42, the attack on what a storage kind answers (``storage/base.py``,
``storage/__init__.py``: ``register``, ``storage_class``, ``kind_at``,
``in_memory``; ``snapshot/live.py``: ``verify_live``).

Every new surface is untrusted input's door: a name that is no kind, a
class that is no storage, a snapshot whose recorded kind or options were
crafted (its checksum rewritten), a path that is a FIFO, a dangling link or
a lock file that is not one. Each gets bigper's error or a verdict, never a
raw exception or a hang, and the path is left as it was.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper import storage
from bigper.errors import BigperError, IncompatibleSnapshotError, InvalidArgumentError, InvalidTypeError
from bigper.snapshot.live import verify_live
from bigper.snapshot.manifest import MANIFEST, decode, encode
from bigper.storage.memory import MemoryStorage

FIELDS = {"obs": ((3,), np.float32), "reward": ((), np.float32)}


@contextmanager
def deadline(seconds: int):
    """A hang is a failure, not a stuck suite."""
    def fail(*_):
        raise TimeoutError(f"took more than {seconds} s")
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _buf(kind="memory", path=None, n=12):
    buf = bigper.PrioritizedReplayBuffer(capacity=16, fields=FIELDS, storage=kind, path=path, seed=0)
    for i in range(n):
        buf.add(obs=np.full(3, i, np.float32), reward=float(i), next_obs=np.zeros(3, np.float32),
                terminated=False)
    return buf


@pytest.mark.parametrize("name", [None, 3, 2.5, b"memory", ["memory"], {"memory": 1}, "", "Memory", " memory",
                                  "memory\x00", "hdf5-source", "dict", "../memmap"])
def test_a_name_that_is_no_kind_is_refused_by_name(name):
    with pytest.raises(InvalidArgumentError, match="storage must be one of"):
        storage.storage_class(name)
    with pytest.raises(InvalidArgumentError, match="storage must be one of"):
        bigper.PrioritizedReplayBuffer(capacity=4, fields=FIELDS, storage=name)
    assert storage.in_memory(name) is False


@pytest.mark.parametrize("kind", [None, 3, "", "a b", "Upper", "x-y", "1st", "memory\n"])
def test_register_refuses_a_kind_that_is_no_name(kind):
    cls = type("Odd", (MemoryStorage,), {"kind": kind})
    with pytest.raises(InvalidArgumentError, match="own lower-case identifier|is taken"):
        storage.register(cls)
    assert storage.kinds() == ("memory", "memmap", "hdf5")


def test_register_refuses_a_kind_given_as_a_property():
    cls = type("Prop", (MemoryStorage,), {"kind": property(lambda self: "prop")})
    with pytest.raises(InvalidArgumentError, match="own lower-case identifier"):
        storage.register(cls)
    assert "prop" not in storage.kinds()


@pytest.mark.parametrize("kind", ["memory", "memmap", "hdf5"])
def test_bigper_s_own_kinds_cannot_be_replaced(kind):
    cls = type("Usurper", (MemoryStorage,), {"kind": kind})
    with pytest.raises(InvalidArgumentError, match="is taken"):
        storage.register(cls)
    assert storage.storage_class(kind).__module__.startswith("bigper.storage.")


def _craft(snap: Path, **storage_record):
    body = decode((snap / MANIFEST).read_bytes(), snap)
    body["storage"].update(storage_record)
    (snap / MANIFEST).write_bytes(encode(body))


def _craft_config(snap: Path, kind):
    body = decode((snap / MANIFEST).read_bytes(), snap)
    body["config"]["storage"] = kind
    (snap / MANIFEST).write_bytes(encode(body))


@pytest.mark.parametrize("kind", ["nosuch", "hdf5-source", "", 7, None, ["memory"]])
def test_a_snapshot_naming_no_known_kind_is_refused(tmp_path, kind):
    buf = _buf()
    snap = buf.save(tmp_path / "snap")
    buf.close()
    _craft_config(snap, kind)
    with deadline(20), pytest.raises(BigperError):
        bigper.PrioritizedReplayBuffer.load(snap, path=tmp_path / "live")
    assert not os.path.lexists(tmp_path / "live")


@pytest.mark.parametrize("kind", ["memmap", "hdf5"])
def test_a_memory_snapshot_relabelled_as_a_disk_kind_makes_nothing_wrong(tmp_path, kind):
    """The config says a disk kind, the data are a memory buffer's: the load
    makes that kind's storage (its layout checked) or refuses; never a raw error."""
    buf = _buf()
    snap = buf.save(tmp_path / "snap")
    buf.close()
    _craft_config(snap, kind)
    live = tmp_path / ("live.h5" if kind == "hdf5" else "live")
    with deadline(30):
        try:
            twin = bigper.PrioritizedReplayBuffer.load(snap, path=live)
        except BigperError:
            return
    assert twin.config.storage == kind and len(twin) == 12
    twin.sample(4)
    twin.close()


@pytest.mark.parametrize("options", [{"chunk_bytes": 0}, {"chunk_bytes": "4096"}, {"chunk_bytes": True},
                                     {"chunk_bytes": 2 ** 70}, {"compression": "zstd"}, {"compression": 1},
                                     ["chunk_bytes"], "options"])
@pytest.mark.parametrize("kind", ["memmap", "hdf5"])
def test_crafted_storage_options_are_bigper_s_error_and_change_nothing(tmp_path, kind, options):
    src = tmp_path / ("src.h5" if kind == "hdf5" else "src")
    buf = _buf(kind, src)
    snap = buf.save(tmp_path / "snap")
    buf.close()
    _craft(snap, options=options)
    live = tmp_path / ("live.h5" if kind == "hdf5" else "live")
    with deadline(30):
        try:
            twin = bigper.PrioritizedReplayBuffer.load(snap, path=live)
        except BigperError:
            assert not os.path.lexists(live)
            return
    twin.sample(4)  # an option the kind does not read (chunk_bytes for hdf5) changes nothing
    twin.close()


def test_a_registered_kind_whose_restoring_refuses_crafted_options_is_incompatible(tmp_path):
    class Picky(MemoryStorage):
        kind = "picky"

        def snapshot_options(self):
            return {"rows_per_page": 4}

        @classmethod
        def restoring(cls, path, options):
            if not isinstance(options.get("rows_per_page"), int):
                raise InvalidArgumentError(f"rows_per_page must be an int, got {options.get('rows_per_page')!r}")
            return cls()

    storage.register(Picky)
    try:
        buf = _buf("picky")
        snap = buf.save(tmp_path / "snap")
        buf.close()
        bigper.PrioritizedReplayBuffer.load(snap).close()
        _craft(snap, options={"rows_per_page": "four"})
        with pytest.raises(IncompatibleSnapshotError, match="do not make a picky storage"):
            bigper.PrioritizedReplayBuffer.load(snap)
    finally:
        storage._REGISTERED.pop("picky", None)


def test_kind_at_and_verify_live_never_hang_or_raise_on_odd_paths(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    h5ish = tmp_path / "fake.h5"
    h5ish.write_bytes(b"\x89HDF\r\n\x1a\n" + os.urandom(200))
    lockfifo = tmp_path / "x.h5"
    lockfifo.write_bytes(b"not hdf5 at all")
    os.mkfifo(tmp_path / "x.h5.lock")
    metafifo = tmp_path / "mm"
    metafifo.mkdir()
    os.mkfifo(metafifo / "meta.json")
    with deadline(20):
        for p in (fifo, dangling, loop, tmp_path / "absent", tmp_path):
            assert storage.kind_at(p) is None, p
            assert verify_live(p) is None, p
        for p, kind in ((h5ish, "hdf5"), (lockfifo, "hdf5"), (metafifo, "memmap")):
            assert storage.kind_at(p).kind == kind, p
            v = verify_live(p)
            assert v is not None and v.status in ("CORRUPT", "INCOMPATIBLE", "IN USE", "UNCLEAN"), (p, v)
    assert (tmp_path / "fake.h5").read_bytes()[:8] == b"\x89HDF\r\n\x1a\n"
    assert sorted(os.listdir(metafifo)) == ["meta.json"]  # no lock file left where the open was refused
    assert sorted(os.listdir(tmp_path)) == ["dangling", "fake.h5", "fifo", "loop", "mm", "x.h5", "x.h5.lock"]


def test_a_recognizer_that_raises_is_not_the_path_s_kind(tmp_path):
    class Nosy(MemoryStorage):
        kind = "nosy"

        @classmethod
        def recognizes(cls, path):
            raise PermissionError(13, "no", str(path))

    storage.register(Nosy)
    try:
        assert storage.kind_at(tmp_path) is None
        assert verify_live(tmp_path) is None
    finally:
        storage._REGISTERED.pop("nosy", None)


def test_a_live_storage_verdict_never_changes_it(tmp_path):
    for kind, path in (("memmap", tmp_path / "mm"), ("hdf5", tmp_path / "b.h5")):
        buf = _buf(kind, path)
        buf.close()
        before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(tmp_path.rglob("*")) if p.is_file()}
        v = verify_live(path)
        assert v.status == "OK" and v.text.startswith(f"a {kind} storage closed cleanly"), v
        after = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(tmp_path.rglob("*")) if p.is_file()}
        assert after == before


def test_storage_class_is_not_reached_through_storage_options(tmp_path):
    for opt in ("takeover", "read_only", "kind", "path"):
        with pytest.raises(InvalidArgumentError, match="does not take"):
            bigper.PrioritizedReplayBuffer(capacity=4, fields=FIELDS, storage="memmap", path=tmp_path / "m",
                                           storage_options={opt: True})
    assert not os.path.lexists(tmp_path / "m")
    with pytest.raises(InvalidTypeError):
        storage.register(MemoryStorage())
