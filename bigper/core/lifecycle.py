"""A buffer's life in its process: the decorators every public method runs
under (its lock, an open buffer, device updates settled first), closing the
buffers still open at interpreter exit, and what a ``fork()`` does to them.

``OPEN`` holds every open buffer (weakly): the exit handler closes them
(state recorded, so a script that ends without ``close()`` leaves a folder
that resumes), and the fork handlers take and give back their locks.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import weakref

from ..errors import BigperError, BufferClosedError
from ..storage.files import real_names

log: logging.Logger = logging.getLogger("bigper")

# Buffers still open at interpreter exit are closed cleanly (state recorded),
# so a script that ends without close() leaves a folder that resumes.
OPEN: "weakref.WeakSet" = weakref.WeakSet()


def _close_all_at_exit() -> None:
    for buf in list(OPEN):
        try:
            buf.close()
        except Exception as e:  # noqa: BLE001 (exit must go on; say what was lost)
            log.warning("bigper: could not close %r at exit: %s", buf, e)


def run_first_at_exit() -> None:
    """(Re-)register the exit handler so that it runs before every handler
    registered so far: atexit runs last-registered first, and h5py tears its
    objects down in its own handler, registered when h5py is first imported
    (after bigper's). An HDF5 storage's state must be recorded before that."""
    atexit.unregister(_close_all_at_exit)
    atexit.register(_close_all_at_exit)


atexit.register(_close_all_at_exit)


# fork(): the child gets a copy of every open buffer, but not the threads that
# may hold their locks, and shares the parent's files, mappings and flocks.
# Before a fork every open buffer's lock is taken (no method half-way through
# in the copy); in the child, each gets a fresh lock, and a disk buffer is
# closed there without touching anything (its exit must not record state
# into, or release the lock of, the parent's live path).
_FORK_WAIT_S = 10.0
_held_for_fork: list = []


def _before_fork() -> None:
    for buf in list(OPEN):
        lock = getattr(buf, "_lock", None)
        if lock is not None and lock.acquire(timeout=_FORK_WAIT_S):
            _held_for_fork.append(lock)


def _after_fork_in_parent() -> None:
    while _held_for_fork:
        _held_for_fork.pop().release()


def _after_fork_in_child() -> None:
    _held_for_fork.clear()
    for buf in list(OPEN):
        buf._lock = threading.RLock()
        for s in list(buf._samplers):  # their threads are the parent's: what they prepared is too
            try:
                s.close(wait=False, why=BufferClosedError(
                    "this sampler's thread is in the process that forked this one; make a new sampler here"))
            except Exception:  # noqa: BLE001 (a child must come up whatever a sampler's state)
                pass
        buf._samplers = weakref.WeakSet()
        if not buf._store.in_memory:
            buf._closed = True
            buf._closed_why = (f"it was opened in process {buf._pid} and this is a forked child, which shares "
                               "its files and lock; open the path here (read_only=True to sample)")
            OPEN.discard(buf)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


def entry_point(method):
    """A public method: runs under the buffer's lock, on an open buffer.
    ``_in_call`` names it while it runs, so that a ``close()`` reached from
    inside it (an input's ``__array__``, a callback) is refused, not run under it."""
    name = method.__name__

    @functools.wraps(method)
    def entry(self, *args, **kwargs):
        if name != "update_priorities":
            deferred = getattr(self, "_deferred", None)
            if deferred:
                deferred.wait()  # device copies still running: waited for before the lock, not under it
        with self._lock:
            if self._closed:
                raise BufferClosedError(f"this buffer is closed ({name} needs an open one)"
                                        + (f": {self._closed_why}" if self._closed_why else ""))
            outer = self._in_call
            self._in_call = name if outer is None else outer
            try:
                if name != "update_priorities" and self._deferred:
                    # Updates from device tensors, in order, before anything reads the tree. The
                    # sampler's draws keep an invalid one's error for the learner's next call.
                    self._settle(keep=name == "_sample_for")
                if self._deferred_error is not None and name != "_sample_for":
                    e, self._deferred_error = self._deferred_error, None
                    raise e
                return method(self, *args, **kwargs)
            except (OSError, BigperError) as e:
                raise real_names(e)  # paths as the user gave them, not /proc/self/fd/N
            finally:
                self._in_call = outer
    return entry


def reader(method):
    """A public reader that also answers on a closed buffer (its last values), under the lock."""
    @functools.wraps(method)
    def entry(self, *args, **kwargs):
        deferred = getattr(self, "_deferred", None)
        if deferred:
            deferred.wait()  # (outside the lock, as for every entry point)
        with self._lock:
            if not self._closed and getattr(self, "_deferred", None):
                self._settle(keep=True)  # (a reader reports nobody's error: the next call does)
            return method(self, *args, **kwargs)
    return entry
