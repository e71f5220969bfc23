"""The TorchRL drop-in against real TorchRL 0.14 (the ``torchrl`` extra), never mocks:
real ALE frames through TorchRL's collector, ``DQNLoss`` and ``ReplayBufferTrainer``;
batches compared key by key with TorchRL's own ``TensorDictReplayBuffer`` +
``LazyMemmapStorage``; exact resume from ``dumps``/``loads``, ``mode="resume"``
and after a kill -9."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchrl")
pytest.importorskip("ale_py")

from tensordict import TensorDict  # noqa: E402
from torchrl.collectors import Collector  # noqa: E402
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, TensorDictReplayBuffer  # noqa: E402
from torchrl.envs import ExcludeTransform  # noqa: E402
from torchrl.objectives import DQNLoss  # noqa: E402
from torchrl.trainers import ReplayBufferTrainer  # noqa: E402

from bigper.errors import InvalidArgumentError  # noqa: E402
from bigper.integrations.torchrl import PrioritizedReplayBuffer  # noqa: E402
from tests._child import Child  # noqa: E402
from tests.integrations._torchrl_data import make_actor, make_env, stream  # noqa: E402

FRAMES = 192  # three collector batches of 64 real ALE steps


@pytest.fixture(scope="module")
def ale_steps():
    """Real Pong steps from TorchRL's collector (episodes cut at 40 steps: truncations)."""
    env = make_env(max_steps=40)
    env.set_seed(0)
    actor = make_actor(env)
    tds = [td.clone() for td in Collector(env, actor, frames_per_batch=64, total_frames=FRAMES)]
    env.close()
    return tds


def _same_row(got: TensorDict, want: TensorDict) -> None:
    for key in want.keys(True, True):
        assert torch.equal(got[key], want[key]), key


def test_batches_hold_torchrl_keys_shapes_and_dtypes(ale_steps, tmp_path):
    ours = PrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=LazyMemmapStorage(1000), batch_size=32,
                                   frame_stack=4)
    theirs = TensorDictReplayBuffer(storage=LazyMemmapStorage(1000, scratch_dir=tmp_path / "trl"), batch_size=32)
    for td in ale_steps:
        ours.extend(td)
        theirs.extend(td.clone())
    a, b = ours.sample(), theirs.sample()
    ka, kb = set(a.keys(True, True)), set(b.keys(True, True))
    assert ka == kb | {"priority_weight"}, (ka ^ kb)
    for key in kb:
        assert (a[key].shape, a[key].dtype, a[key].device) == (b[key].shape, b[key].dtype, b[key].device), key
    assert a["priority_weight"].dtype == torch.float32 and a["priority_weight"].shape == (32,)
    assert a.batch_size == b.batch_size
    # every sampled row is exactly the step written at its index (here the i-th step written)
    written = torch.cat(ale_steps)
    for i, slot in enumerate(a["index"].tolist()):
        _same_row(a[i].exclude("index", "priority_weight"), written[slot])


def test_frames_are_stored_once(ale_steps, tmp_path):
    """Bytes on disk a transition at the same capacity: bigper's memmap against
    TorchRL's LazyMemmapStorage holding both stacks whole."""
    cap = FRAMES
    ours = PrioritizedReplayBuffer(storage=LazyMemmapStorage(cap, scratch_dir=tmp_path / "ours"), frame_stack=4)
    theirs = TensorDictReplayBuffer(storage=LazyMemmapStorage(cap, scratch_dir=tmp_path / "trl"))
    for td in ale_steps:
        ours.extend(td)
        theirs.extend(td.clone())
    ours.close()
    size = lambda p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file())  # noqa: E731
    mine, trl = size(tmp_path / "ours"), size(tmp_path / "trl")
    print(f"bytes a transition on disk: bigper {mine / cap:,.0f}, TorchRL {trl / cap:,.0f} ({trl / mine:.1f}x)")
    assert mine * 6 <= trl


