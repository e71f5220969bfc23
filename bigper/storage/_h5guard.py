"""Checks of an untrusted HDF5 file before any of its datasets is read.

An HDF5 file can make a reader read bytes that are not in it: a dataset with
*external raw storage* reads a named file as its data (any file the user can
read comes back as "observations"), an *external link* opens another HDF5 file,
a *virtual dataset* maps other files' datasets. ``check_links`` walks every
link of the file without resolving one (``H5Lvisit``, which enters groups only
through hard links) and refuses each of these, naming the dataset and what it
points to, unless the caller allows them. It runs before the layout readers,
so nothing outside the file is opened, not even to test that a link resolves.

``check_sizes`` bounds what a file can make bigper allocate: per-transition
arrays of ``n`` rows and batches of rows, against this machine's memory,
before anything is allocated.
"""

from __future__ import annotations

import math
import os

from ..errors import OfflineDatasetError

# Bytes of RAM a transition costs the buffer (tree leaves and inner nodes,
# status, end flags, generation ids, index arrays), rounded up.
BYTES_PER_TRANSITION = 64
# A row may take at most this share of memory (a batch holds many rows).
ROW_SHARE = 256


def memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # not told: assume a large machine
        return 1 << 40


def check_links(f, where, allow_external: bool) -> None:
    """Refuse external links, external raw storage, virtual datasets that map other files and
    link types HDF5 does not define; see the module docstring.

    Parameters
    ----------
    f : h5py.File
        Opened read-only.
    where : Path
        The file, for messages.
    allow_external : bool
        Accept external links and storage, and virtual datasets of other files.
    """
    from h5py import h5d, h5i, h5l, h5o

    found = []

    def visit(name: bytes, info):
        # An exception must not escape this callback (h5py's lock would be left in a bad
        # state): every failure is recorded, and a non-None return stops the walk.
        try:
            _visit(name, info)
        except Exception as e:  # noqa: BLE001
            found.append(f"{name.decode('utf-8', 'replace')!r} cannot be opened ({str(e)[:200]})")
        return True if len(found) >= 8 else None

    def _visit(name: bytes, info) -> None:
        key = name.decode("utf-8", "replace")
        if info.type == h5l.TYPE_SOFT:
            return  # a path inside this file; its target is one of the links visited here
        if info.type == h5l.TYPE_EXTERNAL:
            if not allow_external:
                link = f.get(key, getlink=True)
                found.append(f"{key!r} is an external link to {link.path!r} in file {link.filename!r}")
            return
        if info.type != h5l.TYPE_HARD:
            found.append(f"{key!r} is a user-defined link (type {info.type}) that bigper does not follow")
            return
        obj = h5o.open(f.id, name)
        if h5i.get_type(obj) != h5i.DATASET or allow_external:
            return
        dcpl = obj.get_create_plist()
        n_ext = dcpl.get_external_count()
        if n_ext:
            files = [dcpl.get_external(i)[0].decode("utf-8", "replace") for i in range(min(n_ext, 3))]
            found.append(f"dataset {key!r} keeps its data in external file(s) {files}")
        elif dcpl.get_layout() == h5d.VIRTUAL:
            outside = []
            for i in range(dcpl.get_virtual_count()):
                fn = dcpl.get_virtual_filename(i)
                if fn != ".":
                    outside.append(f"{fn}:{dcpl.get_virtual_dsetname(i)}")
            if outside:
                found.append(f"virtual dataset {key!r} maps data of other files {outside[:3]}")

    try:
        f.id.links.visit(visit, info=True)
    except (RuntimeError, KeyError, ValueError, TypeError, OSError) as e:
        raise OfflineDatasetError(f"{where}: its links cannot be listed ({e}); not a readable HDF5 "
                                  "dataset") from None
    if found:
        outside = [m for m in found if "cannot be opened" not in m]
        if not outside:
            raise OfflineDatasetError(f"{where} is not a readable HDF5 dataset: " + "; ".join(found))
        raise OfflineDatasetError(
            f"{where} reads data from outside the file: " + "; ".join(outside)
            + ". An untrusted file could return any local file this way; if you trust this one, "
            "pass allow_external=True")


def check_rows(n: int, where, what: str) -> None:
    """Refuse ``n`` transitions whose bookkeeping would not fit in memory."""
    need = int(n) * BYTES_PER_TRANSITION
    have = memory_bytes()
    if need > have:
        raise OfflineDatasetError(
            f"{where}: {what} declares {n:,} transitions; the buffer needs about {need / 1e9:,.1f} GB "
            f"of memory for them ({BYTES_PER_TRANSITION} bytes each), more than this machine's "
            f"{have / 1e9:,.1f} GB. A crafted or corrupt file?")


def check_row_bytes(shape, itemsize: int, where, name: str) -> int:
    """Bytes of one row of ``shape``, computed without overflow; refused when a batch of them
    could not be held."""
    rb = math.prod(int(s) for s in shape) * int(itemsize)
    limit = memory_bytes() // ROW_SHARE
    if rb > limit:
        raise OfflineDatasetError(f"{where}: dataset {name!r} declares rows of shape {tuple(shape)} "
                                  f"({rb:,} bytes each), more than 1/{ROW_SHARE} of this machine's memory")
    return rb
