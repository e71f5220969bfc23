"""The children of ``dqn_scale.py``: a child interpreter run to its end
or killed with SIGKILL at a point it reports, and the peak RSS of processes
(``VmHWM`` from ``/proc``: ``ru_maxrss`` of a child carries its parent's peak
across fork and exec)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time

from benchkit import REPO_ROOT


def hwm_mb(pid="self", key="VmHWM") -> float:
    """Peak RSS of a process since it started (or since ``reset_hwm``), MB (``key``: another
    line of its status); 0 once it is gone. (Not ``ru_maxrss``: a child's carries its parent's
    peak across fork and exec.)"""
    try:
        with open(f"/proc/{pid}/status") as f:
            return [int(x.split()[1]) for x in f if x.startswith(key + ":")][0] / 1024
    except (OSError, IndexError):
        return 0.0


def reset_hwm() -> None:
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the RSS now


def child(code: str, *args, kill_after=None, log=None):
    """Run ``code`` in a child; ``kill_after(line, elapsed)`` -> seconds (None: not yet) starts
    a timer that sends SIGKILL then. Returns ``(result dict or None, killed, seconds, lines)``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                         stderr=log or subprocess.DEVNULL, text=True, env=env)
    killed, timer, result, lines = [], None, None, []

    peak, anon = [0.0], [0.0]
    done = threading.Event()

    def watch():  # the child's peak RSS (and of it anonymous memory, not mapped files), from /proc
        while not done.wait(0.5):
            peak[0], anon[0] = max(peak[0], hwm_mb(p.pid)), max(anon[0], hwm_mb(p.pid, "RssAnon"))
    threading.Thread(target=watch, daemon=True).start()

    def kill():
        if p.poll() is None:
            peak[0] = max(peak[0], hwm_mb(p.pid))
            p.kill()  # SIGKILL
            killed.append(time.perf_counter() - t0)
    for line in p.stdout:
        lines.append(line.strip())
        if line.startswith("result "):
            result = json.loads(line[7:])
        elif kill_after is not None and timer is None:
            delay = kill_after(line.strip(), time.perf_counter() - t0)
            if delay is not None:
                timer = threading.Timer(delay, kill)
                timer.start()
    p.stdout.close()
    rc = p.wait()
    done.set()
    if timer is not None:
        timer.cancel()
    if result is not None:
        peak[0] = max(peak[0], result.get("rss_mb", 0.0))
    child.peaks.append(peak[0])
    child.anon.append(anon[0])
    if not killed and rc != 0:
        raise RuntimeError(f"child exited {rc}; its last lines: {lines[-5:]}")
    return result, bool(killed), time.perf_counter() - t0, lines


child.peaks, child.anon = [], []  # each child's peak RSS, and peak anonymous RSS (polled), MB
