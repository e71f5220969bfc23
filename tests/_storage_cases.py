"""Shared pieces of the storage tests: how to open each storage on a real
path, a plain copy of what was added, and a child process that holds a
storage open on command (for locks and killed writers)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

import bigper

DISK = ("memmap", "hdf5")
ROOT = Path(__file__).resolve().parents[1]


def where(kind: str, tmp: Path, name: str = "buf") -> Path | None:
    """The path a storage of ``kind`` lives at under ``tmp`` (None in memory)."""
    if kind == "memory":
        return None
    return tmp / (f"{name}.h5" if kind.startswith("hdf5") else name)


def open_buffer(kind: str, path, capacity, fields, **kw) -> bigper.PrioritizedReplayBuffer:
    """``kind`` is a storage, or ``"hdf5-lzf"`` for compressed HDF5."""
    if kind == "hdf5-lzf":
        kw["storage_options"] = {"compression": "lzf"}
        kind = "hdf5"
    if kind != "memory":
        kw["path"] = path
        kw.setdefault("mode", "resume")  # these tests reopen on purpose
    return bigper.PrioritizedReplayBuffer(capacity, fields, storage=kind, **kw)


def random_values(rng: np.random.Generator, shape: tuple, dtype, extremes: bool = True) -> np.ndarray:
    """Values spanning the dtype's range, its extremes (and NaN, inf) included
    unless ``extremes`` is False."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if dt.kind in "iu":
        info = np.iinfo(dt)
        v = rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
        flat = v.reshape(-1)
        if extremes and flat.size >= 2:
            flat[0], flat[-1] = info.min, info.max
        return v
    info = np.finfo(dt)
    v = (rng.standard_normal(shape) * 1e3).astype(dt)
    flat = v.reshape(-1) if extremes else v.reshape(-1)[:0]
    special = [info.max, info.min, info.tiny, -0.0, np.nan, np.inf]
    k = min(flat.size, len(special))
    flat[:k] = special[:k]
    return v


class Stream:
    """Random steps for ``fields`` (plus ``next_<name>`` for ``next_of`` and the
    episode flags), fed to any number of buffers, with a copy of every step kept
    in the order added: with one env the i-th is at slot ``i % capacity``."""

    def __init__(self, fields: dict, next_of=(), num_envs: int = 1, seed: int = 0,
                 end_rate: float = 0.2, extremes: bool = True):
        self.fields, self.next_of, self.k = fields, tuple(next_of), num_envs
        self.extremes = extremes
        self.rng = np.random.default_rng(seed)
        self.end_rate = end_rate
        self.added: list[dict] = []  # one dict per transition (per env step)

    def steps(self, m: int) -> dict:
        """``m`` steps: every value has a leading (m,) or (m, num_envs) axis."""
        lead = (m,) if self.k == 1 else (m, self.k)
        out = {n: random_values(self.rng, lead + tuple(s), d, self.extremes)
               for n, (s, d) in self.fields.items()}
        for n in self.next_of:
            s, d = self.fields[n]
            out[f"next_{n}"] = random_values(self.rng, lead + tuple(s), d, self.extremes)
        out["terminated"] = self.rng.random(lead) < self.end_rate
        out["truncated"] = ~out["terminated"] & (self.rng.random(lead) < self.end_rate / 2)
        flat = {n: v.reshape((m * self.k,) + v.shape[len(lead):]) for n, v in out.items()}
        self.added += [{n: v[i] for n, v in flat.items()} for i in range(m * self.k)]
        return out

    def add(self, bufs, m: int = 1) -> None:
        """``m`` calls of ``add`` on every buffer in ``bufs``."""
        for _ in range(m):
            step = {n: v[0] for n, v in self.steps(1).items()}
            for b in bufs:
                b.add(**step)

    def extend(self, bufs, m: int) -> None:
        data = self.steps(m)
        for b in bufs:
            b.extend(data)

    def expected(self, slots: np.ndarray, capacity: int) -> dict:
        """What each slot holds now: the latest transition ``i`` with ``i % capacity == slot``."""
        n = len(self.added)
        out = {}
        for s in slots:
            i = n - 1 - ((n - 1 - int(s)) % capacity)
            assert 0 <= i < n and i % capacity == s
            for name, v in self.added[i].items():
                out.setdefault(name, []).append(v)
        return {name: np.stack(v) for name, v in out.items()}


def file_sizes(path: Path) -> dict[str, int]:
    """Size of every regular file at or under ``path`` (the lock files excluded)."""
    path = Path(path)
    if path.is_file():
        return {path.name: path.stat().st_size}
    return {str(p.relative_to(path)): p.stat().st_size
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".lock"}


def file_bytes(path: Path) -> dict[str, bytes]:
    path = Path(path)
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes()
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".lock"}


# A child that opens a buffer when told to and answers one line per command:
#   open KIND PATH writer|reader  ->  "ok" or "err <ExceptionClass> <message>"
#   add N                           ->  adds N steps to the open buffer, "ok"
#   close                           ->  "ok"
# It never closes on its own: killing it is how a test leaves a lock behind.
_AGENT = textwrap.dedent("""
    import sys
    import numpy as np
    import bigper
    FIELDS = {"obs": ((3,), np.float32), "reward": ((), np.float32)}
    # warm up (imports, numba's cached kernels) before the first command
    buf = bigper.PrioritizedReplayBuffer(16, FIELDS)
    buf.add(obs=np.zeros(3, np.float32), reward=np.float32(0), next_obs=np.zeros(3, np.float32))
    buf.update_priorities(buf.sample(2), np.ones(2))
    buf = None
    for line in sys.stdin:
        cmd = line.split()
        try:
            if cmd[0] == "open":
                kind, path, role = cmd[1:]
                buf = bigper.PrioritizedReplayBuffer(16, FIELDS, storage=kind, path=path, mode="resume",
                                                     read_only=role == "reader")
            elif cmd[0] == "add":
                for i in range(int(cmd[1])):
                    buf.add(obs=np.full(3, i, np.float32), reward=np.float32(i),
                            next_obs=np.full(3, i + 1, np.float32))
            elif cmd[0] == "close":
                buf.close()
            print("ok", flush=True)
        except Exception as e:
            print("err", type(e).__name__, str(e).replace("\\n", " "), flush=True)
""")

AGENT_FIELDS = {"obs": ((3,), np.float32), "reward": ((), np.float32)}


class Agent:
    """A child process holding storages open on command (see ``_AGENT``)."""

    def __init__(self):
        from tests._child import Child

        self.child = Child(_AGENT, stdin=True, cwd=str(ROOT))
        self.proc = self.child.proc

    def ask(self, line: str) -> str:
        """Its answer to ``line``; a child that dies or hangs fails the test, with its stderr."""
        self.child.send(line)
        return self.child.line().strip()

    def kill(self) -> None:
        """SIGKILL: no close, no flush, no atexit; the kernel drops its locks."""
        self.child.kill()
        self.child.close()

    def stop(self) -> None:
        self.child.close()


class AgentPool:
    """Hands out fresh agents, keeping one spare starting up in the background
    so a test does not wait for a child's imports."""

    def __init__(self):
        self.spare: Agent | None = None
        self.given: list[Agent] = []

    def take(self) -> Agent:
        a = self.spare or Agent()
        self.spare = Agent()
        self.given.append(a)
        return a

    def stop(self) -> None:
        for a in self.given + [self.spare]:
            if a is not None:
                a.stop()
