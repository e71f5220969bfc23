"""Hostile input for offline datasets: crafted priorities sidecars (path escapes, links, special
files, bad numbers) and crafted HDF5 datasets (external storage and links, virtual datasets, link
loops, odd dtypes, huge declared sizes, addresses past the end, special files in place of the file).

Every refusal is checked against a fingerprint of the dataset, the sidecar and any victim file
(names, kinds and bytes on disk) taken before it: a refusal changes nothing.
"""

import hashlib
import json
import os
import stat
import threading
import warnings

import h5py
import numpy as np
import pytest

import bigper
from bigper.offline.datasets import OfflineDatasetError
from tests.offline.test_offline import scores_of, write_d4rl

PRB = bigper.PrioritizedReplayBuffer


def fingerprint(*roots) -> dict:
    """Every entry under ``roots`` (lstat kind, symlink target or sha256 of the bytes)."""
    out = {}
    for root in roots:
        root = str(root)
        paths = [root]
        if os.path.isdir(root) and not os.path.islink(root):
            for d, dirs, files in os.walk(root):
                paths += [os.path.join(d, n) for n in dirs + files]
        for p in paths:
            if not os.path.lexists(p):
                out[p] = None
                continue
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[p] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[p] = ("file", hashlib.sha256(open(p, "rb").read()).hexdigest())
            else:
                out[p] = ("other", stat.S_IFMT(st.st_mode))
    return out


