"""Hostile tests for the last hour's device work: the sampler's staging block
on the CPU (``_STAGED`` forced), ``TensorBatch.host_target``, beta / n_step
limits, the ``bigper info`` device line, and threads around a staged sampler."""
import json
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import bigper  # noqa: E402
import bigper.buffer as B  # noqa: E402
from bigper.tensors import pinned, streams, transport  # noqa: E402
from bigper.errors import BigperError  # noqa: E402

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="handover/mark_ready act only on CUDA tensors")


@pytest.fixture
def staged(monkeypatch):
    monkeypatch.setattr(B, "_STAGED", ("cuda", "cpu"))


def _np(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _kw(frame_stack=3, n_step=1, num_envs=1, extra=None, next_of=None, capacity=48):
    k = frame_stack or 3
    fields = {"obs": ((k, 4, 5), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}
    if extra:
        fields.update(extra)
    kw = dict(capacity=capacity, fields=fields, frame_stack=frame_stack, n_step=n_step, num_envs=num_envs, seed=3)
    if next_of is not None:
        kw["next_of"] = next_of
    return kw


def _value(shape, dtype, t, rng):
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return (rng.integers(0, 2, shape) == 1)
    return rng.integers(0, 100, shape).astype(dt)


def _fill(buf, n, seed=0, resets=False):
    """Frames that shift (next_obs = obs moved on by one) unless ``resets``:
    then every 5th step's next_obs is a fresh stack (does not pair)."""
    cfg = buf.config
    e = cfg.num_envs
    rng = np.random.default_rng(seed)
    k = cfg.frame_stack or cfg.fields["obs"][0][0]
    frames = rng.integers(0, 255, (n + k + 8, e, 4, 5), dtype=np.uint8)
    for t in range(n):
        obs = np.moveaxis(frames[t:t + k], 1, 0)
        nxt = np.moveaxis(frames[t + 1:t + 1 + k], 1, 0)
        if resets and t % 5 == 4:
            nxt = np.moveaxis(frames[t + 1:t + 1 + k][::-1], 1, 0).copy()
        row = {"obs": obs, "action": np.full(e, t), "reward": np.full(e, t, np.float32),
               "terminated": np.full(e, t % 11 == 10)}
        if "obs" in cfg.next_of:
            row["next_obs"] = nxt
        for name, (shape, dtype) in cfg.fields.items():
            if name in row or name.startswith("next_"):
                continue
            row[name] = _value((e, *shape), dtype, t, rng)
        for name in cfg.next_of:
            if name != "obs":
                row[f"next_{name}"] = _value((e, *cfg.fields[name][0]), cfg.fields[name][1], t, rng)
        if e == 1:
            row = {k_: v[0] for k_, v in row.items()}
        buf.add(**row)


def _pair_of(kw, n=60, resets=False):
    a, b = bigper.PrioritizedReplayBuffer(**kw), bigper.PrioritizedReplayBuffer(**kw)
    _fill(a, n, resets=resets)
    _fill(b, n, resets=resets)
    return a, b


def _same(want, got):
    assert list(got) == list(want.to_torch()), (list(got), list(want.to_torch()))
    for k in want:
        g = _np(got[k])
        assert g.shape == want[k].shape, k
        np.testing.assert_array_equal(g, want[k], err_msg=k)
    np.testing.assert_array_equal(_np(got["weights"]), want.weights)
    np.testing.assert_array_equal(_np(got["indices"]), want.indices)
    np.testing.assert_array_equal(_np(got["generations"]), want.generations)


def _compare(kw, steps=5, prefetch=0, size=8, resets=False, update=True):
    a, b = _pair_of(kw, resets=resets)
    it = b.sampler(size, prefetch=prefetch, device="cpu")
    try:
        for i in range(steps):
            want, got = a.sample(size), next(it)
            _same(want, got)
            if update and prefetch == 0:
                p = np.linspace(0.5, 2, size) + i
                a.update_priorities(want, p)
                b.update_priorities(got, torch.from_numpy(p))
        if update and prefetch == 0:
            assert a.total_priority == b.total_priority
    finally:
        if hasattr(it, "close"):
            it.close()
        a.close()
        b.close()


# ---------------------------------------------------------------- 1. staging block vs sample

EXTRA = {"flag": ((), np.bool_), "half": ((2,), np.float16), "big": ((3,), ">f4"),
         "scalar": ((), np.int8), "u16": ((2, 2), np.uint16)}


def test_shape_zero_field_refused():
    with pytest.raises(BigperError):
        bigper.PrioritizedReplayBuffer(**_kw(3, 1, extra={"empty": ((0,), np.float32)}))


@pytest.mark.parametrize("frame_stack", [None, 1, 3])
@pytest.mark.parametrize("n_step", [1, 3])
@pytest.mark.parametrize("num_envs", [1, 2])
def test_staged_matches_sample_every_config(staged, frame_stack, n_step, num_envs):
    _compare(_kw(frame_stack, n_step, num_envs, extra=EXTRA))


@pytest.mark.parametrize("frame_stack", [None, 3])
@pytest.mark.parametrize("n_step", [1, 3])
def test_staged_next_of_other_than_obs(staged, frame_stack, n_step):
    _compare(_kw(frame_stack, n_step, extra={"aux": ((2,), np.float16), "flag": ((), np.bool_)},
                 next_of=("obs", "aux", "flag")))


@pytest.mark.parametrize("frame_stack", [None, 3])
def test_staged_next_of_without_obs(staged, frame_stack):
    _compare(_kw(frame_stack, 1, extra={"aux": ((2,), ">f8")}, next_of=("aux",)))


@pytest.mark.parametrize("frame_stack", [1, 3])
@pytest.mark.parametrize("n_step", [1, 3])
def test_staged_stacks_that_do_not_pair(staged, frame_stack, n_step):
    _compare(_kw(frame_stack, n_step), steps=8, resets=True, size=16)


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3, 4])
def test_staged_prefetch(staged, prefetch):
    _compare(_kw(3, 1, extra=EXTRA), prefetch=prefetch)


