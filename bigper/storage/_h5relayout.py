"""An HDF5 storage file's arrays replaced by others: a new file written beside it, then renamed over it.

HDF5 writes a file's metadata in place, so a process killed while it changes
a file can leave one the library cannot open: a conversion (an older
bigper's frame references, ``core/legacy.py``) never changes the file.
It writes a complete new file beside it, ``.<name>.convert-<12 hex>``
(every dataset copied but the old ones, the new ones added, the record
updated; fsync-ed), keeps the old file under a second name,
``.<name>.trash-<12 hex>`` (a hard link: no copy), and renames the new
file over the old name: the commit. A kill -9 before it leaves the old file
at its name, after it the new one; the extra names are removed at the next
writer's open (``clear``). The old file is kept until the writer closes, so
a resume refused after the rename puts it back.
"""

from __future__ import annotations

import json
import os
import re
import stat
import uuid
from pathlib import Path

import numpy as np

from .base import RECORD
from ..common.files import fsync_dir, open_regular, preallocate


def clear(root: Path, name: str) -> None:
    """Remove what an interrupted replace or conversion left beside file
    ``name`` in folder ``root``: plain files named as bigper names them."""
    pat = re.compile(r"^\." + re.escape(name) + r"\.(trash|convert)-[0-9a-f]{12}$")
    for entry in os.listdir(root):
        if pat.match(entry):
            p = root / entry
            if stat.S_ISREG(os.lstat(p).st_mode):
                p.unlink(missing_ok=True)


def rewrite(h5py, f, root: Path, name: str, new: dict, old: tuple, old_state: tuple, meta: dict) -> Path:
    """The new file (see the module docstring) written and synced beside the
    open file ``f``; returns its path. ``meta``: the record it holds."""
    tmp = root / f".{name}.convert-{uuid.uuid4().hex[:12]}"
    try:
        with h5py.File(tmp, "w-", rdcc_nbytes=0) as g:
            for key in f:
                if key not in old and key != RECORD:
                    f.copy(f[key], g, name=key)
            rec = g.create_group(RECORD)
            state = f.get(f"{RECORD}/state")
            if state is not None:
                s = rec.create_group("state")
                for key in state:
                    if key not in old_state:
                        state.copy(state[key], s, name=key)
            for key, a in new.items():
                r = meta["arrays"][key]
                g.create_dataset(key, data=np.ascontiguousarray(a), chunks=(int(r["chunk_rows"]), *a.shape[1:]),
                                 compression=meta.get("compression"))
            rec.attrs["meta"] = json.dumps(meta)
        preallocate(tmp, os.stat(tmp).st_size)  # (its blocks really reserved, as a new storage's)
        fd = open_regular(tmp, os.O_RDONLY)  # (the file just written: a regular one, or refused)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def swap(root: Path, name: str, tmp: Path) -> Path:
    """The commit: the old file kept under a trash name (a hard link), the
    new one renamed over ``name``; returns the trash name."""
    keep = root / f".{name}.trash-{uuid.uuid4().hex[:12]}"
    os.link(root / name, keep)
    fsync_dir(root)
    os.replace(tmp, root / name)
    fsync_dir(root)
    return keep
