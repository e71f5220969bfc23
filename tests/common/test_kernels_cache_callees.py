"""A kernel's on-disk cache entry is keyed to every file that defines kernels
(``common/kernels.py`` ``KERNEL_FILES``), not only to its own: numba compiles
the kernels a kernel calls into it, so a changed callee in another file left
the caller's cached code running the old one (found when ``is_weight``'s
floor, in ``prioritization/_tree_kernels.py``, did not reach the native
feed's ``draw_kernel``, in ``core/feed.py``, from a warm cache)."""

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import bigper
from bigper.common import kernels

ROOT = Path(bigper.__file__).resolve().parent
DEFINES = re.compile(r"^\s*@(kernel|jit\(|njit)\b|^\s*\w+\s*=\s*jit\(", re.M)


def test_kernel_files_are_every_file_that_defines_kernels():
    found = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if DEFINES.search(p.read_text()))
    assert sorted(kernels.KERNEL_FILES) == found


PROBE = textwrap.dedent("""
    import numpy as np, bigper
    buf = bigper.PrioritizedReplayBuffer(16, {"x": ((), np.float32)}, seed=3)
    for t in range(16):
        buf.add(x=np.float32(t), terminated=False)
    p = np.full(16, 1e-300)
    p[5] = 1.7e308
    buf.update_priorities(np.arange(16), p)
    with buf.sampler(8, prefetch=0, device="cpu") as it:  # (core/feed.py's draw_kernel: is_weight inlined)
        print(repr(float(np.asarray(next(it)["weights"]).min())))
""")


def test_a_changed_callee_in_another_file_reaches_its_cached_caller(tmp_path):
    """A copy of the package run twice on one cache: between the runs the
    copy's ``W_MIN`` (the weights' floor, ``_tree_kernels.py``) changes; the
    second run's native feed (``core/feed.py``, unchanged) gives the new one."""
    pkg = tmp_path / "pkg"
    shutil.copytree(ROOT, pkg / "bigper", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(pkg), "NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    def run() -> float:
        out = subprocess.run([sys.executable, "probe.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return float(out.stdout.strip().splitlines()[-1])

    tiny = run()
    assert tiny > 0
    src = pkg / "bigper" / "prioritization" / "_tree_kernels.py"
    text = src.read_text()
    line = "W_MIN = float(np.finfo(np.float32).tiny)"
    assert text.count(line) == 1
    src.write_text(text.replace(line, "W_MIN = float(np.finfo(np.float32).tiny) * 4"))
    assert run() == tiny * 4