def test_staged_batch_one(staged):
    _compare(_kw(3, 1), size=1)


def test_many_samplers_alive_on_one_buffer(staged):
    kw = _kw(3, 1, extra=EXTRA)
    a, b = _pair_of(kw)
    its = [b.sampler(s, prefetch=0, device="cpu") for s in (4, 8, 4, 8, 16, 4, 4, 8)]
    for _ in range(3):
        for it, s in zip(its, (4, 8, 4, 8, 16, 4, 4, 8)):
            _same(a.sample(s), next(it))


def test_many_prefetching_samplers_then_plain_one(staged):
    kw = _kw(3, 1, extra=EXTRA)
    a, b = _pair_of(kw)
    its = [b.sampler(8, prefetch=4, device="cpu") for _ in range(10)]
    got = [next(it) for it in its]
    assert all(g["obs"].shape == (8, 3, 4, 5) for g in got)
    for it in its:
        it.close()
    it = b.sampler(8, prefetch=0, device="cpu")
    for _ in range(pinned.POOL_DEPTH * 2):
        _consistent(b, next(it))


def _consistent(buf, got):
    """A sampler batch holds what ``gather`` reads at its indices."""
    want = buf.gather(_np(got["indices"]))
    for k in want:
        if k in got:
            np.testing.assert_array_equal(_np(got[k]), np.asarray(want[k]), err_msg=k)


def test_sampler_closed_with_batches_never_taken_then_new_sampler(staged):
    """Batches made but never taken hold their pinned slots: a later sampler of the same layout must still run."""
    kw = _kw(3, 1, extra=EXTRA)
    a, b = _pair_of(kw)
    for _ in range(pinned.POOL_DEPTH + 3):
        it = b.sampler(8, prefetch=4, device="cpu")
        _consistent(b, next(it))
        it.close()
    it = b.sampler(8, prefetch=0, device="cpu")
    for _ in range(pinned.POOL_DEPTH + 3):
        _consistent(b, next(it))


def test_prefetch0_batches_never_sent(staged):
    """prefetch=0 hands out tensors; a staged Batch that never reached to_torch (an error in the
    draw) must give its slot back."""
    kw = _kw(3, 1)
    a, b = _pair_of(kw)
    it = b.sampler(8, prefetch=0, device="cpu")
    for _ in range(pinned.POOL_DEPTH * 3):
        _same(a.sample(8), next(it))


def test_staged_tensors_are_not_overwritten_by_next_batch(staged):
    """Tensors handed out must not share the pinned block the next batch is gathered into."""
    kw = _kw(3, 1, extra=EXTRA)
    a, b = _pair_of(kw)
    it = b.sampler(8, prefetch=0, device="cpu")
    kept = []
    for _ in range(pinned.POOL_DEPTH * 2 + 2):
        want, got = a.sample(8), next(it)
        kept.append((want, got))
    for want, got in kept:
        _same(want, got)


def test_staged_learner_changes_tensors_in_place(staged):
    """A learner writing into its tensors changes nothing of the next batches nor the updates."""
    kw = _kw(3, 1, extra=EXTRA)
    a, b = _pair_of(kw)
    it = b.sampler(8, prefetch=0, device="cpu")
    for i in range(pinned.POOL_DEPTH * 2):
        want, got = a.sample(8), next(it)
        _same(want, got)
        p = np.linspace(1, 2, 8) + i
        a.update_priorities(want, p)
        b.update_priorities(got, torch.from_numpy(p))
        for t in got.values():
            if isinstance(t, torch.Tensor) and t.dtype != torch.bool:
                t.fill_(7)
    assert a.total_priority == b.total_priority


