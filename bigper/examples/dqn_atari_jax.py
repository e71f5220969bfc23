"""CleanRL's ``dqn_atari_jax.py`` with prioritized replay from bigper, in plain JAX.

::

    python -m bigper.examples.dqn_atari_jax --game Breakout --total-timesteps 10000000
    python -m bigper.examples.dqn_atari_jax --path runs/dqn-jax-breakout/replay   # the buffer on disk
    python -m bigper.examples.dqn_atari_jax --smoke      # a few hundred steps of Breakout on the CPU

The loop is CleanRL's (``global_step``, a linear epsilon schedule, a learner
step every ``--train-frequency`` steps after ``--learning-starts``, a soft
target update every ``--target-network-frequency``), the network and the
update are CleanRL's DQN (the Nature CNN, ``y = r + discount * max_a
Q_target(s', a)``, Adam), written with ``jax.lax`` and a few lines of Adam
instead of flax and optax, so the recipe needs JAX alone. What PER changes,
four lines::

    batch = rb.sample(args.batch_size)                 # beta advances once per call
    data = batch.to_jax(device)                        # jax.Arrays: shared on the host, one transfer to a GPU
    q_state, loss, td_abs = update(q_state, data)      # loss = mean(weights * td ** 2)
    rb.update_priorities(data, td_abs)                 # a GPU's td_abs is applied without blocking

``discount`` is bigper's (``gamma ** k``, 0 where the episode terminated), so
time limits still bootstrap. ``--path`` keeps the buffer on disk (memmap);
snapshots and resume are in ``dqn_atari``.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import bigper
from bigper.examples._atari import atari_fields, make_env


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bigper.examples.dqn_atari_jax", description=__doc__.split("\n")[0])
    p.add_argument("--game", default="Breakout")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--total-timesteps", type=int, default=10_000_000)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--buffer-size", type=int, default=1_000_000)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--tau", type=float, default=1.0, help="target network update rate")
    p.add_argument("--target-network-frequency", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--start-e", type=float, default=1.0)
    p.add_argument("--end-e", type=float, default=0.01)
    p.add_argument("--exploration-fraction", type=float, default=0.10)
    p.add_argument("--learning-starts", type=int, default=80_000)
    p.add_argument("--train-frequency", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6, help="PER: priority exponent")
    p.add_argument("--beta0", type=float, default=0.4, help="PER: IS exponent, annealed to 1 over training")
    p.add_argument("--path", help="keep the buffer on disk (memmap) at this new directory")
    p.add_argument("--net", choices=("nature", "tiny"), default="nature")
    p.add_argument("--log-every", type=int, default=10_000)
    p.add_argument("--smoke", action="store_true", help="a short CPU run of Breakout (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.total_timesteps, args.buffer_size, args.learning_starts = 400, 1_000, 150
        args.target_network_frequency, args.net, args.log_every = 50, "tiny", 100
        args.learning_rate = 1e-3
    return args


# -- the Q-network: CleanRL's Nature CNN (or a tiny one for smoke runs), in jax.lax --------------

def _conv(x, w, b, stride):  # x (B, C, H, W), w (O, C, kh, kw)
    y = jax.lax.conv_general_dilated(x, w, (stride, stride), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return y + b[None, :, None, None]


def _layers(net: str, n_actions: int) -> list:
    """``[(kind, shape of w, stride)]`` of the network."""
    if net == "tiny":  # every other pixel (42x42), one conv, 64 units: a fast CPU smoke run
        return [("conv", (16, 4, 4, 4), 4), ("dense", (16 * 10 * 10, 64), 0), ("dense", (64, n_actions), 0)]
    return [("conv", (32, 4, 8, 8), 4), ("conv", (64, 32, 4, 4), 2), ("conv", (64, 64, 3, 3), 1),
            ("dense", (64 * 7 * 7, 512), 0), ("dense", (512, n_actions), 0)]


def init_params(key, net: str, n_actions: int) -> list:
    params = []
    for kind, shape, _ in _layers(net, n_actions):
        key, sub = jax.random.split(key)
        fan_in = int(np.prod(shape[1:])) if kind == "conv" else shape[0]
        w = jax.random.normal(sub, shape, jnp.float32) * jnp.sqrt(2.0 / fan_in)  # He init
        params.append({"w": w, "b": jnp.zeros(shape[0] if kind == "conv" else shape[1], jnp.float32)})
    return params


def q_values(params, obs, net: str):
    """Q-values ``(B, actions)`` of uint8 stacks ``(B, 4, 84, 84)``."""
    if net == "tiny":
        obs = obs[..., ::2, ::2]
    x = obs.astype(jnp.float32) / 255.0
    layers = _layers(net, params[-1]["w"].shape[1])
    for i, ((kind, _, stride), p) in enumerate(zip(layers, params)):
        if kind == "conv":
            x = jax.nn.relu(_conv(x, p["w"], p["b"], stride))
        else:
            x = x.reshape(x.shape[0], -1) @ p["w"] + p["b"]
            if i < len(params) - 1:
                x = jax.nn.relu(x)
    return x


# -- Adam, as optax.adam does it -----------------------------------------------------------------

def adam_init(params):
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return {"m": zeros, "v": zeros, "t": jnp.zeros((), jnp.int32)}


def adam_step(params, grads, opt, lr, b1=0.9, b2=0.999, eps=1e-8):
    t = opt["t"] + 1
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, opt["m"], grads)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["v"], grads)
    scale = lr * jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    params = jax.tree_util.tree_map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + eps), params, m, v)
    return params, {"m": m, "v": v, "t": t}


def make_update(net: str, lr: float):
    @jax.jit
    def update(q_state, data):
        params, target, opt = q_state
        q_next = q_values(target, data["next_obs"], net).max(axis=1)
        y = data["reward"] + data["discount"] * q_next  # discount: gamma, or 0 where terminated

        def loss_fn(p):
            q = jnp.take_along_axis(q_values(p, data["obs"], net), data["action"][:, None], axis=1)[:, 0]
            td = y - q
            return (data["weights"] * td ** 2).mean(), jnp.abs(td)  # IS-weighted, as PER asks

        (loss, td_abs), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        params, opt = adam_step(params, grads, opt, lr)
        return (params, target, opt), loss, td_abs

    return update


def linear_schedule(start_e: float, end_e: float, duration: int, t: int) -> float:
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = jax.devices()[0]  # a GPU where JAX has one: batches go there with one transfer each
    env = make_env(args.game, seed=args.seed)
    n_actions = env.action_space.n
    key = jax.random.PRNGKey(args.seed)
    params = init_params(key, args.net, n_actions)
    q_state = (params, params, adam_init(params))
    update = make_update(args.net, args.learning_rate)
    act = jax.jit(lambda p, o: q_values(p, o[None], args.net)[0].argmax())
    learner_steps = max(1, (args.total_timesteps - args.learning_starts) // args.train_frequency)
    storage = {"storage": "memmap", "path": args.path, "mode": "new"} if args.path else {}
    rb = bigper.PrioritizedReplayBuffer(
        args.buffer_size, atari_fields(), frame_stack=4, gamma=args.gamma, alpha=args.alpha,
        beta=bigper.LinearSchedule(args.beta0, 1.0, max(1, learner_steps - 1)), seed=args.seed, **storage)
    print(f"DQN + PER (JAX {jax.__version__}, {device.platform}) on ALE/{args.game}-v5: buffer "
          f"{rb.capacity:,} transitions ({args.path or 'in memory'}), {args.net} network", flush=True)
    rng = np.random.default_rng(args.seed)
    obs, _ = env.reset(seed=args.seed)
    ret, returns, losses, updates = 0.0, [], [], 0
    t0 = time.perf_counter()
    try:
        for global_step in range(args.total_timesteps):
            epsilon = linear_schedule(args.start_e, args.end_e, int(args.exploration_fraction * args.total_timesteps),
                                      global_step)
            if rng.random() < epsilon:
                action = int(rng.integers(n_actions))
            else:
                action = int(act(q_state[0], jnp.asarray(obs)))
            nxt, reward, term, trunc, _ = env.step(action)
            rb.add(obs=obs, action=action, reward=np.sign(reward), next_obs=nxt, terminated=term, truncated=trunc)
            ret += reward
            obs = nxt
            if term or trunc:
                returns.append(ret)
                ret = 0.0
                obs, _ = env.reset()
            if global_step > args.learning_starts and global_step % args.train_frequency == 0:
                batch = rb.sample(args.batch_size)             # beta advances once per call
                data = batch.to_jax(device)                    # shared on the host, one transfer to a GPU
                q_state, loss, td_abs = update(q_state, data)
                rb.update_priorities(data, td_abs)             # a GPU's values: applied without blocking
                losses.append(loss)
                updates += 1
                if global_step % args.target_network_frequency == 0:
                    online, target, opt = q_state
                    target = jax.tree_util.tree_map(lambda o, t: args.tau * o + (1 - args.tau) * t, online, target)
                    q_state = (online, target, opt)
            if (global_step + 1) % args.log_every == 0 or global_step + 1 == args.total_timesteps:
                recent = f"{np.mean(returns[-10:]):.1f}" if returns else "-"
                last = float(jnp.stack(losses[-100:]).mean()) if losses else float("nan")
                print(f"step {global_step + 1:>9,}  episodes {len(returns):>5}  return(last 10) {recent:>6}  "
                      f"loss {last:.4f}  beta {rb.beta:.3f}  "
                      f"{(global_step + 1) / (time.perf_counter() - t0):,.0f} steps/s", flush=True)
    finally:
        env.close()
        rb.close()
    losses = np.asarray(jnp.stack(losses)) if losses else np.array([])
    if not losses.size or not np.isfinite(losses).all():
        print("dqn_atari_jax: no finite loss was produced", file=sys.stderr)
        return 1
    print(f"done: {updates:,} learner steps, loss first 10 {losses[:10].mean():.4f}, "
          f"last 10 {losses[-10:].mean():.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
