"""Promise 13: every script that ends without close(), on every storage, leaves
a buffer that resumes. Each case is a real interpreter that exits normally
with the buffer still open (and, in some cases, a sampler thread alive or a
snapshot taken); the parent then resumes the path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import bigper

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import bigper

    storage, prio, extra, path, snap = sys.argv[1:6]
    buf = bigper.PrioritizedReplayBuffer(
        50, {"obs": ((3,), np.float32), "reward": ((), np.float32)}, storage=storage, path=path,
        prioritization=prio, seed=1)
    for i in range(37):
        buf.add(obs=np.full(3, i, np.float32), reward=float(i), next_obs=np.full(3, i + 1, np.float32))
    b = buf.sample(8)
    buf.update_priorities(b, np.arange(8, dtype=np.float64) + 0.5)
    if extra == "sampler":
        it = buf.sampler(4, prefetch=2)
        next(it)
    elif extra == "snapshot":
        buf.save(snap)
    print("exiting without close", flush=True)
""")


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("prio", ["proportional", "rank"])
@pytest.mark.parametrize("extra", ["plain", "sampler", "snapshot"])
def test_a_script_that_ends_without_close_leaves_a_buffer_that_resumes(tmp_path, storage, prio, extra):
    path = tmp_path / ("replay.h5" if storage == "hdf5" else "replay")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    r = subprocess.run([sys.executable, "-c", SCRIPT, storage, prio, extra, str(path), str(tmp_path / "snap")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "could not close" not in r.stderr, r.stderr  # the exit handler's warning
    with bigper.PrioritizedReplayBuffer(
            50, {"obs": ((3,), np.float32), "reward": ((), np.float32)}, storage=storage, path=path,
            prioritization=prio, seed=1, mode="resume") as buf:
        assert len(buf) == 37
        got = buf.gather(np.arange(37))
        assert np.array_equal(got["reward"], np.arange(37, dtype=np.float32))
        assert np.array_equal(got["next_obs"][:, 0], np.arange(1, 38, dtype=np.float32))
        # the update made before exit was recorded: not every key is the entry key 1.0
        assert not np.allclose(buf.leaves(np.arange(37)), buf.leaves(np.arange(37))[0])
