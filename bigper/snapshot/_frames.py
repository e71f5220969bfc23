"""``verify`` of a snapshot with compressed frames: every live frame decoded.

The snapshot's data files are read in place (mapped read-only, each opened
through ``storage._files.open_regular``), never copied into a live storage:
verifying changes nothing and makes nothing.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from ..core.layout import DERIVED
from ..errors import BigperError
from ..frames.store import FrameStore
from ..common.files import open_regular
from ..storage.base import StorageBase


class _ChunkFiles(StorageBase):
    """A read-only storage over a snapshot's chunk files (``read`` only)."""

    def __init__(self, snap: Path, data: dict, names):
        self._maps, self._arrays = [], {}
        for name in names:
            rec = data[name]
            if "array" in rec:  # converted from an older format in memory (_refs.convert)
                self._arrays[name] = ([rec["array"]], max(int(rec["rows"]), 1))
                continue
            shape, dtype, per = tuple(rec["shape"]), np.dtype(rec["dtype"]), int(rec["chunk_rows"])
            chunks = []
            for member in rec["files"]:
                fd = open_regular(snap / member)
                try:
                    size = os.fstat(fd).st_size
                    m = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
                finally:
                    os.close(fd)
                if m is not None:
                    self._maps.append(m)
                chunks.append(np.frombuffer(m if m is not None else b"", dtype=dtype).reshape(-1, *shape))
            self._arrays[name] = (chunks, per)

    def rows(self, name: str) -> int:
        chunks, _ = self._arrays[name]
        return sum(c.shape[0] for c in chunks)

    def read(self, name: str, rows) -> np.ndarray:
        chunks, per = self._arrays[name]
        if isinstance(rows, slice):
            rows = np.arange(rows.start or 0, rows.stop, dtype=np.int64)
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((rows.shape[0], *chunks[0].shape[1:]), dtype=chunks[0].dtype)
        which = rows // per
        for c in np.unique(which):
            sel = which == c
            out[sel] = chunks[int(c)][rows[sel] - int(c) * per]
        return out

    def close(self) -> None:
        self._arrays = {}
        for m in self._maps:
            m.close()
        self._maps = []


def check_frames(snap: Path, body: dict, cfg, state: dict) -> int:
    """Decode every frame a live or pending transition of the snapshot
    references (bounds, size, checksum each) after checking the whole index
    against the segment state; returns the frames checked. Raises a
    ``BigperError`` (``CorruptSnapshotError``) on the first that fails."""
    frames = None
    files = _ChunkFiles(snap, body["data"], [n for n in ("frame_index", "frame_log", "frame_ref", "frame_off")
                                            if n in body["data"]])
    try:
        off, index = body["data"].get("frame_off"), body["data"].get("frame_index")
        frames = FrameStore(cfg, files, offsets=None if off is None else np.dtype(off["dtype"]),
                            index=None if index is None else index.get("shape"))
        # (each slot's oldest frame derived from the references, as a load does: layout.DERIVED)
        frames.restore(body["state"]["meta"]["frames"], {n: a for n, a in state.items() if n not in DERIVED})
        return frames.check_live(state["status"])
    except (IndexError, ValueError) as e:  # a layout the manifest checks let through: said, not a crash
        raise BigperError(f"its frames could not be read: {e!r}") from e
    finally:
        if frames is not None and frames.log is not None:
            frames.log.close()
        files.close()
