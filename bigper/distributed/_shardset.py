"""ShardSet: the coordinator's view of its shard actors.

It knows which shards are up, the newest stats each one reported
``(total, min_leaf, len, max_leaf, epoch)``, and the priority updates not yet
sent. Updates ride on the next call to their shard (a probe, a sample), so a
learner's sample-update loop costs no extra round trip; they go on their own
(asynchronously, at most ``max_in_flight`` calls unacknowledged) when
``max_pending`` rows pile up or on ``flush``.

A shard that fails a call (died, restarting) or does not answer within
``timeout`` is *down*: calls skip it and a background probe watches it; once
the probe answers it is up again. Its pending updates are dropped: it comes
back from its snapshot, where they mean nothing.
"""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError, RayActorError


class ShardSet:
    def __init__(self, actors: list, *, timeout: float, max_in_flight: int, max_pending: int):
        self.actors = actors
        self.n = len(actors)
        self.timeout = timeout
        self.max_in_flight = max_in_flight
        self.max_pending = max_pending
        self.max_leaf = 1.0  # the largest leaf seen anywhere; every call carries it
        self.down = [False] * self.n
        self._stats: list = [None] * self.n  # (seq, stats) of the newest reply
        self._seq = 0
        self._probes: list = [None] * self.n  # a probe of a down shard, in flight
        self._pending: list = [[] for _ in range(self.n)]  # (slots, stamps, priorities)
        self._pending_rows = [0] * self.n
        self._updates: list = []  # standalone update calls: (ref, shard, seq)

    # -- calls -----------------------------------------------------------------------
    def call(self, s: int, method: str, *args):
        """Call ``method(updates, max_leaf, *args)`` on shard ``s``; returns ``(ref, seq)``."""
        updates = self._pending[s] or None
        self._pending[s], self._pending_rows[s] = [], 0
        self._seq += 1
        return getattr(self.actors[s], method).remote(updates, self.max_leaf, *args), self._seq

    def collect(self, calls: dict) -> dict:
        """Wait for ``calls`` (shard -> (ref, seq)); replies of shards that answered,
        marking the others down. A reply is ``(payload, stats)``."""
        if not calls:
            return {}
        refs = [ref for ref, _ in calls.values()]
        try:
            values = ray.get(refs, timeout=self.timeout)
            out = dict(zip(calls, values))
        except (RayActorError, GetTimeoutError):
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout)
            ready, out = set(ready), {}
            for s, (ref, _) in calls.items():
                if ref not in ready:
                    self.mark_down(s, probe=ref)
                    continue
                try:
                    out[s] = ray.get(ref)
                except RayActorError:
                    self.mark_down(s)
        for s, value in out.items():
            self.note(s, calls[s][1], value[1])
        return out

    def note(self, s: int, seq: int, stats: tuple) -> None:
        if self._stats[s] is None or seq > self._stats[s][0]:
            self._stats[s] = (seq, stats)
        if stats[3] > self.max_leaf:
            self.max_leaf = stats[3]

    def mark_down(self, s: int, probe=None) -> None:
        self.down[s], self._stats[s] = True, None
        self._pending[s], self._pending_rows[s] = [], 0
        if probe is not None:
            self._probes[s] = probe

    # -- stats -----------------------------------------------------------------------
    def revive(self) -> list:
        """Down shards whose background probe has answered are up again; returns them."""
        back = []
        for s in range(self.n):
            if not self.down[s]:
                continue
            ref = self._probes[s]
            if ref is not None:
                ready, _ = ray.wait([ref], timeout=0)
                if not ready:
                    continue
                self._probes[s] = None
                try:
                    ray.get(ref)
                    self.down[s] = False
                    back.append(s)
                    continue
                except RayActorError:
                    pass
            self._probes[s] = self.actors[s].stats.remote(None, self.max_leaf)
        return back

    def live(self) -> list:
        """Shards not known to be down. When every shard is down, wait up to
        ``timeout`` for one of their probes to answer."""
        self.revive()
        if all(self.down):
            probes = [p for p in self._probes if p is not None]
            if probes:
                ray.wait(probes, num_returns=1, timeout=self.timeout)
            self.revive()
        return [s for s in range(self.n) if not self.down[s]]

    def probe(self) -> dict:
        """Fresh stats of every live shard (carrying their pending updates): one round trip."""
        self.revive()
        calls = {s: self.call(s, "stats") for s in range(self.n) if not self.down[s]}
        out = {s: v[1] for s, v in self.collect(calls).items()}
        back = self.revive()  # background probes that answered meanwhile: ask those too
        if back:
            out.update({s: v[1] for s, v in self.collect({s: self.call(s, "stats") for s in back}).items()})
        return out

    def cached(self) -> dict:
        """The newest stats each live shard reported (probing any that has none)."""
        self.revive()
        if any(not self.down[s] and self._stats[s] is None for s in range(self.n)):
            return self.probe()
        return {s: self._stats[s][1] for s in range(self.n) if not self.down[s]}

    # -- priority updates ----------------------------------------------------------------
    def queue_update(self, s: int, slots, stamps, priorities) -> None:
        if self.down[s]:
            return
        self._pending[s].append((slots, stamps, priorities))
        self._pending_rows[s] += slots.shape[0]
        if self._pending_rows[s] >= self.max_pending:
            ref, seq = self.call(s, "update")
            self._updates.append((ref, s, seq))
            self.reap(self.max_in_flight)

    def send_updates(self) -> None:
        """Send every pending update on its own."""
        for s in range(self.n):
            if self._pending[s]:
                ref, seq = self.call(s, "update")
                self._updates.append((ref, s, seq))

    def reap(self, most: int) -> None:
        """Collect finished update calls; wait until at most ``most`` are in flight.
        A shard's error (a raw index never written) is raised here."""
        if not self._updates:
            return
        refs = [u[0] for u in self._updates]
        want = len(refs) - most
        if want > 0:
            ready, _ = ray.wait(refs, num_returns=want)
        else:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        ready = set(ready)
        done = [u for u in self._updates if u[0] in ready]
        self._updates = [u for u in self._updates if u[0] not in ready]
        for ref, s, seq in done:
            try:
                self.note(s, seq, ray.get(ref)[1])
            except RayActorError:
                self.mark_down(s)

    @property
    def updates_in_flight(self) -> int:
        return len(self._updates)
