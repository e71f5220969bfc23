"""A real ALE game, through Gymnasium's Atari wrappers, into a frame-stacked
n-step buffer of every storage; every sampled field is checked against a
naive copy of every transition.

The games are recorded once per module (random actions, seeded) and then fed
to each storage. Pong runs with a short ``TimeLimit`` (truncations) and with
episodes reset by hand, some flagged ``truncated`` and some with no end flag
at all (the next ``obs`` then does not continue the previous ``next_obs``:
the buffer must still return exactly what was added). Breakout with
``terminal_on_life_loss`` supplies frequent terminations. A small capacity
makes the ring and the frame ring wrap several times.
"""

from __future__ import annotations

import numpy as np
import pytest

gym = pytest.importorskip("gymnasium")
ale_py = pytest.importorskip("ale_py")

import bigper  # noqa: E402

from tests.frames.test_frames import naive_expectation, window_complete  # noqa: E402

gym.register_envs(ale_py)

K_STACK, N_STEP, GAMMA = 4, 3, 0.99
CAPACITY = 97  # not a power of two; wraps about four times
STEPS = 400
FIELDS = {"obs": ((K_STACK, 84, 84), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}
GAMES = {
    # name: (env id, TimeLimit steps, AtariPreprocessing extras, P(hand reset), P(it is flagged))
    "pong": ("ALE/Pong-v5", 100, {}, 0.02, 0.5),
    "breakout": ("ALE/Breakout-v5", 70, {"terminal_on_life_loss": True}, 0.0, 0.0),
}


def make_env(env_id: str, max_steps: int, **pre):
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation, TimeLimit

    env = gym.make(env_id, frameskip=1, repeat_action_probability=0.0)
    env = AtariPreprocessing(env, frame_skip=4, screen_size=84, noop_max=30, **pre)
    env = TimeLimit(env, max_episode_steps=max_steps)  # counts agent steps, not ALE frames
    return FrameStackObservation(env, K_STACK)


def record(game: str, seed: int = 0) -> list[dict]:
    """``STEPS`` transitions of ``game`` in the keys ``naive_expectation`` reads."""
    env_id, max_steps, pre, p_hand, p_flag = GAMES[game]
    env = make_env(env_id, max_steps, **pre)
    rng, noise = np.random.default_rng(seed), np.random.default_rng(seed + 1000)
    obs, _ = env.reset(seed=seed)
    steps = []
    for _ in range(STEPS):
        action = int(rng.integers(env.action_space.n))
        nxt, reward, term, trunc, _ = env.step(action)
        hand = not (term or trunc) and rng.random() < p_hand
        if hand and rng.random() < p_flag:
            trunc = True  # the loop cut the episode and says so
        # The game's rewards are sparse (a point every ~100 steps); noise on top
        # makes every n-step sum depend on the order and discount of its terms.
        shaped = np.float32(reward + 0.1 * noise.standard_normal())
        steps.append(dict(obs=np.array(obs), next_obs=np.array(nxt), action=action,
                          reward=shaped, game_reward=float(reward), term=bool(term),
                          trunc=bool(trunc), unflagged_reset=hand and not trunc))
        obs = env.reset()[0] if (term or trunc or hand) else nxt
    env.close()
    return steps


@pytest.fixture(scope="module")
def games() -> dict[str, list[dict]]:
    return {game: record(game, seed=i) for i, game in enumerate(GAMES)}


def test_recordings_cover_the_cases(games):
    """The recordings hold what the buffer test relies on: every kind of end,
    unflagged resets, non-zero rewards and real (non-blank) frames."""
    pong, breakout = games["pong"], games["breakout"]
    assert sum(s["trunc"] for s in pong) >= 4
    assert sum(s["unflagged_reset"] for s in pong) >= 2
    assert sum(s["term"] for s in breakout) >= 3
    assert any(s["game_reward"] != 0 for s in pong) and any(s["game_reward"] != 0 for s in breakout)
    for steps in games.values():
        assert all(s["obs"].shape == (K_STACK, 84, 84) and s["obs"].dtype == np.uint8 for s in steps)
        assert len({s["obs"][-1].tobytes() for s in steps}) > STEPS // 2
        # Gymnasium pads a reset stack with the first frame: the frame stack sees repeats.
        assert any((s["obs"][0] == s["obs"][1]).all() for s in steps)


def check(batch, added: list[dict], capacity: int) -> int:
    """Compare every row of ``batch`` with the naive reference; return the rows checked."""
    count = len(added)
    for i in range(batch.size):
        g = int(batch.generations[i])
        assert count - capacity <= g < count, f"row {i}: transition {g} is no longer held ({count} added)"
        assert int(batch.indices[i]) == g % capacity
        assert window_complete(added, g, N_STEP, 1), f"row {i}: transition {g} sampled before its window completed"
        ret, nxt, term, disc = naive_expectation(added, g, N_STEP, 1, GAMMA)
        a = added[g]
        np.testing.assert_array_equal(batch["obs"][i], a["obs"], err_msg=f"obs of transition {g}")
        np.testing.assert_array_equal(batch["next_obs"][i], nxt, err_msg=f"next_obs of transition {g}")
        assert batch["action"][i] == a["action"], f"action of transition {g}"
        np.testing.assert_allclose(batch["reward"][i], ret, rtol=1e-6, atol=1e-6,
                                   err_msg=f"n-step reward of transition {g}")
        assert bool(batch["terminated"][i]) == term, f"terminated of transition {g}"
        np.testing.assert_allclose(batch["discount"][i], disc, rtol=1e-6, err_msg=f"discount of transition {g}")
    w = np.asarray(batch.weights)
    assert np.all(np.isfinite(w)) and w.min() > 0 and w.max() <= 1 + 1e-6
    return batch.size


def check_all_sampleable(buf, added: list[dict], capacity: int) -> int:
    """Draw each sampleable transition once (a target in the middle of its
    leaf) and check them all; also, nothing unheld or incomplete is sampleable."""
    leaves = np.asarray(buf.prioritization.tree.leaves, dtype=np.float64)[:capacity]
    live = np.flatnonzero(leaves > 0)
    count = len(added)
    held = {g % capacity for g in range(max(0, count - capacity), count)
            if window_complete(added, g, N_STEP, 1)}
    assert set(live.tolist()) <= held
    if live.size == 0:
        return 0
    # Transitions expire only when their frames were overwritten: with one new
    # frame a step (two at an episode start) that is a few per wrap at most.
    assert live.size >= len(held) - capacity // 4, f"{live.size} sampleable of {len(held)} held"
    targets = np.cumsum(leaves)[live] - leaves[live] / 2
    return check(buf.shard.sample_at(targets, beta=0.4), added, capacity)


@pytest.mark.parametrize("game", list(GAMES))
@pytest.mark.parametrize("storage", ["memory", "memmap", "hdf5"])
def test_real_atari_matches_naive_buffer(games, game, storage, tmp_path):
    steps = games[game]
    kw = {} if storage == "memory" else {"path": tmp_path / ("buf.h5" if storage == "hdf5" else "buf")}
    buf = bigper.PrioritizedReplayBuffer(CAPACITY, FIELDS, frame_stack=K_STACK, n_step=N_STEP,
                                         gamma=GAMMA, storage=storage, seed=3, **kw)
    rng = np.random.default_rng(7)
    added: list[dict] = []
    checked = 0
    for t, s in enumerate(steps):
        buf.add(obs=s["obs"], action=s["action"], reward=s["reward"], next_obs=s["next_obs"],
                terminated=s["term"], truncated=s["trunc"])
        added.append(s)
        if t % 20 == 19 and buf.total_priority > 0:
            batch = buf.sample(32)
            checked += check(batch, added, CAPACITY)
            # Uneven priorities, so later draws are not uniform over the ring.
            buf.update_priorities(batch, rng.exponential(1.0, batch.size))
        if t % 60 == 59:
            checked += check_all_sampleable(buf, added, CAPACITY)
    checked += check_all_sampleable(buf, added, CAPACITY)
    assert len(buf) == CAPACITY
    assert checked > 1000
    buf.close()

    if storage != "memory":  # reopening the directory resumes with the same contents
        buf = bigper.PrioritizedReplayBuffer(CAPACITY, FIELDS, frame_stack=K_STACK, n_step=N_STEP,
                                             gamma=GAMMA, storage=storage, seed=3, mode="resume",
                                             continue_episodes=True, **kw)  # the naive reference's episodes go on
        check_all_sampleable(buf, added, CAPACITY)
        check(buf.sample(32), added, CAPACITY)
        buf.close()