def test_a_dqn_loop_with_the_collector_dqnloss_and_the_trainer_hook():
    env = make_env(max_steps=30)
    env.set_seed(1)
    actor = make_actor(env, seed=1)
    rb = PrioritizedReplayBuffer(alpha=0.6, beta=0.4, priority_key="td_error", storage=LazyTensorStorage(500),
                                 batch_size=16, frame_stack=4)
    loss = DQNLoss(actor, action_space=env.action_spec, delay_value=True)
    loss.make_value_estimator(gamma=0.99)
    opt = torch.optim.Adam(loss.parameters(), lr=1e-3)
    hook = ReplayBufferTrainer(rb)  # what TorchRL's Trainer registers: extend, sample, update_priority
    collector = Collector(env, actor, frames_per_batch=32, total_frames=96, replay_buffer=rb)
    updates = 0
    for _ in collector:
        for _ in range(2):
            batch = hook.sample(None)
            out = loss(batch)
            assert "td_error" in batch.keys()
            opt.zero_grad()
            out["loss"].backward()
            opt.step()
            hook.update_priority(batch)
            updates += 1
            # each sampled slot's leaf is now (|td| + eps) ** alpha (the last of a repeated slot)
            idx = batch["index"].numpy()
            td = batch["td_error"].detach().reshape(-1).numpy().astype(np.float64)
            last = {s: td[i] for i, s in enumerate(idx)}
            leaves = rb.buffer.leaves(np.array(list(last)))
            np.testing.assert_allclose(leaves, (np.array(list(last.values())) + 1e-8) ** 0.6, rtol=1e-6)
    assert updates == 6 and len(rb) == 96 and rb.write_count == 96
    env.close()


def test_n_step_returns_and_windows(tmp_path):
    td = stream(40)
    rb = PrioritizedReplayBuffer(capacity=64, frame_stack=4, n_step=3, gamma=0.5, batch_size=64, seed=3)
    rb.extend(td)
    s = rb.sample()
    assert s["steps_to_next_obs"].shape == (64, 1) and s["steps_to_next_obs"].dtype == torch.int64
    for i, slot in enumerate(s["index"].tolist()):
        g, ret, m = slot, 0.0, 0
        while True:  # the window: up to 3 steps, never past an episode end
            ret += 0.5 ** m * float(td["next", "reward"][g])
            m += 1
            if m == 3 or bool(td["next", "done"][g]):
                break
            g += 1
        assert s["next", "reward"][i].item() == pytest.approx(ret)
        assert torch.equal(s["next", "pixels"][i], td["next", "pixels"][g])
        assert torch.equal(s["next", "terminated"][i], td["next", "terminated"][g])
        assert torch.equal(s["next", "step_count"][i], td["next", "step_count"][g])
        assert torch.equal(s["pixels"][i], td["pixels"][slot])
        if not bool(td["next", "terminated"][g]):
            assert s["steps_to_next_obs"][i].item() == m


def _draws(rb, n=3):
    out = []
    for _ in range(n):
        s = rb.sample()
        rb.update_priority(s["index"], torch.rand(len(s), generator=torch.Generator().manual_seed(len(out))))
        out.append(s)
    return out


def _same_draws(a, b):
    for x, y in zip(a, b):
        assert set(x.keys(True, True)) == set(y.keys(True, True))
        for key in x.keys(True, True):
            assert torch.equal(x[key], y[key]), key


def test_dumps_and_loads_resume_exactly(tmp_path):
    rb = PrioritizedReplayBuffer(capacity=100, frame_stack=4, batch_size=8, seed=5)
    rb.extend(stream(60))
    _draws(rb, 2)
    snap = tmp_path / "dump"
    snap.mkdir()  # TorchRL's dumps takes a folder that exists (a TemporaryDirectory): fine when empty
    rb.dumps(snap)
    manifest = json.loads(next(snap.rglob("manifest.json")).read_text())
    assert manifest and not list(snap.rglob("*.pkl")) and not list(snap.rglob("*.pt"))  # no pickle
    again = PrioritizedReplayBuffer(capacity=100, frame_stack=4, batch_size=8, seed=99)
    again.loads(snap)
    assert len(again) == len(rb) and again.write_count == rb.write_count
    _same_draws(_draws(rb), _draws(again))


