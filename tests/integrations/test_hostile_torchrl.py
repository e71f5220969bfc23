"""Hostile input to the TorchRL drop-in: TensorDicts with missing, extra or
mistyped keys, wrong batch dims, tensors without data, NaN and negative
priorities, a stale or crafted index, two threads at once, and ``loads`` of
crafted or corrupt folders. Every refusal is a bigper error naming what was
wrong, and leaves the buffer exactly as it was: its state, its priorities, its
data and the next batch it draws (a full fingerprint before and after)."""

from __future__ import annotations

import hashlib
import json
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchrl")

from tensordict import TensorDict  # noqa: E402

from bigper.errors import (  # noqa: E402
    BigperError,
    CorruptSnapshotError,
    InvalidArgumentError,
    InvalidIndexError,
    InvalidTypeError,
)
from bigper.integrations.torchrl import PrioritizedReplayBuffer  # noqa: E402
from tests.integrations._torchrl_data import stream  # noqa: E402


def fingerprint(rb) -> str:
    """Everything the buffer holds: its recorded state (counters, RNG, beta step,
    ring, tree), every stored array, and the length and count."""
    core = rb.buffer
    meta, arrays = core.state_dict()
    h = hashlib.sha256(json.dumps(meta, sort_keys=True, default=str).encode())
    for source in (arrays, core.storage.arrays):
        for k in sorted(source):
            h.update(k.encode())
            h.update(np.ascontiguousarray(source[k]).tobytes())
    h.update(f"{len(rb)} {rb.write_count} {core.total_priority!r}".encode())
    return h.hexdigest()


@pytest.fixture
def rb():
    b = PrioritizedReplayBuffer(capacity=40, frame_stack=4, batch_size=8, seed=0)
    b.extend(stream(30))
    s = b.sample()
    b.update_priority(s["index"], torch.linspace(0.1, 2, 8))
    return b


def refused(rb, exc, match, fn, *args, **kw):
    before = fingerprint(rb)
    with pytest.raises(exc, match=match) as e:
        fn(*args, **kw)
    assert isinstance(e.value, BigperError)
    assert fingerprint(rb) == before
    return e.value


def test_missing_extra_and_mistyped_keys(rb):
    td = stream(5, start=30)
    refused(rb, InvalidArgumentError, r"missing \[\('next', 'step_count'\)\]", rb.extend,
            td.exclude(("next", "step_count")))
    refused(rb, InvalidArgumentError, r"extra \[\('surprise',\)\]", rb.extend, td.clone().set("surprise", torch.ones(5)))
    bad = td.clone()
    bad["next", "reward"] = bad["next", "reward"].double()
    refused(rb, InvalidArgumentError, r"tensordicts\[\('next', 'reward'\)\] must have shape \(1,\) and dtype "
            r"float32 per item, got shape \(1,\) dtype float64", rb.extend, bad)
    wide = td.clone()
    wide["action"] = torch.zeros(5, 4, dtype=torch.int64)
    refused(rb, InvalidArgumentError, r"tensordicts\[\('action',\)\] must have shape \(3,\)", rb.extend, wide)
    cplx = td.clone()
    cplx["step_count"] = torch.zeros(5, 1, dtype=torch.complex64)
    refused(rb, InvalidTypeError, r"key \('step_count',\) has dtype torch.complex64", rb.extend, cplx)
    text = td.clone()
    text["note"] = "a string"  # NonTensorData
    refused(rb, InvalidTypeError, r"key \('note',\) holds a", rb.extend, text)
    refused(rb, InvalidTypeError, "tensordicts must be a TensorDict, got dict", rb.extend, {"pixels": 1})


def test_wrong_batch_dims(rb):
    td = stream(4, start=30)
    refused(rb, InvalidArgumentError, r"must have batch size \(T,\) \(num_envs=1\), got \(\)", rb.extend, td[0])
    refused(rb, InvalidArgumentError, r"got \(2, 4\)", rb.extend, torch.stack([td, td]))
    refused(rb, InvalidArgumentError, r"data must have batch size \(num_envs,\)|data must have batch size",
            rb.add, td)


def test_tensors_without_data_are_refused_and_strided_views_are_stored_right(rb):
    meta = stream(3, start=30)
    meta["action"] = torch.empty(3, 3, dtype=torch.int64, device="meta")
    refused(rb, InvalidArgumentError, r"key \('action',\) is a torch.strided tensor on meta", rb.extend, meta)
    td = stream(3, start=30)
    td["action"] = torch.eye(3, dtype=torch.int64).T[[2, 0, 1]].T  # not contiguous
    assert not td["action"].is_contiguous()
    slots = rb.extend(td)
    got = rb.buffer.gather(slots.numpy())
    assert np.array_equal(got["t--action"], td["action"].numpy())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_tensors_are_copied_to_the_host(rb):
    td = stream(3, start=30).to("cuda")
    slots = rb.extend(td)
    assert np.array_equal(rb.buffer.gather(slots.numpy())["t--action"], td["action"].cpu().numpy())