def no_hang(fn, fifos=(), seconds=20):
    """Run ``fn``; fail (after unblocking it by opening ``fifos`` for writing) if it blocks."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        for f in fifos:
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(5)
        pytest.fail(f"blocked for {seconds} s on a special file")
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.fixture
def scored(tmp_path):
    """A D4RL file with a complete reprioritize in its sidecar, and a victim file beside it."""
    path = tmp_path / "hopper.hdf5"
    write_d4rl(path)
    with PRB.from_hdf5(path) as buf:
        buf.reprioritize(scores_of, progress=False)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious user data\n" * 10)
    return path, tmp_path / "hopper.hdf5.priorities", victim


def edit_meta(side, fn):
    meta = json.loads((side / "meta.json").read_text())
    fn(meta)
    (side / "meta.json").write_text(json.dumps(meta))
    return meta


def partial_entry(side, rows, **kw):
    """A 'partial' entry shaped like the ones bigper writes."""
    import xxhash

    e = {"file": "scores-0123456789ab.f64", "done": 0, "total": rows, "rows_valid": 0,
         "xxh64": xxhash.xxh64(b"").hexdigest(), "batch_size": 8}
    e.update(kw)
    return e


# -- the sidecar: names ---------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["scores", "partial", "leaves"])
@pytest.mark.parametrize("name", ["../hopper.hdf5", "../victim.txt", "/etc/passwd", "..", "",
                                  "scores-0123456789ab.f64/../../victim.txt", "meta.json", ".lock", 7])
def test_entry_names_outside_bigpers_own_are_refused(scored, key, name):
    path, side, victim = scored
    n = 25

    def craft(meta):
        if key == "partial":
            meta["partial"] = partial_entry(side, n, file=name)
        elif key == "leaves":
            meta["leaves"] = {"file": name, "alpha": 0.6, "eps": 1e-6, "max_priority": None,
                              "xxh64": "0" * 16}
        else:
            meta["scores"]["file"] = name

    edit_meta(side, craft)
    before = fingerprint(path, side, victim)
    with pytest.raises(bigper.CorruptSnapshotError, match="not one bigper writes"):
        PRB.from_hdf5(path)
    assert fingerprint(path, side, victim) == before
    assert "unusable" in bigper.offline.datasets.describe(path)


def test_a_partial_entry_that_is_a_hard_link_to_the_dataset_is_never_written(tmp_path):
    """The reported attack, with a name bigper would write: a hard link to a file of
    exactly the right size. Reading it is harmless; reprioritize refuses to write it."""
    path = tmp_path / "hopper.hdf5"
    write_d4rl(path)
    side = tmp_path / "hopper.hdf5.priorities"
    side.mkdir()
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"\x07" * (25 * 8))
    os.link(victim, side / "scores-0123456789ab.f64")
    (side / ".lock").touch()
    with PRB.from_hdf5(path) as probe:
        fp = probe.storage.fingerprint()
    (side / "meta.json").write_text(json.dumps({"format": "bigper-priorities", "version": 1, "dataset": fp,
                                                "partial": partial_entry(side, 25)}))
    before = fingerprint(path, side, victim)
    with PRB.from_hdf5(path) as buf:
        with pytest.raises(bigper.CorruptSnapshotError, match="has 2 links"):
            buf.reprioritize(scores_of, progress=False)
    assert fingerprint(path, side, victim) == before


def test_the_dataset_itself_is_never_opened_for_writing_by_the_sidecar(tmp_path):
    """Even with one link (the sidecar entry *is* the dataset's inode) the check holds."""
    from bigper.offline.sidecar import Sidecar

    path = tmp_path / "d.hdf5"
    write_d4rl(path)
    st = os.stat(path)
    sc = Sidecar(tmp_path, {}, 25, protect=(st.st_dev, st.st_ino))
    os.rename(path, tmp_path / "scores-0123456789ab.f64")
    before = fingerprint(tmp_path)
    with pytest.raises(bigper.CorruptSnapshotError, match="is the dataset itself"):
        sc.write_scores({"file": "scores-0123456789ab.f64"}, 0, np.ones(3))
    assert fingerprint(tmp_path) == before


@pytest.mark.parametrize("what", ["scores", "meta.json", ".lock"])
def test_symlinks_in_the_sidecar_are_refused(scored, what):
    path, side, victim = scored
    if what == "scores":
        name = json.loads((side / "meta.json").read_text())["scores"]["file"]
    else:
        name = what
    os.unlink(side / name)
    os.symlink(victim, side / name)
    before = fingerprint(path, side, victim)
    with pytest.raises(bigper.BigperError, match="symbolic link|regular file"):
        with PRB.from_hdf5(path) as buf:  # .lock is only opened by a writer
            buf.reprioritize(scores_of, progress=False, restart=True)
    assert fingerprint(path, side, victim) == before


@pytest.mark.parametrize("what", ["scores", "meta.json", ".lock"])
def test_fifos_in_the_sidecar_are_refused_without_blocking(scored, what):
    path, side, victim = scored
    name = json.loads((side / "meta.json").read_text())["scores"]["file"] if what == "scores" else what
    os.unlink(side / name)
    os.mkfifo(side / name)
    before = fingerprint(path, side, victim)

    def go():
        with PRB.from_hdf5(path) as buf:
            buf.reprioritize(scores_of, progress=False, restart=True)

    with pytest.raises(bigper.CorruptSnapshotError, match="FIFO|regular file"):
        no_hang(go, [side / name])
    assert fingerprint(path, side, victim) == before


def test_a_planted_temporary_name_is_not_written_through(scored):
    """``.meta.json.tmp`` hard-linked to a victim: the commit replaces the name, the
    victim keeps its bytes."""
    path, side, victim = scored
    os.link(victim, side / ".meta.json.tmp")
    before = fingerprint(victim)
    with PRB.from_hdf5(path) as buf:
        buf.reprioritize(scores_of, progress=False, restart=True)
    assert fingerprint(victim) == before


def test_only_bigpers_own_names_are_ever_deleted(scored, tmp_path):
    path, side, victim = scored
    (side / "notes.txt").write_text("mine")
    (side / "scores-run.f64").write_text("not bigper's name either")
    keep = fingerprint(side / "notes.txt", side / "scores-run.f64")
    with PRB.from_hdf5(path) as buf:
        buf.reprioritize(scores_of, progress=False, restart=True)
        buf.update_priorities(np.array([0]), np.array([9.0]))
    assert fingerprint(side / "notes.txt", side / "scores-run.f64") == keep
    # a priorities= directory that is someone's (no meta.json) is refused, untouched
    theirs = tmp_path / "results"
    theirs.mkdir()
    (theirs / "train.csv").write_text("a,b\n1,2\n")
    before = fingerprint(theirs)
    with PRB.from_hdf5(path, priorities=theirs) as buf:
        with pytest.raises(bigper.errors.PathExistsError, match="did not create"):
            buf.reprioritize(scores_of, progress=False)
    assert fingerprint(theirs) == before


# -- the sidecar: numbers ---------------------------------------------------------------------------
BAD_META = {
    "dataset-list": lambda m: m.update(dataset=[1, 2]),
    "scores-list": lambda m: m.update(scores=["scores-0123456789ab.f64"]),
    "total-str": lambda m: m["scores"].update(total="25"),
    "total-huge": lambda m: m["scores"].update(total=2 ** 70),
    "total-bool": lambda m: m["scores"].update(total=True),
    "xxh-bad": lambda m: m["scores"].update(xxh64="zz"),
    "partial-negative": lambda m: m.update(partial=partial_entry(None, 25, rows_valid=-5)),
    "partial-rows-past": lambda m: m.update(partial=partial_entry(None, 25, rows_valid=26)),
    "partial-done-past": lambda m: m.update(partial=partial_entry(None, 25, done=30)),
    "partial-float": lambda m: m.update(partial=partial_entry(None, 25, done=1.5)),
    "partial-batch0": lambda m: m.update(partial=partial_entry(None, 25, batch_size=0)),
    "leaves-alpha-nan": lambda m: m.update(leaves={"file": "leaves-0123456789ab.npy", "alpha": "nan",
                                                   "eps": 1e-6, "max_priority": None, "xxh64": "0" * 16}),
    "leaves-maxp-list": lambda m: m.update(leaves={"file": "leaves-0123456789ab.npy", "alpha": 0.6,
                                                   "eps": 1e-6, "max_priority": [1], "xxh64": "0" * 16}),
    "leaves-kind-unknown": lambda m: m.update(leaves={"file": "leaves-0123456789ab.npy", "alpha": 0.6,
                                                      "eps": 1e-6, "max_priority": None, "xxh64": "0" * 16,
                                                      "prioritization": "uniform"}),
    "leaves-kind-list": lambda m: m.update(leaves={"file": "leaves-0123456789ab.npy", "alpha": 0.6,
                                                   "eps": 1e-6, "max_priority": None, "xxh64": "0" * 16,
                                                   "prioritization": ["rank"]}),
}


@pytest.mark.parametrize("case", sorted(BAD_META))
def test_bad_numbers_in_meta_are_refused(scored, case):
    path, side, victim = scored
    edit_meta(side, BAD_META[case])
    before = fingerprint(path, side, victim)
    with pytest.raises(bigper.CorruptSnapshotError, match="meta.json"):
        PRB.from_hdf5(path)
    assert fingerprint(path, side, victim) == before


def test_a_scores_file_of_the_wrong_size_is_refused(scored):
    path, side, victim = scored
    f = side / json.loads((side / "meta.json").read_text())["scores"]["file"]
    with open(f, "ab") as fh:
        fh.write(b"\0" * 8)
    before = fingerprint(path, side, victim)
    with pytest.raises(bigper.CorruptSnapshotError, match="208 bytes"):
        PRB.from_hdf5(path)
    assert fingerprint(path, side, victim) == before


@pytest.mark.parametrize("kind", ["proportional", "rank"])
@pytest.mark.parametrize("bad", [-1.0, np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("entry", ["scores", "partial"])
def test_resigned_scores_that_reprioritize_could_not_have_written_are_refused(scored, kind, bad, entry):
    """A scores file with a negative or non-finite score under a valid checksum: the
    file's error, naming it, never a leaf or a heap entry made of it."""
    from bigper.offline.sidecar import _xxh

    path, side, victim = scored
    meta = json.loads((side / "meta.json").read_text())
    f = side / meta["scores"]["file"]
    scores = np.fromfile(f, "<f8")
    scores[5] = bad
    scores.tofile(f)
    if entry == "scores":
        meta["scores"]["xxh64"] = _xxh(scores)
    else:  # the same file as an interrupted run, valid up to slot 10
        meta["partial"] = partial_entry(side, 25, file=meta.pop("scores")["file"], done=10, rows_valid=10,
                                        xxh64=_xxh(scores[:10]))
    (side / "meta.json").write_text(json.dumps(meta))
    before = fingerprint(path, side, victim)
    with pytest.raises(bigper.CorruptSnapshotError, match=rf"{f.name} holds the score .* at slot 5"):
        if entry == "scores":
            PRB.from_hdf5(path, prioritization=kind)
        else:
            with PRB.from_hdf5(path, prioritization=kind) as buf:
                buf.reprioritize(scores_of, progress=False)  # resumes: reads the partial file
    assert fingerprint(path, side, victim) == before


@pytest.mark.parametrize("kind", ["proportional", "rank"])
def test_saved_keys_above_what_max_priority_gives_are_refused(tmp_path, kind):
    import io

    from bigper.offline.sidecar import _xxh

    path = tmp_path / "hopper.hdf5"
    write_d4rl(path)
    with PRB.from_hdf5(path, prioritization=kind, max_priority=2.0) as buf:
        buf.update_priorities(np.array([0, 1]), np.array([1.0, 5.0]))  # 5.0 is clipped to 2.0
        top = float(buf.leaves(np.array([1]))[0])
    side = tmp_path / "hopper.hdf5.priorities"
    meta = json.loads((side / "meta.json").read_text())
    f = side / meta["leaves"]["file"]
    keys = np.load(f)
    keys[3] = top * 1.5
    raw = io.BytesIO()
    np.save(raw, keys, allow_pickle=False)
    f.write_bytes(raw.getvalue())
    meta["leaves"]["xxh64"] = _xxh(keys)
    (side / "meta.json").write_text(json.dumps(meta))
    before = fingerprint(path, side)
    with pytest.raises(bigper.CorruptSnapshotError, match="saved key .* of slot 3 is above"):
        PRB.from_hdf5(path, prioritization=kind, max_priority=2.0)
    assert fingerprint(path, side) == before


@pytest.mark.parametrize("text", ["[" * 100_000, "{" * 10, "\xff\xfe", "null"])
def test_meta_json_that_is_not_an_object(scored, text):
    path, side, victim = scored
    (side / "meta.json").write_bytes(text.encode("utf-8", "surrogateescape") if text != "\xff\xfe"
                                     else b"\xff\xfe")
    before = fingerprint(path, side, victim)
    with pytest.raises((bigper.CorruptSnapshotError, bigper.SidecarMismatchError)):
        PRB.from_hdf5(path)
    assert fingerprint(path, side, victim) == before


# -- the dataset file -------------------------------------------------------------------------------
def external_file(tmp_path, kind):
    """A D4RL file whose 'observations' (or part of it) comes from outside the file."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(25 * 3, dtype=np.float32).tobytes())
    path = tmp_path / f"{kind}.hdf5"
    write_d4rl(path, next_obs=False, extras=False)
    other = tmp_path / "other.hdf5"
    with h5py.File(other, "w") as f:
        f["observations"] = np.arange(25 * 3, dtype=np.float32).reshape(25, 3)
    with h5py.File(path, "a") as f:
        del f["observations"]
        if kind == "external-storage":
            f.create_dataset("observations", shape=(25, 3), dtype="<f4",
                             external=[(str(secret), 0, h5py.h5f.UNLIMITED)])
            target = "secret.bin"
        elif kind == "external-link":
            f["observations"] = h5py.ExternalLink(str(other), "/observations")
            target = "other.hdf5"
        else:
            lay = h5py.VirtualLayout(shape=(25, 3), dtype="<f4")
            lay[:] = h5py.VirtualSource(str(other), "observations", shape=(25, 3))
            f.create_virtual_dataset("observations", lay)
            target = "other.hdf5"
    return path, target


@pytest.mark.parametrize("kind", ["external-storage", "external-link", "virtual"])
def test_data_from_outside_the_file_needs_allow_external(tmp_path, kind):
    path, target = external_file(tmp_path, kind)
    before = fingerprint(tmp_path)
    with pytest.raises(OfflineDatasetError, match=f"'observations'.*{target}.*allow_external=True"):
        PRB.from_hdf5(path)
    assert fingerprint(tmp_path) == before
    with pytest.raises(OfflineDatasetError, match="allow_external"):
        bigper.offline.datasets.describe(path)
    with PRB.from_hdf5(path, allow_external=True) as buf:  # trusted: read as the user asked
        b = buf.sample(8)
        assert np.array_equal(b["obs"], np.arange(75, dtype=np.float32).reshape(25, 3)[b.indices])
    with pytest.raises(TypeError, match="allow_external"):
        PRB.from_hdf5(path, allow_external="yes")


def test_a_virtual_dataset_inside_the_file_is_fine(tmp_path):
    path = tmp_path / "vds.hdf5"
    data = write_d4rl(path, next_obs=False, extras=False)
    with h5py.File(path, "a") as f:
        f.move("observations", "raw_obs")
        lay = h5py.VirtualLayout(shape=(25, 3), dtype="<f4")
        lay[:] = h5py.VirtualSource(".", "raw_obs", shape=(25, 3))
        f.create_virtual_dataset("observations", lay)
    with PRB.from_hdf5(path) as buf:
        b = buf.sample(8)
        assert np.array_equal(b["obs"], data["observations"][b.indices])


def crafted(tmp_path, how):
    path = tmp_path / f"{how}.hdf5"
    write_d4rl(path, extras=False)
    with h5py.File(path, "a") as f:
        if how == "soft-loop":
            del f["observations"]
            f["observations"] = h5py.SoftLink("/loop")
            f["loop"] = h5py.SoftLink("/observations")
        elif how == "compound-obs":
            del f["observations"]
            f["observations"] = np.zeros(25, dtype=[("a", "<f4"), ("b", "<i4")])
        elif how == "vlen-obs":
            del f["observations"]
            f.create_dataset("observations", (25,), dtype=h5py.vlen_dtype(np.float32))
        elif how == "string-terminals":
            del f["terminals"]
            f["terminals"] = np.array([b"x"] * 25)
        elif how == "compound-terminals":
            del f["terminals"]
            f["terminals"] = np.zeros(25, dtype=[("a", "<f4")])
        elif how == "huge-rows":
            for k in list(f):
                del f[k]
            n = 1 << 50
            for k in ("observations", "actions", "rewards", "terminals"):
                f.create_dataset(k, shape=(n,), dtype="f4", chunks=(1 << 16,), compression="gzip")
        elif how == "huge-row-shape":
            del f["observations"], f["next_observations"]
            f.create_dataset("observations", shape=(25, 1 << 30, 1 << 20), dtype="f4",
                             chunks=(1, 1, 1 << 20), compression="gzip")
        elif how == "scalar-obs":
            del f["observations"]
            f["observations"] = 3.0
        elif how == "group-obs":
            del f["observations"]
            f.create_group("observations")
        elif how == "minari-cycle":
            for k in list(f):
                del f[k]
            g = f.create_group("episode_0")
            g["observations/pos"] = np.zeros((4, 2))
            g["observations/again"] = g["observations"]  # a hard link: the group holds itself
            g["actions"] = np.zeros((3, 1))
            g["rewards"] = np.zeros(3)
            g["terminations"] = np.zeros(3, dtype=bool)
            g["truncations"] = np.zeros(3, dtype=bool)
        elif how == "minari-huge":
            for k in list(f):
                del f[k]
            for e in range(2):
                g = f.create_group(f"episode_{e}")
                for k in ("observations", "actions", "rewards", "terminations", "truncations"):
                    g.create_dataset(k, shape=(1 << 49,), dtype="f4", chunks=(1 << 16,), compression="gzip")
    return path


CRAFTED = {"soft-loop": "too many links|cannot be", "compound-obs": "dtype", "vlen-obs": "dtype",
           "string-terminals": "end flags must be", "compound-terminals": "end flags must be",
           "huge-rows": "declares 1,125,899,906,842,624 transitions", "huge-row-shape": "declares rows of shape",
           "scalar-obs": "no transitions", "group-obs": "needs a dataset 'observations'",
           "minari-cycle": "reached twice", "minari-huge": "the episodes up to episode_0 declares"}


@pytest.mark.parametrize("how", sorted(CRAFTED))
def test_crafted_datasets_get_offline_dataset_error(tmp_path, how):
    path = crafted(tmp_path, how)
    before = fingerprint(tmp_path)
    with pytest.raises(OfflineDatasetError, match=CRAFTED[how]):
        no_hang(lambda: PRB.from_hdf5(path))
    assert fingerprint(tmp_path) == before


@pytest.mark.parametrize("layout", ["contiguous", "chunked"])
def test_data_past_the_end_of_the_file_is_refused(tmp_path, layout):
    """A dataset whose recorded address puts its last rows past the end of the file: the
    map must not read outside it (a crash) nor serve other bytes. HDF5 itself refuses a
    contiguous one; a chunk's address is only bigper's to check."""
    path = tmp_path / "past.hdf5"
    write_d4rl(path, extras=False, layout=layout)
    with h5py.File(path, "r") as f:
        d = f["observations"]
        if layout == "contiguous":
            off, nbytes = d.id.get_offset(), d.id.get_storage_size()
            old = off.to_bytes(8, "little") + nbytes.to_bytes(8, "little")  # layout message: address, size
        else:
            info = d.id.get_chunk_info(2)  # rows 8..11: neither the first nor the last row
            off, nbytes = info.byte_offset, info.size
            old = off.to_bytes(8, "little")
    size = os.path.getsize(path)
    raw = bytearray(path.read_bytes())
    assert raw.count(old) == 1, "the address is not unique in the file"
    new = size - nbytes // 2  # the first rows inside the file, the last ones past its end
    raw[raw.index(old):raw.index(old) + 8] = new.to_bytes(8, "little")
    path.write_bytes(bytes(raw))
    before = fingerprint(tmp_path)
    with pytest.raises(OfflineDatasetError, match="'/observations'|past the end|observations"):
        PRB.from_hdf5(path)
    if layout == "chunked":
        with h5py.File(path, "r") as f:  # HDF5 opens it; only the map's check stands in the way
            d = f["observations"]
            assert d.id.get_chunk_info(2).byte_offset == new
        with pytest.raises(OfflineDatasetError, match="'/observations' declares .* past the end of the file"):
            PRB.from_hdf5(path)
    assert fingerprint(tmp_path) == before


@pytest.mark.parametrize("kind", ["fifo", "symlink-to-fifo", "dev-zero", "directory-file",
                                  "symlink-loop", "dangling"])
def test_special_files_in_place_of_the_dataset(tmp_path, kind):
    path = tmp_path / "d.hdf5"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink-to-fifo":
        os.mkfifo(tmp_path / "pipe")
        os.symlink(tmp_path / "pipe", path)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)
    elif kind == "directory-file":  # a Minari directory whose main file is a FIFO
        path = tmp_path / "minari"
        (path / "data").mkdir(parents=True)
        os.mkfifo(path / "data" / "main_data.hdf5")
    elif kind == "symlink-loop":
        os.symlink(tmp_path / "d2.hdf5", path)
        os.symlink(path, tmp_path / "d2.hdf5")
    else:
        os.symlink(tmp_path / "nothing.hdf5", path)
    before = fingerprint(tmp_path)
    fifos = [tmp_path / "pipe", path, path / "data" / "main_data.hdf5"] if "fifo" in kind else []
    err = FileNotFoundError if kind == "dangling" else OfflineDatasetError
    with pytest.raises(err):
        no_hang(lambda: PRB.from_hdf5(path), fifos)
    assert fingerprint(tmp_path) == before


def test_a_symlink_the_user_gives_to_a_real_dataset_is_followed(tmp_path):
    real = tmp_path / "real.hdf5"
    data = write_d4rl(real)
    os.symlink(real, tmp_path / "link.hdf5")
    with PRB.from_hdf5(tmp_path / "link.hdf5") as buf:
        b = buf.sample(8)
        assert np.array_equal(b["obs"], data["observations"][b.indices])


# -- the dataset is only ever opened read-only --------------------------------------------------------
def open_modes(path) -> list:
    """Access modes (O_RDONLY, O_WRONLY, O_RDWR) of this process's fds open on ``path``."""
    real = os.path.realpath(path)
    modes = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != real:
                continue
            with open(f"/proc/self/fdinfo/{fd}") as f:
                flags = next(int(ln.split()[1], 8) for ln in f if ln.startswith("flags:"))
        except (OSError, StopIteration):
            continue
        modes.append(flags & os.O_ACCMODE)
    return modes


def test_the_dataset_file_is_opened_read_only_at_the_os_level(tmp_path):
    """Equal bytes before and after do not show this (a read-write open changes none);
    the open modes of the process's descriptors do."""
    path = tmp_path / "d.hdf5"
    write_d4rl(path)
    assert open_modes(path) == []
    with PRB.from_hdf5(path) as buf:
        modes = open_modes(path)
        assert len(modes) >= 2 and set(modes) == {os.O_RDONLY}, modes  # bigper's map and HDF5's own
        assert buf.storage._file.mode == "r"
        buf.reprioritize(scores_of, batch_size=7, progress=False)
        buf.update_priorities(np.array([0, 1]), np.array([3.0, 4.0]))
        assert set(open_modes(path)) == {os.O_RDONLY}
    assert open_modes(path) == []  # and closed at close


READER = """
import sys
import bigper
buf = bigper.PrioritizedReplayBuffer.from_hdf5(sys.argv[1], priorities=sys.argv[2])
print("open", flush=True)
sys.stdin.readline()
print("sampled", buf.sample(4).indices.shape[0], flush=True)
buf.close()
"""


def test_two_processes_open_one_dataset_at_once(tmp_path):
    """A read-write open would take HDF5's exclusive lock and refuse the second reader."""
    from tests._child import Child

    path = tmp_path / "d.hdf5"
    data = write_d4rl(path)
    with Child(READER, path, tmp_path / "p2", stdin=True) as other:
        other.said("open")
        with PRB.from_hdf5(path) as buf:  # while the other process holds it open
            b = buf.sample(8)
            assert np.array_equal(b["obs"], data["observations"][b.indices])
            other.send("go")
            other.said("sampled 4")
        if other.end() != 0:
            other.fail("did not close its buffer")


# -- bigper's own layout and Minari's metadata, crafted -------------------------------------------------
def bigper_file(tmp_path):
    path = tmp_path / "replay.h5"
    buf = PRB(16, {"x": ((3,), np.float32)}, storage="hdf5", path=path)
    for i in range(20):
        buf.add(x=np.full(3, i, np.float32), terminated=i % 5 == 4)
    buf.close()
    return path


def set_meta(path, fn):
    with h5py.File(path, "a") as f:
        raw = f["_bigper"].attrs["meta"]
        meta = json.loads(raw)
        out = fn(meta)
        f["_bigper"].attrs["meta"] = out if out is not None else json.dumps(meta)


BIGPER_META = {
    "object-dtype": (lambda m: m["arrays"]["x"].update(dtype="|O"), "records array 'x'"),
    "other-dtype": (lambda m: m["arrays"]["x"].update(dtype="<f8"), "records array 'x'"),
    "other-shape": (lambda m: m["arrays"]["x"].update(shape=[300]), "records array 'x'"),
    "shape-not-list": (lambda m: m["arrays"]["x"].update(shape=7), "shape 7"),
    "path-name": (lambda m: m["arrays"].update({"../x": m["arrays"]["x"]}), "names array"),
    "capacity-huge": (lambda m: m["config"].update(capacity=2 ** 60), "declares"),
    "capacity-str": (lambda m: m["config"].update(capacity="16"), "capacity '16'"),
    "arrays-list": (lambda m: m.update(arrays=[]), "no config or arrays"),
    "not-json": (lambda m: "{not json", "cannot be read|JSON|Expecting"),
    "deep-json": (lambda m: "[" * 100_000, "cannot be read|Recursion|JSON"),
    "number-attr": (lambda m: np.int64(3), "not a JSON string"),
}


@pytest.mark.parametrize("case", sorted(BIGPER_META))
def test_crafted_bigper_layout_meta(tmp_path, case):
    path = bigper_file(tmp_path)
    fn, match = BIGPER_META[case]
    set_meta(path, fn)
    before = fingerprint(tmp_path)
    with pytest.raises(OfflineDatasetError, match=match):
        PRB.from_hdf5(path)
    assert fingerprint(tmp_path) == before


def test_a_huge_recorded_state_array_is_not_read(tmp_path):
    path = bigper_file(tmp_path)
    with h5py.File(path, "a") as f:
        f["_bigper/state"].create_dataset("junk", shape=(1 << 40,), dtype="f8", chunks=(1 << 16,),
                                          compression="gzip")
    with pytest.raises(OfflineDatasetError, match="'junk'.*larger than any state"):
        PRB.from_hdf5(path)


@pytest.mark.parametrize("kind", ["fifo", "symlink-to-dev-zero", "not-json"])
def test_minari_metadata_that_is_not_a_file_is_ignored_without_blocking(tmp_path, kind):
    root = tmp_path / "ds"
    (root / "data").mkdir(parents=True)
    with h5py.File(root / "data" / "main_data.hdf5", "w") as f:
        g = f.create_group("episode_0")
        g["observations"] = np.arange(8.0).reshape(4, 2)
        g["actions"] = np.zeros((3, 1))
        g["rewards"] = np.ones(3)
        g["terminations"] = np.array([False, False, True])
        g["truncations"] = np.zeros(3, dtype=bool)
    meta = root / "data" / "metadata.json"
    if kind == "fifo":
        os.mkfifo(meta)
    elif kind == "symlink-to-dev-zero":
        os.symlink("/dev/zero", meta)
    else:
        meta.write_text("[" * 100_000)
    with no_hang(lambda: PRB.from_hdf5(root), [meta]) as buf:
        assert len(buf) == 3
        assert any("metadata.json ignored" in n for n in buf.storage.notes)


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_bigper_layout_lock_that_is_not_a_file(tmp_path, kind):
    path = bigper_file(tmp_path)
    lock = tmp_path / "replay.h5.lock"
    os.unlink(lock)
    if kind == "fifo":
        os.mkfifo(lock)
    else:
        (tmp_path / "elsewhere").write_text("")
        os.symlink(tmp_path / "elsewhere", lock)
    before = fingerprint(tmp_path)
    with pytest.raises(OfflineDatasetError, match="FIFO|symbolic link"):
        no_hang(lambda: PRB.from_hdf5(path), [lock])
    assert fingerprint(tmp_path) == before


# -- meta.json fields under Hypothesis ------------------------------------------------------------------
def _json_values():
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                        st.sampled_from([0, 1, 24, 25, 26, -1, 2 ** 31, 2 ** 63]),
                        st.floats(allow_nan=True, allow_infinity=True),
                        st.sampled_from(["", "..", "../hopper.hdf5", "/etc/passwd", "scores-0123456789ab.f64",
                                         "leaves-0123456789ab.npy", "meta.json", "0" * 16]),
                        st.text(max_size=8))
    return st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                        st.dictionaries(st.text(max_size=4), kids, max_size=3)),
                        max_leaves=6)


