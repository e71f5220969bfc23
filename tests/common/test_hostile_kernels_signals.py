"""Hostile tests of the signal hold around bigper's compiles
(``common.kernels.jit`` and ``_signals_held_back``): while a kernel compiles
or loads from numba's cache on the main thread, the Python signal handlers
(SIGINT's, SIGTERM's, any other's) are swapped for one that records, and the
originals are put back and called once the compile is done.

What is attacked, each case in a fresh child interpreter with a numba cache
dir of its own (so every kernel really compiles; a crash or a hang is a
result, hence the timeouts):

- what a compile does to handlers: a SIGTERM handler runs once after it,
  never inside; SIG_IGN, SIG_DFL and ``default_int_handler`` are what they
  were; a compile that fails while a signal is held; a kernel calling a
  kernel; a handler that compiles a kernel when it is delivered;
- threads: a compile on another thread while the main thread gets SIGINTs,
  a main-thread compile waiting on numba's lock while a thread compiles;
- a fork (``os.fork``, multiprocessing's fork) from a thread while the main
  thread is inside a compile: the child inherits the recording handler with
  nobody left to put the original back;
- asyncio's ``add_signal_handler`` (a wakeup fd) and ``asyncio.run``'s
  Ctrl-C across a compile; a compile in a subinterpreter (no handler may
  move there);
- a signal whose handler raises at every point where the handlers go in or
  come back (``signal.signal``/``getsignal`` wrapped so a signal lands just
  before or just after each call): every handler back, no signal lost;
  SIGINT+SIGTERM bursts every 0.5 ms across thousands of holds;
- SIGINTs every 0.5 ms while kernels load from numba's on-disk cache;
- a handler of another signal (a SIGALRM timeout) that raises inside a
  compile: numba's half-done imports and registrations.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Seconds a child may run: its imports and a few compiles on a busy 2-core machine; one
# that takes longer hangs (a signal that never comes, a fork that deadlocked).
_LIMIT = 120

# What every child starts with: ``probe`` (a kernel of bigper's own decorator) whose compile
# runs ``during``'s callbacks on the compiling thread, inside numba's typing of the kernel
# (an intrinsic's typer): a signal sent there arrives inside the compile, every time.
_PRELUDE = '''
import os, signal, sys, threading, time
import numpy as np
from numba import types
from numba.extending import intrinsic
from bigper.common import kernels
from bigper.common.kernels import jit, kernel

during = []
refusing = [False]


@intrinsic
def inside(typingctx, x):
    fns = list(during)
    during.clear()
    for fn in fns:
        fn()
    if refusing[0]:  # no signature (numba asks again, without literals: no again): a TypingError
        return None

    def codegen(context, builder, signature, args):
        return context.get_dummy_value()

    return types.none(x), codegen


@kernel
def probe(a):
    inside(a)
    return a


@jit(cache=True)
def probe2(a):
    inside(a)
    return a


@kernel
def inner(a):
    inside(a)
    return a + 1


@kernel
def outer(a):
    return inner(a) * 2


# each compile_with() a type no probe has seen: a new compile of it
_fresh = iter([np.int8(1), np.int16(1), np.int32(1), np.uint8(1), np.uint16(1), np.uint32(1),
               np.uint64(1), np.float32(1), np.float64(1), np.int64(1), True, 1.5, 2, 1j, np.complex64(1)])


def compile_with(*fns, k=probe):
    """Compile ``k`` for a new type, running ``fns`` inside its compile."""
    during.extend(fns)
    x = next(_fresh)
    try:
        return k(x)
    finally:
        refusing[0] = False
        assert not during, "no compile ran"


def in_compile():
    """Is a compile (numba's dispatcher compiling, or any llvmlite code) on the stack of this
    handler's caller? (Not any numba code: a running kernel calls back into numba's Python
    to box what it returns, no compile.)"""
    f = sys._getframe(2)
    while f is not None:
        if os.sep + "llvmlite" + os.sep in f.f_code.co_filename or f.f_code.co_name == "_compile_for_args":
            return True
        f = f.f_back
    return False


def send(sig):
    return lambda: os.kill(os.getpid(), sig)


def retried(armed, call, exc, until=None):
    """``call()`` with ``armed[0]`` set (the handler raises only then), again
    while it raises ``exc``; None once ``time.monotonic()`` passes ``until``."""
    while until is None or time.monotonic() < until:
        try:
            armed[0] = True
            try:
                return call()
            finally:
                armed[0] = False
        except exc:
            pass
    return None


def ok(*what):
    print("OK", *what, flush=True)
'''


def _run(tmp_path, body: str, name: str = "child", cache: str = "cache", prelude: str = _PRELUDE,
         limit: float = _LIMIT) -> str:
    """Run ``prelude`` + ``body`` in a fresh interpreter (a file, so numba can cache its
    kernels), numba's cache in ``tmp_path/cache``; its stdout, after it exited 0 in time."""
    script = tmp_path / f"{name}.py"
    script.write_text(prelude + textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               NUMBA_CACHE_DIR=str(tmp_path / cache), PYTHONFAULTHANDLER="1")
    try:
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=limit, cwd=str(tmp_path), env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child hung for {limit} s: {(e.stdout or b'')[-1000:]!r} {(e.stderr or b'')[-3000:]!r}")
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    return r.stdout


