"""Attacks on the zstd dictionaries of compressed frames (bigper/dictionaries.py,
the generations named in bigper/segments.py's frame index): crafted states
that every other check lets through, retrains around snapshots, kill -9 and
the frames still in flight. Each is refused with bigper's error, or comes
back byte for byte; never other bytes than the ones added."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import bigper
import bigper.dictionaries
import bigper.segments
from bigper import _zstd
from bigper.errors import CorruptSnapshotError

from ._hostile_snapshot_cases import refused
from .test_compression import ATARI, Feed, check_all_live, check_sample, make
from .test_compression_dicts import _always_retrain, run
from .test_compression_hostile import put_data

GAMES = np.load(ATARI)
SKIPPABLE = 0x184D2A50  # a zstd skippable frame's magic: decoders step over it


def _retrained_snapshot(tmp_path, monkeypatch, games=("Pong", "Qbert", "MsPacman", "Seaquest")):
    """A memory snapshot whose live frames name several dictionary generations."""
    _always_retrain(monkeypatch)
    buf = make("memory", tmp_path, (84, 84), k=4, capacity=300, budget=1500)
    feed = None
    for game in games:
        feed = run(buf, GAMES[game], 90, feed)
    log, fs = buf._frames.log, buf._frames
    lo = max(log.oldest(), fs.fw - fs.F, 0)
    ids = np.arange(lo, fs.fw, dtype=np.int64)
    info = {"ids": ids, "entries": log._entries(ids).copy(), "raw": log.decode(ids).copy(),
            "dicts": {log.dicts.lo + i: d.copy() for i, d in enumerate(log.dicts.dicts)},
            "log": np.asarray(fs.store.arrays["frame_log"]).reshape(-1).copy(),
            "index": np.asarray(fs.store.arrays["frame_index"]).copy(), "F": fs.F,
            "block": log.block}
    snap = buf.save(tmp_path / "snap")
    buf.close()
    return snap, info


def _compress(raw: np.ndarray, d: np.ndarray | None) -> bytes:
    c = _zstd.Codec(3)
    try:
        slot = 0
        if d is not None:
            c.set_dictionary(1, d)
            slot = 1
        data, _ = c.compress(raw.reshape(1, -1), slot)
        return bytes(data)
    finally:
        c.close()


def test_a_frame_naming_an_older_live_generation_is_refused_at_load(tmp_path, monkeypatch):
    """Frame X (after a frame of generation k) is rewritten as a valid zstd
    frame of an older live generation j (padded to its length with a skippable
    frame), its index entry naming j: every offset, length, bound and
    decode check passes, only "generations never go back" is broken. Loaded,
    the slot reuse would drop j while X still names it (adopt keeps the
    generations from the oldest live frame's on): refused at load."""
    snap, m = _retrained_snapshot(tmp_path, monkeypatch)
    ids, e = m["ids"], m["entries"]
    gens = e[:, 1] >> 32
    lens = e[:, 1] & 0xFFFFFFFF
    live_gens = sorted(m["dicts"])
    assert len(live_gens) >= 2
    found = None
    for i in range(len(ids) - 2, 0, -1):  # not the newest (the open segment's end is checked) nor the first
        k = int(gens[i])
        if gens[i - 1] != k:
            continue
        for j in live_gens:
            if not 1 <= j < k:
                continue
            body = _compress(m["raw"][i], m["dicts"][j])
            if len(body) + 8 <= lens[i]:
                found = i, j, body
                break
        if found:
            break
    assert found is not None, "no frame that an older generation compresses shorter"
    i, j, body = found
    o, ln = int(e[i, 0]), int(lens[i])
    pad = ln - len(body) - 8
    crafted = body + struct.pack("<II", SKIPPABLE, pad) + b"\0" * pad
    # the crafted bytes decode to exactly frame X's bytes with generation j's dictionary
    c = _zstd.Codec(3)
    c.set_dictionary(1, m["dicts"][j])
    out = np.empty((1, m["raw"].shape[1]), np.uint8)
    r = _zstd.decompress_rows(c.dctx(), c.ddicts, np.frombuffer(crafted, np.uint8), np.zeros(1, np.int64),
                              np.array([ln]), np.ones(1, np.int64), out, 0, 1)
    c.close()
    assert r == -1 and np.array_equal(out[0], m["raw"][i])
    log = m["log"].copy()
    log[o:o + ln] = np.frombuffer(crafted, np.uint8)
    index = m["index"].copy()
    index[ids[i] % m["F"], 1] = ln | (j << 32)
    put_data(snap, "frame_log", log.reshape(-1, m["block"]))
    put_data(snap, "frame_index", index)
    err = refused(CorruptSnapshotError, snap)
    assert "going back" in str(err) or "back" in str(err)
