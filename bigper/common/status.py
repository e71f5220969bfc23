"""The status of a slot (and of a sequence item): one uint8 a slot, in the
buffer's ``status`` array, its snapshots and every kernel that reads it.

::

    EMPTY    never written (or cleared)
    LIVE     sampleable
    PENDING  written, waiting for the steps its n-step return needs
    DEAD     not sampleable: its frames were overwritten, a reset step of
             next-step autoreset, or an episode cut short before n steps

The values are part of the file format (a recorded ``status`` array holds
them). Kernels use the names too: numba reads module-level ints as
constants when it compiles, so a name costs nothing.
"""

from __future__ import annotations

EMPTY, LIVE, PENDING, DEAD = 0, 1, 2, 3
