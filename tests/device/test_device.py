"""The device tier (``device=``), the single-copy ``to_torch``, deferred
priority updates from device tensors, and sequence batches with frames once.

Every tier test runs on ``device="cpu"`` (the same code over CPU tensors) and,
where a GPU is present, on CUDA too; the tier is held to the plain host path,
bit for bit."""

import os
import textwrap
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import bigper  # noqa: E402
from bigper.tensors import transfer, transport  # noqa: E402
from bigper.frames.distinct import distinct_frames, frames_of_stacks  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (run on a GPU machine)")


def _np(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _equal_batches(host, dev):
    """A tier batch holds exactly the host batch: keys (in order), dtypes, shapes, bytes."""
    assert list(host.keys()) == list(dev.keys())
    for k in host:
        a, b = host[k], _np(dev[k])
        assert b.dtype == a.dtype and b.shape == a.shape, (k, a.dtype, b.dtype, a.shape, b.shape)
        assert np.array_equal(a, b), k
    np.testing.assert_array_equal(host.indices, dev.indices)
    np.testing.assert_array_equal(host.generations, dev.generations)
    np.testing.assert_array_equal(host.weights, _np(dev.weights))
    np.testing.assert_array_equal(host.probabilities, dev.probabilities)
    if host.mask is not None:
        np.testing.assert_array_equal(host.mask, _np(dev.mask))
    t = dev.to_torch()
    for k in host:
        assert np.array_equal(_np(t[k]), host[k]), k
    np.testing.assert_array_equal(_np(t["weights"]), host.weights)
    np.testing.assert_array_equal(_np(t["indices"]), host.indices)


FIELDS = {"obs": ((3, 4, 5), np.uint8), "action": ((), np.int64), "reward": ((), np.float32),
          "aux": ((2,), np.float16)}


@st.composite
def configs(draw):
    k = draw(st.sampled_from([None, 1, 3]))
    kw = {"capacity": draw(st.sampled_from([1, 7, 32, 50])),
          "n_step": draw(st.sampled_from([1, 1, 3])),
          "num_envs": draw(st.sampled_from([1, 1, 2])),
          "prioritization": draw(st.sampled_from(["proportional", "rank"])),
          "seed": draw(st.integers(0, 5))}
    shape = (k or 3, 4, 5)
    kw["fields"] = dict(FIELDS, obs=(shape, np.uint8))
    kw["frame_stack"] = k
    if k and draw(st.booleans()):
        kw["compression"] = "zstd"
    if draw(st.integers(0, 3)) == 0 and kw["capacity"] >= 10:
        kw["sequence"] = bigper.Sequence(draw(st.sampled_from([1, 3])), burn_in=draw(st.sampled_from([0, 2])))
        kw["n_step"] = 1  # (sequences compute their n-step targets from the sampled steps)
    return kw


def _step(rng, kw, t):
    ne = kw["num_envs"]
    lead = (ne,) if ne > 1 else ()
    shape = kw["fields"]["obs"][0]
    obs = rng.integers(0, 4, (*lead, *shape), dtype=np.uint8)  # few values: frames repeat and dedupe
    nxt = rng.integers(0, 4, (*lead, *shape), dtype=np.uint8)
    if kw["frame_stack"]:
        nxt = np.concatenate([obs[..., 1:, :, :], nxt[..., :1, :, :]], axis=-3)
    end = rng.random(lead) < 0.15
    trunc = rng.random(lead) < 0.05
    return {"obs": obs, "next_obs": nxt, "action": rng.integers(-5, 5, lead),
            "reward": rng.standard_normal(lead).astype(np.float32),
            "aux": rng.standard_normal((*lead, 2)).astype(np.float16),
            "terminated": end, "truncated": trunc & ~end}


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(kw=configs(), ops=st.lists(st.sampled_from(["add", "add", "add", "add", "extend", "sample", "update"]),
                                  min_size=5, max_size=60), seed=st.integers(0, 2**16))
def test_tier_matches_the_host_path_bit_for_bit(device, kw, ops, seed):
    host = bigper.PrioritizedReplayBuffer(**kw)
    tier = bigper.PrioritizedReplayBuffer(**kw, device=device)
    rng = np.random.default_rng(seed)
    last = None
    t = 0
    for op in ops:
        if op == "add":
            step = _step(rng, kw, t)
            host.add(**step)
            tier.add(**step)
            t += 1
        elif op == "extend":
            steps = [_step(rng, kw, t + i) for i in range(int(rng.integers(1, 9)))]
            data = {n: np.stack([s[n] for s in steps]) for n in steps[0]}
            host.extend(data)
            tier.extend(data)
            t += len(steps)
        elif op == "sample":
            try:
                a = host.sample(5)
            except bigper.InvalidArgumentError:
                with pytest.raises(bigper.InvalidArgumentError):
                    tier.sample(5)
                continue
            b = tier.sample(5)
            _equal_batches(a, b)
            last = (a, b)
        elif op == "update" and last is not None:
            a, b = last
            shape = (a.size, a.mask.shape[1]) if a.mask is not None and rng.random() < 0.5 else (a.size,)
            p = np.abs(rng.standard_normal(shape)) * 3
            host.update_priorities(a, p)
            tier.update_priorities(b.to_torch(), torch.from_numpy(p).to(device))
            last = None
    assert host.total_priority == tier.total_priority
    ma, aa = host.state_dict()
    mb, ab = tier.state_dict()
    assert ma == mb
    for name in aa:
        np.testing.assert_array_equal(aa[name], ab[name], err_msg=name)


def _fill(buf, n, seed=0, start=0):
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 255, (n + start + 8, 4, 5), dtype=np.uint8)
    for t in range(start, start + n):
        buf.add(obs=frames[t:t + 3], next_obs=frames[t + 1:t + 4], action=t, reward=np.float32(t),
                aux=np.zeros(2, np.float16), terminated=t % 13 == 12)


