"""A Double DQN learner that reads bigper batches, and its state without pickle.

Shared by ``dqn_atari``, ``resume`` and ``tools/dev/learning_check.py``. The
update, for a batch of n-step transitions ``(s, a, R, discount, s')``::

    a* = argmax_a Q_online(s', a)                  (Double DQN: online net picks,
    y  = R + discount * Q_target(s', a*)            target net evaluates)
    loss = mean_i  w_i * huber(y_i - Q_online(s_i, a_i))
    priorities <- |y - Q_online(s, a)|

``discount`` is ``gamma ** k`` for a window of ``k`` steps, or 0 where the
episode terminated, so truncated episodes still bootstrap.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


class DoubleDQN:
    """Online and target Q-networks, Adam, and the IS-weighted Double DQN update.

    Parameters
    ----------
    make_net : callable () -> nn.Module
        Builds a Q-network mapping a batch of observations to (B, actions).
    lr : float
    target_every : int
        Learner steps between target-network syncs.
    grad_clip : float or None
        Max gradient norm.
    device : str or torch.device
    """

    def __init__(self, make_net, *, lr=1e-4, adam_eps=1.5e-4, target_every=2000, grad_clip=10.0,
                 device="cpu"):
        self.device = torch.device(device)
        self.net = make_net().to(self.device)
        self.target = make_net().to(self.device)
        self.target.load_state_dict(self.net.state_dict())
        self.target.requires_grad_(False)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=lr, eps=adam_eps)
        self.target_every = int(target_every)
        self.grad_clip = grad_clip
        self.updates = 0

    @torch.no_grad()
    def act(self, obs: np.ndarray) -> int:
        """Greedy action for one observation."""
        x = torch.as_tensor(np.asarray(obs))[None].to(self.device)
        return int(self.net(x).argmax(1).item())

    def td_errors(self, t: dict) -> torch.Tensor:
        """``y - Q(s, a)`` for a batch of tensors (``Batch.to_torch``); grad flows into the online net."""
        with torch.no_grad():
            a_star = self.net(t["next_obs"]).argmax(1, keepdim=True)
            q_next = self.target(t["next_obs"]).gather(1, a_star).squeeze(1)
            y = t["reward"].to(q_next.dtype) + t["discount"].to(q_next.dtype) * q_next
        q = self.net(t["obs"]).gather(1, t["action"].long()[:, None]).squeeze(1)
        return y - q

    def learn(self, batch) -> tuple[torch.Tensor, float]:
        """One update from a ``bigper.Batch``; returns ``(|TD|, loss)`` (|TD| on the learner's device)."""
        t = batch.to_torch(device=self.device)
        td = self.td_errors(t)
        # IS weights undo the bias of prioritized sampling (all ones with uniform replay).
        loss = (t["weights"] * F.huber_loss(td, torch.zeros_like(td), reduction="none")).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.grad_clip)
        self.opt.step()
        self.updates += 1
        if self.updates % self.target_every == 0:
            self.target.load_state_dict(self.net.state_dict())
        return td.detach().abs(), float(loss.detach())

    # -- state, as plain arrays and JSON (no pickle) -------------------------------
    def state(self) -> tuple[dict, dict]:
        """``(meta, arrays)``: counters and optimizer hyper-parameters; weights and Adam moments."""
        arrays = {f"net.{k}": v.detach().cpu().numpy() for k, v in self.net.state_dict().items()}
        arrays.update({f"target.{k}": v.detach().cpu().numpy() for k, v in self.target.state_dict().items()})
        opt = self.opt.state_dict()
        for i, st in opt["state"].items():
            for k, v in st.items():
                arrays[f"opt.{i}.{k}"] = v.detach().cpu().numpy() if torch.is_tensor(v) else np.asarray(v)
        meta = {"updates": self.updates, "param_groups": opt["param_groups"]}
        return meta, arrays

    def load_state(self, meta: dict, arrays: dict) -> None:
        def sub(prefix):
            return {k[len(prefix):]: torch.from_numpy(np.array(v)) for k, v in arrays.items()
                    if k.startswith(prefix)}

        self.net.load_state_dict(sub("net."))
        self.target.load_state_dict(sub("target."))
        state: dict = {}
        for k, v in sub("opt.").items():
            i, name = k.split(".", 1)
            state.setdefault(int(i), {})[name] = v.to(self.device) if name != "step" else v
        self.opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        self.updates = int(meta["updates"])


def save_state(path, meta: dict, arrays: dict) -> None:
    """``path.json`` and ``path.npz``, each written to a temporary name, fsynced
    and renamed (the npz last: its presence means both are complete)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for suffix, write in ((".json", lambda f: f.write(json.dumps(meta).encode())),
                          (".npz", lambda f: np.savez(f, **arrays))):
        final = path.with_name(path.name + suffix)
        tmp = final.with_name(f".{final.name}.tmp")
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_state(path) -> tuple[dict, dict]:
    """What ``save_state`` wrote; never runs code from the file (``allow_pickle=False``)."""
    path = Path(path)
    meta = json.loads(path.with_name(path.name + ".json").read_text())
    with np.load(path.with_name(path.name + ".npz"), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return meta, arrays


def epsilon(step: int, *, start=1.0, end=0.01, steps=250_000) -> float:
    """Linear exploration schedule."""
    return end + (start - end) * max(0.0, 1.0 - step / steps)