def test_meta_fields_under_hypothesis(tmp_path_factory):
    """Any value in any field of any entry: bigper's error or a working buffer, and the
    dataset, the sidecar and a victim file keep their bytes."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    root = tmp_path_factory.mktemp("hyp")
    path = root / "hopper.hdf5"
    write_d4rl(path)
    with PRB.from_hdf5(path) as buf:
        buf.reprioritize(scores_of, progress=False)
        buf.update_priorities(np.array([1]), np.array([2.0]))
    side = root / "hopper.hdf5.priorities"
    victim = root / "victim.txt"
    victim.write_text("mine")
    good = (side / "meta.json").read_text()
    fields = ["file", "total", "xxh64", "done", "rows_valid", "batch_size", "alpha", "eps", "max_priority",
              "prioritization"]

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(key=st.sampled_from(["scores", "partial", "leaves", "dataset"]), field=st.sampled_from(fields),
           value=st.one_of(_json_values(), st.sampled_from(["rank", "proportional"])),
           kind=st.sampled_from(["proportional", "rank"]))
    def check(key, field, value, kind):
        meta = json.loads(good)
        if key == "partial":
            meta["partial"] = partial_entry(side, 25)
        entry = meta.get(key) if isinstance(meta.get(key), dict) else {}
        entry[field] = value
        meta[key] = entry
        (side / "meta.json").write_text(json.dumps(meta))
        before = fingerprint(path, side, victim)
        try:
            with warnings.catch_warnings():  # saved leaves of another alpha are announced, then unused
                warnings.simplefilter("ignore", UserWarning)
                with PRB.from_hdf5(path, prioritization=kind) as b:
                    b.sample(4)
        except bigper.BigperError:
            pass
        assert fingerprint(path, side, victim) == before

    check()


WRITER = """
import sys
import h5py
try:
    h5py.File(sys.argv[1], "r+").close()
