"""A compiled-kernel cache damaged in the ways a shared or hostile cache
folder can be: a data file (``.nbc``) that does not unpickle, is cut short,
is a folder, a FIFO or a link to ``/dev/zero``, under an index that reads
fine; an index that is a FIFO or such a link; two processes (and two threads
each) meeting one stale index at once; Ctrl-C while the stale index is
rebuilt; a call numba cannot type meeting a stale index; a cache file swapped
for a FIFO just before it is opened. Never a hang, never
a failed call that a compile would have served, never a genuine error
swallowed. Real interpreters, a cache folder of their own."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DAMAGE = ["data garbage", "data cut short", "data emptied", "data removed", "data a folder", "data a fifo",
          "data links to /dev/zero", "index a fifo", "index links to /dev/zero", "index a link loop",
          "index dangling link", "data sparse 1 TiB", "index sparse 1 TiB"]

# One kernel a case (each has its own index and data file), compiled in one process.
_KERNELS = "from bigper.common.kernels import jit, kernel\n\n" + "".join(
    f"\n@kernel\ndef k{i}(a):\n    return a[0] + {i}\n\n" for i in range(len(DAMAGE))) + '''
@jit(cache=True)
def plain(a):
    return a[0] * 2.0


@kernel
def callee(a):
    return a[0] * 3.0


@kernel
def caller(a):
    return callee(a) + 1.0
'''

_CALL_ALL = f'''
import numpy as np, kern_h as m
a = np.arange(3.0) + 1
print(m.caller(a), *[getattr(m, "k%d" % i)(a) for i in range({len(DAMAGE)})])
'''


def _env(tmp_path):
    return {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
            "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}


def _py(tmp_path, code, *args):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=_env(tmp_path), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def _files(tmp_path, name, ext):
    found = glob.glob(str(tmp_path / "cache" / "**" / f"kern_h.{name}-*.{ext}"), recursive=True)
    assert len(found) == 1, found
    return found[0]


def _damage(path, how):
    if how in ("garbage", "cut short", "emptied"):
        data = open(path, "rb").read()
        data = {"garbage": b"\x80\x05garbage" * 40, "cut short": data[:len(data) // 2], "emptied": b""}[how]
        open(path, "wb").write(data)
        return
    if how == "sparse 1 TiB":  # (read whole, it would take a TiB of memory: read never)
        os.truncate(path, 1 << 40)
        return
    os.unlink(path)
    if how == "a folder":
        os.mkdir(path)
        open(os.path.join(path, "keep"), "w").close()  # (not empty: nothing replaces it)
    elif how == "a fifo":
        os.mkfifo(path)
    elif how == "links to /dev/zero":
        os.symlink("/dev/zero", path)
    elif how == "a link loop":
        os.symlink(path, path)
    elif how == "dangling link":
        os.symlink(path + ".gone", path)


def test_damaged_cache_files_are_compiled_past_never_a_hang_nor_a_failed_call(tmp_path):
    (tmp_path / "kern_h.py").write_text(_KERNELS)
    want = ["4.0"] + [str(float(1 + i)) for i in range(len(DAMAGE))]
    r = _py(tmp_path, _CALL_ALL)
    assert r.returncode == 0 and r.stdout.split() == want, r.stderr[-2000:]
    for i, case in enumerate(DAMAGE):
        which, how = case.split(" ", 1)
        _damage(_files(tmp_path, f"k{i}", "nbc" if which == "data" else "nbi"), how)
    # A kernel compiled as another's callee (numba's ``compile``, not the call path): its caller failed for good.
    _damage(_files(tmp_path, "callee", "nbi"), "cut short")
    r = _py(tmp_path, _CALL_ALL)  # (a FIFO read by numba blocked here for good: the timeout)
    assert r.returncode == 0 and r.stdout.split() == want, r.stderr[-3000:]
    r = _py(tmp_path, _CALL_ALL)  # healed: silent, but for the folder no one can replace (in memory only)
    assert r.returncode == 0 and r.stdout.split() == want, r.stderr[-3000:]
    folder = DAMAGE.index("data a folder")
    assert [ln for ln in r.stderr.splitlines() if ln.strip() and f"kern_h.k{folder}-" not in ln] == [], r.stderr
    for i, case in enumerate(DAMAGE):
        if case != "data a folder":
            assert os.path.isfile(_files(tmp_path, f"k{i}", "nbi")) and not os.path.islink(
                _files(tmp_path, f"k{i}", "nbi")), case
            assert os.path.isfile(_files(tmp_path, f"k{i}", "nbc")), case
    assert os.path.isdir(_files(tmp_path, f"k{folder}", "nbc"))


_RACE = '''
import threading, numpy as np, kern_h as m
a = np.arange(3.0) + 1
go = threading.Barrier(2)
out = {}
def call(i):
    go.wait()
    out[i] = (m.k0(a), m.k1(a), m.plain(a))
ts = [threading.Thread(target=call, args=(i,)) for i in range(2)]
[t.start() for t in ts]
[t.join() for t in ts]
print(out[0] == out[1] == (1.0, 2.0, 2.0))
'''


def test_two_processes_of_two_threads_meet_one_stale_index_at_once(tmp_path):
    (tmp_path / "kern_h.py").write_text(_KERNELS)
    assert _py(tmp_path, _RACE).stdout.strip() == "True"
    for name in ("k0", "k1", "plain"):
        open(_files(tmp_path, name, "nbi"), "wb").write(b"\x80\x04not an index")
    procs = [subprocess.Popen([sys.executable, "-c", _RACE], env=_env(tmp_path), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 and o.strip() == "True" for p, (o, _) in zip(procs, outs)), outs
    r = _py(tmp_path, _RACE)
    assert r.returncode == 0 and r.stdout.strip() == "True" and r.stderr == "", r.stderr[-2000:]


_INTERRUPTED = '''
import os, signal, numpy as np, kern_h as m
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a child of a background shell starts with it ignored)
a = np.arange(3.0) + 1
cf = m.k0._cache._cache_file
save_index = cf._save_index
def ctrl_c_then_save(overloads):
    os.kill(os.getpid(), signal.SIGINT)  # (while the stale index is rebuilt: held back)
    save_index(overloads)
cf._save_index = ctrl_c_then_save
try:
    m.k0(a)
    print("no interrupt")
except KeyboardInterrupt:
    print("interrupted after", len(m.k0.signatures))
print(m.k0(a))
'''


def test_ctrl_c_while_a_stale_index_is_rebuilt_waits_for_the_compile(tmp_path):
    (tmp_path / "kern_h.py").write_text(_KERNELS)
    assert _py(tmp_path, _CALL_ALL).returncode == 0
    open(_files(tmp_path, "k0", "nbi"), "wb").write(b"\x80\x04not an index")
    r = _py(tmp_path, _INTERRUPTED)
    assert r.returncode == 0 and r.stdout.split("\n")[:2] == ["interrupted after 1", "1.0"], r.stdout + r.stderr


def test_a_typing_error_meeting_a_stale_index_is_raised_once_not_retried_for_good(tmp_path):
    """Both compiles fail (the index was stale, and the call cannot be
    typed): the second failure is raised, the index rebuilt once."""
    (tmp_path / "kern_h.py").write_text(_KERNELS)
    assert _py(tmp_path, _CALL_ALL).returncode == 0
    open(_files(tmp_path, "k0", "nbi"), "wb").write(b"garbage")
    code = '''
    import numpy as np, kern_h as m
    for _ in range(2):
        try:
            m.k0(3)
        except Exception as e:
            print(type(e).__name__)
    print(m.k0(np.arange(3.0) + 1))
    '''
    r = _py(tmp_path, code)
    assert r.returncode == 0 and r.stdout.split() == ["TypingError", "TypingError", "1.0"], r.stdout + r.stderr
    assert r.stderr.count("could not be read") == 1, r.stderr


# A cache file swapped for a FIFO at the last moment before it is opened: after the guard looked at its
# name (``os.stat``: the guard as first written) or just as it is opened (``os.open``: the guard now).
_SWAP = '''
import os, sys
ext = sys.argv[1]
real_stat, real_open = os.stat, os.open
swapped = []
def swap(p):
    if isinstance(p, (str, os.PathLike)) and os.fspath(p).endswith(ext) and "kern_h.k0-" in os.fspath(p) \\
            and not swapped:
        swapped.append(os.fspath(p))
        os.unlink(p)
        os.mkfifo(p)
def looked(p, *a, **k):
    r = real_stat(p, *a, **k)
    swap(p)
    return r
def opened(p, *a, **k):
    swap(p)
    return real_open(p, *a, **k)
os.stat, os.open = looked, opened
import numpy as np, kern_h as m
a = np.arange(3.0) + 1
print(m.k0(a), bool(swapped), os.path.isfile(swapped[0]))
'''


def test_a_cache_file_swapped_for_a_fifo_after_it_was_looked_at_is_never_a_hang(tmp_path):
    """The guard looked at a cache file's name (a regular file) and numba
    then opened the name: a FIFO put there in between blocked the first call
    for good. Now the file is opened without blocking and measured on the
    descriptor: the FIFO is taken as stale (index) or missing (data)."""
    import subprocess

    (tmp_path / "kern_h.py").write_text(_KERNELS)
    assert _py(tmp_path, _CALL_ALL).returncode == 0
    for ext in ("nbi", "nbc"):
        try:
            r = subprocess.run([sys.executable, "-c", _SWAP, "." + ext], env=_env(tmp_path), cwd=tmp_path,
                               capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a .{ext} swapped for a FIFO hung the first call") from None
        assert r.returncode == 0 and r.stdout.split() == ["1.0", "True", "True"], (ext, r.stdout, r.stderr[-2000:])
        assert os.path.isfile(_files(tmp_path, "k0", ext))  # (the FIFO replaced by the save after the compile)
