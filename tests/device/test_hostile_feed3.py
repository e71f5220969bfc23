"""Third attack on the feed (``sampler(B, prefetch, device="cpu")``), after its batch tensors
became ``detach()``es of per-slot prototypes and its short kernels kept the GIL.

Found and fixed (plain tests): the prototypes were views of the slot's block, so every tensor of
a batch shared one version counter (an in-place edit of ``reward`` failed a backward that saved
``weights``; ``sample().to_torch()`` gives each field a counter of its own); a slot first made
under the caller's ``torch.inference_mode`` (``prefetch=0``) gave inference tensors to every later
batch of that slot, which autograd refuses; a slot first made under a default-device context
(``torch.device("meta")``, ``set_default_device``) put its host block there and failed.
Every later batch is held to a twin's ``sample(B).to_torch("cpu")`` key by key.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import bigper  # noqa: E402
from tests.device.test_feed import _add, _atari_like, _check_rows, _np  # noqa: E402

B = 8
CAP = 96


def _pair(capacity=CAP):
    bufs = []
    for _ in range(2):
        buf = _atari_like(capacity=capacity)
        _add(buf, 0, capacity)
        bufs.append(buf)
    return bufs


def _same(got, want):
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and tuple(got[k].shape) == tuple(want[k].shape), k
        np.testing.assert_array_equal(_np(got[k]), _np(want[k]), err_msg=k)


def _later_exact(it, twin, n=6):
    for _ in range(n):
        t = next(it)
        _same(t, twin.sample(B).to_torch("cpu"))
        _check_rows(t)
    del t


# ---------------------------------------------------------------------------------------------
# Holds through everything a batch reaches: the held values never change, later batches exact.
# ---------------------------------------------------------------------------------------------

def _hold(t, how):
    """Returns a function giving the held values now (numpy), after whatever edit ``how`` makes."""
    if how == "view":
        v = t["obs"][1:, 2]
        return lambda: v.numpy()
    if how == "untyped_storage":
        st, off = t["reward"].untyped_storage(), t["reward"].storage_offset()
        return lambda: torch.empty(0, dtype=torch.float32).set_(st, off, (B,)).numpy()
    if how == "numpy":
        a = t["next_obs"].numpy()
        return lambda: a
    if how == "dlpack":
        d = torch.from_dlpack(t["step"])
        return lambda: d.numpy()
    if how == "detach":
        d = t["obs"].detach()
        return lambda: d.numpy()
    if how == "dict":
        d = dict(t)
        return lambda: np.concatenate([_np(d[k]).reshape(-1).view(np.uint8) for k in d])
    if how == "requires_grad_and_grad":
        w = t["weights"]
        w.requires_grad_(True)
        w.grad = torch.full((B,), 3.0)
        return lambda: w.detach().numpy()
    if how == "in_place":
        r = t["reward"]
        r.mul_(2).add_(1)
        return lambda: r.numpy()
    if how == "set_masked":
        s = t["step"]
        v = s.view(-1)[:]
        s.set_(torch.zeros(B, dtype=torch.int64))
        return lambda: v.numpy()
    if how == "as_strided_masked":
        r = t["discount"]
        v = r[:4]
        r.as_strided_((B,), (0,))
        return lambda: v.numpy()
    if how == "resize_smaller":
        r = t["generations"]
        r.resize_(2)
        return lambda: r.numpy()
    if how == "version_bumped":
        o = t["obs"]
        o[0, 0, 0, 0] = o[0, 0, 0, 0]
        return lambda: o.numpy()
    raise AssertionError(how)


HOWS = ["view", "untyped_storage", "numpy", "dlpack", "detach", "dict", "requires_grad_and_grad", "in_place",
        "set_masked", "as_strided_masked", "resize_smaller", "version_bumped"]


@pytest.mark.parametrize("how", HOWS)
def test_a_held_part_of_a_batch_keeps_its_values_and_later_batches_are_exact(how):
    buf, twin = _pair()
    it = buf.sampler(B, prefetch=0, device="cpu")
    try:
        t = next(it)
        _same(t, twin.sample(B).to_torch("cpu"))
        get = _hold(t, how)
        want = get().copy()
        del t
        _later_exact(it, twin, n=8)
        np.testing.assert_array_equal(get(), want)
    finally:
        it.close()
        buf.close()
        twin.close()


# ---------------------------------------------------------------------------------------------
# Autograd: tensors saved in graphs, backward after later batches; version counters.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefetch", [0, 2])
def test_graphs_saved_over_batches_backward_after_later_batches(prefetch):
    """Three graphs save ``weights`` and ``discount`` of three batches (and edit ``reward`` in
    place after the forward); their backward runs after six more batches: the grads are the
    products of what was drawn."""
    buf, twin = _pair()
    it = buf.sampler(B, prefetch=prefetch, device="cpu")
    try:
        p = torch.ones(B, requires_grad=True)
        losses, want = [], np.zeros(B, np.float32)
        for _ in range(3):
            t = next(it)
            ref = twin.sample(B).to_torch("cpu")
            _same(t, ref)
            losses.append((p * t["weights"] * t["discount"]).sum())
            t["reward"].add_(1.0)  # (another field of the batch, edited after the forward)
            want += _np(ref["weights"]) * _np(ref["discount"])
            del t
        _later_exact(it, twin)
        for loss in losses:
            loss.backward()
        np.testing.assert_allclose(p.grad.numpy(), want, rtol=1e-6)
    finally:
        it.close()
        buf.close()
        twin.close()


@pytest.mark.parametrize("edited", ["reward", "step", "obs", "next_obs", "indices", "generations", "terminated"])
def test_an_in_place_edit_of_one_field_never_fails_a_backward_that_saved_another(edited):
    """As with ``sample(B).to_torch()`` (each field a counter of its own): a backward that saved
    ``weights`` runs after an in-place op on another field. (Fixed: the prototypes were views
    of one block, sharing its version counter.)"""
    buf, twin = _pair()
    it = buf.sampler(B, prefetch=0, device="cpu")
    try:
        for t in (twin.sample(B).to_torch("cpu"), next(it)):  # (the general path first: the same rule)
            p = torch.ones(B, requires_grad=True)
            loss = (p * t["weights"]).sum()
            before = {k: t[k]._version for k in t if k != edited}
            t[edited].mul_(1) if t[edited].dtype != torch.bool else t[edited].logical_not_()
            assert {k: t[k]._version for k in t if k != edited} == before
            loss.backward()
            np.testing.assert_array_equal(p.grad.numpy(), _np(t["weights"]))
        del t
    finally:
        it.close()
        buf.close()
        twin.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_first_batch_under_inference_mode_never_makes_later_batches_inference_tensors(prefetch):
    """(Fixed: with ``prefetch=0`` the slots made in the caller's ``inference_mode`` gave inference
    tensors to every later batch of them: autograd refuses to save one.)"""
    buf, twin = _pair()
    it = buf.sampler(B, prefetch=prefetch, device="cpu")
    try:
        with torch.inference_mode():
            for _ in range(3):
                _same(next(it), twin.sample(B).to_torch("cpu"))
        for _ in range(6):
            t = next(it)
            _same(t, twin.sample(B).to_torch("cpu"))
            assert not any(v.is_inference() for v in t.values())
            p = torch.ones(B, requires_grad=True)
            (p * t["weights"]).sum().backward()
            t["reward"].add_(1.0)
        del t
    finally:
        it.close()
        buf.close()
        twin.close()


@pytest.mark.parametrize("how", ["context", "set_default_device"])
def test_a_default_device_at_the_first_batch_never_moves_the_slots(how):
    """(Fixed: ``prefetch=0`` made the slot's host block on the default device: a ``meta`` block
    failed at its numpy view; a CUDA default would have done the same.)"""
    buf, twin = _pair()
    it = buf.sampler(B, prefetch=0, device="cpu")
    try:
        if how == "context":
            with torch.device("meta"):
                t = next(it)
        else:
            torch.set_default_device("meta")
            try:
                t = next(it)
            finally:
                torch.set_default_device(None)
        assert all(v.device.type == "cpu" for v in t.values())
        _same(t, twin.sample(B).to_torch("cpu"))
        del t
        _later_exact(it, twin, n=4)
    finally:
        it.close()
        buf.close()
        twin.close()


# ---------------------------------------------------------------------------------------------
# Concurrency: the draw and the intact check keep the GIL, the gather runs without it.
# ---------------------------------------------------------------------------------------------

def _join_all(threads, timeout=30.0):
    for th in threads:
        th.join(timeout)
    stuck = [th.name for th in threads if th.is_alive()]
    assert not stuck, f"threads still running (deadlock?): {stuck}"


def test_writers_updates_restores_and_snapshots_race_the_feed_then_batches_are_exact(tmp_path):
    """Extends, crafted updates, restores (state_dict/load_state), save + load and plain samples
    from threads while the feed's thread draws and gathers: every row is one transition at the
    slot it names. Once they stop, the feed's batches equal a twin loaded from its snapshot
    and the buffer's own data at the drawn indices."""
    buf = _atari_like(capacity=CAP)
    _add(buf, 0, CAP)
    stop = threading.Event()
    errors = []
    total = [CAP]
    lock = threading.Lock()  # (the test's: which step comes next)

    def loop(name, body):
        def run():
            n = 0
            try:
                while not stop.is_set():
                    body(n)
                    n += 1
            except Exception as e:  # noqa: BLE001
                errors.append((name, repr(e)))
        return threading.Thread(target=run, name=name, daemon=True)

    def write(n):
        with lock:
            k = 1 + n % 7
            _add(buf, total[0], k)
            total[0] += k

    rng = np.random.default_rng(1)

    def update(n):
        idx = rng.integers(0, CAP, 12)
        buf.update_priorities({"indices": idx, "generations": buf.generations[idx]}, rng.random(12) + 0.1)

    def restore(n):  # (the state it took: the feed's sources are made anew under its gather)
        with lock:
            meta, arrays = buf.state_dict()
            buf.load_state(meta, {k: np.array(v, copy=True) for k, v in arrays.items()})

    def snapshot(n):
        if n < 2:
            buf.save(tmp_path / f"snap-{n}")
            with bigper.PrioritizedReplayBuffer.load(tmp_path / f"snap-{n}") as back:
                s = back.sample(4)
                assert np.array_equal(s["step"], s.generations)

    def sample(n):
        s = buf.sample(4)
        assert np.array_equal(s["obs"][:, -1, 0, 0], (s["step"] % 251).astype(np.uint8))

    threads = [loop(n, b) for n, b in (("write", write), ("update", update), ("restore", restore),
                                       ("snapshot", snapshot), ("sample", sample))]
    it = buf.sampler(B, prefetch=2, device="cpu")
    try:
        for th in threads:
            th.start()
        for _ in range(80):
            t = next(it)
            _check_rows(t)
            np.testing.assert_array_equal(t.host["indices"], _np(t["generations"]) % CAP)
            buf.update_priorities(t, torch.from_numpy(_np(t["reward"]) % 7 + 0.5))
        del t
    finally:
        stop.set()
        _join_all(threads)
        it.close()
    assert not errors, errors
    buf.save(tmp_path / "final")
    twin = bigper.PrioritizedReplayBuffer.load(tmp_path / "final", continue_episodes=True)
    it = buf.sampler(B, prefetch=0, device="cpu")
    try:
        for _ in range(5):
            t = next(it)
            _same(t, twin.sample(B).to_torch("cpu"))
            idx = t.host["indices"]
            ref = buf.gather(idx)
            for k in ("obs", "next_obs", "step", "reward", "terminated", "truncated"):
                np.testing.assert_array_equal(_np(t[k]), ref[k], err_msg=k)
            np.testing.assert_array_equal(_np(t["generations"]), buf.generations[idx])
        del t
    finally:
        it.close()
        buf.close()
        twin.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_close_from_another_thread_while_the_feed_draws_never_deadlocks(prefetch):
    """A closer and a writer race the learner's loop: the loop ends with BufferClosedError
    (never a torn batch), within a timeout, and every thread ends."""
    buf = _atari_like(capacity=CAP)
    _add(buf, 0, CAP)
    it = buf.sampler(B, prefetch=prefetch, device="cpu")
    seen, outcome = [], []
    started = threading.Event()

    def learner():
        try:
            for t in it:
                _check_rows(t)
                seen.append(1)
                started.set()
        except bigper.BufferClosedError:
            outcome.append("closed")
        except Exception as e:  # noqa: BLE001
            outcome.append(repr(e))
        started.set()

    def writer():
        g = CAP
        try:
            while True:
                _add(buf, g, 3)
                g += 3
        except bigper.BufferClosedError:
            pass

    threads = [threading.Thread(target=learner, name="learner", daemon=True),
               threading.Thread(target=writer, name="writer", daemon=True)]
    for th in threads:
        th.start()
    assert started.wait(30)
    closer = threading.Thread(target=buf.close, name="closer", daemon=True)
    closer.start()
    _join_all([closer, *threads])
    assert outcome == ["closed"] and seen and buf.closed
    it.close()


def test_a_loaded_buffer_gives_batch_keys_in_the_order_of_the_run_that_never_stopped(tmp_path):
    """(Was a strict xfail: every file sorts its JSON keys; the config now records the fields' order.)"""
    buf = _atari_like(capacity=CAP)
    _add(buf, 0, CAP)
    buf.save(tmp_path / "s")
    back = bigper.PrioritizedReplayBuffer.load(tmp_path / "s")
    try:
        assert list(back.config.fields) == list(buf.config.fields)
        a, b = buf.sampler(B, prefetch=0, device="cpu"), back.sampler(B, prefetch=0, device="cpu")
        _same(next(b), next(a))
        a.close()
        b.close()
    finally:
        back.close()
        buf.close()
