"""Workload "tree", the libraries: one adapter per library, filled and ready.

Every library gets the same 2**20 transitions (obs (4,) f32, action i64,
reward f32, next_obs (4,) f32, terminated bool) through its bulk add, then
the same random priorities |N(0,1)| + 0.01 on all slots through its bulk
priority update. A round is: sample B transitions with their IS weights and
data, then update those B priorities with fresh values (precomputed, in each
library's native type, so no round pays for random numbers or conversions
the user would not do). The timing and the table are in main.py (beside this file).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from benchkit import PeerUnavailable, dist_version, import_bigper

TREE_CAPACITY = 2**20
TREE_ALPHA = 0.6
TREE_BETA = 0.4
TREE_BATCHES = (32, 256)
TREE_POOL = 64  # precomputed priority arrays per batch size, used in turn


@dataclass
class TreeSubject:
    """One library, filled and ready: the calls the tree workload times.

    ``make_round(B)`` returns ``round(i)``: one sample of B plus one update of
    the sampled priorities (the i-th precomputed array). ``bulk_update(p)``
    sets all ``capacity`` priorities at once. ``probe(B)`` samples once and
    returns ``(indices, weights)`` as numpy arrays, for the sanity checks.
    """

    name: str
    version: str | None
    api: str
    fill_s: float
    length: int
    make_round: Callable[[int], Callable[[int], None]]
    bulk_update: Callable[[np.ndarray], None]
    probe: Callable[[int], tuple[np.ndarray, np.ndarray]]
    notes: list[str] = field(default_factory=list)
    law: str = "proportional"  # which distribution the sanity check expects
    buffer: object = None      # bigper's buffer, for the extra rows (rank re-sort)


def tree_data(capacity: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((capacity, 4), dtype=np.float32)
    terminated = rng.random(capacity) < 0.01
    return {
        "obs": obs,
        "action": rng.integers(0, 18, capacity, dtype=np.int64),
        "reward": rng.standard_normal(capacity, dtype=np.float32),
        "next_obs": obs + np.float32(0.01),
        "terminated": terminated,
        "truncated": np.zeros(capacity, dtype=bool),
        "done": terminated.copy(),
    }


def tree_priorities(n: int, seed: int) -> np.ndarray:
    return np.abs(np.random.default_rng(seed).standard_normal(n)) + 0.01


def _td_pool(batch: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 + batch)
    return [np.abs(rng.standard_normal(batch)) + 0.01 for _ in range(TREE_POOL)]


# -- bigper -------------------------------------------------------------------


def _tree_bigper(data: dict[str, np.ndarray], p0: np.ndarray, prioritization: str = "proportional") -> TreeSubject:
    bigper = import_bigper()
    cap = len(p0)
    buf = bigper.PrioritizedReplayBuffer(
        capacity=cap,
        fields={"obs": ((4,), np.float32), "action": ((), np.int64), "reward": ((), np.float32)},
        alpha=TREE_ALPHA,
        beta=TREE_BETA,
        prioritization=prioritization,
        seed=0,
    )
    t0 = time.perf_counter()
    buf.extend(
        {k: data[k] for k in ("obs", "action", "reward", "next_obs", "terminated")},
        priorities=None,
    )
    fill_s = time.perf_counter() - t0
    all_idx = np.arange(cap)
    buf.update_priorities(all_idx, p0)

    def make_round(batch: int) -> Callable[[int], None]:
        pool = _td_pool(batch)

        def rnd(i: int) -> None:
            b = buf.sample(batch)
            buf.update_priorities(b, pool[i % TREE_POOL])

        return rnd

    def probe(batch: int) -> tuple[np.ndarray, np.ndarray]:
        b = buf.sample(batch)
        return np.array(b.indices), np.array(b.weights)

    rank = prioritization == "rank"
    return TreeSubject(
        name="bigper-rank" if rank else "bigper",
        version=getattr(bigper, "__version__", None) or dist_version("bigper") or "checkout",
        api="PrioritizedReplayBuffer.sample / update_priorities(batch, td)"
            + (", prioritization='rank'" if rank else ""),
        fill_s=fill_s,
        length=len(buf),
        make_round=make_round,
        bulk_update=lambda p: buf.update_priorities(all_idx, p),
        probe=probe,
        law="rank" if rank else "proportional",
        buffer=buf,
    )


def _tree_bigper_rank(data: dict[str, np.ndarray], p0: np.ndarray) -> TreeSubject:
    """bigper with ``prioritization="rank"``: the same round; its full re-sort is timed apart."""
    return _tree_bigper(data, p0, prioritization="rank")


# -- cpprb --------------------------------------------------------------------


def _tree_cpprb(data: dict[str, np.ndarray], p0: np.ndarray) -> TreeSubject:
    import cpprb

    cap = len(p0)
    buf = cpprb.PrioritizedReplayBuffer(
        cap,
        {
            "obs": {"shape": 4, "dtype": np.float32},
            "action": {"dtype": np.int64},
            "reward": {"dtype": np.float32},
            "next_obs": {"shape": 4, "dtype": np.float32},
            "done": {"dtype": np.bool_},
        },
        alpha=TREE_ALPHA,
    )
    t0 = time.perf_counter()
    buf.add(
        obs=data["obs"],
        action=data["action"],
        reward=data["reward"],
        next_obs=data["next_obs"],
        done=data["terminated"],
    )
    fill_s = time.perf_counter() - t0
    all_idx = np.arange(cap)
    buf.update_priorities(all_idx, p0)

    def make_round(batch: int) -> Callable[[int], None]:
        pool = _td_pool(batch)

        def rnd(i: int) -> None:
            s = buf.sample(batch, beta=TREE_BETA)
            buf.update_priorities(s["indexes"], pool[i % TREE_POOL])

        return rnd

    def probe(batch: int) -> tuple[np.ndarray, np.ndarray]:
        s = buf.sample(batch, beta=TREE_BETA)
        # copies: cpprb reuses the "indexes"/"weights" arrays on the next sample()
        return np.array(s["indexes"]), np.array(s["weights"])

    return TreeSubject(
        name="cpprb",
        version=dist_version("cpprb"),
        api="PrioritizedReplayBuffer.sample(B, beta) / update_priorities(indexes, p)",
        fill_s=fill_s,
        length=buf.get_stored_size(),
        make_round=make_round,
        bulk_update=lambda p: buf.update_priorities(all_idx, p),
        probe=probe,
    )


# -- Tianshou -----------------------------------------------------------------


def _tree_tianshou(data: dict[str, np.ndarray], p0: np.ndarray) -> TreeSubject:
    from tianshou.data import Batch, PrioritizedReplayBuffer

    cap = len(p0)
    np.random.seed(0)  # Tianshou's prioritized sampling draws from the global RNG
    buf = PrioritizedReplayBuffer(cap, alpha=TREE_ALPHA, beta=TREE_BETA)  # compiles its kernels, ~4 s
    t0 = time.perf_counter()
    # Adding 2**20 single steps takes minutes. set_batch is Tianshou's own bulk
    # path (ReplayBuffer.from_data uses it): hand over full-size arrays, then
    # set the fill state and the new-transition weights that add() would set.
    # set_batch keeps the arrays it is given; copy them, as add() would.
    buf.set_batch(
        Batch(
            obs=data["obs"].copy(),
            act=data["action"].copy(),
            rew=data["reward"].copy(),
            terminated=data["terminated"].copy(),
            truncated=data["truncated"].copy(),
            done=data["done"].copy(),
            obs_next=data["next_obs"].copy(),
        )
    )
    buf._size = cap
    buf._insertion_idx = 0
    buf.last_index[0] = cap - 1
    all_idx = np.arange(cap)
    buf.init_weight(all_idx)
    fill_s = time.perf_counter() - t0
    buf.update_weight(all_idx, p0)

    def make_round(batch: int) -> Callable[[int], None]:
        pool = _td_pool(batch)

        def rnd(i: int) -> None:
            b, idx = buf.sample(batch)
            buf.update_weight(idx, pool[i % TREE_POOL])

        return rnd

    def probe(batch: int) -> tuple[np.ndarray, np.ndarray]:
        b, idx = buf.sample(batch)
        return np.array(idx), np.array(b.weight)

    return TreeSubject(
        name="tianshou",
        version=dist_version("tianshou"),
        api="PrioritizedReplayBuffer.sample(B) / update_weight(idx, p); filled by set_batch",
        fill_s=fill_s,
        length=len(buf),
        make_round=make_round,
        bulk_update=lambda p: buf.update_weight(all_idx, p),
        probe=probe,
        notes=["weights normalized by the batch max (weight_norm=True default)"],
    )


# -- TorchRL ------------------------------------------------------------------


def _tree_torchrl(data: dict[str, np.ndarray], p0: np.ndarray) -> TreeSubject:
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer

    try:  # the sum/min trees live in TorchRL's C++ extension, built against one torch
        import torchrl._torchrl  # noqa: F401
    except ImportError as exc:
        raise PeerUnavailable(f"torchrl._torchrl does not load with torch {torch.__version__}: {exc}") from exc

    cap = len(p0)
    torch.manual_seed(0)
    np.random.seed(0)  # PrioritizedSampler draws from np.random when no generator is set
    buf = TensorDictPrioritizedReplayBuffer(
        alpha=TREE_ALPHA, beta=TREE_BETA, storage=LazyTensorStorage(cap), priority_key="td_error"
    )
    t0 = time.perf_counter()
    td = TensorDict(
        {
            "obs": torch.from_numpy(data["obs"]),
            "action": torch.from_numpy(data["action"]),
            "reward": torch.from_numpy(data["reward"]),
            "next_obs": torch.from_numpy(data["next_obs"]),
            "terminated": torch.from_numpy(data["terminated"]),
        },
        batch_size=[cap],
    )
    buf.extend(td)
    fill_s = time.perf_counter() - t0
    all_idx = torch.arange(cap)
    buf.update_priority(all_idx, torch.from_numpy(p0))

    def make_round(batch: int) -> Callable[[int], None]:
        pool = [torch.from_numpy(p) for p in _td_pool(batch)]

        def rnd(i: int) -> None:
            s = buf.sample(batch)
            buf.update_priority(s["index"], pool[i % TREE_POOL])

        return rnd

    def probe(batch: int) -> tuple[np.ndarray, np.ndarray]:
        s = buf.sample(batch)
        return s["index"].numpy().copy(), s["priority_weight"].numpy().copy()

    return TreeSubject(
        name="torchrl",
        version=dist_version("torchrl"),
        api="TensorDictPrioritizedReplayBuffer(LazyTensorStorage).sample(B) / update_priority(index, p)",
        fill_s=fill_s,
        length=len(buf),
        make_round=make_round,
        bulk_update=lambda p: buf.update_priority(all_idx, torch.from_numpy(p)),
        probe=probe,
        notes=[f"torch threads {torch.get_num_threads()}"],
    )


TREE_ADAPTERS: dict[str, Callable[[dict[str, np.ndarray], np.ndarray], TreeSubject]] = {
    "bigper": _tree_bigper,
    "bigper-rank": _tree_bigper_rank,
    "cpprb": _tree_cpprb,
    "tianshou": _tree_tianshou,
    "torchrl": _tree_torchrl,
}

