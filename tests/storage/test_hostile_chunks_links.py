"""Issue 40, cause 3: the compressed log grows into chunk files bigper
makes, never into a file that is already there (promises 7 and 17).

A hard link (``st_nlink > 1``) or any file bigper did not record, planted at
the next chunk name the log will open (``data/frame_log.00000N.bin``), was
taken for bigper's own leftover: extended through the link, mapped read-only
as shared, and written by the log (SIGSEGV). Now the growth is refused with
bigper's error naming the path, the add changes nothing, the file is
untouched, and the buffer goes on once the file is gone. Each run is a child
process, so a crash is a failed test, not a dead pytest.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import bigper

ROOT = Path(__file__).resolve().parents[2]
SHAPE = (32, 32)  # 1 KB frames of noise: a few a segment, so the log grows often
KW = dict(capacity=256, fields={"obs": ((2, *SHAPE), np.uint8)}, frame_stack=2, compression="zstd",
          storage="memmap", seed=0)


def _next_chunk(path: Path) -> Path:
    """The chunk file the log opens when it next grows."""
    meta = json.loads((path / "meta.json").read_text())
    rec = meta["arrays"]["frame_log"]
    k = -(-rec["rows"] // rec["chunk_rows"])
    return path / "data" / f"frame_log.{k:06d}.bin"


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


CHILD = textwrap.dedent("""
    import sys, numpy as np, bigper
    kw = dict(capacity=256, fields={"obs": ((2, 32, 32), np.uint8)}, frame_stack=2, compression="zstd",
              storage="memmap", seed=0)
    buf = bigper.PrioritizedReplayBuffer(**kw, path=sys.argv[1], mode="resume")
    rng = np.random.default_rng(1)
    n = len(buf)
    for t in range(400):
        f = rng.integers(0, 256, size=(3, 32, 32), dtype=np.uint8)
        try:
            buf.add(obs=f[:2], next_obs=f[1:])
        except bigper.BigperError as e:
            print("REFUSED", type(e).__name__, e, flush=True)
            assert len(buf) == n + t, (len(buf), n, t)
            break
    else:
        print("NEVER REFUSED", flush=True)
    buf.close()
""")


def _fill(path: Path, n: int = 30) -> None:
    rng = np.random.default_rng(0)
    with bigper.PrioritizedReplayBuffer(**KW, path=path) as buf:
        for _ in range(n):
            f = rng.integers(0, 256, size=(3, *SHAPE), dtype=np.uint8)
            buf.add(obs=f[:2], next_obs=f[1:])


def _run_child(path: Path) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, f"the child died (returncode {r.returncode}): {r.stderr[-3000:]}"
    return r


@pytest.mark.parametrize("plant", ["hard link", "regular file", "hard link, smaller"])
def test_a_file_at_the_next_chunk_name_is_refused_never_written(tmp_path, plant):
    path = tmp_path / "b"
    _fill(path)
    victim = tmp_path / "victim.bin"
    size = 4096 if plant.endswith("smaller") else 1 << 20
    victim.write_bytes(np.random.default_rng(9).integers(0, 256, size, dtype=np.uint8).tobytes())
    before = _digest(victim)
    where = _next_chunk(path)
    if plant.startswith("hard link"):
        os.link(victim, where)
    else:
        where.write_bytes(victim.read_bytes())
    r = _run_child(path)
    assert "REFUSED PathExistsError" in r.stdout and str(where) in r.stdout, r.stdout + r.stderr
    assert _digest(victim) == before and victim.stat().st_size == size  # never extended or written through
    assert _digest(where) == before
    # The file gone, the same buffer resumes and grows past it.
    where.unlink()
    r = _run_child(path)
    assert "NEVER REFUSED" in r.stdout, r.stdout + r.stderr
    assert where.exists() and where.stat().st_nlink == 1


def test_a_file_at_a_copy_on_write_name_is_refused_never_truncated(tmp_path):
    """After a snapshot shares the chunk files, the first write of a chunk
    copies it to ``<chunk>.cow`` first: a hard link planted there on a live
    buffer is refused by name, the add changes nothing, the link's target
    keeps its bytes."""
    path = tmp_path / "b"
    fields = {"obs": ((64,), np.uint8)}
    buf = bigper.PrioritizedReplayBuffer(64, fields, storage="memmap", path=path, seed=0)
    for g in range(10):
        buf.add(obs=np.full(64, g, np.uint8), next_obs=np.full(64, g + 1, np.uint8))
    buf.save(tmp_path / "snap")  # every chunk now shared with the snapshot
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious" * 512)
    before = _digest(victim)
    os.link(victim, path / "data" / "obs.bin.cow")
    state = buf.state_dict()
    meta, arrays = state[0], {k: np.array(v, copy=True) for k, v in state[1].items()}
    with pytest.raises(bigper.errors.PathExistsError, match="obs.bin.cow"):
        buf.add(obs=np.zeros(64, np.uint8), next_obs=np.ones(64, np.uint8))
    assert _digest(victim) == before
    after = buf.state_dict()
    assert after[0] == meta and all(np.array_equal(arrays[k], after[1][k]) for k in arrays)
    (path / "data" / "obs.bin.cow").unlink()
    buf.add(obs=np.zeros(64, np.uint8), next_obs=np.ones(64, np.uint8))
    assert len(buf) == 11
    buf.close()