def test_staged_after_buffer_wraps_and_grows(staged):
    kw = _kw(3, 1, extra=EXTRA, capacity=20)
    a, b = _pair_of(kw)
    it = b.sampler(8, prefetch=0, device="cpu")
    for r in range(4):
        _fill(a, 7, seed=10 + r)
        _fill(b, 7, seed=10 + r)
        _same(a.sample(8), next(it))


def test_staged_sequence_buffer(staged):
    kw = _kw(3, 1, capacity=40)
    kw["sequence"] = bigper.Sequence(3, burn_in=1)
    a, b = _pair_of(kw)
    it = b.sampler(4, prefetch=0, device="cpu")
    for _ in range(3):
        want, got = a.sample(4), next(it)
        for k in want:
            np.testing.assert_array_equal(_np(got[k]), want[k], err_msg=k)


def test_staged_sampler_bad_beta_in_kw(staged):
    kw = _kw(3, 1)
    a, b = _pair_of(kw)
    with pytest.raises(BigperError):
        next(b.sampler(8, prefetch=0, device="cpu", beta=1.5))
    # the slot from the refused draw went back: the pool still serves
    it = b.sampler(8, prefetch=0, device="cpu")
    for _ in range(pinned.POOL_DEPTH + 2):
        next(it)


# ---------------------------------------------------------------- 2. TensorBatch.host_target

def _tb(staged_path=True):
    kw = _kw(3, 1, extra={"aux": ((2,), np.float16)})
    a, b = _pair_of(kw)
    t = next(b.sampler(8, prefetch=0, device="cpu"))
    assert isinstance(t, transport.TensorBatch)
    return a, b, t


def test_host_target_kept_as_given(staged):
    _, b, t = _tb()
    assert t.host_target() is not None
    b.update_priorities(t, torch.ones(8))


def test_host_target_key_replaced_reads_dict(staged):
    a, b, t = _tb()
    want = a.sample(8)
    np.testing.assert_array_equal(want.indices, _np(t["indices"]))
    t["indices"] = torch.flip(t["indices"], [0])
    t["generations"] = torch.flip(t["generations"], [0])
    assert t.host_target() is None
    p = np.arange(1, 9, dtype=np.float64)
    b.update_priorities(t, torch.from_numpy(p))
    a.update_priorities({"indices": want.indices[::-1].copy(), "generations": want.generations[::-1].copy()}, p)
    np.testing.assert_array_equal(b.leaves(np.arange(48)), a.leaves(np.arange(48)))


def test_host_target_generations_deleted_keeps_host(staged):
    _, b, t = _tb()
    del t["generations"]
    assert t.host_target() is not None
    b.update_priorities(t, torch.ones(8))


def test_host_target_indices_deleted_is_bigper_error(staged):
    _, b, t = _tb()
    del t["indices"]
    assert t.host_target() is None
    with pytest.raises(BigperError):
        b.update_priorities(t, torch.ones(8))


def test_host_target_readded_same_tensor(staged):
    _, b, t = _tb()
    i = t.pop("indices")
    t["indices"] = i
    assert t.host_target() is not None
    b.update_priorities(t, torch.ones(8))


def test_host_target_plain_dict_copy(staged):
    _, b, t = _tb()
    b.update_priorities(dict(t), torch.ones(8))


def test_host_target_copy_and_deepcopy(staged):
    import copy

    _, b, t = _tb()
    for c in (copy.copy(t), copy.deepcopy(t)):
        assert isinstance(c, transport.TensorBatch)
        b.update_priorities(c, torch.ones(8))


def test_host_target_host_cleared_is_bigper_error_or_reads_dict(staged):
    """``t.host`` is a public attribute: a learner clearing it must not get a raw KeyError."""
    _, b, t = _tb()
    t.host.clear()
    b.update_priorities(t, torch.ones(8))


def test_host_target_host_replaced_by_none(staged):
    _, b, t = _tb()
    t.host = None
    b.update_priorities(t, torch.ones(8))


def test_host_target_in_place_indices_edit_matches_plain_dict(staged):
    """In-place edits of the tensors do not reach the batch (copies): the host copies rule."""
    _, b, t = _tb()
    orig = t["indices"].clone()
    t["indices"].fill_(int(orig[0]))
    ht = t.host_target()
    assert ht is not None and np.array_equal(ht[0], orig.numpy())


def test_host_target_of_to_torch_batch_twice(staged):
    """A Batch's to_torch called twice: each TensorBatch its own host dict."""
    kw = _kw(3, 1)
    a, _ = _pair_of(kw)
    bt = a.sample(8)
    t1, t2 = bt.to_torch(), bt.to_torch()
    t1["indices"] = t1["indices"].clone()
    assert t2.host_target() is not None and t1.host_target() is None