KW = dict(capacity=40, fields=FIELDS, frame_stack=3, n_step=2, seed=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_resume_and_load_rebuild_the_device_copy(tmp_path, device, storage):
    kw = dict(KW, storage=storage)
    for name, dev in (("host", None), ("tier", device)):
        buf = bigper.PrioritizedReplayBuffer(**kw, path=tmp_path / name, device=dev)
        _fill(buf, 70)
        buf.save(tmp_path / f"snap-{name}")
        _fill(buf, 9, seed=1, start=70)
        buf.close()
    host = bigper.PrioritizedReplayBuffer(**kw, path=tmp_path / "host", mode="resume")
    tier = bigper.PrioritizedReplayBuffer(**kw, path=tmp_path / "tier", mode="resume", device=device)
    # A snapshot written without the tier loads with it, and the other way round.
    loaded = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap-host", path=tmp_path / "l1", device=device)
    plain = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap-tier", path=tmp_path / "l2")
    for _ in range(4):
        _equal_batches(host.sample(16), tier.sample(16))
        _equal_batches(plain.sample(16), loaded.sample(16))
    for b in (host, tier, loaded, plain):
        b.close()


CHILD = textwrap.dedent("""
    import sys, numpy as np, bigper
    sys.path.insert(0, {tests!r})
    from test_device import KW, _fill
    buf = bigper.PrioritizedReplayBuffer(**KW, storage="memmap", path={path!r}, device="cpu")
    _fill(buf, 60)
    buf.save({snap!r})
    print("saved", flush=True)
    t = 60
    while True:
        _fill(buf, 1, seed=t, start=t)
        t += 1
""")


def test_kill_9_then_load_rebuilds_the_device_copy_exactly(tmp_path):
    code = CHILD.format(tests=os.path.dirname(__file__), path=str(tmp_path / "live"), snap=str(tmp_path / "snap"))
    from tests._child import Child

    with Child(code) as child:
        child.said("saved")
        child.kill()
    # compared with a buffer that never stopped: the episode open at the snapshot goes on
    host = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=tmp_path / "a", continue_episodes=True)
    tier = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=tmp_path / "b", device="cpu",
                                               continue_episodes=True)
    ref = bigper.PrioritizedReplayBuffer(**KW)
    _fill(ref, 60)
    for _ in range(3):
        a, b, c = host.sample(8), tier.sample(8), ref.sample(8)
        _equal_batches(a, b)
        _equal_batches(c, b)  # (a loaded config keeps its fields' order: Config field_order)
    host.close()
    tier.close()


