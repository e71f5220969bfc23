"""Workload "learner": how fast bigper feeds a learner, as a share of the learner's ceiling.

A Nature-CNN DQN learner (3 convs, 512 hidden, Adam, Huber loss weighted by
the IS weights) in plain PyTorch eager mode on ``--device`` (CUDA when
present, else the CPU), fed 100k Atari transitions (``--transitions``) cut
from real ALE Pong frames (``workloads.atari.data.real_frames``; ``--frames
FILE.npy`` to bring them where ALE is not installed). For B = 32 and 256,
µs per learner update with each feed (the best of ``--rounds`` turns):

  ceiling     the same batch reused, already on the device (no feed at all)
  numpy SB3   obs and next_obs stacks stored per transition in RAM (SB3's
              layout), uniform indices, ``torch.from_numpy(...).to(device)``
  sample      bigper ``sample`` -> ``to_torch(device)`` -> ``update_priorities``
  sampler     bigper ``sampler(B, prefetch=2, device=...)`` (the feed: ``device/feed.py``)
  sampler (general)  the same buffer through the general sampler (``sample`` -> ``to_torch``
              in a thread), as before the feed: the two compared in one run
  tier        the same, with the device tier (``device=`` on the buffer); "tier (general)" likewise
  zstd        the sampler over ``compression="zstd"`` frames
  zstd tier   the same with the device tier (raw frames on the device)
  n-step 3    the sampler over a buffer with ``n_step=3`` (memmap); "n-step 3 (general)" likewise

and the buffer alone per feed (sample, to the device, a priority update from
a device tensor; synchronized once at the end), beside the floor: frames
stored once in device memory, the sampled indices sent up, one gather of
k + 1 frames a row, priorities back with one copy. Then sequences, 32 x (40 +
80) steps with their stacks, to the device: the host path and the tier.
TorchRL's ``TensorDictPrioritizedReplayBuffer`` runs where it imports
(LazyMemmapStorage, pinned; its CPU sampler); where it does not, the JSON
says why (``torchrl_error``). Each feed is printed as a share of the ceiling, then a JSON line.

An eager learner on a GPU is launch-bound: its thread drops and retakes the
GIL at every op, so whatever Python a feed runs in its own thread is taken
from it, whatever the number of cores. The **proxy learner** measures that
on any machine: ``--proxy-ops`` (default 300) tiny torch ops an update (each
drops and retakes the GIL as a CUDA launch does) on a few numbers read from
the batch, handing back priorities; its share of its own ceiling, per feed,
is the column "proxy share" (it replaces a GIL counter, which a
pure-Python thread under-reads: it yields the GIL only once a switch
interval). "py calls/batch" counts the Python calls (calls and C calls)
the sampler's thread makes a batch, and those of the learner's ``next()``. ``--learner proxy`` runs the proxy table alone (no CNN), as CI can.

Usage::

    python tools/bench.py learner                    # CUDA if present
    python tools/bench.py learner --device cpu --transitions 20000 --iters 20
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchkit import import_bigper, print_header, print_table, say, short_error
from workloads.atari.data import Stream, real_frames
from workloads.learner.proxy import make_sampler, proxy_learner, python_calls

K, H, W, N_ACTIONS = 4, 84, 84, 6


def add_arguments(p):
    p.add_argument("--device", default=None, help="torch device (default: cuda when present, else cpu)")
    p.add_argument("--transitions", type=int, default=100_000, help="transitions in the buffer (default 100k)")
    p.add_argument("--iters", type=int, default=200, help="timed learner updates per feed and batch size")
    p.add_argument("--batches", default="32,256", help="batch sizes")
    p.add_argument("--frames", default=None, help="an .npy (or .npz with 'frames') of (n, 84, 84) uint8 frames (default: ALE Pong)")
    p.add_argument("--only", default=None, help="comma-separated feeds to run (default all)")
    p.add_argument("--seq-steps", type=int, default=20_000, help="steps in the sequence buffer")
    p.add_argument("--no-compression", action="store_true", help="skip the zstd feeds")
    p.add_argument("--learner", choices=("both", "cnn", "proxy"), default="both",
                   help="the Nature-CNN learner, the launch-bound proxy learner, or both (default)")
    p.add_argument("--proxy-ops", type=int, default=300, help="tiny torch ops an update of the proxy learner")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the feeds; each feed's best round counts")


def learner(torch, device):
    """A DQN step over a dict of tensors; returns the |TD| of the batch (a device tensor)."""
    nn = torch.nn

    def net():
        return nn.Sequential(nn.Conv2d(4, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
                             nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten(), nn.Linear(3136, 512), nn.ReLU(),
                             nn.Linear(512, N_ACTIONS)).to(device)

    q, target = net(), net()
    target.load_state_dict(q.state_dict())
    opt = torch.optim.Adam(q.parameters(), lr=1e-4)

    def step(t):
        obs = t["obs"].float().div_(255.0)
        nxt = t["next_obs"].float().div_(255.0)
        with torch.no_grad():
            y = t["reward"].float() + t["discount"].float() * target(nxt).max(1).values
        qa = q(obs).gather(1, t["action"].long().view(-1, 1)).squeeze(1)
        td = y - qa
        loss = (t["weights"].float() * torch.nn.functional.smooth_l1_loss(qa, y, reduction="none")).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return td.detach().abs()

    return step


def sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(torch, device, fn, iters: int, warmup: int) -> float:
    """µs per call of ``fn()``, synchronized before and after the timed calls."""
    for _ in range(warmup):
        fn()
    sync(torch, device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(torch, device)
    return (time.perf_counter() - t0) / iters * 1e6


def torchrl_buffers(torch, stream: Stream, n: int, tmp: Path, device):
    """TorchRL's prioritized buffer over LazyMemmapStorage (pinned), filled with the same stream."""
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, TensorDictPrioritizedReplayBuffer

    rb = TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, priority_key="td_error",
                                           storage=LazyMemmapStorage(n, scratch_dir=str(tmp / "torchrl")),
                                           pin_memory=device.type == "cuda")
    for g in range(0, n, 1000):
        m = min(1000, n - g)
        steps = [stream.step(g + i) for i in range(m)]
        rb.extend(TensorDict({
            "obs": torch.from_numpy(np.stack([s[0] for s in steps])),
            "next_obs": torch.from_numpy(np.stack([s[1] for s in steps])),
            "action": torch.from_numpy(np.array([s[2] for s in steps])),
            "reward": torch.from_numpy(np.array([s[3] for s in steps])),
            "discount": torch.from_numpy(np.where([s[4] for s in steps], 0.0, 0.99).astype(np.float32)),
        }, batch_size=[m]))
    return rb


