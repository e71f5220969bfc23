"""bigper's own errors. Bad arguments raise the usual ValueError, TypeError
or IndexError; these are for states of files and storages."""


class BigperError(Exception):
    """Base of every error that is bigper's own."""


class CorruptSnapshotError(BigperError):
    """A snapshot's files do not match their recorded sizes or checksums."""


class IncompatibleSnapshotError(BigperError):
    """A snapshot or storage directory of another format version or config."""


class StorageLockedError(BigperError):
    """Another live writer holds the storage directory."""


class UncleanStorageError(BigperError):
    """A storage whose last writer died without closing it: its data and
    priorities may disagree, so it is refused; resume from a snapshot."""


class SidecarMismatchError(IncompatibleSnapshotError):
    """A priorities sidecar that belongs to another dataset (length, schema or episodes differ)."""


class OfflineDatasetError(BigperError, ValueError):
    """An HDF5 dataset that cannot be read as D4RL, Minari or bigper layout (names the dataset)."""