# ---------------------------------------------------------------- 4. beta in [0, 1], n_step <= MAX_N_STEP

def _small():
    b = bigper.PrioritizedReplayBuffer(16, {"x": ((), np.float32)}, seed=1)
    for i in range(10):
        b.add(x=np.float32(i), reward=0.0, terminated=False) if "reward" in b.config.fields else b.add(x=np.float32(i))
    return b


@pytest.mark.parametrize("beta", [0, 1, 0.0, 1.0, np.float32(1), np.float64(0.5), np.int64(1), np.nextafter(1, 0)])
def test_beta_at_limits_accepted(beta):
    _small().sample(4, beta=beta)


@pytest.mark.parametrize("beta", [-0.0 - 1e-300, np.nextafter(1, 2), 1.5, -1, np.inf, -np.inf, np.nan,
                                  np.float32(1.0000001), 2**1000])
def test_beta_beyond_limits_refused(beta):
    with pytest.raises(BigperError):
        _small().sample(4, beta=beta)


@pytest.mark.parametrize("beta", [True, False])
def test_beta_bool_refused(beta):
    with pytest.raises(BigperError):
        _small().sample(4, beta=beta)


@pytest.mark.parametrize("beta", ["0.5", b"1"])
def test_beta_string_refused(beta):
    with pytest.raises(BigperError):
        _small().sample(4, beta=beta)


def test_beta_complex_is_bigper_error():
    with pytest.raises(BigperError):
        _small().sample(4, beta=1j)


def test_beta_torch_scalar_accepted():
    _small().sample(4, beta=torch.tensor(0.5))


@pytest.mark.parametrize("beta", [1.5, -0.1, np.nan])
def test_sampler_beta_refused_at_call_or_first_batch(beta):
    b = _small()
    with pytest.raises(BigperError):
        next(b.sampler(4, prefetch=0, beta=beta))


@pytest.mark.parametrize("n", [bigper.config.MAX_N_STEP, np.int64(bigper.config.MAX_N_STEP), np.uint16(4096)])
def test_n_step_at_limit_accepted_and_samples(n):
    b = bigper.PrioritizedReplayBuffer(8, {"x": ((), np.float32), "reward": ((), np.float32)}, n_step=n)
    assert b.config.n_step == 4096 and type(b.config.n_step) is int
    for i in range(20):
        b.add(x=np.float32(i), reward=1.0, terminated=i == 19)
    got = b.sample(4)
    assert got["reward"].shape == (4,)


@pytest.mark.parametrize("n", [4097, np.int64(4097), 2**63, np.uint64(2**64 - 1), True, 0, -1, 4096.0])
def test_n_step_beyond_limit_refused(n):
    with pytest.raises(BigperError):
        bigper.PrioritizedReplayBuffer(8, {"x": ((), np.float32), "reward": ((), np.float32)}, n_step=n)


@pytest.mark.parametrize("n", [4097, 2**29, "4", 4.0, True, None, [4]])
def test_n_step_from_recorded_config_refused(n):
    cfg = bigper.PrioritizedReplayBuffer(8, {"x": ((), np.float32), "reward": ((), np.float32)}).config
    d = json.loads(json.dumps(cfg.to_dict()))
    d["n_step"] = n
    with pytest.raises(BigperError):
        bigper.config.Config.from_dict(d)


def test_n_step_from_recorded_config_at_limit():
    cfg = bigper.PrioritizedReplayBuffer(8, {"x": ((), np.float32), "reward": ((), np.float32)}).config
    d = json.loads(json.dumps(cfg.to_dict()))
    d["n_step"] = 4096
    assert bigper.config.Config.from_dict(d).n_step == 4096


def _snapshot_dir(d):
    out = {}
    for f in sorted(d.rglob("*")):
        if f.is_file():
            name = str(f.relative_to(d))  # (the lock file is rewritten with the pid: its bytes are compared)
            out[name] = (f.read_bytes(), None if name == ".lock" else f.stat().st_mtime_ns)
    return out


def _memmap(tmp_path, **kw):
    path = tmp_path / "mm"
    b = bigper.PrioritizedReplayBuffer(16, {"obs": ((3, 4), np.uint8), "reward": ((), np.float32)}, frame_stack=3,
                                       storage="memmap", path=path, **kw)
    for t in range(5):
        b.add(obs=np.zeros((3, 4), np.uint8), next_obs=np.zeros((3, 4), np.uint8), reward=1.0, terminated=False)
    b.close()
    return path