# -- what a compile does to handlers -------------------------------------------------------


def test_a_sigterm_handler_runs_once_after_the_compile(tmp_path):
    """Three SIGTERMs inside one compile: the handler runs once, after it,
    and is the handler again."""
    out = _run(tmp_path, '''
    calls = []
    def on_term(s, f):
        calls.append(in_compile())
    signal.signal(signal.SIGTERM, on_term)
    seen = []
    r = compile_with(lambda: seen.append(signal.getsignal(signal.SIGTERM)),
                     send(signal.SIGTERM), send(signal.SIGTERM), send(signal.SIGTERM),
                     lambda: seen.append(list(calls)))
    assert seen[0] is not on_term and seen[1] == [], seen  # held inside
    assert calls == [False], calls  # once, after
    assert signal.getsignal(signal.SIGTERM) is on_term
    assert r == 1
    ok()
    ''')
    assert "OK" in out


def test_sig_ign_sig_dfl_and_the_default_int_handler(tmp_path):
    """SIG_IGN and SIG_DFL are no Python code: left alone, inside the compile
    too. ``default_int_handler`` is held: Ctrl-C inside the compile is a
    ``KeyboardInterrupt`` from the call once it is compiled, the handler back."""
    out = _run(tmp_path, '''
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    seen = []
    compile_with(lambda: seen.append((signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))),
                 send(signal.SIGTERM))
    assert seen == [(signal.SIG_DFL, signal.SIG_IGN)], seen
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == (signal.SIG_DFL, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        compile_with(send(signal.SIGINT))
    except KeyboardInterrupt as e:
        assert not any("numba" in f.filename or "llvmlite" in f.filename
                       for f in __import__("traceback").extract_tb(e.__traceback__)), e.__traceback__
    else:
        raise AssertionError("the Ctrl-C was lost")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert probe(np.int16(3)) == 3  # compiled all the same
    ok()
    ''')
    assert "OK" in out


def test_a_compile_that_fails_while_a_signal_is_held(tmp_path):
    """A typing error with a SIGINT and a SIGTERM held: the process lives,
    both handlers run once after, the caller sees the TypingError (or, with
    ``default_int_handler``, the Ctrl-C, the TypingError as its context); a
    type numba refuses outright likewise; every handler back."""
    out = _run(tmp_path, '''
    from numba.core.errors import TypingError
    calls = []
    def on_int(s, f):
        calls.append(("int", in_compile()))
    def on_term(s, f):
        calls.append(("term", in_compile()))
    signal.signal(signal.SIGINT, on_int)
    signal.signal(signal.SIGTERM, on_term)

    def refuse():
        refusing[0] = True

    try:
        compile_with(send(signal.SIGINT), send(signal.SIGTERM), refuse)
    except TypingError:
        pass
    else:
        raise AssertionError("compiled")
    assert sorted(calls) == [("int", False), ("term", False)], calls
    assert signal.getsignal(signal.SIGINT) is on_int and signal.getsignal(signal.SIGTERM) is on_term
    try:
        probe(object())  # pyobject: refused before typing the body
    except TypingError:
        pass
    else:
        raise AssertionError("compiled")
    assert signal.getsignal(signal.SIGINT) is on_int and signal.getsignal(signal.SIGTERM) is on_term

    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        compile_with(send(signal.SIGINT), refuse)
    except KeyboardInterrupt as e:
        assert isinstance(e.__context__, TypingError), repr(e.__context__)
    else:
        raise AssertionError("neither the Ctrl-C nor the TypingError")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is on_term
    assert probe(np.float64(2.0)) == 2.0  # compiles fine afterwards
    ok()
    ''')
    assert "OK" in out


