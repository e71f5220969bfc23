"""Stable-Baselines3 / CleanRL drop-in: a prioritized ``ReplayBuffer`` backed by bigper.

``PrioritizedReplayBuffer`` is a subclass of SB3's ``ReplayBuffer`` with its
constructor, ``add`` and ``sample``, so that both ::

    DQN("CnnPolicy", env, replay_buffer_class=PrioritizedReplayBuffer,
        replay_buffer_kwargs={"frame_stack": 4, "storage": "memmap", "path": "runs/replay"})

and CleanRL's positional ``ReplayBuffer(size, obs_space, act_space, device, ...)``
work unchanged. It keeps nothing of SB3's arrays: every transition lives in a
``bigper.PrioritizedReplayBuffer`` (the ``buffer`` attribute), frames once.

``sample`` returns SB3's ``ReplayBufferSamples`` fields in their order plus
``weights`` (IS weights, like ``rewards``) and ``indices``; hand ``indices`` and
``|TD error|`` to ``update_priorities``. Each ``sample`` is served by a
background sampler the buffer keeps open (``prefetch=2``; ``prefetch=0``
draws in the caller's thread), on the buffer's device, and with
``device_tier=True`` (``replay_buffer_kwargs={"device": ...}`` for the
``Prioritized*`` algorithms) the data also lives in device memory and
batches are gathered there (``PrioritizedReplayBuffer.sample`` says what a
prefetched batch may lag). ``PrioritizedDQN`` (SB3's DQN with an
IS-weighted loss and the write-back) does that; with SB3's plain ``DQN`` the
buffer still works, but nothing updates priorities: every transition keeps the
largest priority seen, and sampling stays uniform over what is sampleable.

Pickling (SB3's ``save_replay_buffer``) writes no transition into the pickle:
the buffer is saved as a bigper snapshot and the pickle holds its path and the
SHA-256 of its manifest. Where the snapshot goes, first that applies:

1. ``snapshot_dir=`` given to the buffer: a ``bigper.Snapshots`` series there;
2. ``PrioritizedDQN.save_replay_buffer(path)``: ``<path>.bigper/`` next to the pickle;
3. a disk storage (``storage="memmap"``/``"hdf5"``): ``<storage path>.snapshots/``;

otherwise pickling is refused. Unpickling checks the manifest's hash, loads
the snapshot (priorities, cursor, RNG, beta step: sampling continues exactly)
and never unpickles anything of bigper's: the snapshot is plain arrays and JSON.
What each pickle promises (its snapshot kept, no rewind of a live path
holding newer data unless asked: ``load_replay_buffer(path, rewind=True)``
or ``with rewinding(): pickle.loads(...)``; atomic saves) is in
``bigper.integrations._sb3_pickle``.

This module only gathers the public names: the buffer lives in
``_sb3_buffer``, the algorithms in their own modules (imported on first use:
SB3's algorithm modules are heavier), none of which imports this one.
"""

from __future__ import annotations

from typing import Any

from ._sb3_buffer import PrioritizedReplayBuffer, PrioritizedReplayBufferSamples, annealed_beta
from ._sb3_pickle import rewinding

__all__ = ["PrioritizedDDPG", "PrioritizedDQN", "PrioritizedQRDQN", "PrioritizedReplayBuffer",
           "PrioritizedReplayBufferSamples", "PrioritizedSAC", "PrioritizedTD3", "PrioritizedTQC",
           "annealed_beta", "rewinding"]

# name -> module that defines it (loaded on first access; QRDQN and TQC need sb3-contrib)
_ALGORITHMS = {"PrioritizedDQN": "_sb3_dqn", "PrioritizedSAC": "_sb3_actor_critic",
               "PrioritizedTD3": "_sb3_actor_critic", "PrioritizedDDPG": "_sb3_actor_critic",
               "PrioritizedQRDQN": "_sb3_contrib", "PrioritizedTQC": "_sb3_contrib"}


def __getattr__(name: str) -> Any:
    mod = _ALGORITHMS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    if mod == "_sb3_contrib":
        try:
            import sb3_contrib  # noqa: F401
        except ImportError:
            raise ImportError(f"{name} needs sb3-contrib: in a bigper checkout, pip install -e '.[sb3-contrib]' "
                              "(from an index: pip install 'bigper[sb3-contrib]')") from None
    return getattr(import_module(f"{__package__}.{mod}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ALGORITHMS))