@pytest.mark.parametrize("n", [4097, 2**40, -3, 0, 1.5, "2", None, True])
def test_resume_storage_with_crafted_n_step(tmp_path, n):
    path = _memmap(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    meta["config"]["n_step"] = n
    (path / "meta.json").write_text(json.dumps(meta))
    before = _snapshot_dir(path)
    with pytest.raises(BigperError):
        bigper.PrioritizedReplayBuffer(16, {"obs": ((3, 4), np.uint8), "reward": ((), np.float32)}, frame_stack=3,
                                       storage="memmap", path=path, mode="resume", n_step=4096)
    with pytest.raises(BigperError):
        bigper.PrioritizedReplayBuffer.load(path) if hasattr(bigper.PrioritizedReplayBuffer, "load") else None
    assert _snapshot_dir(path) == before


# ---------------------------------------------------------------- 5. buf.device and the info device line

def test_buf_device_none_and_cpu():
    b = _small()
    assert b.device is None
    d = bigper.PrioritizedReplayBuffer(16, {"x": ((), np.float32)}, device="cpu")
    assert d.device == torch.device("cpu")
    d.close()
    assert d.device == torch.device("cpu") or d.device is None


@pytest.mark.parametrize("dev", ["cuda:99", "meta", "tpu", 3.5, object(), "cpu:0:1", ""])
def test_bad_device_is_bigper_error(dev):
    with pytest.raises(BigperError):
        bigper.PrioritizedReplayBuffer(16, {"x": ((), np.float32)}, device=dev)
    with pytest.raises(BigperError):
        _small().sampler(4, device=dev)


CRAFTED = [
    {"obs": [[2**62, 2**62], "|u1"]},
    {"obs": [[3, 2**63], "|u1"]},
    {"obs": [[3, -4], "|u1"]},
    {"obs": [[3, "a"], "|u1"]},
    {"obs": [[3, 2.5], "|u1"]},
    {"obs": [[3, None], "|u1"]},
    {"obs": [[3, [4]], "|u1"]},
    {"obs": [3, "|u1"]},
    {"obs": [[3, 4], "O"]},
    {"obs": [[3, 4], "V0"]},
    {"obs": [[3, 4], "<U9999999999"]},
    {"obs": [[3, 4], 7]},
    {"obs": [[3, 4]]},
    {"obs": "x"},
    [],
    {"obs": [[3, 1e308], "|u1"]},
    {"obs": [[3, True], "|u1"]},
]


@pytest.mark.parametrize("fields", CRAFTED, ids=[str(i) for i in range(len(CRAFTED))])
def test_info_device_line_on_crafted_meta(tmp_path, capsys, fields):
    from bigper import cli

    path = _memmap(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    meta["config"]["fields"] = fields
    (path / "meta.json").write_text(json.dumps(meta))
    try:
        cli.main(["info", str(path)])
    except SystemExit:
        pass
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out


@pytest.mark.parametrize("key,val", [("capacity", 2**62), ("capacity", -1), ("frame_stack", 2**40),
                                     ("num_envs", 2**40), ("capacity", "16"), ("frame_stack", 0)])
def test_info_device_line_crafted_sizes(tmp_path, capsys, key, val):
    from bigper import cli

    path = _memmap(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    meta["config"][key] = val
    (path / "meta.json").write_text(json.dumps(meta))
    try:
        cli.main(["info", str(path)])
    except SystemExit:
        pass
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out


def test_info_device_line_huge_but_valid(tmp_path, capsys):
    from bigper import cli

    path = _memmap(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    meta["config"]["fields"]["obs"] = [[3, 2**40], "|u1"]
    meta["config"]["capacity"] = 2**40
    (path / "meta.json").write_text(json.dumps(meta))
    try:
        cli.main(["info", str(path)])
    except SystemExit:
        pass
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out


# ---------------------------------------------------------------- 1b. more staged layouts

@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
@pytest.mark.parametrize("n_step", [1, 3])
def test_staged_on_disk_storage(staged, tmp_path, storage, n_step):
    kw = _kw(3, n_step, extra={"flag": ((), np.bool_)})
    a = bigper.PrioritizedReplayBuffer(**kw)
    b = bigper.PrioritizedReplayBuffer(**kw, storage=storage, path=tmp_path / "s")
    _fill(a, 60)
    _fill(b, 60)
    it = b.sampler(8, prefetch=0, device="cpu")
    for _ in range(4):
        _same(a.sample(8), next(it))


@pytest.mark.parametrize("n_step", [1, 3])
def test_staged_zstd(staged, n_step):
    _compare(dict(_kw(3, n_step, extra={"flag": ((), np.bool_)}), compression="zstd"), resets=True)


def test_two_buffers_same_layout_share_pool(staged):
    kw = _kw(3, 1, extra=EXTRA)
    a, b = _pair_of(kw)
    c, d = _pair_of(kw)
    i1, i2 = b.sampler(8, prefetch=2, device="cpu"), d.sampler(8, prefetch=2, device="cpu")
    for _ in range(pinned.POOL_DEPTH + 2):
        _same(a.sample(8), next(i1))
        _same(c.sample(8), next(i2))


# ---------------------------------------------------------------- 3. handover / mark_ready (CUDA only)

@needs_cuda
def test_mark_ready_then_handover_on_other_stream():
    kw = _kw(3, 1)
    a, b = _pair_of(kw)
    it = b.sampler(8, prefetch=2, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = next(it)
        assert "ready" not in t.host
        assert t["obs"].device.type == "cuda"
        t["obs"].float().sum().item()
    b.update_priorities(t, torch.ones(8, device="cuda"))
    it.close()


@needs_cuda
def test_handover_without_ready_and_twice():
    t = transport.TensorBatch({"indices": torch.zeros(2, dtype=torch.int64, device="cuda")}, {"indices": np.zeros(2),
                                                                                      "generations": np.zeros(2),
                                                                                      "mask": None})
    assert streams.handover(t) is t
    streams.mark_ready(t)
    assert "ready" in t.host
    streams.handover(t)
    streams.handover(t)
    assert "ready" not in t.host


def test_mark_ready_on_cpu_tensors_is_a_no_op():
    t = transport.TensorBatch({"indices": torch.zeros(2, dtype=torch.int64)}, {"indices": np.zeros(2, np.int64),
                                                                       "generations": np.zeros(2, np.int64),
                                                                       "mask": None})
    assert streams.mark_ready(t) is t and "ready" not in t.host
    assert streams.handover(t) is t


def test_mark_ready_without_indices():
    t = transport.TensorBatch({"obs": torch.zeros(2)}, {"indices": None, "generations": None, "mask": None})
    assert streams.mark_ready(t) is t and t.host_target() is None


# ---------------------------------------------------------------- 6. two threads

OPS = ("next", "update", "add", "save", "close")


def _thread_world(tmp_path):
    kw = _kw(3, 1, extra={"flag": ((), np.bool_)})
    b = bigper.PrioritizedReplayBuffer(**kw)
    _fill(b, 60)
    it = b.sampler(8, prefetch=2, device="cpu")
    first = next(it)
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (10, 4, 5), dtype=np.uint8)
    counter = iter(range(10**6))

    def op(name):
        if name == "next":
            t = next(it)
            assert t["obs"].shape == (8, 3, 4, 5)
        elif name == "update":
            b.update_priorities(first, torch.rand(8, dtype=torch.float64) + 0.1)
        elif name == "add":
            b.add(obs=frames[:3], next_obs=frames[1:4], action=1, reward=np.float32(1), flag=True, terminated=False)
        elif name == "save":
            b.save(tmp_path / f"snap{next(counter)}")
        elif name == "close":
            b.close()
    return b, it, op


@pytest.mark.parametrize("x,y", [(x, y) for i, x in enumerate(OPS) for y in OPS[i:]])
def test_two_threads(staged, tmp_path, x, y):
    from bigper.errors import BufferClosedError

    b, it, op = _thread_world(tmp_path)
    errors = []
    n = 3 if "save" in (x, y) else 25

    def run(name):
        for _ in range(1 if name == "close" else n):
            try:
                op(name)
            except (BufferClosedError, StopIteration):
                return
            except BigperError as e:
                if "closed" in str(e) or b.closed:
                    return
                errors.append(e)
                return
            except Exception as e:  # noqa: BLE001
                errors.append(e)
                return

    ts = [threading.Thread(target=run, args=(x,)), threading.Thread(target=run, args=(y,))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "a thread hung"
    if hasattr(it, "close"):
        it.close()
    assert not errors, repr(errors)
    if not b.closed:
        b.close()


# ---------------------------------------------------------------- 1c. field names that collide with the block's keys

_BOOK = ("a field named like the block's bookkeeping: Reader.staging_specs (bigper/core/reader.py:278) "
         "specs.update(weights=, indices=, generations=) replaces the field's spec, and send_staged "
         "(bigper/tensors/transfer.py, send_staged) takes the field's own tensor (it lands in `rest`) for the key, so the "
         "sampler's {k!r} tensor is the (8, 2) field where to_torch gives the batch's {k} (8,)")
_KEYS = ("send_staged (bigper/tensors/transfer.py) `ordered = {{key: out[key] for key in data}}` raises KeyError: "
         "{k!r}: the staged block's own key {k!r} (popped at :519, or by _derive at :338-339) shadows a user field "
         "of that name; to_torch without staging returns it")
_CASES = [
    pytest.param(None, "weights"),
    pytest.param(3, "weights"),
    pytest.param(None, "indices"),
    pytest.param(3, "indices"),
    pytest.param(None, "generations"),
    pytest.param(3, "generations"),
    pytest.param(None, "_pair"),
    pytest.param(3, "_pair"),
    pytest.param(3, "_frames"),
    (None, "_frames"), (None, "mask"), (3, "mask"), (None, "probabilities"), (3, "probabilities"),
]


@pytest.mark.parametrize("frame_stack,name", _CASES)
def test_staged_field_named_like_bookkeeping(staged, frame_stack, name):
    if name in bigper.config.RESERVED:  # keys of every to_torch dict: refused as field names
        with pytest.raises(bigper.InvalidArgumentError, match=name):
            _kw_buffer = bigper.PrioritizedReplayBuffer(**_kw(frame_stack, 1, extra={name: ((2,), np.float64)}))
        return
    _compare(_kw(frame_stack, 1, extra={name: ((2,), np.float64)}), update=False)


# ---------------------------------------------------------------- 1d. dtypes torch may not hold; failing draws

@pytest.mark.parametrize("dtype", [np.uint32, np.uint64, np.complex64, ">c16", np.int16, ">i8", ">u2", "<f2", ">f2",
                                   np.float64, np.bool_])
def test_staged_dtype_same_as_to_torch(staged, dtype):
    kw = _kw(3, 1, extra={"odd": ((2,), dtype)})
    a, b = _pair_of(kw)
    try:
        want = a.sample(8).to_torch("cpu")
    except BigperError as e:
        with pytest.raises(type(e)):
            next(b.sampler(8, prefetch=0, device="cpu"))
        return
    got = next(b.sampler(8, prefetch=0, device="cpu"))
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


def test_staged_draw_failing_repeatedly_returns_slots(staged):
    kw = _kw(3, 3)
    b = bigper.PrioritizedReplayBuffer(**kw)
    it = b.sampler(8, prefetch=0, device="cpu")
    for _ in range(pinned.POOL_DEPTH * 3):
        with pytest.raises(BigperError):
            next(b.sampler(8, prefetch=0, device="cpu"))
    _fill(b, 30)
    for _ in range(pinned.POOL_DEPTH * 2):
        _consistent(b, next(it))


def test_staged_large_batch(staged):
    _compare(_kw(3, 1, extra=EXTRA), size=1000, steps=2)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_staged_sequence_compressed(staged, compression):
    kw = dict(_kw(3, 1, capacity=40), sequence=bigper.Sequence(3, burn_in=1))
    if compression:
        kw["compression"] = compression
    a, b = _pair_of(kw, resets=True)
    it = b.sampler(4, prefetch=0, device="cpu")
    for _ in range(3):
        want, got = a.sample(4), next(it)
        for k in want:
            np.testing.assert_array_equal(_np(got[k]), want[k], err_msg=k)


# ---------------------------------------------------------------- 4b. beta elsewhere: sample_at, the constructor

_SA = ("sample_at (bigper/buffer.py:1209) passes float(beta) to the strategy unchecked: the [0, 1] rule "
       "sample() got at buffer.py:603-607 (and the schedules' _is_beta) is not applied here")


@pytest.mark.parametrize("beta", [
    pytest.param(1.5),
    pytest.param(-0.5),
    pytest.param(np.nan),
    pytest.param(True),
    pytest.param("x"),
    pytest.param(None),
])
def test_sample_at_beta_checked_like_sample(beta):
    b = _small()
    with pytest.raises(BigperError):
        b.shard.sample_at(np.array([0.5]), beta=beta)


def test_sample_at_beta_in_range():
    b = _small()
    b.shard.sample_at(np.array([0.5]), beta=1.0)
    b.shard.sample_at(np.array([0.5]), beta=0)


_CTOR = ("InvalidTypeError: beta must be a float or a schedule ... got np.float32(0.5): schedules.as_schedule "
         "(bigper/schedules.py:81) and _is_beta (:14) take only int/float, while sample(beta=) takes any "
         "float()-able number (buffer.py:603): a numpy beta works per call but not in the constructor")


@pytest.mark.parametrize("beta", [
    pytest.param(np.float32(0.5)),
    pytest.param(np.int64(1)),
    np.float64(0.5), 1, 0.0,
])
def test_constructor_takes_numpy_betas_like_sample(beta):
    bigper.PrioritizedReplayBuffer(16, {"x": ((), np.float32)}, beta=beta).close()


_RINT = ("TypeError: Cannot cast array data from dtype('float32') to dtype('{d}') according to the rule 'safe' "
         "at bigper/core/reader.py:146 (arrays[name].take(rows, out=o)): with n_step > 1 and an integer reward, "
         "staging_specs (core/reader.py:271-273) makes out['reward'] float32 (the n-step return) but gather's loop "
         "(core/reader.py:165-166) reads the raw stored reward into out.get('reward'); sample(out=...) fails the same way")


@pytest.mark.parametrize("rdt,n_step", [
    pytest.param(np.int32, 3),
    pytest.param(np.uint8, 3),
    pytest.param(">i2", 3),
    (np.float16, 3), (">f8", 3), (np.int32, 1), (np.uint8, 1), (">i2", 1), (np.float16, 1), (">f8", 1),
])
def test_staged_reward_dtypes(staged, rdt, n_step):
    kw = _kw(3, n_step)
    kw["fields"] = dict(kw["fields"], reward=((), rdt))
    _compare(kw)


def test_staged_sampler_kwargs(staged):
    kw = _kw(3, 1)
    a, b = _pair_of(kw)
    it = b.sampler(np.int64(8), prefetch=np.int32(0), device=torch.device("cpu"), beta=1.0, stratified=False)
    for _ in range(3):
        _same(a.sample(8, beta=1.0, stratified=False), next(it))


def test_sample_out_integer_reward_n_step():
    kw = _kw(3, 3)
    kw["fields"] = dict(kw["fields"], reward=((), np.int32))
    a = bigper.PrioritizedReplayBuffer(**kw)
    _fill(a, 40)
    want = a.sample(8)
    out = {k: np.empty_like(v) for k, v in want.items()}
    try:
        a.sample(8, out=out)
    except BigperError:
        pass


def test_staged_more_layouts_than_the_cache_keeps(staged):
    """Batch sizes beyond MAX_KEYS layouts: the layout cache and the pool evict, batches stay right."""
    kw = _kw(3, 1, extra={"flag": ((), np.bool_)})
    a, b = _pair_of(kw)
    sizes = list(range(1, pinned.MAX_KEYS + 6))
    its = {s: b.sampler(s, prefetch=0, device="cpu") for s in sizes}
    for _ in range(2):
        for s in sizes:
            _same(a.sample(s), next(its[s]))


def test_two_threads_two_staged_samplers_same_layout(staged):
    kw = _kw(3, 1, extra=EXTRA)
    b = bigper.PrioritizedReplayBuffer(**kw)
    _fill(b, 60)
    errors = []

    def run():
        it = b.sampler(8, prefetch=0, device="cpu")
        try:
            for _ in range(40):
                _consistent(b, next(it))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, repr(errors)


def _snap(tmp_path):
    b = bigper.PrioritizedReplayBuffer(16, {"obs": ((3, 4), np.uint8), "reward": ((), np.float32)}, frame_stack=3)
    for _ in range(5):
        b.add(obs=np.zeros((3, 4), np.uint8), next_obs=np.zeros((3, 4), np.uint8), reward=1.0, terminated=False)
    return b.save(tmp_path / "sn")


@pytest.mark.parametrize("fields", CRAFTED, ids=[str(i) for i in range(len(CRAFTED))])
def test_info_device_line_on_resigned_snapshot(tmp_path, capsys, fields):
    """A crafted (re-signed) snapshot manifest: ``bigper info``'s device line adds nothing or a line, never a traceback."""
    from bigper import cli
    from bigper.snapshot import manifest as M

    snap = _snap(tmp_path)
    body = M.decode((snap / "manifest.json").read_bytes(), snap)
    body["config"]["fields"] = fields
    (snap / "manifest.json").write_bytes(M.encode(body))
    try:
        cli.main(["info", str(snap)])
    except SystemExit:
        pass
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out


@pytest.mark.parametrize("key,val", [("capacity", 2**62), ("frame_stack", 2**40), ("num_envs", 2**40),
                                     ("n_step", 4097), ("config", None)])
def test_info_device_line_on_resigned_snapshot_sizes(tmp_path, capsys, key, val):
    from bigper import cli
    from bigper.snapshot import manifest as M

    snap = _snap(tmp_path)
    body = M.decode((snap / "manifest.json").read_bytes(), snap)
    if key == "config":
        body["config"] = val
    else:
        body["config"][key] = val
    (snap / "manifest.json").write_bytes(M.encode(body))
    try:
        cli.main(["info", str(snap)])
    except SystemExit:
        pass
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out


_HT = ("bigper/buffer.py:739 takes target.host_target()'s arrays raw (the code it replaced ran "
       "as_index(host['indices']), as_index(host['generations'])), so a mutated t.host reaches ")


@pytest.mark.parametrize("key,val", [
    ("indices", np.arange(3)), ("indices", np.array([10**9] * 8)),
    pytest.param("generations", np.zeros(2, np.int64)),
    pytest.param("indices", "junk"),
    pytest.param("indices", None),
    pytest.param("generations", None),
])
def test_host_target_host_values_mutated_is_bigper_error(staged, key, val):
    _, b, t = _tb()
    t.host[key] = val
    with pytest.raises(BigperError):
        b.update_priorities(t, torch.ones(8))


def test_staged_n_step_at_limit(staged):
    kw = _kw(3, bigper.config.MAX_N_STEP, capacity=16)
    _compare(kw, steps=3)
