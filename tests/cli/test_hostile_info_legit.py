"""Hostile tests of ``bigper info`` on LEGIT live memmap storages
(bigper/cli/__init__.py ``_check_live_record``): every storage kind bigper
writes must be described (exit 0) wherever a read-only resume of it succeeds;
a false refusal would tell a user their run is corrupt.

Built for real: a wrapped ring, n_step > 1, num_envs > 1, rank, sequence items
(with envs, with zstd frames), raw and zstd frame stacks with and without a
compression_budget, a zstd log still growing (frame_log rows below its most),
fields of float16/bool/int8/big-endian/complex dtypes at shapes () (1,) (2,3)
given in unsorted order, a buffer closed empty, the committed live-v1
fixtures, the device tier, the SB3 drop-in (n_envs=2, frame_stack=4); each
closed, and with its writer still open. No case found a false
refusal when written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper.cli import main

P = bigper.PrioritizedReplayBuffer
SEQ = bigper.Sequence(length=4, burn_in=1)
DATA = Path(__file__).resolve().parents[1] / "data"

KINDS = {
    "wrapped": dict(cap=16, n=200),
    "nstep3": dict(cap=16, n=40, n_step=3),
    "envs3_nstep2": dict(cap=18, n=30, num_envs=3, n_step=2),
    "rank": dict(cap=16, n=50, prioritization="rank"),
    "sequence_envs2": dict(cap=32, n=50, num_envs=2, sequence=SEQ),
    "frames_raw": dict(cap=32, n=70, frame_stack=4),
    "frames_zstd_growing": dict(cap=4096, n=70, frame_stack=4, compression="zstd"),
    "frames_zstd_budget": dict(cap=64, n=300, frame_stack=4, compression="zstd", compression_budget=30),
    "frames_zstd_sequence": dict(cap=32, n=70, frame_stack=4, compression="zstd", sequence=SEQ),
}


def _build(root, kind):
    k = dict(KINDS[kind])
    cap, n = k.pop("cap"), k.pop("n")
    fs, ne = k.get("frame_stack"), k.get("num_envs", 1)
    fields = {"reward": ((), np.float32), "obs": ((fs, 4, 4) if fs else (4, 4), np.uint8)}
    path = root / "live"
    buf = P(cap, fields, storage="memmap", path=path, **k)
    for i in range(n):
        o = np.full((fs, 4, 4) if fs else (4, 4), i % 7, np.uint8)
        kw = dict(obs=o, reward=np.float32(i), next_obs=o, terminated=(i % 9 == 8), truncated=False)
        if ne > 1:
            kw = {key: np.stack([np.asarray(v)] * ne) for key, v in kw.items()}
        buf.add(**kw)
    return buf, path, cap, fields, k


def _info(path, capsys):
    rc = main(["info", str(path)])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_closed_storage_of_every_kind_is_described_as_a_read_only_resume_opens_it(tmp_path, capsys, kind):
    buf, path, cap, fields, k = _build(tmp_path, kind)
    n = len(buf)
    buf.close()
    r = P(cap, fields, storage="memmap", path=path, mode="resume", read_only=True, **k)
    assert len(r) == n
    r.close()
    rc, out, err = _info(path, capsys)
    assert rc == 0, err
    assert "closed cleanly" in out and f"capacity {cap:,}" in out, out


@pytest.mark.parametrize("kind", ["wrapped", "envs3_nstep2", "sequence_envs2", "frames_zstd_growing",
                                  "frames_zstd_budget"])
def test_a_storage_whose_writer_is_still_open_is_described(tmp_path, capsys, kind):
    buf, path, _, _, _ = _build(tmp_path, kind)
    try:
        rc, out, err = _info(path, capsys)
        assert rc == 0, err
        assert "OPEN" in out, out
        assert json.loads((path / "meta.json").read_text())["clean"] is False
    finally:
        buf.close()


def test_a_growing_log_records_fewer_rows_than_its_most_and_is_described(tmp_path, capsys):
    buf, path, _, _, _ = _build(tmp_path, "frames_zstd_growing")
    buf.close()
    from bigper.config import Config
    from bigper.core.layout import storage_specs
    meta = json.loads((path / "meta.json").read_text())
    most = storage_specs(Config.from_dict(meta["config"]))["frame_log"][0]
    assert meta["arrays"]["frame_log"]["rows"] < most  # the case is what it says
    rc, out, err = _info(path, capsys)
    assert rc == 0, err


DTYPES = [np.float16, np.bool_, np.int8, ">f4", ">i8", "<u2", np.complex64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (1,), (2, 3)], ids=str)
def test_fields_of_every_dtype_and_shape_in_unsorted_order_are_described(tmp_path, capsys, dtype, shape):
    fields = {"z": (shape, dtype), "a": ((), np.int64)}  # not sorted
    path = tmp_path / "live"
    b = P(8, fields, storage="memmap", path=path)
    b.add(z=np.zeros(shape, dtype), a=1)
    b.close()
    r = P(8, fields, storage="memmap", path=path, mode="resume", read_only=True)
    assert len(r) == 1
    r.close()
    rc, out, err = _info(path, capsys)
    assert rc == 0, err


def test_a_buffer_closed_empty_is_described(tmp_path, capsys):
    path = tmp_path / "live"
    P(8, {"x": ((2,), np.float32)}, storage="memmap", path=path).close()
    rc, out, err = _info(path, capsys)
    assert rc == 0, err
    assert "0 transitions" in out, out


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("live-*") if p.is_dir()))
def test_the_committed_live_fixtures_are_described(tmp_path, capsys, name):
    live = tmp_path / name
    shutil.copytree(DATA / name, live)
    rc, out, err = _info(live, capsys)
    assert rc == 0, err
    assert "closed cleanly" in out, out


def test_a_buffer_with_the_device_tier_is_described(tmp_path, capsys):
    path = tmp_path / "live"
    b = P(8, {"x": ((2,), np.float32)}, storage="memmap", path=path, device="cpu")
    b.add(x=np.zeros(2, np.float32))
    b.close()
    rc, out, err = _info(path, capsys)
    assert rc == 0, err
    assert "device tier" in out, out


def test_a_storage_written_by_the_sb3_drop_in_is_described(tmp_path, capsys):
    from gymnasium import spaces

    from bigper.integrations.sb3 import PrioritizedReplayBuffer as SB

    path = tmp_path / "r"
    rb = SB(64, spaces.Box(0, 255, (4, 8, 8), np.uint8), spaces.Discrete(3), "cpu", n_envs=2, frame_stack=4,
            storage="memmap", path=str(path), prefetch=0)
    for i in range(20):
        o = np.full((2, 4, 8, 8), i, np.uint8)
        rb.add(o, o, np.array([1, 2]), np.array([0.5, 0.5], np.float32), np.array([False, i % 7 == 6]), [{}, {}])
    rb.buffer.close()
    rc, out, err = _info(path, capsys)
    assert rc == 0, err
    assert "40 transitions" in out, out
