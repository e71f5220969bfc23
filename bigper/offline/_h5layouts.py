"""How each HDF5 layout maps onto fields: the D4RL, Minari and bigper readers of ``H5Source``.

Each ``_open_<layout>(f)`` sets, on the source: ``n`` (transitions), ``starts``
(segment boundaries, ``E + 1`` ints), ``ends`` (uint8 per transition: bit 0
terminated, bit 1 truncated), ``status`` (LIVE or DEAD per transition),
``columns`` (name -> ``Column``), ``next_of`` and, for bigper's layout,
``recorded`` (config, state meta, state arrays). It reads the small per-step
flag datasets whole (in blocks); data stays in the file.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re

import numpy as np

from ..errors import OfflineDatasetError, StorageLockedError
from ..common.files import open_regular, read_regular
from ..storage._h5guard import check_row_bytes, check_rows
from ..storage.state import state_bytes_limit
from ._h5map import Column
from ..common.status import DEAD, LIVE

_RESERVED = {"terminated", "truncated", "discount", "priorities"}
_FLAG_BLOCK = 1 << 20
_MAX_DEPTH = 32  # nested observation groups deeper than this are not a Minari space
_METADATA_LIMIT = 16 << 20




def _safe_name(text: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_\-]", "_", text.strip("/")).strip("_") or "field"
    return name if re.match(r"[A-Za-z_]", name) else f"f_{name}"


def _leaves(node, parts=(), seen=None):
    """``(parts, dataset)`` for every dataset under ``node`` (itself when it is one), sorted.

    A group reached twice (hard links can make cycles) is entered once, and the
    depth is bounded: a crafted file cannot recurse without end."""
    import h5py

    if isinstance(node, h5py.Dataset):
        return [(parts, node)]
    seen = set() if seen is None else seen
    if node.id in seen or len(parts) > _MAX_DEPTH:
        raise OfflineDatasetError(f"{node.file.filename}: group {node.name!r} is reached twice or nests "
                                  f"deeper than {_MAX_DEPTH} levels (a link cycle?)")
    seen.add(node.id)
    out = []
    for key in sorted(node.keys()):
        out.extend(_leaves(node[key], parts + (key,), seen))
    return out


def _numeric(d) -> bool:
    return d.dtype.kind in "biuf" and not d.dtype.hasobject and d.ndim >= 1 and 0 not in d.shape[1:]


def _flags(d, n: int) -> np.ndarray:
    """A per-step flag dataset (bool, int or float; ``(n,)`` or ``(n, 1)``) as bool, read in blocks."""
    if d.shape not in ((n,), (n, 1)):
        raise OfflineDatasetError(f"{d.file.filename}: dataset {d.name!r} must have shape ({n},), "
                                  f"got {d.shape}")
    if d.dtype.hasobject or d.dtype.kind not in "biuf":
        raise OfflineDatasetError(f"{d.file.filename}: dataset {d.name!r} holds {d.dtype}; end flags "
                                  "must be bool, int or float")
    out = np.empty(n, dtype=bool)
    for a in range(0, n, _FLAG_BLOCK):
        out[a:a + _FLAG_BLOCK] = np.asarray(d[a:a + _FLAG_BLOCK]).reshape(-1) != 0
    return out


class Layouts:
    """The layout readers, mixed into ``H5Source`` (they use its ``file_path``,
    ``layout``, ``notes``, ``_held`` and ``_lock_fd``)."""

    def _need(self, group, key: str, where: str = ""):
        import h5py

        obj = group.get(key)
        if not isinstance(obj, h5py.Dataset):
            found = sorted(group.keys())[:20]
            raise OfflineDatasetError(
                f"{self.file_path}: the {self.layout} layout needs a dataset {where + key!r}, which is "
                f"missing (found {found})")
        return obj

    def _open_d4rl(self, f) -> None:
        obs = self._need(f, "observations")
        n = obs.shape[0] if obs.ndim else 0
        if n == 0:
            raise OfflineDatasetError(f"{self.file_path}: dataset 'observations' holds no transitions")
        check_rows(n, self.file_path, "dataset 'observations'")
        named = {"observations": "obs", "actions": "action", "rewards": "reward"}
        ds = {k: self._need(f, k) for k in (*named, "terminals")}
        for key in ("timeouts", "next_observations"):
            if key in f:
                ds[key] = self._need(f, key)
        for key, d in ds.items():
            if d.ndim == 0 or d.shape[0] != n:
                raise OfflineDatasetError(
                    f"{self.file_path}: dataset {key!r} has {d.shape[0] if d.ndim else 0} rows but "
                    f"'observations' has {n}; every per-step dataset needs one row per transition")
        term = _flags(ds["terminals"], n)
        tout = _flags(ds["timeouts"], n) if "timeouts" in ds else np.zeros(n, dtype=bool)
        if "timeouts" not in ds:
            self.notes.append("no 'timeouts' dataset: episode ends by time limit are not marked")
        self.n, self.starts = n, [0, n]
        self.ends = term.astype(np.uint8) | (tout.astype(np.uint8) << 1)
        self.status = np.full(n, LIVE, dtype=np.uint8)
        cols = {}
        for key, name in named.items():
            d = ds[key]
            if not _numeric(d):
                raise OfflineDatasetError(f"{self.file_path}: dataset {key!r} has dtype {d.dtype}; "
                                          "bigper reads numeric arrays")
            shape = d.shape[1:] if name != "reward" or d.shape[1:] != (1,) else ()
            cols[name] = Column(name, shape, d.dtype, [key], key)
        if "next_observations" in ds:
            nx = ds["next_observations"]
            if nx.shape != obs.shape or nx.dtype.newbyteorder("=") != obs.dtype.newbyteorder("="):
                raise OfflineDatasetError(
                    f"{self.file_path}: dataset 'next_observations' has shape {nx.shape} {nx.dtype}, "
                    f"'observations' {obs.shape} {obs.dtype}; they must match")
            cols["next_obs"] = Column("next_obs", obs.shape[1:], nx.dtype, ["next_observations"],
                                      "next_observations")
        else:
            unknown = tout & ~term
            unknown[-1] |= not term[-1]
            self.status[unknown] = DEAD
            k = int(unknown.sum())
            if k:
                self.notes.append(f"{k} transition(s) end an episode by timeout (or end the file) with no "
                                  "next observation in the file: held, never sampled")
            cols["next_obs"] = Column("next_obs", obs.shape[1:], obs.dtype, ["observations"],
                                      "observations[t+1] (own row at a terminal)", shift=1,
                                      back=term.astype(np.uint8))
        used = set(ds) | {"timeouts"}

        def visit(key, d):
            if key in used or not hasattr(d, "dtype"):
                return
            name = _safe_name(key.replace("/", "_"))
            if d.ndim == 0 or d.shape[0] != n:
                self.notes.append(f"dataset {key!r} skipped: {d.shape[0] if d.ndim else 0} rows, not {n}")
            elif not _numeric(d):
                self.notes.append(f"dataset {key!r} skipped: dtype {d.dtype} is not numeric")
            elif name in cols or name in self.taken or f"next_{name}" in cols:
                self.notes.append(f"dataset {key!r} skipped: its field name {name!r} is taken")
            else:
                cols[name] = Column(name, d.shape[1:], d.dtype, [key], key)

        f.visititems(visit)
        self.columns, self.next_of = cols, ("obs",)
        for col in cols.values():
            col.seg_rows = np.array([n], dtype=np.int64)

    def _open_minari(self, f) -> None:
        import h5py

        keys = sorted((int(k[8:]), k) for k in f.keys() if re.fullmatch(r"episode_\d+", k))
        if not keys:
            raise OfflineDatasetError(f"{self.file_path}: no episode_<i> groups (Minari layout)")
        spaces = {}
        meta_path = self.file_path.parent / "metadata.json"
        if os.path.lexists(meta_path):
            try:  # a regular file of bounded size: a FIFO or device there is ignored, never read
                meta = json.loads(read_regular(meta_path, limit=_METADATA_LIMIT, follow=True,
                                               error=OfflineDatasetError))
                spaces = {"observations": json.loads(meta.get("observation_space") or "null"),
                          "actions": json.loads(meta.get("action_space") or "null")}
            except (ValueError, TypeError, AttributeError, RecursionError, OSError) as e:
                self.notes.append(f"{meta_path} ignored: {str(e)[:200]}")
                spaces = {}
        schema = None       # name -> (shape, dtype, relative path, shift, extra rows)
        paths: dict[str, list] = {}
        seg_rows: dict[str, list] = {}
        lengths, ends, skipped, total = [], [], 0, 0
        for _, key in keys:
            g = f[key]
            if not isinstance(g, h5py.Group):
                raise OfflineDatasetError(f"{self.file_path}: {key} is not a group (Minari layout)")
            rewards = self._need(g, "rewards", f"{key}/")
            steps = rewards.shape[0] if rewards.ndim else 0
            total += steps
            check_rows(total, self.file_path, f"the episodes up to {key}")
            if steps == 0:
                skipped += 1
                continue
            cols = self._minari_episode(g, key, steps, spaces)
            if schema is None:
                schema = cols
                paths = {name: [] for name in cols}
                seg_rows = {name: [] for name in cols}
            else:
                for name in schema.keys() | cols.keys():
                    a, b = schema.get(name), cols.get(name)
                    if a is None or b is None or a[:2] != b[:2] or a[3] != b[3]:
                        raise OfflineDatasetError(
                            f"{self.file_path}: {key} does not match the first episode in field {name!r}: "
                            f"{b[:2] if b else 'missing'} per step, expected {a[:2] if a else 'missing'}")
            for name, (_, _, rel, shift, rows) in cols.items():
                paths[name].append(f"{key}/{rel}")
                seg_rows[name].append(rows)
            term = _flags(self._need(g, "terminations", f"{key}/"), steps)
            trunc = _flags(self._need(g, "truncations", f"{key}/"), steps)
            ends.append(term.astype(np.uint8) | (trunc.astype(np.uint8) << 1))
            lengths.append(steps)
        if schema is None:
            raise OfflineDatasetError(f"{self.file_path}: every episode is empty; no transitions")
        if skipped:
            self.notes.append(f"{skipped} empty episode(s) skipped")
        self.starts = np.concatenate([[0], np.cumsum(lengths)])
        self.n = int(self.starts[-1])
        self.ends = np.concatenate(ends)
        self.status = np.full(self.n, LIVE, dtype=np.uint8)
        self.columns = {}
        for name, (shape, dtype, rel, shift, _) in schema.items():
            col = Column(name, shape, dtype, paths[name], f"{rel}[t+{shift}]" if shift else rel, shift=shift)
            col.seg_rows = np.asarray(seg_rows[name], dtype=np.int64)
            self.columns[name] = col
        self.next_of = tuple(n for n in schema if n == "obs" or n.startswith("obs_"))
        for name in self.next_of:
            col = self.columns[name]
            nxt = Column(f"next_{name}", col.shape, col.dtype, col.paths,
                         f"{schema[name][2]}[t+1]", shift=1)
            nxt.seg_rows = col.seg_rows
            self.columns[nxt.name] = nxt

    def _minari_episode(self, g, key: str, steps: int, spaces: dict) -> dict:
        """Fields of one episode: name -> (shape, dtype, path in the group, row shift, rows)."""
        out = {}
        groups = (("observations", "obs", steps + 1), ("actions", "action", steps),
                  ("rewards", "reward", steps), ("infos", "info", None))
        for top, prefix, rows in groups:
            if top not in g:
                if top == "infos":
                    continue
                self._need(g, top, f"{key}/")
            for parts, d in _leaves(g[top]):
                rel = "/".join((top, *parts))
                want = rows if rows is not None else (steps + 1 if d.shape[:1] == (steps + 1,) else steps)
                name = prefix if not parts else _safe_name(prefix + "_" + "_".join(p.strip("_") for p in parts))
                shape = tuple(d.shape[1:])
                space = _space_leaf(spaces.get(top), parts)
                encoded = not _numeric(d) or (space is not None and space.get("type") == "Box"
                                              and tuple(space.get("shape", shape)) != shape)
                if top == "infos" and (encoded or d.shape[:1] != (want,)):
                    continue  # not one numeric row per step
                if encoded:
                    raise OfflineDatasetError(
                        f"{self.file_path}: {key}/{rel} holds {d.dtype} rows of shape {shape}, not the "
                        f"space's raw arrays (JPEG-encoded images, Minari's default for image spaces); "
                        "bigper reads raw arrays: create the dataset with DataCollector(..., "
                        "jpeg_encoding=False)")
                if d.shape[0] != want:
                    raise OfflineDatasetError(
                        f"{self.file_path}: dataset {key}/{rel} has {d.shape[0]} rows; expected {want} "
                        f"({key} has {steps} steps)")
                if name in out or name in self.taken:
                    raise OfflineDatasetError(f"{self.file_path}: {key}/{rel} maps to the field name "
                                              f"{name!r}, which is taken")
                if prefix == "reward" and shape == (1,):
                    shape = ()
                shift = 1 if (top == "infos" and want == steps + 1) else 0
                out[name] = (shape, d.dtype, rel, shift, want)
        return out

    def _open_bigper(self, f) -> None:
        import h5py

        from ..storage.state import check_meta
        from ..storage.hdf5 import FORMAT, VERSION

        lock = self.file_path.with_name(self.file_path.name + ".lock")
        if os.path.lexists(lock) and not self._held:  # a writer holds it exclusively while the buffer is open
            fd = open_regular(lock, os.O_RDONLY, error=OfflineDatasetError)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise StorageLockedError(f"{self.file_path} is open in a writer (lock {lock} is held)") from None
            self._lock_fd = fd
        raw = f["_bigper"].attrs["meta"]
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8", "replace")
        if not isinstance(raw, str) or len(raw) > _METADATA_LIMIT:
            raise OfflineDatasetError(f"{self.file_path}: /_bigper's meta attribute is not a JSON string")
        meta = check_meta(json.loads(raw), FORMAT, VERSION, self.file_path)
        self._check_bigper_meta(f, meta)
        # (an older bigper's frame references, obs_ref / next_obs_ref, are converted in memory: datasets.py)
        self.recorded_arrays = meta["arrays"]
        g = f.get("_bigper/state")
        if not isinstance(g, h5py.Group) or meta.get("state") is None:
            raise OfflineDatasetError(f"{self.file_path}: no recorded buffer state in /_bigper/state")
        cap = meta["config"]["capacity"]
        limit = state_bytes_limit(meta["config"])
        arrays = {}
        for name in g:
            d = g.get(name)
            if not isinstance(d, h5py.Dataset) or d.dtype.hasobject or d.dtype.kind not in "biuf":
                raise OfflineDatasetError(f"{self.file_path}: recorded state {name!r} is not a numeric dataset")
            # state arrays hold a few numbers per slot, the last stack of each env and the
            # dictionaries: a bigger one is crafted, not read
            if math.prod(d.shape) * d.dtype.itemsize > limit:
                raise OfflineDatasetError(f"{self.file_path}: recorded state {name!r} of shape {d.shape} is "
                                          f"larger than any state of a {cap}-slot buffer")
            arrays[name] = d[()]
        for name in ("status", "ends"):  # (gid, recorded before issue 43, follows from count)
            if name not in arrays or arrays[name].shape != (cap,):
                raise OfflineDatasetError(f"{self.file_path}: recorded state array {name!r} is missing or "
                                          f"not of shape ({cap},)")
        self.recorded = (meta["config"], meta["state"], arrays)
        self.n, self.starts = cap, [0, cap]
        self.ends = arrays["ends"].astype(np.uint8, copy=False)  # (the record's own: one copy, not two)
        self.status = arrays["status"].astype(np.uint8, copy=False)
        self.ends.flags.writeable = self.status.flags.writeable = False  # (the buffer's ring copies them)
        self.columns = {}
        for name, a in meta["arrays"].items():
            col = Column(name, tuple(a["shape"]), np.dtype(a["dtype"]), [name], name)
            col.seg_rows = np.array([a["rows"]], dtype=np.int64)
            self.columns[name] = col
        self.next_of = tuple(meta["config"].get("next_of", ()))


    def _check_bigper_meta(self, f, meta: dict) -> None:
        """The recorded config's capacity and every array's rows, shape and dtype, against the
        file's datasets: a crafted meta must not make the map read other bytes than the data."""
        import h5py

        def bad(what):
            raise OfflineDatasetError(f"{self.file_path}: /_bigper meta {what}")

        cfg, arrays = meta.get("config"), meta.get("arrays")
        if not isinstance(cfg, dict) or not isinstance(arrays, dict):
            bad("has no config or arrays object")
        cap = cfg.get("capacity")
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            bad(f"has capacity {cap!r:.80}; expected an int >= 1")
        check_rows(cap, self.file_path, "the recorded config")
        for name, a in arrays.items():
            if not isinstance(a, dict) or not isinstance(name, str) or "/" in name or name.startswith("_"):
                bad(f"names array {name!r:.80} with {a!r:.80}")
            d = f.get(name)
            if not isinstance(d, h5py.Dataset):
                bad(f"names array {name!r}, which is not a dataset of the file")
            try:
                dt = np.dtype(a.get("dtype"))
                shape = tuple(int(x) for x in a.get("shape"))
                if any(type(x) is not int for x in a.get("shape")):  # (not "1", 1.0 or true: read as 1)
                    raise TypeError
            except (TypeError, ValueError):
                bad(f"gives array {name!r} dtype {a.get('dtype')!r:.40} and shape {a.get('shape')!r:.80}")
            rows = a.get("rows")
            if dt.hasobject or dt.kind not in "biuf" or dt != d.dtype or (rows, *shape) != d.shape \
                    or isinstance(rows, bool):
                bad(f"records array {name!r} as {rows!r:.20} rows of {shape} {dt}; the dataset is "
                    f"{d.shape} {d.dtype}")
            check_row_bytes(shape, dt.itemsize, self.file_path, name)


def _space_leaf(space, parts):
    """The serialized Minari space at ``parts`` (Dict keys, Tuple ``_index_i``), or None."""
    for p in parts:
        if not isinstance(space, dict):
            return None
        sub = space.get("subspaces")
        if isinstance(sub, dict):
            space = sub.get(p)
        elif isinstance(sub, list) and p.startswith("_index_") and p[7:].isdigit() and int(p[7:]) < len(sub):
            space = sub[int(p[7:])]
        else:
            return None
    return space if isinstance(space, dict) else None
