"""A small R2D2: a recurrent Q-network learning from prioritized sequences.

::

    python -m bigper.examples.r2d2                 # CartPole with the velocities hidden: about a minute
    python -m bigper.examples.r2d2 --steps 15000   # long enough to learn it (a few minutes on 2 cores)
    python -m bigper.examples.r2d2 --smoke         # a few seconds: CartPole, then Atari frames on memmap
    python -m bigper.examples.r2d2 --check         # 3 seeds, prioritized vs uniform sequences

It prints its progress (steps, seconds, episodes, mean return, loss) every
``--log-every`` steps and its returns at the end. Every run starts afresh (the
buffer is in memory; ``--smoke`` puts its memmap buffer in a temporary folder
it removes), so it runs again as it ran.

The task is partially observed: CartPole-v1 shows only the cart position and
the pole angle, so the agent must infer the velocities from what it has seen
(an LSTM's job). Every step stores the actor's recurrent state ``(h, c)``
from before it; a sampled sequence starts its LSTM from the stored state of
its first real step (R2D2's "stored state"), runs the ``burn_in`` steps
without gradient, then learns on the ``length`` steps after them with
double-Q targets inside the sequence. Per-step TD errors go back to
``update_priorities`` as a ``(B, T)`` array, which bigper reduces with
``eta * max + (1 - eta) * mean`` over the real learning steps.

Padding (before an episode's start in the burn-in, after its end) is zeros
with ``mask`` False: the LSTM state is reset to the stored one at each row's
first real step, and padded steps never enter the loss.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import bigper

HIDDEN = 64


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("this example needs torch: pip install -e '.[torch]' in a bigper checkout") from e
    return torch


def recurrent_q(obs_shape, n_actions, conv=False):
    """An LSTM Q-network over one step's observation (a vector, or a uint8 frame stack)."""
    torch = _torch()
    from torch import nn

    class RQ(nn.Module):
        def __init__(self):
            super().__init__()
            if conv:
                self.enc = nn.Sequential(nn.Conv2d(obs_shape[0], 8, 8, stride=8), nn.ReLU(), nn.Flatten(),
                                         nn.LazyLinear(HIDDEN), nn.ReLU())
            else:
                self.enc = nn.Sequential(nn.Linear(obs_shape[0], HIDDEN), nn.ReLU())
            self.cell = nn.LSTMCell(HIDDEN, HIDDEN)
            self.head = nn.Linear(HIDDEN, n_actions)

        def step(self, obs, state):
            x = obs.to(torch.float32) / (255.0 if conv else 1.0)
            h, c = self.cell(self.enc(x), state)
            return self.head(h), (h, c)

        def unroll(self, obs, h0, c0, mask):
            """Q-values (B, T, A) over a sampled sequence; the state restarts from
            the stored ``(h0, c0)`` (B, T, H) at each row's first real step."""
            B, T = mask.shape
            h, c = h0[:, 0], c0[:, 0]
            prev = torch.zeros(B, dtype=torch.bool)
            out = []
            for t in range(T):
                first = (mask[:, t] & ~prev)[:, None]
                h, c = torch.where(first, h0[:, t], h), torch.where(first, c0[:, t], c)
                q, (h, c) = self.step(obs[:, t], (h, c))
                out.append(q)
                prev = prev | mask[:, t]
            return torch.stack(out, 1)

    return RQ()


def td_errors(online, target, batch, gamma):
    """Per-step double-Q TD errors (B, T) of the learning part, and the loss.

    A step is trained when it is real, after the burn-in, and either ends its
    episode or has its next step in the sequence to bootstrap from."""
    torch = _torch()
    t = {k: torch.as_tensor(np.ascontiguousarray(v)) for k, v in batch.items()}
    mask = torch.as_tensor(batch.mask)
    B, T = mask.shape
    bi = batch.burn_in
    with torch.no_grad():
        q_next_online = online.unroll(t["obs"], t["h"], t["c"], mask)
        q_next_target = target.unroll(t["obs"], t["h"], t["c"], mask)
    q = online.unroll(t["obs"], t["h"], t["c"], mask)
    q_taken = q.gather(2, t["action"][..., None]).squeeze(2)
    nxt_a = q_next_online[:, 1:].argmax(2, keepdim=True)
    boot = q_next_target[:, 1:].gather(2, nxt_a).squeeze(2)
    boot = torch.cat([boot, torch.zeros(B, 1)], 1)
    has_next = torch.cat([mask[:, 1:], torch.zeros(B, 1, dtype=torch.bool)], 1)
    term = t["terminated"]
    y = t["reward"] + gamma * boot * (~term).to(torch.float32)
    train = mask & (term | has_next)
    train[:, :bi] = False
    err = (y - q_taken) * train.to(torch.float32)
    w = torch.as_tensor(batch.weights)[:, None]
    loss = (w * torch.nn.functional.smooth_l1_loss(q_taken, y.detach(), reduction="none")
            * train.to(torch.float32)).sum() / train.sum().clamp(min=1)
    td = err.detach().abs().numpy().astype(np.float64)
    td[~batch.mask] = np.nan  # padding: bigper ignores it
    return td, loss