def test_a_kernel_calling_a_kernel(tmp_path):
    """``outer`` calls ``inner``: inner compiles inside outer's compile (one
    hold, not two stacked). A SIGINT inside inner's compile runs once after
    outer's, and the handler is the user's again."""
    out = _run(tmp_path, '''
    calls = []
    def on_int(s, f):
        calls.append(in_compile())
    signal.signal(signal.SIGINT, on_int)
    seen = []
    r = compile_with(send(signal.SIGINT), lambda: seen.append(signal.getsignal(signal.SIGINT)), k=outer)
    assert calls == [False], calls
    assert seen[0] is not on_int
    assert signal.getsignal(signal.SIGINT) is on_int
    assert r == 4
    ok()
    ''')
    assert "OK" in out


def test_a_handler_that_compiles_a_kernel_when_delivered(tmp_path):
    """The SIGINT handler calls a kernel not compiled yet (and a SIGTERM
    arrives inside that compile): its compile holds again, the SIGTERM runs
    once after it, every handler back."""
    out = _run(tmp_path, '''
    calls = []
    def on_term(s, f):
        calls.append(("term", in_compile()))
    def on_int(s, f):
        calls.append(("int", in_compile()))
        calls.append(("compiled", compile_with(send(signal.SIGTERM), k=probe2)))
    signal.signal(signal.SIGINT, on_int)
    signal.signal(signal.SIGTERM, on_term)
    compile_with(send(signal.SIGINT))
    assert [c[0] for c in calls] == ["int", "term", "compiled"], calls
    assert calls[0][1] is False and calls[1][1] is False, calls
    assert signal.getsignal(signal.SIGINT) is on_int and signal.getsignal(signal.SIGTERM) is on_term
    ok()
    ''')
    assert "OK" in out


# -- threads -----------------------------------------------------------------------------------


def test_a_compile_on_a_thread_holds_nothing_of_the_main_threads(tmp_path):
    """A thread compiles; inside its compile it SIGINTs the main thread
    (``pthread_kill``) and waits for the main thread's handler: that handler
    runs meanwhile (only the main thread's compiles hold), the thread never
    sees a recording handler, and its kernel is right."""
    out = _run(tmp_path, '''
    ran = threading.Event()
    calls = []
    def on_int(s, f):
        calls.append(threading.current_thread() is threading.main_thread())
        ran.set()
    signal.signal(signal.SIGINT, on_int)
    got = {}
    def work():
        def meanwhile():
            got["handler"] = signal.getsignal(signal.SIGINT)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            got["ran"] = ran.wait(20)
        got["r"] = compile_with(meanwhile)
    th = threading.Thread(target=work)
    th.start()
    while th.is_alive():
        time.sleep(0.01)
    th.join()
    assert got == {"handler": on_int, "ran": True, "r": 1}, got
    assert calls == [True], calls
    assert signal.getsignal(signal.SIGINT) is on_int
    ok()
    ''')
    assert "OK" in out