def test_a_device_copy_that_does_not_fit_is_refused_and_makes_nothing(tmp_path):
    big = {"obs": ((1 << 22,), np.float64)}  # 32 MiB a row: 32 TiB at this capacity
    path = tmp_path / "never"
    with pytest.raises(bigper.InvalidArgumentError, match=r"device='cpu'.*bytes"):
        bigper.PrioritizedReplayBuffer(capacity=1 << 20, fields=big, storage="memmap", path=path, device="cpu")
    assert not path.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("device", ["cuda:99", "not-a-device", 3.5])
def test_a_device_torch_does_not_know_is_refused_by_name(tmp_path, device):
    if str(device).startswith("cuda") and not CUDA:
        match = "CUDA"
    else:
        match = "device"
    with pytest.raises(bigper.InvalidArgumentError, match=match):
        bigper.PrioritizedReplayBuffer(capacity=8, fields={"x": ((), np.float32)}, storage="memmap",
                                       path=tmp_path / "p", device=device)
    assert not (tmp_path / "p").exists()


def test_a_field_dtype_torch_cannot_hold_is_refused_by_name():
    with pytest.raises(bigper.InvalidArgumentError, match="'when'"):
        bigper.PrioritizedReplayBuffer(capacity=8, fields={"when": ((), "datetime64[s]")}, device="cpu")


def test_sample_out_is_refused_with_a_tier():
    buf = bigper.PrioritizedReplayBuffer(**KW, device="cpu")
    _fill(buf, 20)
    out = {"action": np.empty(4, np.int64)}
    with pytest.raises(bigper.InvalidArgumentError, match="device tier"):
        buf.sample(4, out=out)


def test_cpu_to_torch_shares_the_pair_gather():
    buf = bigper.PrioritizedReplayBuffer(capacity=64, fields={"obs": ((4, 6, 5), np.uint8)}, frame_stack=4, seed=0)
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (80, 6, 5), dtype=np.uint8)
    for t in range(60):
        buf.add(obs=frames[t:t + 4], next_obs=frames[t + 1:t + 5])
    b = buf.sample(16)
    base = transfer.pair_base(b["obs"], b["next_obs"])
    assert base is not None and base.shape == (16, 5, 6, 5)
    t = b.to_torch()
    assert t["obs"].data_ptr() == b["obs"].ctypes.data  # no copy
    assert t["next_obs"].data_ptr() == b["next_obs"].ctypes.data
    np.testing.assert_array_equal(t["next_obs"].numpy(), b["next_obs"])
    # Two independent arrays are not a pair.
    assert transfer.pair_base(b["obs"].copy(), b["next_obs"].copy()) is None
    assert transfer.pair_base(b["obs"], b["obs"]) is None


def _seq_buffer(**kw):
    buf = bigper.PrioritizedReplayBuffer(capacity=60, fields={"obs": ((3, 4, 5), np.uint8), "r": ((), np.float32)},
                                         frame_stack=3, sequence=bigper.Sequence(6, burn_in=3, period=2),
                                         seed=2, **kw)
    rng = np.random.default_rng(1)
    frames = rng.integers(1, 255, (200, 4, 5), dtype=np.uint8)
    f = 0
    for t in range(150):  # episodes of 7..19 steps; every start repeats its first frame (a reset stack)
        start = t == 0 or ends
        if start:
            obs = np.stack([frames[f % 200]] * 3)
            f += 1
        nxt = np.concatenate([obs[1:], frames[f % 200][None]])
        f += 1
        ends = rng.random() < 0.1
        buf.add(obs=obs, next_obs=nxt, r=np.float32(t), terminated=ends)
        obs = nxt
    return buf


