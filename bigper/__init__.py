"""bigper: prioritized experience replay for millions of transitions on disk."""

from .batch import Batch
from .buffer import PrioritizedReplayBuffer
from .errors import (
    BigperError,
    CorruptSnapshotError,
    IncompatibleSnapshotError,
    OfflineDatasetError,
    SidecarMismatchError,
    StorageLockedError,
    UncleanStorageError,
)
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
    "OfflineDatasetError",
    "PrioritizedReplayBuffer",
    "SidecarMismatchError",
    "Snapshots",
    "StorageLockedError",
    "UncleanStorageError",
    "__version__",
]