except OSError as e:
    print("refused", "lock" in str(e).lower())
else:
    print("opened")
"""


def test_a_writer_cannot_open_the_dataset_while_it_is_read(tmp_path):
    """bigper holds HDF5's shared lock while the dataset is open: another process's
    writer is refused (a writer changing mapped bytes underneath could crash the reader),
    and is let in again after close."""
    import subprocess
    import sys

    path = tmp_path / "d.hdf5"
    write_d4rl(path)
    run = lambda: subprocess.run([sys.executable, "-c", WRITER, str(path)], capture_output=True, text=True,
                                 timeout=120).stdout.strip()
    with PRB.from_hdf5(path):
        assert run() == "refused True"
    assert run() == "opened"


def test_a_file_swapped_between_the_check_and_hdf5s_open_is_refused(tmp_path):
    """The file HDF5 opens is compared with the one checked first (device and inode):
    another file put at the path in between is refused."""
    from bigper.offline.h5source import H5Source

    a, b = tmp_path / "a.hdf5", tmp_path / "b.hdf5"
    write_d4rl(a)
    write_d4rl(b)
    src = H5Source(a)
    try:
        checked = src.file_id
        os.replace(b, a)  # what a swap right after the check looks like to HDF5
        src.file_path = a
        with pytest.raises(OfflineDatasetError, match="was replaced while it was being opened"):
            src._open_h5(h5py, 1 << 20)
        assert src.file_id == checked
    finally:
        src.close()
