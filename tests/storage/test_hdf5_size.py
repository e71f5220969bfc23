"""What the HDF5 storage's file takes beside its datasets (issue 43 section 2).

A compressed buffer's log grows a chunk at a time; each growth reserves the
new chunk's bytes first (a full disk is an ``OSError`` before HDF5 writes).
The reservation must not lengthen the file: measured at 20,000 Atari
transitions, 171-187 bytes a transition of an HDF5 file were zeros past
HDF5's last object, 64 KiB left behind by every growth. Nor may a dataset's
last chunk hang far past its rows (``frame_index``: 20,318 rows in two
chunks of 16,384). What is left is HDF5's own headers and indexes.
"""

from __future__ import annotations

import numpy as np

from bigper.storage.hdf5 import HDF5Storage

SLACK = 48 << 10  # HDF5's object headers, chunk indexes and the record, for a file of a few datasets


def _datasets(store) -> int:
    return sum(int(d.id.get_storage_size()) for d in store.dsets.values())


def test_a_growing_hdf5_file_holds_its_datasets_and_headers_only(tmp_path):
    path = tmp_path / "buf.h5"
    s = HDF5Storage(path)
    s.open({})
    s.allocate({"log": (4000, (4096,), np.dtype(np.uint8)), "index": (20_318, (2,), np.dtype(np.int64)),
                "refs": (20_000, (), np.dtype(np.int64))}, growth={"log": 35})
    for rows in range(70, 35 * 41, 35):
        s.grow("log", rows)
        s.dsets["log"][rows - 35:rows] = 7
        assert path.stat().st_size <= _datasets(s) + SLACK, rows
    data = _datasets(s)
    assert s.dsets["index"].id.get_storage_size() <= 20_318 * 16 + 4096  # its chunks fit its rows
    s.close(None)
    assert path.stat().st_size <= data + SLACK, (path.stat().st_size, data)
    assert path.stat().st_blocks * 512 <= data + SLACK + 4096, (path.stat().st_blocks * 512, data)
