"""An older live memmap folder is read from disk like anything else: hostile.

Its frame references (``obs_ref``, ``next_obs_ref``), their record in
``meta.json`` and the conversion's own journal there (``converting``,
``converted``) are untrusted: references outside the frames stored, of
another shape or dtype, a FIFO or a symlink in place of a chunk file, a
journal naming files that are not the conversion's. Each is refused with
bigper's error naming what is wrong, by a writer's resume, a reader's and
``bigper verify``, and the folder is byte for byte what it was (a refusal
that comes after the conversion was written, in the rest of the resume,
puts the old folder back).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from bigper import CorruptSnapshotError, IncompatibleSnapshotError, PathExistsError
from bigper.errors import BigperError
from bigper.snapshot.live import OK, verify_live

from tests._hostile_snapshot_cases import deadline, fingerprint
from tests.storage.test_older_live import FOLDERS, copy, expected, open_folder, recorded, same_batches

NAME = FOLDERS[0]


def refs(path: Path, name: str) -> np.ndarray:
    rec = recorded(path)["arrays"][name]
    return np.fromfile(path / "data" / f"{name}.bin", dtype=rec["dtype"]).reshape(rec["rows"], *rec["shape"])


def put(path: Path, name: str, arr: np.ndarray) -> None:
    (path / "data" / f"{name}.bin").write_bytes(np.ascontiguousarray(arr).tobytes())


def edit_meta(path: Path, change) -> None:
    meta = recorded(path)
    change(meta)
    (path / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))


def refused_everywhere(path: Path, exc, match: str) -> None:
    """A writer's resume, a reader's and ``bigper verify`` refuse ``path``
    (``exc`` naming ``match``) and leave it byte for byte as it was."""
    (path / ".lock").write_text(f"{os.getpid()}\n")  # (what a writer of this process writes there)
    before = fingerprint(path)
    for kw in ({"continue_episodes": True}, {"read_only": True}):
        with deadline():
            with pytest.raises(exc, match=match):
                open_folder(NAME, path, **kw)
        assert fingerprint(path) == before, kw
    with deadline():
        assert verify_live(path).status != OK
    assert fingerprint(path) == before


def used_slot(path: Path) -> int:
    status = np.load(path / "state" / "status.npy")
    return int(np.flatnonzero(status == 1)[3])


@pytest.mark.parametrize("value", ["past", "negative", "below"])
def test_references_outside_the_frames_stored_are_refused_naming_the_slot(value, tmp_path):
    path = copy(NAME, tmp_path)
    fw = recorded(path)["state"]["frames"]["fw"]
    nxt = refs(path, "next_obs_ref")
    s = used_slot(path)
    bad = nxt.copy()
    bad[s, -1] = {"past": fw, "negative": -1, "below": -5}[value]
    if value == "below":
        bad[s, :] = -5
    put(path, "next_obs_ref", bad)
    refused_everywhere(path, CorruptSnapshotError, f"slot {s}")


@pytest.mark.parametrize("what", ["shape", "dtype", "rows", "missing"])
def test_an_older_reference_array_of_another_layout_is_refused(what, tmp_path):
    path = copy(NAME, tmp_path)
    obs = refs(path, "obs_ref")
    if what == "shape":
        put(path, "obs_ref", obs[:, :3])
        edit_meta(path, lambda m: m["arrays"]["obs_ref"].__setitem__("shape", [3]))
    elif what == "dtype":
        put(path, "obs_ref", obs.astype(np.int32))
        edit_meta(path, lambda m: m["arrays"]["obs_ref"].__setitem__("dtype", "<i4"))
    elif what == "rows":
        put(path, "obs_ref", obs[:40])
        edit_meta(path, lambda m: m["arrays"]["obs_ref"].update(rows=40, chunk_rows=40))
    else:
        os.unlink(path / "data" / "next_obs_ref.bin")
        edit_meta(path, lambda m: m["arrays"].pop("next_obs_ref"))
    refused_everywhere(path, IncompatibleSnapshotError, "obs_ref")


@pytest.mark.parametrize("what", ["fifo", "symlink", "short"])
def test_a_special_or_short_file_in_place_of_an_older_reference_array_is_refused(what, tmp_path):
    path = copy(NAME, tmp_path)
    chunk = path / "data" / "next_obs_ref.bin"
    raw = chunk.read_bytes()
    os.unlink(chunk)
    if what == "fifo":
        os.mkfifo(chunk)
    elif what == "symlink":
        (tmp_path / "elsewhere.bin").write_bytes(raw)
        os.symlink(tmp_path / "elsewhere.bin", chunk)
    else:
        chunk.write_bytes(raw[:-8])
    refused_everywhere(path, BigperError, "next_obs_ref")


def test_a_refusal_after_the_conversion_puts_the_old_folder_back(tmp_path):
    """The references are fine, but another array's chunk file is short: the
    resume fails when it maps it, after the conversion was written; the folder
    is the older bigper's again, byte for byte, and resumes once repaired."""
    path = copy(NAME, tmp_path)
    chunk = path / "data" / "action.bin"
    good = chunk.read_bytes()
    chunk.write_bytes(good[:-8])
    refused_everywhere(path, IncompatibleSnapshotError, "action")
    chunk.write_bytes(good)
    buf = open_folder(NAME, path, continue_episodes=True)
    same_batches(buf, expected(NAME)["batches"])
    buf.close()


@pytest.mark.parametrize("key", ["converted", "converting"])
def test_a_journal_naming_files_that_are_not_the_conversions_is_refused(key, tmp_path):
    """A crafted ``converted`` (old files to delete) or ``converting`` (new
    files to clear) naming a live array, a state file still recorded or a
    path outside the folder: refused, nothing deleted."""
    path = copy(NAME, tmp_path)
    rec = recorded(path)["arrays"]["action"]
    for journal in ({"arrays": {"action": rec}, "state": []},
                    {"arrays": {}, "state": ["status"]},
                    {"arrays": {"../../x": rec}, "state": []},
                    {"arrays": {"zz": {**rec, "dtype": "|O"}}, "state": []},
                    "everything"):
        if key == "converting" and isinstance(journal, dict) and journal["state"]:
            continue  # (a conversion in progress names no state file)
        edit_meta(path, lambda m: m.__setitem__(key, journal))
        refused_everywhere(path, CorruptSnapshotError, key)


def test_a_journal_naming_a_special_file_is_not_followed(tmp_path):
    """A ``converting`` record (a conversion killed while it wrote its new
    files) whose file is a FIFO or a symlink now: not bigper's, never opened
    or deleted; the resume says so."""
    path = copy(NAME, tmp_path)
    rec = dict(recorded(path)["arrays"]["action"])
    edit_meta(path, lambda m: m.__setitem__("converting", {"arrays": {"frame_ref": rec}, "state": []}))
    os.mkfifo(path / "data" / "frame_ref.bin")
    before = fingerprint(path)
    with deadline():
        with pytest.raises(PathExistsError, match="frame_ref"):
            open_folder(NAME, path, continue_episodes=True)
    assert fingerprint(path) == before