def test_sequence_frames_once_rebuild_the_stacks_exactly():
    buf = _seq_buffer()
    for _ in range(10):
        b = buf.sample(16)
        kind, refs = b.transport.frames
        ids, index, first = distinct_frames(refs, b.mask)
        T_, k = b.mask.shape[1], 3
        assert kind == "refs" and ids.shape[1] <= T_ + k + 1  # each row's distinct frames, once (and a zero frame)
        frames = frames_of_stacks([b["obs"], b["next_obs"]], first)
        for name in ("obs", "next_obs"):  # the stacks rebuilt from the distinct frames: exactly the batch's
            rows = index[name] + (np.arange(16) * frames.shape[1])[:, None, None]
            np.testing.assert_array_equal(frames.reshape(-1, 4, 5)[rows], b[name])
        t = b.to_torch()
        for name in ("obs", "next_obs"):
            np.testing.assert_array_equal(t[name].numpy(), b[name])
            assert (b[name][~b.mask] == 0).all()  # padded steps: zeros
        arrays, derived = transfer.fields_of(b, copies=True)
        assert "obs" not in arrays and derived["obs"][0] == ".frames"  # what travels: the distinct frames
        # The stacks are the batch's own: writing into them never reaches the buffer.
        again = buf.gather(b.indices)
        b["obs"][:] = 77
        np.testing.assert_array_equal(buf.gather(b.indices)["obs"], again["obs"])


def test_sampler_for_a_device_moves_only_the_distinct_frames():
    buf = _seq_buffer()
    ref = _seq_buffer()
    it = buf.sampler(8, prefetch=0, device="cpu")
    for _ in range(5):
        t = next(it)
        want = ref.sample(8)
        for name in want:
            np.testing.assert_array_equal(t[name].numpy(), want[name], err_msg=name)


def test_update_priorities_takes_to_torch_dicts_without_reading_the_device():
    buf = bigper.PrioritizedReplayBuffer(**KW)
    _fill(buf, 40)
    b = buf.sample(8)
    t = b.to_torch()
    assert isinstance(t, transport.TensorBatch) and isinstance(t, dict)
    np.testing.assert_array_equal(t.host["indices"], b.indices)
    buf.update_priorities(t, np.ones(8))  # from the host copies
    t["indices"] = torch.full((8,), 10**9)  # a key the caller replaced is read as given: never redirected
    with pytest.raises(bigper.InvalidIndexError):
        buf.update_priorities(t, np.ones(8))
    drawn = b.indices.copy()
    t = b.to_torch()
    t["indices"].zero_()  # (a CPU tensor shares the batch's array; the host copies are the batch's as drawn)
    np.testing.assert_array_equal(t.host["indices"], drawn)
    # A plain dict of tensors still works (read from the tensors).
    buf.update_priorities(dict(b.to_torch()), torch.ones(8))
    with pytest.raises(bigper.InvalidArgumentError):
        buf.update_priorities(dict(b.to_torch()), torch.full((8,), float("nan")))


# -- deferred updates from device tensors (CUDA) -----------------------------------------


def _pair_buffers(**kw):
    a, b = bigper.PrioritizedReplayBuffer(**KW, **kw), bigper.PrioritizedReplayBuffer(**KW, **kw)
    _fill(a, 45)
    _fill(b, 45)
    return a, b


@needs_cuda
@pytest.mark.parametrize("tier", [None, "cuda"])
def test_deferred_update_is_seen_by_the_next_sample(tier):
    a, b = _pair_buffers()
    c = bigper.PrioritizedReplayBuffer(**KW, device=tier)
    _fill(c, 45)
    rng = np.random.default_rng(0)
    for _ in range(20):
        x, y = a.sample(8), c.sample(8)
        np.testing.assert_array_equal(x.indices, y.indices)
        p = np.abs(rng.standard_normal(8)) + 0.01
        torch.cuda._sleep(2_000_000)  # the copy queues behind this: really in flight on return
        td = torch.from_numpy(p).cuda()
        c.update_priorities(y.to_torch("cuda"), td)
        assert len(c._guard.deferred) in (0, 1)
        a.update_priorities(x, p)
    assert a.total_priority == c.total_priority
    np.testing.assert_array_equal(a.state_dict()[1]["gid"], c.state_dict()[1]["gid"])


