"""ShardWriter: the handle writers use to add to a sharded buffer.

It holds the shard actors' handles and the buffer's config, so it pickles
small and can be passed to other Ray actors (``buf.writer()``). It checks
every step exactly as a local buffer would (same errors, raised at ``add``),
collects steps into chunks of ``chunk_size`` and sends each chunk as one
``extend`` call, with at most ``max_in_flight`` chunks unacknowledged, to
the shard ``_routing`` picks: the one with the most room while any has
room (cutting the chunk to it), then the one whose oldest row is oldest.

With ``n_step > 1`` or ``frame_stack`` a chunk must not cut an episode (the
n-step window or frame stack would run into another writer's steps on that
shard), so chunks end at episode ends, and the steps of an unfinished episode
stay with the writer until the episode ends.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..core.ingest import Ingest
from ..config import Config
from ..errors import InvalidArgumentError, ShardUnavailableError
from ._routing import Router
from ._sampling import shard_capacities


def _ray():
    import ray

    return ray


def _locked(method):
    """A public entry point of a writer: one call at a time (its pieces, chunks
    in flight and routing model change together)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


class ShardWriter:
    """Adds transitions to a ``ShardedPrioritizedBuffer`` from any process.

    Get one with ``ShardedPrioritizedBuffer.writer()``; ``add`` and ``extend``
    take what the local buffer's take. Call ``flush()`` to send what is
    pending and wait until every shard has stored it. ``stored[k]`` counts
    the transitions shard ``k`` acknowledged from this writer (a chunk whose
    shard died before answering is counted where it was sent again).
    """

    chunk_size: int
    max_in_flight: int
    sent: int
    stored: list[int]

    def __init__(self, shards: Sequence[Any], config: dict[str, Any], *, start: int = 0, chunk_size: int = 256,
                 max_in_flight: int = 4) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
            raise InvalidArgumentError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, (int, np.integer)) \
                or max_in_flight < 1:
            raise InvalidArgumentError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        self._shards = list(shards)
        self._config = config
        self._start = int(start)
        self.chunk_size = int(chunk_size)
        self.max_in_flight = int(max_in_flight)
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.RLock()  # every public entry point holds it; never pickled
        cfg = Config.from_dict(self._config)
        self._ingest = Ingest(cfg)
        self._envs = cfg.num_envs
        self._episodic = cfg.n_step > 1 or cfg.frame_stack is not None
        self._router = None  # built at the first send, from the shards' fill
        self._pieces: list[tuple] = []  # (rows (m*envs, ...), priorities, valid)
        self._pending = 0  # steps in _pieces
        self._in_flight: list[list] = []  # [ref, shard, data, priorities, valid, attempts, rows]
        self._placeholders = False  # this writer has sent placeholder rows (num_envs > 1)
        self.sent = 0  # steps handed to shards
        self.stored = [0] * len(self._shards)  # transitions each shard acknowledged from this writer

    # -- pickling: a fresh, empty writer on the other side -------------------------
    @_locked
    def __getstate__(self) -> dict[str, Any]:
        if self._pending or self._in_flight:
            raise ShardUnavailableError("flush() this ShardWriter before passing it to another process: "
                               f"{self._pending} step(s) pending, {len(self._in_flight)} chunk(s) in flight")
        return {"shards": self._shards, "config": self._config, "start": self._start,
                "chunk_size": self.chunk_size, "max_in_flight": self.max_in_flight}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._shards, self._config, self._start = state["shards"], state["config"], state["start"]
        self.chunk_size, self.max_in_flight = state["chunk_size"], state["max_in_flight"]
        self._setup()

    # -- writing -------------------------------------------------------------------
    @_locked
    def add(self, *, priorities: npt.ArrayLike | None = None, valid: npt.ArrayLike | None = None,
            **step: npt.ArrayLike) -> None:
        """One env step (with ``num_envs > 1``, one step of every env); see
        ``PrioritizedReplayBuffer.add``."""
        rows, p, v = self._ingest.step(step, priorities, valid)
        self._push(rows, p, v)

    @_locked
    def extend(self, data: Mapping[str, npt.ArrayLike], priorities: npt.ArrayLike | None = None,
               valid: npt.ArrayLike | None = None) -> None:
        """Many steps; see ``PrioritizedReplayBuffer.extend``."""
        rows, p, v = self._ingest.steps(data, priorities, valid)
        self._push(rows, p, v)

    @_locked
    def flush(self) -> None:
        """Send every pending step (in episode mode: up to the last episode end)
        and wait until the shards have stored all of it."""
        self._send_ready(force=True)
        self._wait(0)

    @property
    @_locked
    def pending(self) -> int:
        """Steps collected here and not yet sent."""
        return self._pending

    def _push(self, rows: dict, p, v) -> None:
        e = self._envs
        if v is not None and e == 1:
            # A placeholder row (an env's reset step) carries no transition, and
            # with one env no stream to keep aligned: it never leaves the writer.
            if not v.all():
                rows = {k: a[v] for k, a in rows.items()}
                p = None if p is None else p[v]
            v = None
        m = rows["terminated"].shape[0] // e
        if m == 0:
            return
        if v is not None:
            self._placeholders = True
        if self._pieces and (p is None) != (self._pieces[-1][1] is None):
            # A chunk has priorities for every step or for none: cut here.
            self._send_ready(force=True)
        self._pieces.append((rows, p, v))
        self._pending += m
        if self._pending >= self.chunk_size and (
                not self._episodic or (rows["terminated"] | rows["truncated"]).any()):
            # In episode mode a chunk can only end where an episode ends.
            self._send_ready(force=False)

    def _cuts(self, rows: dict, n: int, force: bool) -> list:
        """Where to cut ``n`` pending steps into chunks of about ``chunk_size``."""
        e, c = self._envs, self.chunk_size
        ends = (rows["terminated"] | rows["truncated"]).reshape(n, e)
        if self._episodic:
            # The next chunk may go to another shard: never cut an episode.
            allowed = np.flatnonzero(ends[:, 0]) + 1
        elif self._placeholders:
            # A placeholder row must follow its env's episode end on the same
            # shard: cut only after a step where no env's episode ended.
            allowed = np.flatnonzero(~ends.any(axis=1)) + 1
        else:
            cuts = list(range(c, n + 1, c))
            if force and (not cuts or cuts[-1] != n):
                cuts.append(n)
            return cuts
        cuts, s = [], 0
        for cut in allowed:
            if cut - s >= c:
                cuts.append(int(cut))
                s = cut
        if force and allowed.shape[0] and allowed[-1] > s:
            cuts.append(int(allowed[-1]))
        return cuts

    def _send_ready(self, force: bool) -> None:
        if not self._pending:
            return
        pieces = self._pieces
        if len(pieces) == 1:
            rows, p, v = pieces[0]
        else:
            rows = {n: np.concatenate([r[n] for r, _, _ in pieces]) for n in pieces[0][0]}
            p = None if pieces[0][1] is None else np.concatenate([q for _, q, _ in pieces])
            v = None
            if any(w is not None for _, _, w in pieces):
                v = np.concatenate([np.ones(r["terminated"].shape[0], bool) if w is None else w
                                    for r, _, w in pieces])
        e, n = self._envs, self._pending
        s = 0
        for cut in self._cuts(rows, n, force):
            sl = slice(s * e, cut * e)
            self._send({k: a[sl] for k, a in rows.items()}, None if p is None else p[sl],
                       None if v is None else v[sl], cut - s)
            s = cut
        if s == n:
            self._pieces, self._pending = [], 0
        elif s or len(pieces) > 1:
            sl = slice(s * e, None)
            self._pieces = [({k: a[sl] for k, a in rows.items()}, None if p is None else p[sl],
                             None if v is None else v[sl])]
            self._pending = n - s

    def _send(self, rows: dict, p, v, m: int) -> None:
        e = self._envs
        # A cut may fall between any two steps, unless an episode or a
        # placeholder row must stay with the steps around it.
        cuttable = not self._episodic and not self._placeholders
        s = 0
        while s < m:
            k, take = self._route().choose((m - s) * e, unit=e, cuttable=cuttable)
            t = take // e
            sl = slice(s * e, (s + t) * e)
            part = {n: a[sl] for n, a in rows.items()}
            pp = None if p is None else p[sl]
            vv = None if v is None else v[sl]
            if e > 1:
                part = {n: a.reshape((t, e) + a.shape[1:]) for n, a in part.items()}
                pp = None if pp is None else pp.reshape(t, e)
                vv = None if vv is None else vv.reshape(t, e)
            self._submit([None, None, part, pp, vv, 0, t * e], k)
            s += t
            self.sent += t
            self._wait(self.max_in_flight)

    def _route(self) -> Router:
        if self._router is None:
            ray = _ray()
            from ray.exceptions import RayActorError

            cfg = Config.from_dict(self._config)
            self._router = r = Router(shard_capacities(cfg.capacity, len(self._shards)), self._start)
            refs = [a.fill.remote() for a in self._shards]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=30.0)
            for k, ref in enumerate(refs):
                try:
                    if ref in ready:
                        r.acked(k, ray.get(ref), 0)
                except RayActorError:
                    pass  # a dead shard: learnt from its first reply once it is back
        return self._router

    def _submit(self, entry: list, k: int) -> None:
        stamp = self._route().stamp()
        entry[0] = self._shards[k].extend.remote(entry[2], entry[3], entry[4], stamp, self._router.token)
        entry[1] = k
        self._router.sent(k, entry[6], stamp)
        self._in_flight.append(entry)

    def _wait(self, most: int) -> None:
        """Wait until at most ``most`` chunks are unacknowledged. A chunk whose
        shard died is sent to the next shard (the dead shard restarts from its
        snapshot, without it)."""
        ray = _ray()
        from ray.exceptions import RayActorError

        while len(self._in_flight) > most:
            refs = [x[0] for x in self._in_flight]
            ready, _ = ray.wait(refs, num_returns=len(refs) - most)
            done = set(ready)
            # A shard's reply counts every earlier chunk of this writer to it, so
            # replies must be taken in send order: ray.wait may name a later
            # chunk ready and not an earlier one to the same shard, and that
            # earlier reply, taken after, would make the shard look emptier by
            # the later chunk (the router then overfills it: 2976 of 3000 held).
            # Every earlier chunk to a shard with a reply is done too (a shard
            # runs one caller's calls in order): take it now, before.
            last = {}
            for i, entry in enumerate(self._in_flight):
                if entry[0] in done:
                    last[entry[1]] = i
            done.update(e[0] for i, e in enumerate(self._in_flight) if i < last.get(e[1], -1))
            keep, retry = [], []
            for i, entry in enumerate(self._in_flight):
                if entry[0] not in done:
                    keep.append(entry)
                    continue
                try:
                    fill = ray.get(entry[0])
                except RayActorError as e:
                    entry[5] += 1
                    if entry[5] > 2 * len(self._shards):
                        raise ShardUnavailableError(
                            f"no shard took a chunk of {entry[6]} transition(s) after {entry[5]} tries: the "
                            "buffer this writer writes to was closed, or its shards died and did not come "
                            f"back ({type(e).__name__})") from e
                    retry.append(entry)
                    continue
                # A caller's calls run in order: the reply counts every earlier
                # chunk to that shard, none of the later ones.
                k = entry[1]
                self.stored[k] += entry[6]
                later = sum(x[6] for x in self._in_flight[i + 1:] if x[1] == k)
                self._router.acked(k, fill, later)
            self._in_flight = keep
            for entry in retry:
                k, _ = self._router.choose(entry[6], exclude=(entry[1],))
                self._submit(entry, k)
