"""bigper: prioritized experience replay for millions of transitions on disk."""

from .batch import Batch
from .buffer import PrioritizedReplayBuffer
from .frames.dictionaries import train_dictionary
from .config import Sequence
from .errors import (
    BigperError,
    BufferClosedError,
    CompressionUnavailableError,
    CorruptSnapshotError,
    IncompatibleSnapshotError,
    InvalidArgumentError,
    InvalidIndexError,
    InvalidTypeError,
    OfflineDatasetError,
    PathExistsError,
    PathNotFoundError,
    ReadOnlyBufferError,
    ShardUnavailableError,
    SidecarMismatchError,
    StorageLockedError,
    UncleanStorageError,
    UnknownFieldError,
)
from .schedules import ConstantSchedule, LinearSchedule
from .snapshot import SnapshotInfo
from .snapshots import Snapshots

from ._version import __version__  # noqa: E402,F401


__all__ = [
    "train_dictionary",
    "Batch",
    "BigperError",
    "BufferClosedError",
    "CompressionUnavailableError",
    "ConstantSchedule",
    "CorruptSnapshotError",
    "IncompatibleSnapshotError",
    "InvalidArgumentError",
    "InvalidIndexError",
    "InvalidTypeError",
    "LinearSchedule",
    "OfflineDatasetError",
    "PathExistsError",
    "PathNotFoundError",
    "PrioritizedReplayBuffer",
    "ReadOnlyBufferError",
    "Sequence",
    "ShardUnavailableError",
    "SidecarMismatchError",
    "SnapshotInfo",
    "Snapshots",
    "StorageLockedError",
    "UncleanStorageError",
    "UnknownFieldError",
    "__version__",
]
