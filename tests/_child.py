"""A child interpreter that a test drives by the lines it prints, and kills
only at a point the child reported.

Why a helper: on a busy machine a child is slow by seconds (imports, a cold
numba cache), so a test that sleeps and then kills can kill it before the
point it meant to reach; and ``poll()`` right after the child closed its
stdout races the child's exit, so a message that reads stderr only
``if p.poll() is not None`` drops the one thing that says what went wrong.
Here stdout is read by a thread (a wait for a line has a timeout, and a child
that prints a lot never blocks on a full pipe), stderr goes to a file (never a
pipe the child could fill while the test waits on stdout), and every failure
waits for the child's exit before it shows that stderr.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Seconds a child may take to reach a point it reports: imports and a cold numba
# cache on two busy cores take tens of seconds; a child that takes this long hangs.
SLOW = 600.0


def env_with_root(env: dict | None = None) -> dict:
    """``env`` (default: this process's) with this checkout first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


class Child:
    """``python -c CODE ARGS...`` in a subprocess.

    ``line``/``said`` wait for what it prints, ``kill`` sends SIGKILL (and
    fails the test if the child had already ended by itself), ``end`` waits for
    it to exit; ``stderr`` is complete once it has exited. A context manager:
    leaving it kills a child still running and closes everything.
    """

    def __init__(self, code: str, *args, env: dict | None = None, cwd=None, stdin: bool = False):
        self._err = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        self.proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)],
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     env=env_with_root(env), cwd=cwd)
        self.pid = self.proc.pid
        self.lines: list[str] = []  # every line read so far, for messages
        self._q: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)  # EOF: the child closed its stdout (it is exiting)

    # -- what it says -------------------------------------------------------------------
    def line(self, timeout: float = SLOW) -> str:
        """The next line it prints; fails the test at EOF or after ``timeout`` seconds."""
        try:
            line = self._q.get(timeout=timeout)
        except queue.Empty:
            self.fail(f"printed nothing for {timeout} s")
        if line is None:
            self._q.put(None)  # later calls see the EOF too
            self.fail("closed its stdout (it ended)", ended=True)
        self.lines.append(line)
        return line

    def said(self, want: str, timeout: float = SLOW) -> str:
        """The next line, which must be ``want`` (or start with ``want`` and a space)."""
        line = self.line(timeout)
        if line.strip() != want and not line.startswith(want + " "):
            self.fail(f"said {line!r}, not {want!r}")
        return line

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    # -- its end ------------------------------------------------------------------------
    def stderr(self) -> str:
        """Everything it wrote to stderr; complete once it has exited."""
        self._err.flush()
        self._err.seek(0)
        return self._err.read()

    def kill(self) -> None:
        """SIGKILL: no close, no flush, no atexit. A child that ended by itself
        before the kill failed in its loop: that fails the test, with its stderr."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:  # (reaped already: it ended before)
            pass
        rc = self.proc.wait(timeout=SLOW)
        if rc != -signal.SIGKILL:
            self.fail(f"ended by itself (exit status {rc}) before it was killed", ended=True)

    def end(self, timeout: float = SLOW) -> int:
        """Wait for it to exit by itself; its exit status."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.fail(f"still ran after {timeout} s")

    def fail(self, why: str, *, ended: bool = False):
        """Fail the test saying ``why``, with its stderr, read after its exit."""
        if ended:  # it is exiting: give it the time to finish writing stderr
            try:
                self.proc.wait(timeout=SLOW)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        pytest.fail(f"the child {why}; its exit status {self.proc.returncode}; it printed "
                    f"{self.lines[-5:]!r}; its stderr:\n{self.stderr()[-4000:]}", )

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(timeout=30)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        self._err.close()

    def __enter__(self) -> "Child":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