def test_a_main_thread_compile_waiting_on_another_threads_compile(tmp_path):
    """A thread is inside a compile (numba's lock held); the main thread
    calls a new kernel and waits for the lock; a SIGINT then: held, run once
    after the main thread's compile, never inside; both kernels right."""
    out = _run(tmp_path, '''
    calls = []
    def on_int(s, f):
        calls.append(in_compile())
    signal.signal(signal.SIGINT, on_int)
    started, release = threading.Event(), threading.Event()
    got = {}
    def work():
        got["r"] = compile_with(started.set, lambda: release.wait(20))
    th = threading.Thread(target=work)
    th.start()
    started.wait(20)
    def later():
        time.sleep(0.3)  # the main thread is waiting on numba's lock by now
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        release.set()
    threading.Thread(target=later).start()
    r = probe2(np.int64(5))
    th.join()
    assert got == {"r": 1} and r == 5, (got, r)
    assert calls == [False], calls
    assert signal.getsignal(signal.SIGINT) is on_int
    ok()
    ''')
    assert "OK" in out


def test_a_compile_in_a_subinterpreter(tmp_path):
    """A subinterpreter may not move signal handlers (``signal.signal``
    raises ValueError there): its compiles hold nothing and still compile,
    neither raising that ValueError at the end of the hold nor retrying
    the put-back forever; the main interpreter's handlers are untouched."""
    out = _run(tmp_path, '''
    import signal, sys  # (and no numpy or numba here: their modules load once a process)
    try:
        import _xxsubinterpreters as interpreters
    except ImportError:  # (3.13 renamed it)
        import _interpreters as interpreters
    import warnings
    warnings.simplefilter("ignore")  # (numpy's: sub-interpreters are not supported)
    code = """if 1:
        import sys, warnings
        warnings.simplefilter("ignore")
        sys.path[:0] = %r
        import numpy as np
        from bigper.common.kernels import jit
        @jit(cache=False)
        def twice(a):
            return a * 2
        print("sub", twice(21), twice(1.5), flush=True)
    """ % (sys.path,)
    before = signal.getsignal(signal.SIGINT)  # (SIG_IGN where the run started in the background)
    i = interpreters.create()
    interpreters.run_string(i, code)
    interpreters.destroy(i)
    assert signal.getsignal(signal.SIGINT) is before
    print("OK", flush=True)
    ''', prelude="", limit=60)  # (a few seconds: one that takes a minute retries forever)
    assert "sub 42 3.0" in out and "OK" in out, out


# -- a fork while the main thread compiles -----------------------------------------------------

# The child's checks (it is the thread that forked, now its main thread): the handlers are the
# parent's originals, a SIGINT reaches the handler, and a hold of its own holds again.
_CHILD_CHECKS = '''
def child_checks():
    """What a child forked inside the parent's compile finds: 0 when all is well."""
    bad = []
    if signal.getsignal(signal.SIGINT) is not on_int:
        bad.append(f"SIGINT handler {signal.getsignal(signal.SIGINT)}")
    if signal.getsignal(signal.SIGTERM) is not on_term:
        bad.append(f"SIGTERM handler {signal.getsignal(signal.SIGTERM)}")
    del calls[:]
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    if sorted(calls) != [("int", False), ("term", False)]:
        bad.append(f"signals reached {calls}")
    del calls[:]
    # (a compile of its own would wait forever on numba's lock, which the parent's compiling
    # thread held at the fork: the hold itself, as a compile would take it)
    try:
        with kernels._signals_held_back():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            inside_calls = list(calls)
    except BaseException as e:
        bad.append(repr(e))
        inside_calls = None
    if inside_calls != [] or len(calls) != 1:
        bad.append(f"a SIGINT inside the child's hold reached {inside_calls} then {calls}")
    if signal.getsignal(signal.SIGINT) is not on_int:
        bad.append(f"after the child's hold SIGINT handler {signal.getsignal(signal.SIGINT)}")
    return bad
'''


