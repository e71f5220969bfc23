"""More hostile ``bigper info`` on live memmap storage directories (after
tests/cli/test_hostile_info_record.py): every value of meta.json that
reaches stdout or stderr, and the directory's other entries.

The rule: a crafted record is a one-line error on stderr naming meta.json
and the field, exit status != 0, nothing on stdout, nothing of the crafted
value echoed raw (no control character: no newline or terminal escape
injected), the directory byte for byte unchanged; a true record (closed
cleanly, held open by a live writer, left open by a dead one, written by an
older bigper, compressed, frame-stacked, a sequence buffer) is described.

Attacked: the record fields check_record checks (clean, state, count,
beta_step, state_files, compression, chunk_bytes, shared_digests) holding
escapes; the count beyond the capacity, missing, null; arrays whose shape,
dtype or names differ from what the config lays out (a resume refuses them
all); a compressed record's frame counters; entries of data/ named with
escapes; a crafted state/status.npy; meta.json as a FIFO, a directory, a
symlink, non-UTF-8, 100,000 levels deep, 300 MB, duplicate keys; ``--json``.

Each case found a bug when it was written (check_record's messages echoed
crafted values raw; arrays, counts, frame counters, data/ names and the
status file were printed unchecked; --json showed check_arrays' fill-in)
except where its docstring says it held; all are fixed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper.cli import main

from tests._hostile_snapshot_cases import deadline, fingerprint
from tests.cli.test_hostile_info_record import closed  # noqa: F401 (the closed storage the cases copy)

DATA = Path(__file__).resolve().parents[1] / "data"
E = "\x1b[2J\x1b]0;pwned\x07\nINJECTED"  # a terminal escape, an OSC title, a newline


@pytest.fixture(scope="module")
def zstd_closed(tmp_path_factory):
    """A closed compressed frame-stacked storage: 40 transitions of 4 stacked 8x8 frames."""
    path = tmp_path_factory.mktemp("info2z") / "live"
    rng = np.random.default_rng(0)
    b = bigper.PrioritizedReplayBuffer(64, {"obs": ((4, 8, 8), np.uint8), "action": ((), np.int64)}, frame_stack=4,
                                       compression="zstd", storage="memmap", path=path)
    st = np.zeros((4, 8, 8), np.uint8)
    for i in range(40):
        nxt = np.concatenate([st[1:], rng.integers(0, 4, (1, 8, 8), dtype=np.uint8)])
        b.add(obs=st, next_obs=nxt, action=i, terminated=False)
        st = nxt
    b.close()
    return path


def _copy(src, tmp_path, change=None, post=None) -> tuple:
    live = tmp_path / "live"
    shutil.copytree(src, live, symlinks=True)
    if change is not None:
        meta = json.loads((live / "meta.json").read_text())
        change(meta)
        (live / "meta.json").write_text(json.dumps(meta))
    if post is not None:
        post(live)
    return live, fingerprint(live)


def _info(live, capsys, *extra) -> tuple:
    with deadline(20):
        rc = main(["info", str(live), *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _no_control(text: str) -> bool:
    """Nothing but printable text and line ends: no escape, bell, carriage return."""
    return not any((ord(ch) < 32 and ch != "\n") or ord(ch) == 127 for ch in text)


def _refused(live, before, capsys, field, *extra):
    rc, out, err = _info(live, capsys, *extra)
    assert fingerprint(live) == before
    assert rc not in (0, None), out
    assert out == "", out
    assert "Traceback" not in err
    # (format and version errors name the directory, as check_meta words them for every reader)
    assert ("meta.json" in err or field in ("format", "version")) and field in err, err
    assert _no_control(err), f"the crafted value reached stderr raw: {err!r}"
    assert err.count("\n") == 1 and "INJECTED" not in err.splitlines()[0][:9], repr(err)


def _st(**kw):
    return lambda m: m["state"].update(kw)


# -- check_record's fields: refused, but the message echoes the crafted value raw ----------------

RECORD = {
    "clean": (lambda m: m.update(clean=E), "clean"),
    "state": (lambda m: m.update(state=E), "state"),
    "count": (_st(count=E), "count"),
    "beta_step": (_st(beta_step=E), "beta_step"),
    "state_files": (lambda m: m.update(state_files=E), "state_files"),
    "compression": (lambda m: m.update(compression=E), "compression"),
    "chunk_bytes": (lambda m: m.update(chunk_bytes=E), "chunk_bytes"),
    "shared_digests": (lambda m: m.update(shared_digests=E), "shared_digests"),
}


@pytest.mark.parametrize("case", sorted(RECORD))
def test_a_record_field_holding_escapes_is_refused_without_echoing_them(closed, tmp_path, capsys, case):
    change, field = RECORD[case]
    live, before = _copy(closed, tmp_path, change)
    _refused(live, before, capsys, field)


@pytest.mark.parametrize("case", ["clean", "count"])
def test_the_same_with_json(closed, tmp_path, capsys, case):
    change, field = RECORD[case]
    live, before = _copy(closed, tmp_path, change)
    _refused(live, before, capsys, field, "--json")


PLAIN = {  # crafted values with no control character: these are refused cleanly
    "count_negative": (_st(count=-5), "count"),
    "count_2**62": (_st(count=2 ** 62), "count"),
    "count_10**30": (_st(count=10 ** 30), "count"),
    "count_float": (_st(count=10.0), "count"),
    "count_bool": (_st(count=True), "count"),
    "clean_missing": (lambda m: m.pop("clean"), "clean"),
    "clean_null": (lambda m: m.update(clean=None), "clean"),
    "config_unknown_key": (lambda m: m["config"].update(evil=1), "config"),
    "config_alpha_string": (lambda m: m["config"].update(alpha="0.6"), "alpha"),
    "array_dtype_object": (lambda m: m["arrays"]["x"].update(dtype="O"), "dtype"),
    # (np.dtype(None) is float64: a missing or null dtype was taken as one, then a raw KeyError)
    "array_dtype_missing": (lambda m: m["arrays"]["x"].pop("dtype"), "dtype"),
    "array_dtype_null": (lambda m: m["arrays"]["x"].update(dtype=None), "dtype"),
    "array_dtype_int": (lambda m: m["arrays"]["x"].update(dtype=5), "dtype"),
    "array_rows_zero": (lambda m: m["arrays"]["x"].update(rows=0), "rows"),
    "array_name_traversal": (lambda m: m["arrays"].update({"../x": m["arrays"]["x"]}), "plain name"),
    "version_string": (lambda m: m.update(version="1"), "version"),
    "format_other": (lambda m: m.update(format="bigper-hdf5"), "format"),
}


@pytest.mark.parametrize("case", sorted(PLAIN))
def test_a_crafted_plain_value_is_refused_naming_its_field(closed, tmp_path, capsys, case):
    change, field = PLAIN[case]
    live, before = _copy(closed, tmp_path, change)
    _refused(live, before, capsys, field)


# -- what info prints that no check looks at ---------------------------------------------------

ARRAYS = {
    "shape_other_than_the_field": lambda m: m["arrays"]["x"].update(shape=[5]),
    "dtype_other_than_the_field": lambda m: m["arrays"]["x"].update(dtype="<i8"),
    "an_array_no_field_has": lambda m: m["arrays"].update(zz=dict(m["arrays"]["x"])),
    "a_fields_array_missing": lambda m: m["arrays"].pop("x"),
    "obs_ref_without_frame_stacks": lambda m: m["arrays"].update(obs_ref=dict(m["arrays"]["x"])),
}


@pytest.mark.parametrize("case", sorted(ARRAYS))
def test_arrays_the_config_does_not_lay_out_are_refused(closed, tmp_path, capsys, case):
    live, before = _copy(closed, tmp_path, ARRAYS[case])
    with pytest.raises(bigper.errors.BigperError):  # the oracle: a resume refuses this record
        probe = tmp_path / "probe"
        shutil.copytree(live, probe)
        bigper.PrioritizedReplayBuffer(100, {"x": ((2,), np.float32), "a": ((), np.int64)}, storage="memmap",
                                       path=probe, mode="resume").close()
    _refused(live, before, capsys, "arrays")



# (a count beyond the capacity is no crafted record: ``count`` is every transition ever written, past
# the capacity once the ring wraps; info prints min(count, capacity), what a wrapped buffer holds)
@pytest.mark.parametrize("case", ["count_missing", "state_missing"])
def test_a_clean_record_whose_count_the_buffer_cannot_hold_or_does_not_say_is_refused(closed, tmp_path, capsys,
                                                                                      case):
    change = {"count_missing": lambda m: m["state"].pop("count"), "state_missing": lambda m: m.pop("state")}[case]
    live, before = _copy(closed, tmp_path, change)
    _refused(live, before, capsys, "count" if case == "count_missing" else "state")



@pytest.mark.parametrize("case", ["fw_huge", "fw_float", "pos_negative", "seg_lo_negative"])
def test_a_compressed_records_crafted_frame_counters_are_refused(zstd_closed, tmp_path, capsys, case):
    change = {"fw_huge": {"fw": 10 ** 30}, "fw_float": {"fw": 1e300}, "pos_negative": {"pos": -10 ** 20},
              "seg_lo_negative": {"seg_lo": -10 ** 9}}[case]
    live, before = _copy(zstd_closed, tmp_path, lambda m: m["state"]["frames"].update(change))
    _refused(live, before, capsys, "frames")


def test_a_compressed_records_unreadable_frame_counters_print_nothing_of_them(zstd_closed, tmp_path, capsys):
    live, before = _copy(zstd_closed, tmp_path, lambda m: m["state"].update(frames=E))
    rc, out, err = _info(live, capsys)
    assert fingerprint(live) == before
    assert _no_control(out + err) and "INJECTED" not in out + err, repr(out + err)



@pytest.mark.parametrize("what", ["fifo", "dir", "symlink"])
def test_data_entries_named_with_escapes_are_not_printed_raw(closed, tmp_path, capsys, what):
    def post(live):
        p = live / "data" / f"{what}{E}"
        {"fifo": os.mkfifo, "dir": os.mkdir, "symlink": lambda q: os.symlink("/etc/passwd", q)}[what](p)
    live, before = _copy(closed, tmp_path, post=post)
    rc, out, err = _info(live, capsys)
    assert fingerprint(live) == before
    assert _no_control(out + err), f"a data/ entry's name reached the terminal raw: {out!r}"


def test_a_clean_record_with_state_null_reads_as_verify_reads_it(closed, tmp_path, capsys):
    """(state null is what a storage closed before anything was recorded
    writes: ``bigper verify`` says OK; info describes it holding nothing.)"""
    live, before = _copy(closed, tmp_path, lambda m: m.update(state=None))
    rc, out, err = _info(live, capsys)
    assert rc == 0 and "capacity 100; 0 transitions" in out, (out, err)
    assert fingerprint(live) == before



@pytest.mark.parametrize("what", ["all_live", "fifo", "wrong_shape", "object"])
def test_a_crafted_status_file_never_claims_more_sampleable_than_transitions(closed, tmp_path, capsys, what):
    def post(live):
        p = live / "state" / "status.npy"
        if what == "all_live":
            np.save(p, np.full(100, 1, np.uint8))
        elif what == "fifo":
            p.unlink()
            os.mkfifo(p)
        elif what == "wrong_shape":
            np.save(p, np.full(7, 1, np.uint8))
        else:
            np.save(p, np.array([1] * 100, dtype=object), allow_pickle=True)
    live, before = _copy(closed, tmp_path, post=post)
    rc, out, err = _info(live, capsys)
    assert fingerprint(live) == before
    assert "Traceback" not in err
    if rc == 0:
        import re
        m = re.search(r"([\d,]+) transitions at the last close(?:, ([\d,]+) of them sampleable)?", out)
        assert m, out
        assert m.group(2) is None or int(m.group(2).replace(",", "")) <= int(m.group(1).replace(",", "")), out


# -- meta.json that is no regular file of JSON ----------------------------------------------------

def _meta_fifo(live):
    (live / "meta.json").unlink()
    os.mkfifo(live / "meta.json")


def _meta_dir(live):
    (live / "meta.json").unlink()
    (live / "meta.json").mkdir()


def _meta_link(live):
    (live / "meta.json").rename(live / "real.json")
    os.symlink("real.json", live / "meta.json")


def _meta_bytes(raw):
    return lambda live: (live / "meta.json").write_bytes(raw)


SPECIAL = {
    "fifo": _meta_fifo,
    "directory": _meta_dir,
    "symlink": _meta_link,
    "dangling_symlink": lambda live: ((live / "meta.json").unlink(), os.symlink("nowhere", live / "meta.json")),
    "non_utf8": _meta_bytes(b'{"format": "bigper-memmap\xff\xfe\x1b[2J"}'),
    "deep_list": _meta_bytes(b"[" * 100_000 + b"]" * 100_000),
    "deep_object": _meta_bytes(b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
    "a_list": _meta_bytes(b"[1, 2, 3]"),
    "a_string_with_escapes": _meta_bytes(json.dumps(E).encode()),
    "empty": _meta_bytes(b""),
    "nul_bytes": _meta_bytes(b"\0" * 64),
    "huge": lambda live: (live / "meta.json").write_bytes(b'{"x": "' + b"a" * (70 << 20) + b'"}'),
    "duplicate_clean_with_escape": lambda live: (live / "meta.json").write_bytes(
        (live / "meta.json").read_bytes().replace(b'"clean": true', b'"clean": true, "clean": "\\u001b[2J\\n"')),
}


@pytest.mark.parametrize("case", sorted(SPECIAL))
def test_a_meta_json_that_is_no_record_is_a_one_line_error_untouched(closed, tmp_path, capsys, case):
    live, before = _copy(closed, tmp_path, post=SPECIAL[case])
    rc, out, err = _info(live, capsys)
    assert fingerprint(live) == before
    assert rc not in (0, None), out
    assert out == "" and "Traceback" not in err, (out, err)
    assert "meta.json" in err, err
    assert _no_control(err) and err.count("\n") == 1, repr(err)


# -- --json of a record that passes --------------------------------------------------------------

def test_json_of_a_record_with_an_unknown_top_level_key_escapes_it(closed, tmp_path, capsys):
    live, before = _copy(closed, tmp_path, lambda m: m.update(evil=E, **{E: 1}))
    rc, out, err = _info(live, capsys, "--json")
    assert fingerprint(live) == before
    assert _no_control(out + err), repr(out)
    if rc == 0:
        assert json.loads(out)["config"]["capacity"] == 100


def test_json_prints_the_record_as_it_is_on_disk(closed, tmp_path, capsys):
    """--json of a record without chunk_rows (an older writer's) prints what
    the file holds, not check_arrays' setdefault."""
    live, before = _copy(closed, tmp_path, lambda m: [a.pop("chunk_rows") for a in m["arrays"].values()])
    rc, out, err = _info(live, capsys, "--json")
    assert rc == 0, err
    disk = json.loads((live / "meta.json").read_text())
    disk.pop("state")
    printed = json.loads(out)
    assert printed["config"] == disk["config"] and printed["format"] == disk["format"]
    assert printed["arrays"] == disk["arrays"], (printed["arrays"], disk["arrays"])
    assert fingerprint(live) == before


# -- true records: described, untouched -------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["live-v1-refs64-memmap", "live-v1-refs64-far-memmap"])
@pytest.mark.parametrize("as_json", [False, True])
def test_an_older_bigpers_committed_live_folder_is_described(tmp_path, capsys, fixture, as_json):
    spec = json.loads((DATA / f"{fixture}.expected.json").read_text())
    live, before = _copy(DATA / fixture, tmp_path)
    rc, out, err = _info(live, capsys, *(["--json"] if as_json else []))
    assert rc == 0, err
    assert fingerprint(live) == before
    if as_json:
        assert json.loads(out)["config"]["capacity"] == spec["spec"]["capacity"]
    else:
        assert f"capacity {spec['spec']['capacity']:,};" in out and "closed cleanly" in out, out
        assert f"{spec['len']:,} transitions at the last close" in out, out
        assert "older bigper's" in out


def test_a_compressed_frame_stacked_storage_is_described(zstd_closed, tmp_path, capsys):
    live, before = _copy(zstd_closed, tmp_path)
    rc, out, err = _info(live, capsys)
    assert rc == 0, err
    assert "capacity 64; 40 transitions" in out and "compression zstd" in out and "ratio unknown" not in out, out
    assert fingerprint(live) == before


def test_a_sequence_buffer_and_a_plain_frame_stacked_one_are_described(tmp_path, capsys):
    seq = tmp_path / "seq"
    b = bigper.PrioritizedReplayBuffer(40, {"obs": ((3,), np.float32), "action": ((), np.int64)}, storage="memmap",
                                       path=seq, sequence=bigper.Sequence(4, burn_in=1, period=2))
    for i in range(30):
        b.add(obs=np.full(3, i, np.float32), next_obs=np.full(3, i + 1, np.float32), action=i,
              terminated=i % 9 == 8)
    b.close()
    fs = tmp_path / "fs"
    b = bigper.PrioritizedReplayBuffer(64, {"obs": ((4, 8, 8), np.uint8)}, frame_stack=4, storage="memmap", path=fs)
    for i in range(20):
        b.add(obs=np.full((4, 8, 8), i, np.uint8), next_obs=np.full((4, 8, 8), i + 1, np.uint8), terminated=False)
    b.close()
    for path, cap, n in ((seq, 40, 30), (fs, 64, 20)):
        before = fingerprint(path)
        rc, out, err = _info(path, capsys)
        assert rc == 0, err
        assert f"capacity {cap}; {n} transitions" in out, out
        assert fingerprint(path) == before


def test_a_storage_a_live_writer_holds_and_one_a_dead_writer_left_are_described(tmp_path, capsys):
    held = tmp_path / "held"
    b = bigper.PrioritizedReplayBuffer(50, {"x": ((2,), np.float32)}, storage="memmap", path=held)
    for i in range(5):
        b.add(x=np.full(2, i, np.float32))
    try:
        before = fingerprint(held)
        rc, out, err = _info(held, capsys)
        assert rc == 0, err
        assert "capacity 50;" in out and "OPEN or its writer died" in out, out
        assert fingerprint(held) == before
        b.add(x=np.full(2, 9, np.float32))  # the writer goes on: info took nothing from it
    finally:
        b.close()
    dead = tmp_path / "dead"
    subprocess.run([sys.executable, "-c", (
        "import os, sys, numpy as np, bigper\n"
        "b = bigper.PrioritizedReplayBuffer(50, {'x': ((2,), np.float32)}, storage='memmap', path=sys.argv[1])\n"
        "[b.add(x=np.full(2, i, np.float32)) for i in range(5)]\n"
        "os._exit(0)\n"), str(dead)], check=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    before = fingerprint(dead)
    rc, out, err = _info(dead, capsys)
    assert rc == 0, err
    assert "capacity 50;" in out and "OPEN or its writer died" in out, out
    assert fingerprint(dead) == before
