"""Ctrl-C while a kernel compiles: llvmlite frees a C string and then marks
it freed; a ``KeyboardInterrupt`` raised between the two makes its finalizer
free it again, and the process aborts ("free(): double free detected") where
the user pressed Ctrl-C (CI saw it in a learner's first ``next()``). bigper's
kernels hold Python signal handlers back while they compile or load from the
cache (``common.kernels.jit``): the handler runs once the compile is done,
never inside numba or llvmlite."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Kernels compiled fresh in the child (a cache dir of their own): a few of each decorator.
_MODULE = '''
import numpy as np
from bigper.common.kernels import jit, kernel

held = jit(cache=True)


@kernel
def total(a):
    s = 0.0
    for x in a:
        s += x
    return s


@held
def scaled(a, k):
    out = np.empty_like(a)
    for i in range(a.shape[0]):
        out[i] = a[i] * k
    return out
'''

_CHILD = '''
import os, signal, sys, threading, time
import numpy as np
import kernels_under_test as m

where = []  # per handler call: did it run inside a compile (numba's, or any llvmlite code)?
armed = [False]


def handler(signum, frame):  # a KeyboardInterrupt only around the kernels' calls
    if not armed[0]:
        return
    f = sys._getframe(1)
    inside = False
    while f is not None:
        name = f.f_code.co_filename
        if os.sep + "llvmlite" + os.sep in name or f.f_code.co_name == "_compile_for_args":
            inside = True
        f = f.f_back
    where.append(inside)
    raise KeyboardInterrupt


signal.signal(signal.SIGINT, handler)


def on_term(signum, frame):
    pass


signal.signal(signal.SIGTERM, on_term)
stop = threading.Event()


def bomb():
    while not stop.is_set():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.0005)


th = threading.Thread(target=bomb)
th.start()
dtypes = [np.float64, np.float32, np.int64, np.int32, np.int16, np.uint8, np.uint16, np.uint32]
results = []
try:
    for dt in dtypes:  # each dtype a new compile of each kernel
        a = np.arange(1, 40, dtype=dt)
        while True:
            try:
                armed[0] = True
                try:
                    got = (float(m.total(a)), m.scaled(a, 3).tolist())
                finally:
                    armed[0] = False
                results.append(got)
                break
            except KeyboardInterrupt:
                pass
finally:
    stop.set()
    th.join()
for dt, (s, scaled) in zip(dtypes, results):
    a = np.arange(1, 40, dtype=dt)
    assert s == float(a.sum()), (dt, s)
    assert scaled == (a * 3).tolist(), dt
assert signal.getsignal(signal.SIGINT) is handler  # every handler is put back
assert signal.getsignal(signal.SIGTERM) is on_term
print("handled", len(where), "inside", sum(where))
'''


def test_ctrl_c_during_a_compile_is_delivered_after_it(tmp_path):
    (tmp_path / "kernels_under_test.py").write_text(_MODULE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")]),
               NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD)], capture_output=True, text=True,
                       timeout=300, cwd=str(tmp_path), env=env)
    assert r.returncode == 0, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    handled, inside = (int(x) for x in r.stdout.split()[1::2])
    assert handled > 0, r.stdout  # the bomb reached the handler
    assert inside == 0, r.stdout  # never while a kernel compiled