def test_os_fork_from_a_thread_while_the_main_thread_compiles(tmp_path):
    """The child of a fork made while the main thread compiles: Ctrl-C and
    SIGTERM reach its handlers, and its own compiles hold again."""
    out = _run(tmp_path, _CHILD_CHECKS + textwrap.dedent('''
    calls = []
    def on_int(s, f):
        calls.append(("int", in_compile()))
    def on_term(s, f):
        calls.append(("term", in_compile()))
    signal.signal(signal.SIGINT, on_int)
    signal.signal(signal.SIGTERM, on_term)
    r, w = os.pipe()
    got = {}
    go, done = threading.Event(), threading.Event()
    def forker():
        go.wait(20)
        pid = os.fork()
        if pid == 0:
            try:
                bad = child_checks()
                os.write(w, repr(bad).encode())
            finally:
                os._exit(0)
        got["pid"] = pid
        done.set()
    threading.Thread(target=forker).start()
    compile_with(go.set, lambda: done.wait(20))
    os.close(w)
    res = os.read(r, 4096).decode()
    os.waitpid(got["pid"], 0)
    assert res == "[]", res
    assert signal.getsignal(signal.SIGINT) is on_int and signal.getsignal(signal.SIGTERM) is on_term
    ok()
    '''))
    assert "OK" in out


def test_a_multiprocessing_fork_while_the_main_thread_compiles(tmp_path):
    """multiprocessing's fork start method, a Process started from a thread
    while the main thread compiles: its target finds the handlers and a
    compile of its own as a plain fork does."""
    out = _run(tmp_path, _CHILD_CHECKS + textwrap.dedent('''
    import multiprocessing as mp
    calls = []
    def on_int(s, f):
        calls.append(("int", in_compile()))
    def on_term(s, f):
        calls.append(("term", in_compile()))
    signal.signal(signal.SIGINT, on_int)
    signal.signal(signal.SIGTERM, on_term)
    ctx = mp.get_context("fork")
    q = ctx.SimpleQueue()

    def target(q):
        q.put(child_checks())

    got = {}
    go, done = threading.Event(), threading.Event()
    def starter():
        go.wait(20)
        got["p"] = ctx.Process(target=target, args=(q,))
        got["p"].start()
        done.set()
    threading.Thread(target=starter).start()
    compile_with(go.set, lambda: done.wait(20))
    got["p"].join(60)
    assert got["p"].exitcode == 0, got["p"].exitcode
    bad = q.get()
    assert bad == [], bad
    ok()
    '''))
    assert "OK" in out


# -- asyncio -----------------------------------------------------------------------------------


def test_asyncio_signal_handlers_across_a_compile(tmp_path):
    """``loop.add_signal_handler`` (a wakeup fd and a no-op Python handler):
    a SIGINT inside a compile reaches the loop's callback once, afterwards.
    ``asyncio.run``'s own Ctrl-C (it cancels the main task): a SIGINT inside
    a compile in a coroutine ends the run with ``KeyboardInterrupt``."""
    out = _run(tmp_path, '''
    import asyncio
    got = []

    async def main():
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, lambda: got.append("sigint"))
        compile_with(send(signal.SIGINT))
        for _ in range(50):
            await asyncio.sleep(0.01)
            if got:
                break
        await asyncio.sleep(0.05)
        loop.remove_signal_handler(signal.SIGINT)
        return list(got)

    assert asyncio.run(main()) == ["sigint"], got
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    cancelled = []
    async def main2():
        try:
            compile_with(send(signal.SIGINT))
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
    t = time.monotonic()
    try:
        asyncio.run(main2())
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("asyncio.run ended without the Ctrl-C")
    assert cancelled == [True] and time.monotonic() - t < 4, (cancelled, time.monotonic() - t)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ok()
    ''')
    assert "OK" in out


# -- a signal at every point where the handlers go in and come back ----------------------------

