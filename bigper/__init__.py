"""bigper: prioritized experience replay for millions of transitions on disk."""

from .batch import Batch
from .buffer import PrioritizedReplayBuffer
from .errors import BigperError, CorruptSnapshotError, IncompatibleSnapshotError, StorageLockedError
from .schedules import ConstantSchedule, LinearSchedule
from .snapshot import Snapshots

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "BigperError",
    "ConstantSchedule",
    "CorruptSnapshotError",
    "IncompatibleSnapshotError",
    "LinearSchedule",
    "PrioritizedReplayBuffer",
    "Snapshots",
    "StorageLockedError",
    "__version__",
]
