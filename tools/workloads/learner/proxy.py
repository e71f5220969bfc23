"""The launch-bound proxy learner of ``bench learner``, the count of Python
calls a batch in a sampler's thread, and the feed or the general sampler over
one buffer (see ``workloads.learner.main``'s docstring)."""

from __future__ import annotations


def proxy_learner(torch, device, ops: int):
    """A launch-bound learner: ``ops`` tiny torch ops an update (each drops and
    retakes the GIL, as an eager CUDA launch does), reading a few numbers of
    the batch; returns a (B,) |TD| on the device."""
    def step(t):
        r = t["reward"].float()
        x = t["obs"][:, -1, 0, :8].float().sum(1) * 0.0 + r * t["weights"].float()
        for _ in range(ops):
            x = x.mul(0.999).add_(0.001)
        return x.abs() + 0.01

    return step


def python_calls(make_iter, n: int) -> dict:
    """Python calls (calls and C calls) a batch: ``thread``, in the thread a
    sampler starts (``threading.setprofile`` reaches only threads started
    after it, so the learner's own thread is not counted there); ``next``, in
    the learner's ``next()`` (``sys.setprofile`` around it)."""
    import sys
    import threading

    counts = [0]

    def prof(frame, event, arg):
        if event in ("call", "c_call"):
            counts[0] += 1
    threading.setprofile(prof)
    try:
        it, buf = make_iter()
    finally:
        threading.setprofile(None)
    td = None
    for _ in range(5):
        t = next(it)
        td = t["weights"].float() + 0.01
        buf.update_priorities(t, td)
    c0, mine = counts[0], 0
    for _ in range(n):
        before = counts[0]
        sys.setprofile(prof)
        t = next(it)
        sys.setprofile(None)
        mine += counts[0] - before  # (the thread's calls in that window count here too: a bound, not exact)
        buf.update_priorities(t, td)
    c1 = counts[0]
    it.close()
    return {"thread": (c1 - c0 - mine) / n, "next": mine / n}


def make_sampler(buf, b: int, device, general: bool):
    """``buf.sampler(b, prefetch=2, device=device)``; ``general``: the general
    sampler (``sample`` -> ``to_torch`` in a ``Prefetcher`` thread) for a buffer
    the feed covers, to compare the two in one run."""
    if not general:
        return buf.sampler(b, prefetch=2, device=device)
    import bigper.device.feed as feed_mod

    real, feed_mod.covered = feed_mod.covered, (lambda *a: "bench: the general path")
    try:
        return buf.sampler(b, prefetch=2, device=device)
    finally:
        feed_mod.covered = real