def test_mode_resume_on_a_memmap_path(tmp_path):
    kw = dict(storage=LazyMemmapStorage(100, scratch_dir=tmp_path / "replay"), frame_stack=4, batch_size=8, seed=2)
    twin = PrioritizedReplayBuffer(capacity=100, frame_stack=4, batch_size=8, seed=2)
    rb = PrioritizedReplayBuffer(**kw)
    for b in (rb, twin):
        b.extend(stream(50))
        _draws(b, 2)
    rb.close()
    back = PrioritizedReplayBuffer(**kw, mode="resume", continue_episodes=True)  # opened here: no extend first
    assert len(back) == 50 and back.write_count == 50
    _same_draws(_draws(back), _draws(twin))
    back.extend(stream(10, start=50))
    twin.extend(stream(10, start=50))
    _same_draws(_draws(back), _draws(twin))


CHILD = r"""
import sys, torch
from bigper.integrations.torchrl import PrioritizedReplayBuffer
from tests.integrations._torchrl_data import stream
from torchrl.data import LazyMemmapStorage
rb = PrioritizedReplayBuffer(storage=LazyMemmapStorage(200, scratch_dir=sys.argv[1]), frame_stack=4,
                             batch_size=8, seed=4)
rb.extend(stream(80))
for _ in range(3):
    s = rb.sample(); rb.update_priority(s["index"], torch.arange(8, dtype=torch.float32))
rb.dumps(sys.argv[2])
s = rb.sample()
print("after", " ".join(map(str, s["index"].tolist())), " ".join(f"{w:.9g}" for w in s["priority_weight"].tolist()),
      flush=True)
i = 80
while True:  # writing and sampling until the kill
    rb.extend(stream(10, start=i)); i += 10
    s = rb.sample(); rb.update_priority(s["index"], torch.rand(8))
"""


def test_exact_resume_after_kill_9(tmp_path):
    with Child(CHILD, tmp_path / "live", tmp_path / "snap") as child:
        said = child.said("after").split()
        child.kill()
    idx, weights = [int(x) for x in said[1:9]], [float(x) for x in said[9:17]]
    rb = PrioritizedReplayBuffer(storage=LazyMemmapStorage(200, scratch_dir=tmp_path / "live"), frame_stack=4,
                                 batch_size=8, seed=4)
    rb.loads(tmp_path / "snap", rewind=True)  # the killed run wrote past its snapshot: asked for by name
    s = rb.sample()
    assert s["index"].tolist() == idx
    assert [float(f"{w:.9g}") for w in s["priority_weight"].tolist()] == weights
    assert len(rb) == 80
    written = stream(80)
    for i, slot in enumerate(idx):
        _same_row(s[i].exclude("index", "priority_weight"), written[slot])


def test_state_dict_round_trip_and_its_limits(tmp_path):
    rb = PrioritizedReplayBuffer(capacity=64, frame_stack=4, batch_size=8, seed=1)
    rb.extend(stream(30))
    _draws(rb, 1)
    sd = rb.state_dict()
    assert all(isinstance(v, torch.Tensor) for part in ("state", "data") for v in sd[part].values())
    other = PrioritizedReplayBuffer(capacity=64, frame_stack=4, batch_size=8, seed=8)
    other.load_state_dict(sd)
    _same_draws(_draws(rb), _draws(other))
    disk = PrioritizedReplayBuffer(storage=LazyMemmapStorage(64, scratch_dir=tmp_path / "d"), frame_stack=4)
    disk.extend(stream(5))
    with pytest.raises(InvalidArgumentError, match="dumps"):
        disk.state_dict()


def test_add_iterate_empty_transform_and_device_tier():
    rb = PrioritizedReplayBuffer(capacity=32, frame_stack=4, batch_size=4, device="cpu",
                                 transform=ExcludeTransform("collector"))
    td = stream(12)
    assert rb.add(td[0]) == 0
    assert rb.extend(td[1:]).tolist() == list(range(1, 12))
    s = next(iter(rb))
    assert "collector" not in s.keys() and s.batch_size == (4,)
    rb.update_tensordict_priority(s.set("td_error", torch.ones(4, 1)))
    rb.empty()
    assert len(rb) == 0 and rb.write_count == 0
    rb.extend(td)
    assert len(rb) == 12


