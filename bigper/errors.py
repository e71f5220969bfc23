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