class HiddenVelocity:
    """CartPole-v1 observing only (cart position, pole angle)."""

    def __init__(self, seed):
        import gymnasium as gym

        self.env = gym.make("CartPole-v1")
        self.seed = seed
        self.n_actions = 2
        self.shape = (2,)

    def reset(self):
        o, _ = self.env.reset(seed=self.seed)
        self.seed += 1
        return o[[0, 2]].astype(np.float32)

    def step(self, a):
        o, r, term, trunc, _ = self.env.step(int(a))
        return o[[0, 2]].astype(np.float32), float(r), bool(term), bool(trunc)


class AtariEnv:
    """Pong frames (4, 84, 84) uint8 through the examples' Atari wrappers."""

    def __init__(self, seed):
        from ._atari import make_env

        self.env = make_env("Pong", seed=seed)
        self.seed = seed
        self.n_actions = int(self.env.action_space.n)
        self.shape = (4, 84, 84)

    def reset(self):
        o, _ = self.env.reset(seed=self.seed)
        self.seed += 1
        return np.asarray(o)

    def step(self, a):
        o, r, term, trunc, _ = self.env.step(int(a))
        return np.asarray(o), float(r), bool(term), bool(trunc)


def train(env, *, steps, seed, alpha=0.9, capacity=50_000, seq=None, storage="memory", path=None,
          batch_size=32, train_every=1, warmup=500, target_every=250, gamma=0.99, lr=1e-3,
          eps_steps=5_000, log=print, log_every=500, conv=False):
    """Run the agent for ``steps`` env steps; returns the episode returns.
    ``alpha=0``: uniform sequence sampling (every item's leaf is 1). ``log``
    (a print function, or None) gets a progress line every ``log_every`` steps."""
    torch = _torch()
    t0 = time.perf_counter()
    loss = None
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    seq = seq or bigper.Sequence(8, burn_in=4, period=4)
    online = recurrent_q(env.shape, env.n_actions, conv)
    target = recurrent_q(env.shape, env.n_actions, conv)
    obs_dt = np.uint8 if conv else np.float32
    fields = {"obs": (env.shape, obs_dt), "action": ((), np.int64), "reward": ((), np.float32),
              "h": ((HIDDEN,), np.float32), "c": ((HIDDEN,), np.float32)}
    buf = bigper.PrioritizedReplayBuffer(
        capacity, fields, frame_stack=4 if conv else None, storage=storage, path=path, alpha=alpha,
        beta=bigper.LinearSchedule(0.6, 1.0, max(steps // train_every, 1)), sequence=seq, seed=seed)
    with torch.no_grad():  # materialize the lazy layer before copying weights
        online.step(torch.zeros((1, *env.shape), dtype=torch.uint8 if conv else torch.float32), None)
        target.step(torch.zeros((1, *env.shape), dtype=torch.uint8 if conv else torch.float32), None)
    target.load_state_dict(online.state_dict())
    opt = torch.optim.Adam(online.parameters(), lr=lr)
    returns, ret = [], 0.0
    o = env.reset()
    h = c = torch.zeros(1, HIDDEN)
    for step in range(steps):
        eps = max(0.05, 1.0 - step / eps_steps)
        with torch.no_grad():
            q, (h2, c2) = online.step(torch.as_tensor(o)[None], (h, c))
        a = int(rng.integers(env.n_actions)) if rng.random() < eps else int(q.argmax())
        o2, r, term, trunc = env.step(a)
        buf.add(obs=o, action=a, reward=r, next_obs=o2, h=h[0].numpy(), c=c[0].numpy(),
                terminated=term, truncated=trunc)
        ret += r
        o, h, c = o2, h2, c2
        if term or trunc:
            returns.append(ret)
            ret = 0.0
            o = env.reset()
            h = c = torch.zeros(1, HIDDEN)
        if step >= warmup and step % train_every == 0 and buf.total_priority > 0:
            batch = buf.sample(batch_size)
            td, loss = td_errors(online, target, batch, gamma)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(online.parameters(), 10.0)
            opt.step()
            buf.update_priorities(batch, td)
        if step % target_every == 0:
            target.load_state_dict(online.state_dict())
        if log and (step + 1) % log_every == 0:
            mean = f"{np.mean(returns[-10:]):.1f}" if returns else "-"
            log(f"step {step + 1:>6} ({time.perf_counter() - t0:.0f} s): {len(returns)} episodes, mean return of "
                f"the last 10 {mean}, loss {'-' if loss is None else f'{float(loss.detach()):.4f}'}", flush=True)
    buf.close()
    return returns


def episodes_to(returns, target, window=10):
    for i in range(window, len(returns) + 1):
        if np.mean(returns[i - window:i]) >= target:
            return i
    return None


def check(seeds, steps, target, variants=("prioritized", "uniform")):
    """Prioritized vs uniform sequence sampling on the hidden-velocity task."""
    rows = []
    for name, alpha in (("prioritized", 0.9), ("uniform", 0.0)):
        if name not in variants:
            continue
        for s in seeds:
            t0 = time.perf_counter()
            rets = train(HiddenVelocity(s), steps=steps, seed=s, alpha=alpha, log=None)
            n = episodes_to(rets, target)
            rows.append((name, s, n, float(np.mean(rets[-10:])), time.perf_counter() - t0))
            print(f"{name:<12} seed {s}: episodes to a mean of {target:g} over 10: {n}; "
                  f"last 10 mean {rows[-1][3]:.1f}; {rows[-1][4]:.0f} s", flush=True)
    for name in variants:
        got = [r for r in rows if r[0] == name]
        reached = [r[2] for r in got if r[2] is not None]
        print(f"{name:<12} reached {len(reached)}/{len(got)}; episodes "
              f"{sorted(reached)}; final means {[round(r[3]) for r in got]}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="a few seconds: CartPole, then Atari on memmap")
    p.add_argument("--check", action="store_true", help="3 seeds, prioritized vs uniform")
    p.add_argument("--steps", type=int, default=2_500,
                   help="env steps (default 2,500: about a minute on 2 cores; 15000 learns the task)")
    p.add_argument("--log-every", type=int, default=500, help="steps between progress lines (500)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1: this network is too small to gain from more; they contend)")
    p.add_argument("--variants", nargs="+", default=["prioritized", "uniform"],
                   choices=["prioritized", "uniform"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--target", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1 or args.log_every < 1 or args.threads < 1:
        p.error(f"--steps, --log-every and --threads must be >= 1, got {args.steps}, {args.log_every}, "
                f"{args.threads}")
    # A tiny network is launch-bound: more intra-op threads only contend for the cores
    # (4x slower on a busy 2-core machine, measured).
    _torch().set_num_threads(args.threads)
    if args.check:
        check(args.seeds, args.steps, args.target, tuple(args.variants))
        return 0
    if not args.smoke:
        t0 = time.perf_counter()
        print(f"R2D2 on CartPole-v1 with the velocities hidden: {args.steps:,} steps, sequences of "
              f"4 burn-in + 8, progress every {args.log_every:,} steps", flush=True)
        rets = train(HiddenVelocity(args.seed), steps=args.steps, seed=args.seed, log_every=args.log_every)
        mean = f"{np.mean(rets[-10:]):.1f}" if rets else "-"
        print(f"done: {args.steps} steps in {time.perf_counter() - t0:.0f} s, {len(rets)} episodes; "
              f"mean return of the last 10 {mean}")
        return 0
    rets = train(HiddenVelocity(0), steps=600, seed=0, warmup=100, train_every=4, capacity=2000, log=None)
    print(f"cartpole smoke: {len(rets)} episodes, {600} steps, sequences of 4 burn-in + 8")
    tmp = Path(tempfile.mkdtemp(prefix="bigper-r2d2-"))
    try:
        try:
            env = AtariEnv(0)
        except ImportError as e:
            print(f"atari smoke skipped: {e}")
            return 0
        rets = train(env, steps=300, seed=0, warmup=100, capacity=1000, storage="memmap", path=tmp / "replay",
                     batch_size=4, train_every=4, seq=bigper.Sequence(8, burn_in=4, period=4), conv=True,
                     log=None)
        print(f"atari smoke: 300 Pong steps on memmap, frames stored once; {len(rets)} episodes ended")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