def test_two_envs_are_two_streams():
    a, b = stream(14), stream(14, start=100)
    rb = PrioritizedReplayBuffer(capacity=64, frame_stack=4, num_envs=2, batch_size=64, n_step=2, seed=0)
    idx = rb.extend(torch.stack([a, b]))  # (envs, T), as a collector over a batched env gives it
    assert idx.shape == (2, 14)
    s = rb.sample()
    rows = {int(idx[e, t]): (e, t) for e in range(2) for t in range(14)}
    for i, slot in enumerate(s["index"].tolist()):
        e, t = rows[slot]
        src = (a, b)[e]
        assert torch.equal(s["pixels"][i], src["pixels"][t])
        g = t if bool(src["next", "done"][t]) else t + 1
        assert torch.equal(s["next", "pixels"][i], src["next", "pixels"][g])


def test_constructor_refusals_name_the_argument():
    with pytest.raises(InvalidArgumentError, match="capacity is needed"):
        PrioritizedReplayBuffer()
    with pytest.raises(InvalidArgumentError, match="reduction must be one of"):
        PrioritizedReplayBuffer(capacity=4, reduction="avg")
    with pytest.raises(InvalidArgumentError, match=r"capacity=5 differs from storage.max_size=4"):
        PrioritizedReplayBuffer(capacity=5, storage=LazyTensorStorage(4))
    with pytest.raises(InvalidArgumentError, match="batch_size must be a positive int"):
        PrioritizedReplayBuffer(capacity=4, batch_size=0)
    assert os.environ.get("BIGPER_NEVER_SET") is None


def test_an_older_state_dict_converts_with_the_offsets_its_references_need():
    """A state_dict an older bigper gave (frame references whole: ``obs_ref``,
    ``next_obs_ref``) loads converted, to wider offsets where a live
    transition's frames lie further apart than the config's uint8 hold (an
    older writer reused frames without a reach); a negative id in a live slot
    is refused, the buffer as it was."""
    from bigper.frames.store import frame_capacity

    rb = PrioritizedReplayBuffer(capacity=300, frame_stack=4, batch_size=8, seed=1)
    rb.extend(stream(300))
    sd = rb.state_dict()
    core, slots = rb.buffer, np.arange(300)
    obs, nxt = core._frames.refs("obs_ref", slots), core._frames.refs("next_obs_ref", slots)
    live = np.flatnonzero(sd["state"]["status"].numpy() == 1)
    fw = json.loads(sd["meta"])["frames"]["fw"]
    s, oldest = int(live[-1]), fw - frame_capacity(300, 4, 1)

    def older(o):
        out = dict(sd, data={k: v for k, v in sd["data"].items() if k not in ("frame_ref", "frame_off")})
        out["data"].update(obs_ref=torch.from_numpy(o), next_obs_ref=torch.from_numpy(nxt))
        return out
    same = PrioritizedReplayBuffer(capacity=300, frame_stack=4, batch_size=8, seed=8)
    same.load_state_dict(older(obs))
    assert same.buffer.storage.arrays["frame_off"].dtype == np.uint8
    _same_draws(_draws(rb), _draws(same))
    far = obs.copy()
    far[s, 0] = oldest  # a frame still stored, further back than uint8 offsets reach
    assert nxt[s].max() - oldest > 255
    wide = PrioritizedReplayBuffer(capacity=300, frame_stack=4, batch_size=8, seed=8)
    wide.load_state_dict(older(far))
    assert wide.buffer.storage.arrays["frame_off"].dtype == np.uint16
    assert wide.buffer._frames.refs("obs_ref", np.array([s])).tolist() == [far[s].tolist()]
    assert _draws(wide)
    bad = obs.copy()
    bad[s, 1] = -4
    with pytest.raises(InvalidArgumentError, match=f"slot {s}"):
        wide.load_state_dict(older(bad))
    assert wide.buffer._frames.refs("obs_ref", np.array([s])).tolist() == [far[s].tolist()]
