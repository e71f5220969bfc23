"""The options every compiled kernel of bigper shares (``kernel``): one
decorator, so that every kernel lands in the same on-disk cache entries in
every process; and ``ring_rows``, the slots and end bits of rows, which the
frames and the core's ring both use. The other kernels live with what they
serve: the tree's in ``prioritization/_tree_kernels.py``, the rank heap's in
``prioritization/_rank_kernels.py``, the ring's in ``core/ring.py``, the
frames' in ``frames/``.

Nothing a kernel takes is validated by it: the Python layer checks everything
once at the public boundary and hands over arrays of the right dtype. Every
kernel works on a whole batch a call.

A group of arguments (``frames.store.RingArgs``, ``prioritization.tree.TreeArrays``,
the sequence items' groups) is a ``NamedTuple`` class that names it, passed
as a plain tuple and named again in the kernel (``ra = RingArgs(*ra)``, free
there): numba computes a plain tuple's type in C but a named tuple's in
Python, at every call (about 0.7 µs for twelve fields, a tenth of an Atari
add; measured).
"""

import io
import logging
import os
import pickle
import signal
import threading
from contextlib import contextmanager

from numba import njit
from numba.core.caching import IndexDataCacheFile

from .files import read_regular

log = logging.getLogger("bigper")

# The signals whose Python handlers are held back while a kernel compiles (or loads from the cache):
# all of them, since any handler may raise (Ctrl-C's KeyboardInterrupt, a SIGTERM handler's exit, a
# SIGALRM timeout's exception: one inside a compile segfaulted it, or left numba's registrations
# half done so that every later compile failed).
_HELD_BACK = tuple(sorted(signal.valid_signals()))
_holding = [False]
# Rounds of putting the originals back before giving up (a handler raising each round, or signal.signal
# failing each time: forever would hang the compile; what is left forwards, see ``hold``).
_ROUNDS = 1000
# The hold in progress: its thread, its hold and the handlers it took out (a fork's child puts them back).
_taken: dict = {}


@contextmanager
def _signals_held_back():
    """Signals with a Python handler (Ctrl-C's ``KeyboardInterrupt``, a
    SIGALRM timeout) run after the block, not inside it. An exception raised
    inside llvmlite's calls (between a C call that frees and the line that
    records it) makes its finalizer free the same memory again: the process
    aborts ("double free") instead of raising. Handlers run only in the main
    thread, so only it needs this; the first signal of each kind is
    delivered once the compile is done.

    A handler may raise wherever CPython runs it: inside ``signal.signal``
    (before it changes anything), after any call, at a loop's jump back; and
    when two signals are pending and the first raises, CPython runs the
    second at its next such point. So the holds go in inside the ``try`` (one
    that raises meanwhile takes the others out again); while the originals go
    back (in one call from C, again until a round gets through) a signal
    still meeting ``hold`` runs its original at once and what it raises waits;
    every caught signal is delivered even when an earlier handler raised. The
    first exception a handler raised is raised once all is done."""
    if _holding[0] or threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: dict = {}
    saved: dict = {}
    kept: list = []  # what handlers raised while the originals went back and ran
    phase = [0]  # 0 holding, 1 putting back, 2 done

    def hold(signum, frame):
        if phase[0] == 0:
            caught.setdefault(signum, frame)
        elif phase[0] == 1:  # (not put back yet: runs now; what it raises waits for the others)
            try:
                saved[signum](signum, frame)
            except BaseException as e:
                kept.append(e)
        else:  # (left in by an exception: puts its original back, and forwards)
            signal.signal(signum, saved[signum])
            saved[signum](signum, frame)

    try:
        _holding[0] = True
        _taken.update(thread=threading.get_ident(), hold=hold, saved=saved)
        try:
            for s in _HELD_BACK:
                h = signal.getsignal(s)
                if callable(h):
                    saved[s] = h
                    signal.signal(s, hold)
        except ValueError:  # (not the main interpreter: its handlers are not ours to move)
            saved.pop(s, None)
        yield
    finally:
        _holding[0] = False
        phase[0] = 1
        try:
            for _ in range(_ROUNDS):
                try:
                    list(map(signal.signal, saved, saved.values()))
                    break
                except BaseException as e:  # (an original, put back already, ran and raised: again)
                    kept += (e,)  # (not a call: CPython runs no handler between here and the retry)
        finally:
            phase[0] = 2
            _taken.clear()
            for s, frame in caught.items():
                try:
                    saved[s](s, frame)
                except BaseException as e:  # (the ones after it still run)
                    kept.append(e)
        if kept:
            raise kept[0]


def _after_fork_in_child() -> None:
    """A fork made by another thread while the main thread held signals back
    (``os.fork``, multiprocessing's fork): the child has the recording
    handler and no thread to put the originals back (its Ctrl-C, SIGTERM,
    ... would be recorded forever), and the hold marked in progress (its own
    compiles would hold nothing). Put both right; what the parent caught was
    the parent's."""
    if not _taken or _taken["thread"] == threading.get_ident():
        return  # (no hold, or the fork came from inside the block: it ends in the child too)
    hold, saved = _taken["hold"], _taken["saved"]
    _taken.clear()
    _holding[0] = False
    for s, h in saved.items():
        if signal.getsignal(s) is hold:
            signal.signal(s, h)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# The most bytes a cache file is read at (numba reads an index or a data file whole: a sparse
# file of terabytes would be read into memory). A kernel's compiled code is a few hundred KiB.
_CACHE_FILE_BYTES = 256 << 20