_EVERY_POINT = '''
class Stop(Exception):
    pass

armed = [False]
in_body = [False]
handled = {signal.SIGINT: 0, signal.SIGTERM: 0}
ran_inside = []
def on_sig(s, f):
    handled[s] += 1
    if in_body[0]:
        ran_inside.append(s)
    if armed[0]:
        raise Stop(s)
signal.signal(signal.SIGINT, on_sig)
signal.signal(signal.SIGTERM, on_sig)

real_signal, real_getsignal = signal.signal, signal.getsignal
plan = {"n": 0, "at": -1, "sigs": (), "when": None}
sent = set()  # what this block really sent (an early Stop ends it before its body)

def kill(sigs):
    """``sigs`` pending at once (blocked, sent, unblocked: CPython runs their handlers in
    signal order at its next check, and one that raises leaves the others for the check after)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    for sig in sigs:  # (to this thread: another one would take it, blocked here, at once)
        signal.pthread_kill(threading.get_ident(), sig)
        sent.add(sig)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)

def wrapped(real):
    def call(*a):
        plan["n"] += 1
        hit = plan["n"] == plan["at"]
        if hit and plan["when"] == "before":  # (lands at the check signal.signal makes before it changes anything)
            kill(plan["sigs"])
        r = real(*a)
        if hit and plan["when"] == "after":  # (lands at the check right after the call)
            kill(plan["sigs"])
        return r
    return call

def block(body_sends):
    """One hold, with ``body_sends`` sent inside it; the Stop a handler raised, if any."""
    plan["n"] = 0
    sent.clear()
    armed[0] = True
    try:
        with kernels._signals_held_back():
            in_body[0] = True
            for s in body_sends:
                kill((s,))
            in_body[0] = False
    except Stop as e:
        return e
    finally:
        in_body[0] = False
        armed[0] = False

signal.signal, signal.getsignal = wrapped(real_signal), wrapped(real_getsignal)
block(())
calls_per_block = plan["n"]
assert calls_per_block >= 4, calls_per_block
bad = []
tried = 0
for body in ((), (signal.SIGINT,), (signal.SIGTERM,), (signal.SIGINT, signal.SIGTERM)):
    for sigs in ((signal.SIGINT,), (signal.SIGTERM,), (signal.SIGINT, signal.SIGTERM)):
        for when in ("before", "after"):
            for at in range(1, calls_per_block + 3):
                plan.update(at=at, sigs=sigs, when=when)
                before = dict(handled)
                block(body)
                tried += 1
                # (a handler that raised left the other pending signal for CPython's next check,
                # which signal.signal makes first thing: run it now, not raising)
                real_signal(signal.SIGUSR1, real_getsignal(signal.SIGUSR1))
                now = (real_getsignal(signal.SIGINT), real_getsignal(signal.SIGTERM))
                if now != (on_sig, on_sig):
                    bad.append((body, sigs, when, at, "left", now))
                    real_signal(signal.SIGINT, on_sig)
                    real_signal(signal.SIGTERM, on_sig)
                lost = [s for s in sent if handled[s] == before[s]]
                if lost:
                    bad.append((body, sigs, when, at, "lost", lost))
                if ran_inside:
                    bad.append((body, sigs, when, at, "ran inside the hold", list(ran_inside)))
                    ran_inside.clear()
signal.signal, signal.getsignal = real_signal, real_getsignal
assert not bad, (tried, bad[:6], len(bad))
ok(tried)
'''


def test_a_raising_signal_at_every_point_of_the_hold(tmp_path):
    """SIGINT, SIGTERM or both at once, their handler raising, landing just
    before or just after each ``signal.signal``/``getsignal`` call the hold
    makes (where CPython runs handlers), with SIGINT, SIGTERM, both or none
    caught inside: every handler is back after the block, every signal sent
    reached its handler (the exception a handler raised propagates, nothing
    is dropped), none ran inside the block."""
    out = _run(tmp_path, _EVERY_POINT)
    assert "OK" in out


def test_sigint_and_sigterm_every_half_millisecond_across_many_holds(tmp_path):
    """A SIGINT and a SIGTERM back to back every 0.5 ms from a thread, their
    handler raising, across a few seconds of holds (nothing compiles: the
    holds going in and coming back are all there is): every handler is back
    after each one, and both kinds keep reaching the handler."""
    out = _run(tmp_path, '''
    from bigper.common.kernels import _signals_held_back
    class Stop(Exception):
        pass
    armed = [False]
    handled = {signal.SIGINT: 0, signal.SIGTERM: 0}
    def on_sig(s, f):
        handled[s] += 1
        if armed[0]:
            raise Stop
    signal.signal(signal.SIGINT, on_sig)
    signal.signal(signal.SIGTERM, on_sig)
    stop = threading.Event()
    def bomb():
        while not stop.is_set():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.0005)
    th = threading.Thread(target=bomb)
    th.start()
    n = raised = 0
    left = None
    t = time.monotonic()
    try:
        while time.monotonic() - t < 3 and left is None:
            n += 1
            try:
                armed[0] = True
                with _signals_held_back():
                    pass
                armed[0] = False
            except Stop:
                armed[0] = False
                raised += 1
            now = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
            if now != (on_sig, on_sig):
                left = now
    finally:
        stop.set()
        th.join()
    assert left is None, (n, left)
    assert raised > 0 and min(handled.values()) > 0, (n, raised, handled)
    ok(n, raised, handled)
    ''')
    assert "OK" in out