@needs_cuda
def test_deferred_updates_are_applied_before_save_and_close(tmp_path):
    a, b = _pair_buffers(storage="memmap") if False else (None, None)
    host = bigper.PrioritizedReplayBuffer(**KW, storage="memmap", path=tmp_path / "a")
    dev = bigper.PrioritizedReplayBuffer(**KW, storage="memmap", path=tmp_path / "b")
    _fill(host, 45)
    _fill(dev, 45)
    x, y = host.sample(8), dev.sample(8)
    p = np.linspace(0.1, 3, 8)
    host.update_priorities(x, p)
    torch.cuda._sleep(5_000_000)
    dev.update_priorities(y.to_torch("cuda"), torch.from_numpy(p).cuda())
    dev.save(tmp_path / "snap")
    host.close()
    torch.cuda._sleep(5_000_000)
    y = dev.sample(8)
    dev.update_priorities(y.to_torch("cuda"), torch.from_numpy(p).cuda())
    dev.close()
    snap = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=tmp_path / "c", continue_episodes=True)
    ref = bigper.PrioritizedReplayBuffer(**KW)
    _fill(ref, 45)
    ref.update_priorities(ref.sample(8), p)
    np.testing.assert_array_equal(ref.state_dict()[1]["leaves"], snap.state_dict()[1]["leaves"])
    resumed = bigper.PrioritizedReplayBuffer(**KW, storage="memmap", path=tmp_path / "b", mode="resume",
                                             continue_episodes=True)
    ref.update_priorities(ref.sample(8), p)
    np.testing.assert_array_equal(ref.state_dict()[1]["leaves"], resumed.state_dict()[1]["leaves"])
    snap.close()
    resumed.close()


@needs_cuda
def test_an_invalid_deferred_update_changes_nothing_and_is_reported_next():
    buf = bigper.PrioritizedReplayBuffer(**KW)
    _fill(buf, 45)
    b = buf.sample(8)
    before = {k: v.copy() for k, v in buf.state_dict()[1].items()}
    bad = torch.ones(8, device="cuda")
    bad[3] = float("nan")
    buf.update_priorities(b.to_torch("cuda"), bad)  # returns at once: the values are still on the device
    with pytest.raises(bigper.InvalidArgumentError, match="not applied.*nan"):
        buf.sample(8)
    after = buf.state_dict()[1]
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)
    buf.sample(8)  # reported once; the buffer goes on
    with pytest.raises(bigper.InvalidArgumentError, match=r"shape \(8,\)"):
        buf.update_priorities(b.to_torch("cuda"), torch.ones(5, device="cuda"))  # shapes: checked at once