def torchrl_feed(torch, rb, b: int, device, step):
    def f():
        s = rb.sample(b)
        t = {k: s.get(k).to(device, non_blocking=True) for k in ("obs", "next_obs", "action", "reward", "discount")}
        t["weights"] = s.get("_weight").to(device, non_blocking=True)
        s.set("td_error", step(t).cpu())
        rb.update_tensordict_priority(s)
    return f


def fill(bigper, stream: Stream, n: int, **kw):
    buf = bigper.PrioritizedReplayBuffer(
        capacity=n, fields={"obs": ((K, H, W), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)},
        frame_stack=K, seed=0, **kw)
    chunk = 1000
    for g in range(0, n, chunk):
        m = min(chunk, n - g)
        steps = [stream.step(g + i) for i in range(m)]
        buf.extend({"obs": np.stack([s[0] for s in steps]), "next_obs": np.stack([s[1] for s in steps]),
                    "action": np.array([s[2] for s in steps]), "reward": np.array([s[3] for s in steps]),
                    "terminated": np.array([s[4] for s in steps])})
    return buf


def main(args) -> int:
    import torch

    bigper = import_bigper()
    versions = print_header("learner")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, device {device} ({gpu}), {args.transitions} transitions")
    if args.frames:
        frames = np.load(args.frames)
        frames = frames["frames"] if isinstance(frames, np.lib.npyio.NpzFile) else frames
        source = f"{frames.shape[0]} frames from {args.frames}"
    else:
        frames, source = real_frames()
    print(f"data: {source}")
    stream = Stream(frames)
    only = set(args.only.split(",")) if args.only else None
    want = (lambda name: only is None or name in only)
    sizes = [int(b) for b in args.batches.split(",")]
    n = args.transitions
    results: dict = {"bench": "learner", "device": str(device), "gpu": gpu, "transitions": n,
                     "versions": versions, "torch": torch.__version__, "feeds": {}, "alone": {}}
    step = learner(torch, device)
    tmp = Path(tempfile.mkdtemp(prefix="bigper-bench-learner-"))

    say("filling the buffers ...")
    t0 = time.perf_counter()
    bufs = {"sample": fill(bigper, stream, n, storage="memmap", path=tmp / "host")}
    say(f"  host buffer: {time.perf_counter() - t0:.1f} s")
    if want("tier"):
        t0 = time.perf_counter()
        bufs["tier"] = fill(bigper, stream, n, device=device)
        say(f"  tier buffer: {time.perf_counter() - t0:.1f} s")
    if want("n-step 3") or want("n-step 3 (general)"):
        t0 = time.perf_counter()
        bufs["n-step 3"] = fill(bigper, stream, n, storage="memmap", path=tmp / "nstep", n_step=3)
        say(f"  n-step buffer: {time.perf_counter() - t0:.1f} s")
    if not args.no_compression and (want("zstd") or want("zstd tier")):
        try:
            t0 = time.perf_counter()
            bufs["zstd"] = fill(bigper, stream, n, storage="memmap", path=tmp / "zstd", compression="zstd")
            say(f"  zstd buffer: {time.perf_counter() - t0:.1f} s")
            if want("zstd tier"):
                bufs["zstd tier"] = fill(bigper, stream, n, compression="zstd", device=device)
        except Exception as e:  # noqa: BLE001 (no libzstd here: reported, the rest runs)
            results["zstd_error"] = short_error(e)
            say(f"  zstd unavailable: {short_error(e)}")
    numpy_obs = numpy_next = None
    if want("numpy SB3"):
        m = min(n, 100_000)
        numpy_obs = np.empty((m, K, H, W), np.uint8)
        numpy_next = np.empty((m, K, H, W), np.uint8)
        for g in range(m):
            o, nx, *_ = stream.step(g)
            numpy_obs[g], numpy_next[g] = o, nx
        numpy_small = {"action": stream.action[np.arange(m) % stream.period],
                       "reward": stream.reward[np.arange(m) % stream.period],
                       "discount": np.where(stream.term[np.arange(m) % stream.period], 0.0, 0.99).astype(np.float32)}

    trl = None
    if want("torchrl"):
        try:
            trl = torchrl_buffers(torch, stream, min(n, 100_000), tmp, device)
        except Exception as e:  # noqa: BLE001 (not installed, or its extension does not load: reported)
            results["torchrl_error"] = short_error(e)
            say(f"  TorchRL unavailable: {short_error(e)}")

    rows_table = []
    learners = {}
    if args.learner in ("both", "cnn"):
        learners["cnn"] = step
    if args.learner in ("both", "proxy"):
        learners["proxy"] = proxy_learner(torch, device, args.proxy_ops)
    results["proxy_ops"] = args.proxy_ops
    for b in sizes:
        say(f"B = {b}")
        ready = bufs["sample"].sample(b).to_torch(device)
        ready = {k: v.clone() for k, v in ready.items()}

        def feed_times(step) -> dict:
            """µs per update of ``step`` fed by each feed: the best of ``--rounds`` rounds, each round
            timing every feed once in turn (this machine's noise moves whole runs by 10-30%)."""
            makers: dict = {"ceiling": lambda: (lambda: step(ready), None)}
            if numpy_obs is not None:
                rng = np.random.default_rng(0)

                def numpy_feed():
                    i = rng.integers(0, numpy_obs.shape[0], b)
                    t = {"obs": torch.from_numpy(numpy_obs[i]).to(device, non_blocking=True),
                         "next_obs": torch.from_numpy(numpy_next[i]).to(device, non_blocking=True)}
                    for k2, v in numpy_small.items():
                        t[k2] = torch.from_numpy(v[i]).to(device, non_blocking=True)
                    t["weights"] = torch.ones(b, device=device)
                    step(t)
                makers["numpy SB3"] = lambda: (numpy_feed, None)

            def plain(buf):
                def f():
                    t = buf.sample(b).to_torch(device)
                    buf.update_priorities(t, step(t))
                return lambda: (f, None)

            def with_sampler(buf, general=False):
                def make():
                    it = make_sampler(buf, b, device, general)

                    def f():
                        t = next(it)
                        buf.update_priorities(t, step(t))
                    return f, it
                return make

            if want("sample"):
                makers["sample"] = plain(bufs["sample"])
            for name, key, general in (("sampler", "sample", False), ("sampler (general)", "sample", True),
                                       ("tier", "tier", False), ("tier (general)", "tier", True),
                                       ("zstd", "zstd", False), ("zstd tier", "zstd tier", False),
                                       ("n-step 3", "n-step 3", False), ("n-step 3 (general)", "n-step 3", True)):
                if key in bufs and want(name):
                    makers[name] = with_sampler(bufs[key], general)
            if trl is not None:
                makers["torchrl"] = lambda: (torchrl_feed(torch, trl, b, device, step), None)
            if "tier" in bufs and want("tier sample"):
                makers["tier sample"] = plain(bufs["tier"])
            feeds: dict = {}
            for _ in range(args.rounds):
                for name, make in makers.items():
                    f, it = make()
                    us = timed(torch, device, f, args.iters, 10)
                    feeds[name] = min(feeds.get(name, us), us)
                    if it is not None:
                        it.close()
            return feeds

        per = {name: feed_times(fn) for name, fn in learners.items()}
        feeds = per.get("cnn", {})
        proxy = per.get("proxy", {})

        # The buffer alone: draw, move, update from a device tensor; synchronized once at the end.
        alone: dict = {}
        td = torch.rand(b, device=device) + 0.01
        for name, key in (("sample", "sample"), ("tier", "tier"), ("zstd", "zstd"), ("zstd tier", "zstd tier")):
            if key in bufs:
                buf = bufs[key]

                def g(buf=buf):
                    t = buf.sample(b).to_torch(device)
                    buf.update_priorities(t, td)
                alone[name] = timed(torch, device, g, args.iters, 10)
        # The floor: frames once in device memory, indices up, one gather, priorities back with one copy.
        fl = torch.from_numpy(np.ascontiguousarray(frames[: min(frames.shape[0], n + K)])).to(device)
        nf = fl.shape[0]
        pin = torch.empty(b, dtype=torch.int64, pin_memory=device.type == "cuda")
        back = torch.empty(b, dtype=torch.float32, pin_memory=device.type == "cuda")
        frng = np.random.default_rng(1)

        def floor():
            pin.numpy()[:] = frng.integers(0, nf - K - 1, b)
            i = pin.to(device, non_blocking=True)
            rows = i.view(-1, 1) + torch.arange(K + 1, device=device)
            s = fl.index_select(0, rows.view(-1)).view(b, K + 1, H, W)
            _ = s[:, :K], s[:, 1:]
            back.copy_(td, non_blocking=True)
        alone["floor"] = timed(torch, device, floor, args.iters, 10)
        # Python calls a batch in the sampler's thread (what it takes from a launch-bound learner).
        calls = {}
        for name, key, general in (("sampler", "sample", False), ("sampler (general)", "sample", True),
                                   ("tier", "tier", False), ("tier (general)", "tier", True),
                                   ("zstd", "zstd", False), ("n-step 3", "n-step 3", False),
                                   ("n-step 3 (general)", "n-step 3", True)):
            if key in bufs and want(name):
                calls[name] = python_calls(lambda buf=bufs[key], g=general: (make_sampler(buf, b, device, g), buf),
                                           max(10, args.iters // 4))
        results["feeds"][b] = feeds
        results.setdefault("proxy", {})[b] = proxy
        results.setdefault("py_calls", {})[b] = calls
        results["alone"][b] = alone
        for name in dict.fromkeys([*feeds, *proxy]):
            us = feeds.get(name)
            rows_table.append([f"{name}", str(b), "" if us is None else f"{us:,.0f}",
                               "" if us is None else f"{100 * feeds['ceiling'] / us:.0f}%",
                               f"{alone[name]:,.0f}" if name in alone else "",
                               f"{100 * proxy['ceiling'] / proxy[name]:.0f}%" if name in proxy else "",
                               f"{calls[name]['thread']:.0f} / {calls[name]['next']:.0f}" if name in calls else ""])
        rows_table.append(["floor (buffer alone)", str(b), "", "", f"{alone['floor']:,.0f}", "", ""])
    print()
    print_table(["feed", "B", "µs per update", "share of ceiling", "buffer alone µs",
                 f"proxy share ({args.proxy_ops} ops)", "py calls/batch: feed thread / next()"], rows_table)

    # Sequences: 32 x (40 + 80) with stacks, to the device.
    if want("sequences"):
        say("sequences ...")
        seq = {}
        for name, kw in (("host", {"storage": "memmap", "path": tmp / "seq"}), ("tier", {"device": device})):
            try:
                sb = bigper.PrioritizedReplayBuffer(
                    capacity=args.seq_steps, fields={"obs": ((K, H, W), np.uint8), "action": ((), np.int64),
                                                     "reward": ((), np.float32)},
                    frame_stack=K, sequence=bigper.Sequence(80, burn_in=40, period=40), seed=0, **kw)
                for g in range(0, args.seq_steps, 1000):
                    m = min(1000, args.seq_steps - g)
                    steps = [stream.step(g + i) for i in range(m)]
                    sb.extend({"obs": np.stack([s[0] for s in steps]), "next_obs": np.stack([s[1] for s in steps]),
                               "action": np.array([s[2] for s in steps]), "reward": np.array([s[3] for s in steps]),
                               "terminated": np.array([s[4] for s in steps])})
                err = torch.rand(32, 120, device=device)
                it = sb.sampler(32, prefetch=2, device=device)

                def sq(sb=sb, it=it):
                    t = next(it)
                    sb.update_priorities(t, err)

                def sq_plain(sb=sb):
                    t = sb.sample(32).to_torch(device)
                    sb.update_priorities(t, err)
                seq[f"{name} sample"] = timed(torch, device, sq_plain, max(5, args.iters // 10), 2)
                seq[f"{name} sampler"] = timed(torch, device, sq, max(5, args.iters // 10), 2)
                it.close()
                sb.close()
            except Exception as e:  # noqa: BLE001
                seq[name] = short_error(e)
        results["sequences"] = seq
        print()
        print_table(["sequences 32 x (40 + 80), to the device", "ms per batch"],
                    [[k, f"{v / 1000:.2f}" if isinstance(v, float) else v] for k, v in seq.items()])
    for buf in bufs.values():
        buf.close()
    shutil.rmtree(tmp, ignore_errors=True)  # (the memmap buffers: hundreds of MB a run)
    print(json.dumps(results))
    return 0
