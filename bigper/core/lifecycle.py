"""A buffer's life in its process: the decorators every public method runs
under (its lock, an open buffer, device updates settled first), closing the
buffers still open at interpreter exit, and what a ``fork()`` does to them.

``OPEN`` holds the guard of every open buffer (weakly): the exit handler
closes those buffers (state recorded, so a script that ends without
``close()`` leaves a folder that resumes), and the fork handlers take and
give back their locks.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from ..errors import BigperError, BufferClosedError
from ..common.files import real_names

log: logging.Logger = logging.getLogger("bigper")
P = ParamSpec("P")
R = TypeVar("R")

# Buffers still open at interpreter exit are closed cleanly (state recorded),
# so a script that ends without close() leaves a folder that resumes.
OPEN: "weakref.WeakSet" = weakref.WeakSet()


def _close_all_at_exit() -> None:
    for guard in list(OPEN):
        close = guard.close_owner()  # (None: the buffer is gone)
        try:
            if close is not None:
                close()
        except Exception as e:  # noqa: BLE001 (exit must go on; say what was lost)
            log.warning("bigper: could not close %r at exit: %s", close.__self__, e)


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
    for guard in list(OPEN):
        if guard.lock.acquire(timeout=_FORK_WAIT_S):
            _held_for_fork.append(guard.lock)


def _after_fork_in_parent() -> None:
    while _held_for_fork:
        _held_for_fork.pop().release()


def _after_fork_in_child() -> None:
    _held_for_fork.clear()
    for guard in list(OPEN):
        guard.lock = threading.RLock()
        for s in list(guard.samplers):  # their threads are the parent's: what they prepared is too
            try:
                s.close(wait=False, why=BufferClosedError(
                    "this sampler's thread is in the process that forked this one; make a new sampler here"))
            except Exception:  # noqa: BLE001 (a child must come up whatever a sampler's state)
                pass
        guard.samplers = weakref.WeakSet()
        if guard.shares_files:
            guard.why = (f"it was opened in process {guard.pid} and this is a forked child, which shares "
                         "its files and lock; open the path here (read_only=True to sample)")
            guard.forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


class Guard:
    """What every public method of one buffer runs under (``entry_point``,
    ``reader``), passed to what draws from it (a sampler's feed): its lock;
    whether it is open (``closed``, and ``why`` not); the method running now
    (``in_call``: a ``close()`` reached from inside one is refused, not run
    under it); the updates from device tensors in flight (``deferred``, a
    ``device.Deferred``), applied with ``apply``, and the error an invalid one
    left for the next call (``error``); the samplers drawing from it; the
    process that opened it. ``opened`` puts it in ``OPEN`` with what closes
    its buffer at exit (weakly) and whether that buffer's storage is files a
    forked child must not use; ``forget`` marks it closed, out of ``OPEN``."""

    def __init__(self, deferred, apply) -> None:
        self.lock = threading.RLock()
        self.closed = True  # until the buffer's parts are built
        self.why: str | None = None
        self.in_call: str | None = None
        self.deferred = deferred
        self.apply = apply
        self.error: BaseException | None = None
        self.samplers: weakref.WeakSet = weakref.WeakSet()
        self.pid = os.getpid()
        self.close_owner: Callable = lambda: None
        self.shares_files = False

    def opened(self, close, shares_files: bool) -> None:
        self.close_owner = weakref.WeakMethod(close)
        self.shares_files = bool(shares_files)
        self.closed = False
        OPEN.add(self)

    def forget(self) -> None:
        self.closed = True
        OPEN.discard(self)

    def settle(self, keep: bool = False, arrived: bool = False) -> None:
        """Apply the updates in flight, oldest first (waiting for their copies;
        ``arrived``: only those whose copies are done). One whose values are not
        valid priorities changes nothing and is reported here, after the valid
        ones are applied (with ``keep``: by the next public call other than a
        sampler's draw)."""
        e = self.deferred.settle(self.apply, arrived)
        if e is not None:
            if keep:
                self.error = self.error or e
            else:
                raise e

    def refuse_closed(self, what: str) -> None:
        raise BufferClosedError(f"this buffer is closed ({what} needs an open one)"
                                + (f": {self.why}" if self.why else ""))


def entry_point(method: Callable[P, R]) -> Callable[P, R]:
    """A public method: runs under the buffer's lock, on an open buffer (its
    ``_guard``). ``in_call`` names it while it runs, so that a ``close()``
    reached from inside it (an input's ``__array__``, a callback) is refused,
    not run under it. Updates from device tensors are applied first (waited
    for before the lock); an invalid one's error is raised."""
    return _entry(method, True, False)


def entry_point_as(*, settle: bool = True, draw: bool = False) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """``entry_point`` declared otherwise: ``settle=False``, updates in flight
    are left as they are (``update_priorities`` adds one); ``draw=True`` (a
    sampler's draw) keeps an invalid update's error for the learner's next
    call instead of raising it."""
    return lambda method: _entry(method, settle, draw)


def _entry(method: Callable[P, R], settle: bool, draw: bool) -> Callable[P, R]:
    name = method.__name__

    @functools.wraps(method)
    def entry(self, *args, **kwargs):
        guard = self._guard
        if settle and guard.deferred.items:
            guard.deferred.wait()  # device copies still running: waited for before the lock, not under it
        with guard.lock:
            if guard.closed:
                guard.refuse_closed(name)
            outer = guard.in_call
            guard.in_call = name if outer is None else outer
            try:
                if settle and guard.deferred.items:  # in order, before anything reads the tree
                    guard.settle(keep=draw)
                if guard.error is not None and not draw:
                    e, guard.error = guard.error, None
                    raise e
                return method(self, *args, **kwargs)
            except (OSError, BigperError) as e:
                raise real_names(e)  # paths as the user gave them, not /proc/self/fd/N
            finally:
                guard.in_call = outer
    return entry


def reader(method):
    """A public reader that also answers on a closed buffer (its last values), under the lock."""
    @functools.wraps(method)
    def entry(self, *args, **kwargs):
        guard = self._guard
        if guard.deferred.items:
            guard.deferred.wait()  # (outside the lock, as for every entry point)
        with guard.lock:
            if not guard.closed and guard.deferred.items:
                guard.settle(keep=True)  # (a reader reports nobody's error: the next call does)
            return method(self, *args, **kwargs)
    return entry