def test_nan_and_negative_priorities(rb):
    td = stream(3, start=30)
    td["td_error"] = torch.tensor([0.5, float("nan"), 1.0])
    refused(rb, InvalidArgumentError, "nan", rb.extend, td)
    s = rb.sample()
    for bad in (torch.full((8, 1), -1.0), torch.full((8, 1), float("nan")), torch.full((8, 1), float("inf"))):
        refused(rb, InvalidArgumentError, "priorities must be finite and >= 0", rb.update_tensordict_priority,
                s.clone().set("td_error", bad))
    refused(rb, InvalidArgumentError, r"priorities must have shape \(8,\)", rb.update_priority, s["index"],
            torch.ones(3, 2))
    refused(rb, InvalidArgumentError, r"data must hold 'index' and 'td_error'", rb.update_tensordict_priority,
            s.exclude("index").set("td_error", torch.ones(8)))


def test_stale_and_crafted_index(rb):
    s = rb.sample(4)
    stale = s["index"]
    gens = rb.buffer.generations[stale.numpy()].copy()
    rb.extend(stream(20, start=30))  # the ring wraps: capacity 40, 50 written
    over = [i for i, g in zip(stale.tolist(), gens) if rb.buffer.generations[i] != g]
    assert over, "the draw should hold a slot written over since"
    leaves_before = rb.buffer.leaves(np.array(over))
    rb.update_tensordict_priority(s.set("td_error", torch.full((4,), 7.0)))
    assert np.array_equal(rb.buffer.leaves(np.array(over)), leaves_before)  # overwritten since: skipped
    refused(rb, InvalidIndexError, "40", rb.update_priority, torch.tensor([1, 40]), torch.ones(2))
    refused(rb, InvalidIndexError, "-1|negative", rb.update_priority, torch.tensor([-1]), torch.ones(1))
    refused(rb, InvalidArgumentError, "", rb.update_priority, torch.tensor([0.5, 1.5]), torch.ones(2))


def test_two_threads_extend_and_sample_at_once():
    rb = PrioritizedReplayBuffer(capacity=64, frame_stack=4, batch_size=8, seed=0)
    rb.extend(stream(10))
    errors = []

    def writer():
        try:
            for i in range(20):
                rb.extend(stream(7, start=10 + 7 * i))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def learner():
        try:
            for _ in range(40):
                s = rb.sample()
                rb.update_tensordict_priority(s.set("td_error", torch.rand(8)))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer), threading.Thread(target=learner)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert rb.write_count == 150 and len(rb) == 64
    s = rb.sample(64)
    for i in range(64):  # every row is still one real step of the stream
        assert int(s["next", "step_count"][i]) == int(s["step_count"][i]) + 1


def test_loads_of_crafted_and_corrupt_folders(rb, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(rb, BigperError, "", rb.loads, empty)
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "manifest.json").write_text('{"format": "bigper-snapshot", "version": 1, "files": {}}')
    refused(rb, BigperError, "", rb.loads, fake)
    good = tmp_path / "good"
    rb.dumps(good)
    victim = max((p for p in good.rglob("*") if p.is_file() and p.name != "manifest.json"),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    refused(rb, CorruptSnapshotError, "", rb.loads, good)
    refused(rb, BigperError, "not empty", rb.dumps, tmp_path)  # holds the folders above


def test_loads_on_a_disk_buffer_refused_keeps_it_open_and_unchanged(tmp_path):
    from torchrl.data import LazyMemmapStorage

    rb = PrioritizedReplayBuffer(storage=LazyMemmapStorage(40, scratch_dir=tmp_path / "live"), frame_stack=4,
                                 batch_size=8, seed=0)
    rb.extend(stream(30))
    (tmp_path / "junk").mkdir()
    refused(rb, BigperError, "", rb.loads, tmp_path / "junk")
    assert len(rb) == 30 and rb.sample().batch_size == (8,)


def test_load_state_dict_of_a_crafted_dict(rb):
    sd = rb.state_dict()
    refused(rb, InvalidArgumentError, "format", rb.load_state_dict, {"format": "torchrl"})
    refused(rb, InvalidArgumentError, "not one this buffer wrote", rb.load_state_dict, {**sd, "meta": "{bad json"})
    short = {**sd, "data": {k: v[:1] for k, v in sd["data"].items()}}
    refused(rb, InvalidArgumentError, r"state_dict\['data'\]", rb.load_state_dict, short)
    gid = dict(sd["state"])
    gid["gid"] = torch.full_like(gid["gid"], -5)
    refused(rb, BigperError, "", rb.load_state_dict, {**sd, "state": gid})


def test_bad_sample_arguments(rb):
    refused(rb, InvalidArgumentError, "batch_size", rb.sample, 0)
    empty = PrioritizedReplayBuffer(capacity=4)
    with pytest.raises(InvalidArgumentError, match="the buffer is empty"):
        empty.sample(2)
    with pytest.raises(InvalidArgumentError, match="batch_size is None"):
        PrioritizedReplayBuffer(capacity=4).sample()
    assert isinstance(TensorDict, type)
