"""Every error bigper raises on purpose. Each is a ``BigperError``; the ones
for bad arguments also keep the built-in base a user would catch
(``except ValueError`` still works for ``InvalidArgumentError``)."""


class BigperError(Exception):
    """Base of every error that is bigper's own."""


# -- bad arguments -----------------------------------------------------------------
class InvalidArgumentError(BigperError, ValueError):
    """An argument with a wrong value (names the argument, the expected and the given value)."""


class InvalidTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type."""


class InvalidIndexError(InvalidArgumentError, IndexError):
    """An index out of range, or a slot that holds no transition."""


class UnknownFieldError(InvalidArgumentError, KeyError):
    """A field name that the buffer or batch does not have."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class BufferClosedError(BigperError, ValueError):
    """A call on a buffer after ``close()``."""


class ReadOnlyBufferError(BigperError, ValueError):
    """A write to a buffer opened read-only (an offline dataset's data, a reader)."""


# -- paths ---------------------------------------------------------------------------
class PathExistsError(BigperError, FileExistsError):
    """A path bigper was asked to write holds something it did not create; untouched."""


class PathNotFoundError(BigperError, FileNotFoundError):
    """A snapshot, storage or dataset path that does not exist."""


# -- files and storages -----------------------------------------------------------
class CorruptSnapshotError(BigperError):
    """A snapshot's files do not match their recorded sizes or checksums, or
    what they record is not a valid buffer state."""


class IncompatibleSnapshotError(BigperError):
    """A snapshot or storage directory of another format version or config."""


class StorageLockedError(BigperError):
    """Another live writer holds the storage directory."""


class UncleanStorageError(BigperError):
    """A storage whose writer did not close it: its data and priorities may
    disagree, so it is refused; resume from a snapshot."""


class SidecarMismatchError(IncompatibleSnapshotError):
    """A priorities sidecar that belongs to another dataset (length, schema or episodes differ)."""


class OfflineDatasetError(BigperError, ValueError):
    """An HDF5 dataset that cannot be read as D4RL, Minari or bigper layout (names the dataset)."""


class ShardUnavailableError(BigperError, RuntimeError):
    """A Ray shard that cannot be reached or placed."""


class CompressionUnavailableError(BigperError, ImportError):
    """``compression=`` was asked for and no libzstd could be loaded (names the extra to install)."""