def _read_cache_file(path) -> bytes:
    """The bytes of ``path`` when it is a regular file (through links) of at
    most ``_CACHE_FILE_BYTES``, without holes, else ``OSError``;
    ``FileNotFoundError`` when nothing is there. numba opens its cache files
    for reading as they are: a FIFO there blocks the first call forever, a
    link to ``/dev/zero`` reads without end, a sparse file is read whole. So
    the file is opened and measured as bigper opens every file it reads
    (``common.files.read_regular``: without blocking, on the descriptor)."""
    return read_regular(path, limit=_CACHE_FILE_BYTES, follow=True, error=OSError)


class _GuardedCacheFile(IndexDataCacheFile):
    """numba's index and data files of one kernel, read only when they are
    regular files. An index that is something else, or that does not
    unpickle, is stale: rebuilt empty where it is read, by whoever reads it
    (a kernel compiled as another's callee too). A data file that is
    something else, or that does not unpickle (garbage, cut short, naming a
    class since removed), is taken as missing, as numba takes a removed one: the kernel compiles and its
    save writes the file again (numba raised at every first call of every
    process, for good, or blocked on a FIFO). A save that fails (a folder
    where the data file goes) leaves the kernel compiled in memory only,
    not a failed call."""

    def _load_index(self):
        try:  # (numba's ``_load_index``, on the bytes read once from the file opened)
            f = io.BytesIO(_read_cache_file(self._index_path))
            if pickle.load(f) != self._version:
                return {}
            stamp, overloads = pickle.loads(f.read())
            return overloads if stamp == self._source_stamp else {}
        except FileNotFoundError:
            return {}
        except Exception:  # noqa: BLE001  (not a regular file, or whatever unpickling an index raises)
            pass
        # Rebuilt here, where numba reads it: also when the kernel is compiled as the callee of another
        # (numba's ``compile``, not ``_compile_for_args``: the caller failed for good, its own index fine).
        if not getattr(self, "_bigper_said", False):
            self._bigper_said = True
            log.warning("bigper: the compiled-kernel cache %s could not be read (written by another version, "
                        "or cut short); rebuilding it", self._index_path)
        try:
            self._save_index({})
        except Exception:  # noqa: BLE001  (not writable: the save after the compile fails too, and says so)
            pass
        return {}

    def _load_data(self, name):
        path = self._data_path(name)
        data = _read_cache_file(path)  # (any OSError: numba's ``load`` takes it as missing)
        try:
            return pickle.loads(data)  # (numba's ``_load_data``, on the bytes read above)
        except Exception as e:  # noqa: BLE001  (whatever unpickling a damaged data file raises)
            raise OSError(f"unreadable cache data file {path!r}: {e!r}") from e

    def save(self, key, data):
        try:
            super().save(key, data)
        except OSError as e:
            log.warning("bigper: the compiled-kernel cache file %s could not be written (%s); the kernel "
                        "is compiled in memory only", self._index_path, e)


# Every file that defines kernels, from the package's root. numba keys a kernel's cache entry to
# its own file (its mtime and size) only, yet compiles the kernels it calls into it: after a change
# to a callee in another file (a development checkout pulled, a file edited), the caller's cached
# code went on running the old callee. Each kernel's entry is keyed to all of these files too
# (``_package_stamp``); tests/common/test_kernels_cache_callees.py holds the list equal to the package's.
KERNEL_FILES = (
    "common/kernels.py", "core/feed.py", "core/ingest.py", "core/nstep.py", "core/ring.py",
    "core/sequences.py", "core/writer.py", "frames/refs.py", "frames/segments.py", "frames/store.py",
    "frames/zstd.py", "offline/_h5map.py", "prioritization/_bulk.py", "prioritization/_rank_kernels.py",
    "prioritization/_rank_law.py", "prioritization/_rank_sort.py", "prioritization/_tree_kernels.py",
)
_stamp: tuple | None = None


def _package_stamp() -> tuple:
    """``(name, mtime_ns, size)`` of each of ``KERNEL_FILES`` (None where a
    stat fails), taken once a process."""
    global _stamp
    if _stamp is None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = []
        for name in KERNEL_FILES:
            try:
                st = os.stat(os.path.join(root, name))
                out.append((name, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append((name, None, None))
        _stamp = tuple(out)
    return _stamp


def jit(**options):
    """``numba.njit(**options)`` whose compiles (first calls, new types, cache
    loads) hold Ctrl-C (any Python signal handler) back until they are done
    (``_signals_held_back``), and whose on-disk cache is read only where it
    can be (``_GuardedCacheFile``)."""
    make = njit(**options)

    def decorate(fn):
        dispatcher = make(fn)
        cache_file = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
        if type(cache_file) is IndexDataCacheFile:  # (numba's, unchanged: same fields, guarded reads)
            cache_file.__class__ = _GuardedCacheFile
            cache_file._source_stamp = (cache_file._source_stamp, _package_stamp())  # (KERNEL_FILES says why)
        compile_for_args = dispatcher._compile_for_args  # (what numba's dispatcher calls on a type it has not seen)

        def compile_held(*args, **kws):
            with _signals_held_back():
                return compile_for_args(*args, **kws)

        dispatcher._compile_for_args = compile_held
        return dispatcher

    return decorate


kernel = jit(cache=True, nogil=True)


@kernel
def ring_rows(g0, capacity, terminated, truncated, slots, ends):
    """Slots and end bits of ``m`` rows numbered from ``g0``: ``slots[r] =
    (g0 + r) % capacity``, ``ends[r]`` bit 0 terminated, bit 1 truncated."""
    for r in range(terminated.shape[0]):
        slots[r] = (g0 + r) % capacity
        ends[r] = (1 if terminated[r] else 0) | (2 if truncated[r] else 0)
