"""A compiled-kernel cache that numba cannot read back: its index, read at
every compile before anything else, names a class another bigper passed to a
kernel and this one no longer has (numba issue 6018: unpickling fails with
``AttributeError``), or was cut short (issue 10434: ``EOFError``), or holds
other bytes. Without care each kernel of that file fails at its first call in
every process, for good; bigper's kernels read their cache through
``common.kernels._GuardedCacheFile``, which empties such an index where it is
read and compiles. Real interpreters, a cache of their own."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_TYPES_BEFORE = '''
from typing import NamedTuple
import numpy as np


class Pair(NamedTuple):
    a: np.ndarray
    b: np.ndarray
'''

_KERNELS = '''
import numpy as np
from bigper.common.kernels import jit, kernel

held = jit(cache=True)


@kernel
def first(t):
    return t[0][0] + t[1][0]


@held
def second(t):
    return t[0][1] * t[1][1]
'''

# The first run passes the named tuple (its type goes into the cache index); the second, after the
# class is gone, a plain tuple (as bigper after the change).
_RUN = '''
import sys
import numpy as np
import kern_under_test as m
a, b = np.arange(3.0), np.arange(3.0) + 10
if sys.argv[1] == "named":
    import nt_types
    t = nt_types.Pair(a, b)
else:
    t = (a, b)
print(m.first(t), m.second(t))
'''


def _run(tmp_path, how):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(_RUN), how], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def _indexes(tmp_path):
    return sorted(glob.glob(str(tmp_path / "cache" / "**" / "*.nbi"), recursive=True))


@pytest.mark.parametrize("damage", ["class removed", "index cut short", "index of other bytes", "index emptied"])
def test_a_cache_index_numba_cannot_read_is_rebuilt_not_fatal(tmp_path, damage):
    (tmp_path / "nt_types.py").write_text(_TYPES_BEFORE)
    (tmp_path / "kern_under_test.py").write_text(_KERNELS)
    r = _run(tmp_path, "named")
    assert r.returncode == 0 and r.stdout.split() == ["10.0", "11.0"], r.stderr[-2000:]
    idx = _indexes(tmp_path)
    assert len(idx) == 2, idx  # (one index a kernel: both read at the next compile)
    if damage == "class removed":
        (tmp_path / "nt_types.py").write_text("# Pair is gone\n")
    for p in idx:
        data = open(p, "rb").read()
        if damage == "index cut short":
            open(p, "wb").write(data[:len(data) // 2])
        elif damage == "index of other bytes":
            open(p, "wb").write(os.urandom(len(data)))
        elif damage == "index emptied":
            open(p, "wb").close()
    r = _run(tmp_path, "plain")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["10.0", "11.0"]
    assert "could not be read" in r.stderr  # (said once a kernel, as a warning)
    r = _run(tmp_path, "plain")  # the rebuilt index serves the next process, silently
    assert r.returncode == 0 and r.stdout.split() == ["10.0", "11.0"] and "could not be read" not in r.stderr, \
        r.stderr[-2000:]


def test_a_typing_error_is_not_taken_for_a_stale_cache(tmp_path):
    """A call numba cannot type raises as before (the index reads fine: no retry, no warning)."""
    (tmp_path / "kern_under_test.py").write_text(_KERNELS)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    code = "import kern_under_test as m\ntry:\n    m.first(3)\nexcept Exception as e:\n" \
           "    print(type(e).__name__)\n"
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "TypingError", r.stdout + r.stderr[-2000:]
    assert "could not be read" not in r.stderr


def test_an_index_that_cannot_be_rewritten_still_compiles(tmp_path):
    """An index numba can neither read nor replace (a folder where the file
    was: no user, root included, writes over it): the kernel is compiled in
    memory, the result right, the folder left where it was."""
    (tmp_path / "kern_under_test.py").write_text(_KERNELS)
    assert _run(tmp_path, "plain").returncode == 0
    idx = _indexes(tmp_path)
    for p in idx:
        os.unlink(p)
        os.mkdir(p)
        open(os.path.join(p, "keep"), "w").close()  # (not empty: os.replace cannot take its place)
    r = _run(tmp_path, "plain")
    assert r.returncode == 0 and r.stdout.split() == ["10.0", "11.0"], r.stderr[-2000:]
    assert all(os.path.isdir(p) for p in idx)
