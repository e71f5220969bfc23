"""A background thread that prepares the next items of an endless stream.

``Prefetcher(produce, depth, lock)`` calls ``produce()`` in a daemon thread,
each call under ``lock``, and keeps up to ``depth`` results ready; iterating
it hands them over in order. The buffer's sampler is one: ``produce`` draws a
batch, gathers it and (with a device) converts it to tensors. Numba kernels
release the GIL (``nogil=True``) and so do numpy's copies and torch's, so the
thread works while the learner computes::

    learner   [forward/backward ......][update]   [forward/backward ......]
    thread       [draw+gather b2]  [draw+gather b3]     (waits: queue full)
                                    ^ the lock serializes it with update/add/save

Errors raised by ``produce`` (a closed or empty buffer) reach the consumer at
the next ``next()``, after the items prepared before them; the thread then
stops. ``close()`` stops the thread and drops what it prepared; it is also
called when the object is garbage-collected, so a loop left with ``break``
does not leave a thread behind for long. ``close(why=...)`` (the source was
closed under the consumer) makes every later ``next()`` raise ``why``, never
a ``StopIteration`` a loop would take for the end.

``Direct(produce)`` is the same iterator without a thread (``prefetch=0``):
each ``next()`` calls ``produce()`` in the consumer's thread.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

from ..errors import BufferClosedError

# How often a blocked thread or consumer looks whether it was told to stop.
_POLL_S = 0.05


class Failure:
    """An exception raised by ``produce``, carried through the queue."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


def _run(produce: Callable[[], Any], q: "queue.Queue", stop: threading.Event, lock, prepare) -> None:
    # Module-level (not a method) so the thread holds no reference to the
    # Prefetcher: dropping the last user reference lets __del__ stop it.
    while not stop.is_set():
        if prepare is not None:
            prepare()  # waits that need no lock (a device's copies), so others' calls go on meanwhile
        # The lock is polled, not waited for: a thread told to stop while another
        # holds the lock (say, for a long snapshot) ends within a poll.
        if not lock.acquire(timeout=_POLL_S):
            continue
        try:
            if stop.is_set():  # told to stop while waiting for the lock: draw nothing more
                return
            item = produce()
        except BaseException as exc:  # noqa: BLE001 (handed to the consumer, who re-raises it)
            item = Failure(exc)
        finally:
            lock.release()
        while not stop.is_set():
            try:
                q.put(item, timeout=_POLL_S)
                break
            except queue.Full:
                continue
        if isinstance(item, Failure):
            return


def why_after(why: BaseException | None, e: BaseException) -> BaseException | None:
    """What the ``next()`` calls after ``produce`` raised ``e`` raise: a closed
    source stays closed (``BufferClosedError`` at every call); any other error
    is raised once, and the iteration then ends."""
    return why if why is not None else e if isinstance(e, BufferClosedError) else None


class Direct:
    """Iterator over ``produce()`` results made when asked for, in the
    caller's thread: ``Prefetcher``'s contract without its thread. An error
    of ``produce`` is raised once and ends the iteration, except a closed
    buffer's ``BufferClosedError``, raised at every later ``next()`` as
    ``why`` is after ``close(why=...)``; after ``close()`` it ends quietly.

    Parameters
    ----------
    produce : callable
        Makes one item.
    """

    ready = 0  # (nothing is prepared ahead)

    def __init__(self, produce: Callable[[], Any]):
        self._produce = produce
        self._done = False
        self._why: BaseException | None = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            if self._why is not None:
                raise self._why
            raise StopIteration
        try:
            return self._produce()
        except BaseException as e:
            self._done, self._why = True, why_after(self._why, e)
            raise

    def close(self, wait: bool = True, timeout: float | None = None, why: BaseException | None = None) -> None:
        """End the iteration (as ``Prefetcher.close``; there is no thread to wait for)."""
        if why is not None and not self._done:
            self._why = why
        self._done = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Threaded:
    """What an iterator with a thread of its own shares (``Prefetcher``, the
    feed's sampler): its end (``StopIteration``, or the error a closed source
    left), ``close``, the context manager, and a finalizer that stops the
    thread. A subclass has ``_thread``, ``_ready`` (a queue of what it
    prepared) and ``_signal_stop()``."""

    _done = False
    _why: BaseException | None = None  # what ends the iteration, when not the iterator's own close
    _thread: threading.Thread | None = None

    def __iter__(self):
        return self

    @property
    def ready(self) -> int:
        """Items prepared and waiting."""
        return self._ready.qsize()

    def _stop_iteration(self):
        if self._why is not None:
            raise self._why
        raise StopIteration

    def _take(self):
        """The next item the thread prepared (polled: a thread that ended with
        nothing left ends the iteration); a ``Failure`` it prepared is raised."""
        ready = self._ready
        while True:
            try:
                item = ready.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and ready.empty():
                    self._done = True
                    self._stop_iteration()
        if isinstance(item, Failure):
            self._done, self._why = True, why_after(self._why, item.exc)
            self.close()
            raise item.exc
        return item

    def close(self, wait: bool = True, timeout: float | None = None, why: BaseException | None = None) -> None:
        """Stop the thread (it finishes the ``produce`` call in progress, if
        any) and drop what it prepared; ``wait``: until the thread has ended
        (at most ``timeout`` seconds). Idempotent. ``why``: the error the
        consumer's next ``next()`` raises instead of ``StopIteration`` (the
        source closed under it: a learner must not take that for the end)."""
        if why is not None and not self._done:
            self._why = why
        self._done = True
        self._signal_stop()
        t = self._thread
        # (a thread not started yet has nothing to wait for: told to stop, it ends at its start)
        if wait and t is not None and t.ident is not None and t is not threading.current_thread():
            t.join(timeout)
        while True:
            try:
                self._ready.get_nowait()
            except queue.Empty:
                break

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # Collected: wait (briefly) for the thread, so that whatever it held
        # during its last call (a buffer, and with it a storage lock) is let go
        # before the collection that dropped this iterator returns.
        try:
            self.close(wait=True, timeout=2.0)
        except Exception:  # noqa: BLE001 (nothing to raise to in a finalizer)
            pass


class Prefetcher(Threaded):
    """Iterator over ``produce()`` results, ``depth`` of them prepared ahead.

    Parameters
    ----------
    produce : callable
        Makes one item; called only in the background thread, under ``lock``.
    depth : int
        Items kept ready (>= 1). Including the one being made, the thread is
        at most ``depth + 1`` calls ahead of the consumer.
    lock : threading.Lock or RLock
        Held during each ``produce()`` call; whoever else takes it (the
        buffer's writes, priority updates, snapshots) is serialized with it.
    name : str
        The thread's name.
    prepare : callable, optional
        Called in the thread before each ``produce()``, without the lock.
    finish : callable, optional
        ``finish(item)`` in the consumer's thread as it takes an item (a CUDA
        batch: the consumer's stream waits for the thread's copies).
    """

    def __init__(self, produce: Callable[[], Any], depth: int, lock, name: str = "bigper-prefetch",
                 prepare: Callable[[], None] | None = None, finish: Callable[[Any], Any] | None = None):
        self._finish = finish
        self._ready: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_run, args=(produce, self._ready, self._stop, lock, prepare),
                                        name=name, daemon=True)
        self._thread.start()

    def __next__(self):
        if self._done:
            self._stop_iteration()
        item = self._take()
        return item if self._finish is None else self._finish(item)

    def _signal_stop(self) -> None:
        self._stop.set()
