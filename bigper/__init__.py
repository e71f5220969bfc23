"""bigper: prioritized experience replay for millions of transitions on disk."""

from . import _protocol
from .batch import Batch
from .buffer import PrioritizedReplayBuffer
from .errors import (
    BigperError,
    BufferClosedError,
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
from .snapshot import Snapshots
from .snapshot._series import SnapshotInfo
from .snapshot import load as _load
from .snapshot import save as _save

from ._version import __version__  # noqa: E402,F401


def _from_hdf5(dataset, **kwargs):
    from .offline import from_hdf5  # h5py-heavy: loaded on first use

    return from_hdf5(dataset, **kwargs)


def _reprioritize(buf, score_fn, **kwargs):
    from .offline import reprioritize

    return reprioritize(buf, score_fn, **kwargs)


# The buffer's save/load/from_hdf5/reprioritize methods are implemented by the
# rooms above it; plugging them in here keeps every import pointing down.
_protocol.provide(save=_save, load=_load, from_hdf5=_from_hdf5, reprioritize=_reprioritize)

__all__ = [
    "Batch",
    "BigperError",
    "BufferClosedError",
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
    "ShardUnavailableError",
    "SidecarMismatchError",
    "SnapshotInfo",
    "Snapshots",
    "StorageLockedError",
    "UncleanStorageError",
    "UnknownFieldError",
    "__version__",
]