def test_sigints_every_half_millisecond_across_cache_loads(tmp_path):
    """A first process compiles and saves the kernels; a second loads them
    from numba's cache while SIGINTs arrive every 0.5 ms and the handler
    raises: it survives, never runs inside a load, the results are right."""
    body = '''
    arrays = [np.arange(1, 30, dtype=dt) for dt in (np.float64, np.float32, np.int64, np.int32, np.uint8)]
    if sys.argv[1:] == ["save"]:
        for a in arrays:
            inner(a); outer(a)
        ok("saved")
        sys.exit(0)
    where = []
    armed = [False]
    def on_int(s, f):
        if armed[0]:
            where.append(in_compile())
            raise KeyboardInterrupt
    signal.signal(signal.SIGINT, on_int)
    stop = threading.Event()
    def bomb():
        while not stop.is_set():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.0005)
    th = threading.Thread(target=bomb)
    th.start()
    results = []
    try:
        for a in arrays:
            results.append(retried(armed, lambda: (inner(a).tolist(), outer(a).tolist()), KeyboardInterrupt))
    finally:
        stop.set()
        th.join()
    for a, (i, o) in zip(arrays, results):
        assert i == (a + 1).tolist() and o == ((a + 1) * 2).tolist(), a.dtype
    assert len(where) > 0 and not any(where), where
    assert signal.getsignal(signal.SIGINT) is on_int
    ok(len(where))
    '''
    script = tmp_path / "loads.py"
    script.write_text(_PRELUDE + textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONFAULTHANDLER="1")
    for arg in ("save", "load"):
        try:
            r = subprocess.run([sys.executable, str(script), arg], capture_output=True, text=True,
                               timeout=_LIMIT, cwd=str(tmp_path), env=env)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{arg}: the child hung for {_LIMIT} s: {(e.stderr or b'')[-3000:]!r}")
        assert r.returncode == 0 and "OK" in r.stdout, (arg, r.returncode, r.stdout[-1000:], r.stderr[-4000:])
    assert list((tmp_path / "cache").rglob("*.nbc")), "nothing was cached: the second run compiled"


# -- other signals -----------------------------------------------------------------------------


def test_a_sigalrm_timeout_that_raises_inside_compiles(tmp_path):
    """A SIGALRM every 5 ms whose handler raises (a timeout, as
    ``signal.alarm``-based timeouts do), the caller retrying: an exception
    inside numba's compile leaves its imports and registrations half done
    (every later compile fails) or llvmlite freeing twice. The kernels
    compile, their results are right, the handler is back."""
    out = _run(tmp_path, '''
    class Timeout(Exception):
        pass
    armed = [False]
    where = []
    def on_alrm(s, f):
        if armed[0]:
            where.append(in_compile())
            raise Timeout
    signal.signal(signal.SIGALRM, on_alrm)
    signal.setitimer(signal.ITIMER_REAL, 0.005, 0.005)
    arrays = [np.arange(1, 30, dtype=dt) for dt in (np.float64, np.int32, np.uint8)]
    results = []
    t = time.monotonic()
    try:
        for a in arrays:
            got = retried(armed, lambda: (inner(a).tolist(), outer(a).tolist()), Timeout, until=t + 60)
            if got is not None:
                results.append(got)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    assert len(results) == len(arrays), "never compiled (every compile was interrupted)"
    for a, (i, o) in zip(arrays, results):
        assert i == (a + 1).tolist() and o == ((a + 1) * 2).tolist(), a.dtype
    assert not any(where), where
    assert signal.getsignal(signal.SIGALRM) is on_alrm
    ok(len(where))
    ''')
    assert "OK" in out
