"""Offline datasets opened in place: D4RL, Minari and bigper HDF5 files read
through ``offline.h5source`` (``datasets``: ``open_dataset``, ``score_all``
for ``reprioritize``), and the priorities sidecar kept beside a dataset
(``sidecar``). ``bigper convert`` is ``bigper.convert`` (it builds a buffer)."""