@needs_cuda
def test_deferred_updates_from_two_threads_with_a_sampler():
    a = bigper.PrioritizedReplayBuffer(**KW, device="cuda")
    _fill(a, 45)
    it = a.sampler(8, prefetch=2, device="cuda")
    errors = []

    def learner():
        try:
            for _ in range(100):
                t = next(it)
                a.update_priorities(t, t["reward"].abs().double() + 0.5)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def writer():
        try:
            _fill(a, 60, seed=3, start=45)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    ths = [threading.Thread(target=learner), threading.Thread(target=writer)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    it.close()
    assert not errors
    assert np.isfinite(a.total_priority)  # a read applies what is still in flight
    assert not a._guard.deferred
    assert np.isfinite(a.total_priority)
    a.close()
    with pytest.raises(bigper.BufferClosedError):
        a.update_priorities(np.arange(2), np.ones(2))


@needs_cuda
def test_cuda_to_torch_is_one_block():
    buf = bigper.PrioritizedReplayBuffer(**KW)
    _fill(buf, 40)
    b = buf.sample(16)
    t = b.to_torch("cuda")
    ptrs = {v.untyped_storage().data_ptr() for v in t.values()}
    assert len(ptrs) == 1  # every tensor a view of one device block: one copy
    for k in b:
        np.testing.assert_array_equal(t[k].cpu().numpy(), b[k])


@pytest.mark.parametrize("n_step", [1, 3])
@pytest.mark.parametrize("frame_stack", [None, 3])
def test_sampler_batches_gathered_into_one_staging_block(monkeypatch, n_step, frame_stack):
    """The sampler's path for a CUDA device (fields gathered straight into one
    pinned block, moved with one copy), checked on the CPU against ``sample``."""
    import bigper.buffer as B

    monkeypatch.setattr(B, "_STAGED", ("cuda", "cpu"))
    kw = dict(KW, n_step=n_step, frame_stack=frame_stack)
    if frame_stack is None:
        kw["fields"] = dict(FIELDS, obs=((3, 4, 5), np.uint8))
    a, b = bigper.PrioritizedReplayBuffer(**kw), bigper.PrioritizedReplayBuffer(**kw)
    _fill(a, 70)
    _fill(b, 70)
    it = b.sampler(8, prefetch=0, device="cpu")
    for _ in range(6):
        want, got = a.sample(8), next(it)
        assert list(got) == list(want.to_torch())
        for k in want:
            np.testing.assert_array_equal(got[k].numpy(), want[k], err_msg=k)
        np.testing.assert_array_equal(got["weights"].numpy(), want.weights)
        np.testing.assert_array_equal(got["indices"].numpy(), want.indices)
        np.testing.assert_array_equal(got["generations"].numpy(), want.generations)
        if frame_stack and n_step == 1:  # obs and next_obs: views of one (B, k + 1) gather, moved once
            assert got["obs"].untyped_storage().data_ptr() == got["next_obs"].untyped_storage().data_ptr()
        p = np.linspace(0.5, 2, 8)
        a.update_priorities(want, p)
        b.update_priorities(got, torch.from_numpy(p))
    assert a.total_priority == b.total_priority


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_gather_of_no_sequence_item(compression):
    buf = _seq_buffer(compression=compression) if compression else _seq_buffer()
    got = buf.gather(np.zeros(0, np.int64))
    assert got["obs"].shape == (0, 9, 3, 4, 5) and got["mask"].shape == (0, 9)


# -- what a tier batch holds (issue 45 §3) -------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["transitions", "sequences"])
def test_a_tier_batch_is_a_loss_ready_batch(device, kind):
    """A learner computes its loss from ``batch.weights`` (and ``batch.mask``) and the fields as
    the guide shows, without a conversion: those are tensors on the tier's device; what names the
    draw for the host's tree (indices, generations, probabilities) stays numpy; the update by the
    batch is the host path's, bit for bit, and the batch and its ``to_torch`` dict own their tensors."""
    if kind == "sequences":
        host, tier = _seq_buffer(), _seq_buffer(device=device)
    else:
        host, tier = bigper.PrioritizedReplayBuffer(**KW), bigper.PrioritizedReplayBuffer(**KW, device=device)
        _fill(host, 40)
        _fill(tier, 40)
    dev = torch.device(device)
    for _ in range(3):
        a, b = host.sample(8), tier.sample(8)
        _equal_batches(a, b)
        assert isinstance(b.weights, torch.Tensor) and b.weights.device.type == dev.type
        assert b.weights.dtype == torch.float32 and b.weights.shape == (8,)
        for name in ("indices", "generations", "probabilities"):
            assert type(getattr(b, name)) is np.ndarray, name
        q = torch.ones(b.weights.shape + (() if b.mask is None else b.mask.shape[1:]), device=dev,
                       requires_grad=True)
        td = b["r" if kind == "sequences" else "reward"].float() - q
        if b.mask is None:
            loss = (b.weights * td.pow(2)).mean()
        else:
            assert isinstance(b.mask, torch.Tensor) and b.mask.dtype == torch.bool and b.mask.device.type == dev.type
            assert b["mask"] is b.mask
            loss = (b.weights[:, None] * b.mask * td.pow(2)).sum() / b.mask.sum()
        loss.backward()
        host.update_priorities(a, np.abs(_np(td.detach())) + 0.5)
        tier.update_priorities(b, td.detach().abs() + 0.5)  # by the batch itself: no host copy to make
        assert host.total_priority == tier.total_priority
        t = b.to_torch()
        t["weights"].mul_(0)  # the dict's tensors are the learner's to change in place ...
        if b.mask is not None:
            t["mask"].logical_not_()
            np.testing.assert_array_equal(_np(b.mask), a.mask)
        np.testing.assert_array_equal(_np(b.weights), a.weights)  # ... the batch's are its own
        b.weights.add_(1)
        assert not _np(t["weights"]).any()
    (ma, aa), (mb, ab) = host.state_dict(), tier.state_dict()
    assert ma == mb
    for name in aa:
        np.testing.assert_array_equal(aa[name], ab[name], err_msg=name)
