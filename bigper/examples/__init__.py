"""Runnable examples, each ``python -m bigper.examples.NAME`` (``--smoke`` for a short run).

- ``dqn_atari``: Double DQN with prioritized replay on an ALE game, memmap buffer, beta annealed 0.4 -> 1.
- ``dqn_atari_jax``: CleanRL's DQN in plain JAX on Breakout, batches with ``to_jax``, ``jax.Array`` priorities.
- ``sac``: SAC with twin critics on Pendulum-v1; priority (|delta1| + |delta2|) / 2, ``--no-per`` for uniform.
- ``resume``: training killed by SIGKILL, resumed from the latest snapshot, checked against a run never killed.
"""
