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
    from bigper.common.kernels import kernel
    from bigper.prioritization._tree_kernels import is_weight

    @kernel  # (a caller in another file, cached: is_weight is compiled into it, as into core/feed.py's draw)
    def weight(lo, v, beta):
        return is_weight(lo, v, beta)

    print(repr(weight(1e-300, 1.7e308, 1.0)))
""")


def test_a_changed_callee_in_another_file_reaches_its_cached_caller(tmp_path):
    """A copy of the package run twice on one cache: between the runs the
    copy's ``W_MIN`` (the weights' floor, ``_tree_kernels.py``) changes; the
    second run's cached caller (unchanged, in another file) gives the new one.
    (The caller is the probe's own, not the native feed's ``draw_kernel``,
    where the bug was found: the same cache, at a small part of the compile
    time, two runs of a whole buffer's kernels took 50 s of the suite.)"""
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
