"""The DQN Replay Dataset's files: Dopamine's replay checkpoints, read as plain arrays.

A run directory (Agarwal et al. 2020; Dopamine's ``OutOfGraphReplayBuffer.save``,
batch_rl's logged buffer) holds, for each checkpoint ``N``, six gzip-wrapped
``.npy`` files::

    $store$_observation_ckpt.N.gz   uint8 (C, 84, 84)   one frame a slot (stacks made at sample time)
    $store$_action_ckpt.N.gz        int32 (C,)
    $store$_reward_ckpt.N.gz        float32 (C,)
    $store$_terminal_ckpt.N.gz      uint8 (C,)          1 on the last step of an episode
    add_count_ckpt.N.gz             int64 ()            adds the circular buffer saw (pads included)
    invalid_range_ckpt.N.gz         int (K + h,)        slots next to the cursor that are not sampleable

The rules that make transitions of them (the format's, restated): the buffer
is a ring of ``C`` slots; add ``i`` went to slot ``i % C``, so the cursor is
``c = add_count % C`` and, once ``add_count >= C``, the oldest slot is ``c``.
Before the first step of every episode ``K - 1`` all-zero pads were added
(observation 0, action 0, reward 0, terminal 0), so a stack of ``K``
frames ending at slot ``i`` (slots ``i-K+1 .. i``) begins with zero frames
early in an episode. Slot ``i`` is a sampleable one-step transition when

- the ring is full, or ``K - 1 <= i < c - h`` (written, its successor too);
- ``i`` is not in the invalid range ``c-h, ..., c+K-1`` (modulo ``C``): the
  newest slots, whose successor is not written, and the oldest, whose
  stack would reach across the cursor into newer data;
- no slot of ``i-K+1 .. i-1`` is terminal (the stack stays in one episode).

Its ``obs`` is the stack ending at ``i``, ``next_obs`` the one ending at
``i+1`` (for a terminal slot that is the episode's last frames and a zero
pad: Dopamine returns it and marks it terminal), ``action``, ``reward`` and
``terminal`` those of slot ``i``.

Everything read here is untrusted input: names resolved inside the run
directory, symlinks and special files refused without blocking, npy headers
parsed without ``pickle`` and bounded, sizes checked against the compressed
files (deflate expands at most ~1032x) before anything is allocated, a
truncated file caught from its gzip trailer before any frame is read, every
value checked against the rules above. A refusal is ``OfflineDatasetError``
naming the file and the value.
"""

from __future__ import annotations

import ast
import os
import queue
import re
import stat
import struct
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InvalidArgumentError, InvalidTypeError, OfflineDatasetError, PathNotFoundError
from ..common.files import open_regular

__all__ = ["Checkpoint", "scan_run", "valid_slots", "is_dqn_replay", "stream_transitions", "KINDS"]

STORE = "$store$_"
KINDS = ("observation", "action", "reward", "terminal", "add_count", "invalid_range")
_FILE = re.compile(r"(?:\$store\$_(observation|action|reward|terminal)|(add_count|invalid_range))"
                   r"_ckpt\.(\d{1,9})\.gz")
# What the format writes, per file: (accepted descrs, ndim). add_count is np.array(0) (int64;
# int32 where a C long is 32 bits); invalid_range a list of Python ints made an array, and
# float zeros before the first add.
_DESCR = {"observation": ({"|u1"}, 3), "action": ({"<i4"}, 1), "reward": ({"<f4"}, 1),
          "terminal": ({"|u1"}, 1), "add_count": ({"<i8", "<i4"}, 0),
          "invalid_range": ({"<i8", "<i4", "<f8"}, 1)}
_ITEM = {"|u1": 1, "<i4": 4, "<f4": 4, "<i8": 8, "<f8": 8}

MAX_CAPACITY = 1 << 27           # slots a checkpoint may declare (the dataset's are 1,000,000)
MAX_FRAME_BYTES = 1 << 20        # bytes of one frame (84 x 84 = 7,056)
MAX_HEADER = 4096                # bytes of an npy header (numpy writes 118 for these arrays)
MAX_HORIZON = 1000               # update_horizon an invalid range may imply
MAX_ADD_COUNT = 1 << 50
DEFLATE_RATIO = 1032             # the most a deflate stream expands (258 bytes from 2 bits, and headers)
_MAGIC = b"\x93NUMPY"
_GZ_MAGIC = b"\x1f\x8b\x08"
_READ = 1 << 20                  # decompressed bytes a skip asks for at a time
_INFLATE = 1 << 18               # decompressed bytes one zlib call gives at most: a convert's
                                 # garbage stays small (a long run's heap does not fragment)


def file_name(kind: str, n: int) -> str:
    return f"{STORE if kind in KINDS[:4] else ''}{kind}_ckpt.{n}.gz"


def is_dqn_replay(path) -> bool:
    """Whether ``path`` is a directory holding at least one DQN Replay observation file."""
    try:
        return os.path.isdir(path) and any(
            (m := _FILE.fullmatch(e)) and m.group(1) == "observation" for e in os.listdir(path))
    except OSError:
        return False


def _err(path, what: str) -> OfflineDatasetError:
    return OfflineDatasetError(f"DQN Replay checkpoint file {path}: {what}")


# -- one file -------------------------------------------------------------------------
@dataclass
class Member:
    """One gzip-wrapped ``.npy`` file of a checkpoint: where it is and what its header says."""

    kind: str
    path: Path                   # for messages and re-opening (inside the run directory)
    size: int                    # bytes of the gzip file
    ident: tuple                 # (st_dev, st_ino, st_size, st_mtime_ns): the file as scanned
    descr: str = ""
    shape: tuple = ()
    offset: int = 0              # bytes of the npy header in the decompressed stream

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _ITEM[self.descr]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.descr)


class _Gunzip:
    """A gzip file's decompressed bytes, read forward: ``read(n)`` gives exactly
    ``n`` bytes or raises ``OfflineDatasetError`` naming the file (truncated,
    not gzip, a bad CRC); ``finish()`` checks that nothing follows. One member,
    as Dopamine writes it. zlib releases the GIL while it inflates, so threads
    decompress on every core."""

    def __init__(self, dir_fd: int, member: Member):
        self.m = member
        try:
            fd = open_regular(member.path.name, dir_fd=dir_fd, error=OfflineDatasetError)
        except OfflineDatasetError as e:
            raise _err(member.path, f"not a regular file ({e})") from None
        except FileNotFoundError:
            raise _err(member.path, "disappeared while converting") from None
        self.f = os.fdopen(fd, "rb", buffering=0)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != member.ident:
            self.f.close()
            raise _err(member.path, "changed since the run directory was scanned (another file, size or "
                                    "modification time); nothing of it was used")
        self.z = zlib.decompressobj(31)
        self.pending = b""
        self.done = False

    def close(self) -> None:
        self.f.close()

    def read(self, n: int, out: memoryview | None = None) -> bytes | None:
        """``n`` bytes (into ``out`` when given, returning None)."""
        got = 0
        parts = []
        while got < n:
            take = self.pending or self._inflate(n - got)
            if not take:
                raise _err(self.m.path, f"ends after {self.z_total():,} decompressed bytes, {n - got:,} short "
                                        "of what its npy header declares (truncated)")
            self.pending = take[n - got:]
            take = take[:n - got]
            if out is not None:
                out[got:got + len(take)] = take
            else:
                parts.append(take)
            got += len(take)
        return None if out is not None else b"".join(parts)

    def z_total(self) -> int:
        return getattr(self, "_total", 0)

    def _inflate(self, want: int) -> bytes:
        while True:
            if self.z.unconsumed_tail:
                src = self.z.unconsumed_tail
            elif self.z.eof:
                return b""
            else:
                src = self.f.read(1 << 20)
                if not src:
                    return b""
            try:
                out = self.z.decompress(src, min(max(want, 1 << 16), _INFLATE))
            except zlib.error as e:
                raise _err(self.m.path, f"is not a valid gzip file ({e})") from None
            if out:
                self._total = self.z_total() + len(out)
                return out

    def skip(self, n: int) -> None:
        left = n
        while left:
            k = min(left, _READ)
            self.read(k)
            left -= k

    def finish(self) -> None:
        """The rest of the stream must be empty, the gzip trailer (CRC, size) sound,
        and nothing may follow the member."""
        if self.pending or self._inflate(1 << 16):
            raise _err(self.m.path, f"holds more data than its npy header declares ({self.m.shape}, "
                                    f"{self.m.descr})")
        if not self.z.eof:
            raise _err(self.m.path, "ends before its gzip trailer (truncated)")
        if self.z.unused_data.strip(b"\0") or self.f.read(1 << 16).strip(b"\0"):
            raise _err(self.m.path, "has data after its gzip member (one member is what Dopamine writes)")


def _open_member(dir_fd: int, run: Path, name: str, kind: str) -> Member:
    path = run / name
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise _err(path, "is missing: a checkpoint needs all six files "
                         f"({', '.join(file_name(k, 'N') for k in KINDS)})") from None
    if stat.S_ISLNK(st.st_mode):
        raise _err(path, "is a symlink; the files of a run are read only as regular files inside it")
    if not stat.S_ISREG(st.st_mode):
        raise _err(path, f"is not a regular file (mode {stat.filemode(st.st_mode)}); FIFOs, devices and "
                         "directories are refused without being opened")
    m = Member(kind, path, int(st.st_size), (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    g = _Gunzip(dir_fd, m)
    try:
        head = os.pread(g.f.fileno(), 3, 0)
        if head != _GZ_MAGIC:
            raise _err(path, f"is not a gzip file (it starts with {head!r}, not {_GZ_MAGIC!r})")
        if m.size < 18:
            raise _err(path, f"is {m.size} bytes, shorter than any gzip file (truncated)")
        _read_header(g, m)
        if m.nbytes + m.offset > m.size * DEFLATE_RATIO + (1 << 16):
            raise _err(path, f"declares {m.nbytes:,} bytes of data ({m.shape}, {m.descr}) in {m.size:,} "
                             "compressed bytes, more than deflate can expand to (truncated or crafted)")
        (isize,) = struct.unpack("<I", os.pread(g.f.fileno(), 4, m.size - 4))
        if isize != (m.nbytes + m.offset) % (1 << 32):
            raise _err(path, f"its gzip trailer says {isize:,} bytes (mod 2**32) where its npy header declares "
                             f"{m.nbytes + m.offset:,} (truncated, or not one gzip member)")
    finally:
        g.close()
    return m


def _read_header(g: _Gunzip, m: Member) -> None:
    """Parse the npy header at the start of ``g`` into ``m`` (no pickle, bounded)."""
    lead = g.read(8)
    if lead[:6] != _MAGIC:
        raise _err(m.path, f"does not hold an npy array (it starts with {lead[:6]!r}, not {_MAGIC!r})")
    major = lead[6]
    if major not in (1, 2, 3):
        raise _err(m.path, f"npy format version {major}.{lead[7]} is not one numpy writes (1, 2 or 3)")
    size = 2 if major == 1 else 4
    (hlen,) = struct.unpack("<H" if size == 2 else "<I", g.read(size))
    if hlen > MAX_HEADER:
        raise _err(m.path, f"declares an npy header of {hlen:,} bytes (at most {MAX_HEADER:,} are read)")
    text = g.read(hlen)
    try:
        d = ast.literal_eval(text.decode("latin1" if major < 3 else "utf8"))
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError, TypeError):
        raise _err(m.path, f"npy header {text[:120]!r} is not a literal dict") from None
    if not isinstance(d, dict) or set(d) != {"descr", "fortran_order", "shape"}:
        raise _err(m.path, f"npy header {d!r:.200} does not have exactly descr, fortran_order, shape")
    descr, fortran, shape = d["descr"], d["fortran_order"], d["shape"]
    accepted, ndim = _DESCR[m.kind]
    if not isinstance(descr, str) or descr not in accepted:
        raise _err(m.path, f"dtype {descr!r:.80} is not the format's ({' or '.join(sorted(accepted))})")
    if fortran is not False:
        raise _err(m.path, f"fortran_order={fortran!r:.40}; the format's arrays are in C order")
    if (not isinstance(shape, tuple) or len(shape) != ndim
            or not all(type(s) is int and 0 <= s < (1 << 40) for s in shape)):
        raise _err(m.path, f"shape {shape!r:.120} is not {ndim}-dimensional with sizes >= 0")
    m.descr, m.shape, m.offset = descr, shape, 8 + size + hlen


def _read_small(dir_fd: int, m: Member) -> np.ndarray:
    """The whole (small) array of ``m``, checked to the last byte."""
    g = _Gunzip(dir_fd, m)
    try:
        g.skip(m.offset)
        buf = bytearray(m.nbytes)
        g.read(m.nbytes, memoryview(buf))
        g.finish()
    finally:
        g.close()
    return np.frombuffer(buf, dtype=m.dtype).reshape(m.shape)


# -- one checkpoint -------------------------------------------------------------------
@dataclass
class Checkpoint:
    """One checkpoint ``n`` of a run: its files and what the format's rules make of them."""

    n: int
    run: Path
    members: dict
    capacity: int = 0            # C
    frame_shape: tuple = ()
    add_count: int = 0
    horizon: int = 1             # h, from the invalid range's length
    transitions: int = 0         # sampleable by the rules
    runs: int = 0                # maximal runs of consecutive sampleable positions
    lo: int = 0                  # frames needed, as stream positions [lo, hi]
    hi: int = -1
    files_bytes: int = 0
    _valid: np.ndarray | None = field(default=None, repr=False)

    @property
    def cursor(self) -> int:
        return self.add_count % self.capacity

    @property
    def full(self) -> bool:
        return self.add_count >= self.capacity

    def slot(self, pos):
        """Slot of stream position ``pos`` (positions count from the oldest slot)."""
        return (self.cursor + pos) % self.capacity if self.full else pos


def valid_slots(terminal: np.ndarray, add_count: int, invalid: np.ndarray, k: int, h: int) -> np.ndarray:
    """The format's sampleable slots as a bool mask of ``terminal``'s length (see the module doc)."""
    c_ = terminal.shape[0]
    cur = add_count % c_
    idx = np.arange(c_)
    ok = np.ones(c_, dtype=bool)
    if add_count < c_:
        ok &= (idx >= k - 1) & (idx < cur - h)
    if add_count > 0:
        ok[np.asarray(invalid, dtype=np.int64) % c_] = False
    t = terminal != 0
    for j in range(1, k):
        ok &= ~np.roll(t, j)
    return ok


def _load_checkpoint(dir_fd: int, ck: Checkpoint, k: int) -> dict:
    """Read and check the small files of ``ck``; fill its counts; return the arrays."""
    mem = ck.members
    obs = mem["observation"]
    c_ = obs.shape[0]
    h_, w_ = obs.shape[1:]
    if not 1 <= c_ <= MAX_CAPACITY:
        raise _err(obs.path, f"holds {c_:,} slots; a checkpoint holds 1 to {MAX_CAPACITY:,}")
    if not 1 <= h_ * w_ <= MAX_FRAME_BYTES:
        raise _err(obs.path, f"frames of shape {(h_, w_)} are not 1 to {MAX_FRAME_BYTES:,} bytes")
    for kind in ("action", "reward", "terminal"):
        if mem[kind].shape != (c_,):
            raise _err(mem[kind].path, f"has shape {mem[kind].shape}; the observation file "
                                       f"{obs.path.name} holds {c_:,} slots, so ({c_},) is expected")
    ac = mem["add_count"]
    add = _read_small(dir_fd, ac)
    add_count = int(add)
    if not 0 <= add_count <= MAX_ADD_COUNT:
        raise _err(ac.path, f"add_count {add_count} is out of range (0 to {MAX_ADD_COUNT:,})")
    if c_ < k + 1:
        raise _err(obs.path, f"holds {c_} slots, fewer than frame_stack {k} + 1")
    inv_m = mem["invalid_range"]
    if not k + 1 <= inv_m.shape[0] <= k + MAX_HORIZON:
        raise _err(inv_m.path, f"holds {inv_m.shape[0]} indices; the format's invalid range holds "
                               f"frame_stack ({k}) + update_horizon (1 to {MAX_HORIZON}), or {k} zeros before "
                               "the first add")
    inv = _read_small(dir_fd, inv_m)
    h = inv.shape[0] - k
    cur = add_count % c_
    if add_count > 0:
        want = (cur - h + np.arange(k + h)) % c_
        if inv.dtype.kind == "f" or not np.array_equal(inv, want):
            raise _err(inv_m.path, f"invalid range {inv[:8].tolist()}{'...' if inv.shape[0] > 8 else ''} is not "
                                   f"the one add_count {add_count:,} gives ({want[:8].tolist()}"
                                   f"{'...' if want.shape[0] > 8 else ''}: cursor {cur}, update_horizon {h}, "
                                   f"frame_stack {k})")
    if h > c_ - k:
        raise _err(inv_m.path, f"implies update_horizon {h}, too long for {c_} slots and frame_stack {k}")
    term = _read_small(dir_fd, mem["terminal"])
    written = min(add_count, c_)
    bad = np.flatnonzero(term[:written] > 1)
    if bad.size:
        raise _err(mem["terminal"].path, f"slot {bad[0]} holds terminal {term[bad[0]]}; the format's are 0 or 1")
    ok = valid_slots(term, add_count, inv, k, h)
    ck.capacity, ck.frame_shape, ck.add_count, ck.horizon = c_, (h_, w_), add_count, h
    pos = np.flatnonzero(ok[ck.slot(np.arange(written))]) if written else np.zeros(0, np.int64)
    ck.transitions = int(pos.shape[0])
    ck.runs = int(np.count_nonzero(np.diff(pos) != 1)) + 1 if pos.size else 0
    ck.lo, ck.hi = (int(pos[0]) - k + 1, int(pos[-1]) + 1) if pos.size else (0, -1)
    ck.files_bytes = sum(m.size for m in mem.values())
    return {"terminal": term, "positions": pos}


def scan_run(run_dir, *, frame_stack: int = 4, workers: int | None = None) -> list[Checkpoint]:
    """Every checkpoint of ``run_dir``, checked: names, file types, npy headers, sizes
    against the compressed files, gzip trailers, lengths and dtypes across the six
    files, add_count and the invalid range, terminal flags. Nothing is allocated
    beyond one checkpoint's small arrays at a time; no frame is decompressed.

    Parameters
    ----------
    run_dir : str or Path
        The directory of ``*_ckpt.N.gz`` files.
    frame_stack : int
        Frames per stack (Dopamine's ``stack_size``; 4 in the dataset). The files do not record it.
    workers : int, optional
        Threads that decompress the small files (default: one per core).

    Returns
    -------
    list of Checkpoint
        By checkpoint number; refusals are ``OfflineDatasetError`` naming the file.
    """
    run = Path(os.path.abspath(os.path.expanduser(run_dir)))
    try:
        dir_fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PathNotFoundError(f"run_dir={str(run_dir)!r} does not exist") from None
    except NotADirectoryError:
        raise InvalidArgumentError(f"run_dir={str(run_dir)!r} is not a directory of DQN Replay checkpoints") from None
    try:
        numbers: dict[int, set] = {}
        for e in os.listdir(dir_fd):
            m = _FILE.fullmatch(e)
            if m:
                numbers.setdefault(int(m.group(3)), set()).add(m.group(1) or m.group(2))
        if not numbers:
            raise OfflineDatasetError(f"run_dir={str(run)!r} holds no DQN Replay checkpoint "
                                      f"({file_name('observation', 'N')} and its five companions)")
        cks = []
        for n in sorted(numbers):
            members = {kind: _open_member(dir_fd, run, file_name(kind, n), kind) for kind in KINDS}
            cks.append(Checkpoint(n, run, members))
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=_workers(workers)) as pool:
            for _ in pool.map(lambda ck: _load_checkpoint(dir_fd, ck, frame_stack), cks):
                pass
        first = cks[0]
        for ck in cks[1:]:
            if ck.frame_shape != first.frame_shape:
                raise _err(ck.members["observation"].path, f"frames of shape {ck.frame_shape}; checkpoint "
                                                           f"{first.n}'s are {first.frame_shape}")
        return cks
    finally:
        os.close(dir_fd)


def _workers(workers) -> int:
    if workers is None:
        return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise InvalidArgumentError(f"workers must be an int >= 1, got {workers!r}")
    return int(workers)


# -- streaming a checkpoint's transitions ------------------------------------------------
def _frame_chunks(dir_fd: int, ck: Checkpoint, rows: int, stop: threading.Event, take):
    """The frames of stream positions ``ck.lo .. ck.hi`` in order, as ``(first position,
    buffer, m)`` chunks: ``m`` frames in ``buffer[head:head + m]`` of a buffer ``take()``
    gives (None: stopped); every byte of the file is decompressed and checked."""
    m = ck.members["observation"]
    c_ = ck.capacity
    row = int(np.prod(ck.frame_shape))
    s, e = ck.slot(ck.lo), ck.slot(ck.hi)
    # slot segments in stream order: one, or two when the positions wrap past slot C-1
    segs = [(s, e, ck.lo)] if s <= e else [(s, c_ - 1, ck.lo), (0, e, ck.lo + c_ - s)]
    for k, (a, b, p0) in enumerate(segs):
        g = _Gunzip(dir_fd, m)
        try:
            g.skip(m.offset + a * row)
            at = a
            while at <= b:
                buf = take()
                if buf is None:
                    return
                n = min(rows, b + 1 - at)
                head = buf.shape[0] - rows
                g.read(n * row, memoryview(buf[head:head + n]).cast("B"))
                yield p0 + at - a, buf, n
                at += n
            if k == 0:  # it reaches the file's end (the second segment starts over at slot 0)
                g.skip((c_ - 1 - b) * row)  # the rest: the CRC covers every byte
                g.finish()
        finally:
            g.close()


class _Prefetch:
    """A thread that decompresses a checkpoint's frames ahead into a bounded queue
    (off the writer's thread, on another core); exceptions come out where the item
    would. Its frame buffers are recycled (``depth + 3`` of them, each ``head`` free
    frames before ``rows``): the consumer puts the window's last frames in the head
    and gives a buffer back (``give``) once done with it, so a long convert
    allocates no frames after its first chunks."""

    _END = object()

    def __init__(self, dir_fd: int, ck: Checkpoint, rows: int, depth: int, head: int):
        self.head = head
        rows = max(1, min(rows, ck.hi - ck.lo + 1))
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.free: queue.Queue = queue.Queue()
        for _ in range(depth + 3):  # queued, being filled, being read, the one before it
            self.free.put(None)  # (allocated on first use)
        self.shape = (head + rows, *ck.frame_shape)
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, args=(lambda: _frame_chunks(dir_fd, ck, rows, self.stop,
                                                                                 self._take),),
                                  daemon=True, name="bigper-gunzip")
        self.t.start()

    def _run(self, gen_fn) -> None:
        try:
            for item in gen_fn():
                if not self._put(item):
                    return
            self._put(self._END)
        except BaseException as e:  # handed to the consumer
            self._put(e)

    def _take(self):
        """A free buffer; None once stopped."""
        while not self.stop.is_set():
            try:
                buf = self.free.get(timeout=0.1)
            except queue.Empty:
                continue
            return np.empty(self.shape, dtype=np.uint8) if buf is None else buf
        return None

    def give(self, buf: np.ndarray | None) -> None:
        """A buffer done with, back to the pool (None: the pool makes a new one in its place)."""
        self.free.put(buf)

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def __iter__(self):
        while True:
            item = self.q.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self.stop.set()
        self.t.join()


def open_run(run_dir) -> int:
    run = Path(os.path.abspath(os.path.expanduser(run_dir)))
    return os.open(run, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def stream_transitions(dir_fd: int, ck: Checkpoint, k: int, *, chunk: int = 1024, rows: int = 2048,
                       depth: int = 4, prefetch=None, recycle: bool = False):
    """The sampleable transitions of ``ck`` in stream order (the order they were added), as
    dicts of ``obs``/``next_obs`` ``(B, k, H, W)`` uint8, ``action`` int32, ``reward`` float32,
    ``terminated`` and ``truncated`` bool. The last transition before a position that is not
    sampleable (the next episode's pads, the cursor, the end) ends its bigper episode:
    ``terminated`` where the slot is terminal, else ``truncated`` (the bootstrap is kept),
    so no stack or n-step window ever joins transitions the format does not join.
    The stacks are read-only views of the decompressed frames. With ``recycle`` their
    buffers are used again for later chunks (a long convert allocates nothing more): a
    dict's stacks then hold only until the next dict is asked for. Without it every
    chunk's frames are new and every dict's stacks hold as long as they are kept.

    ``prefetch``: a started ``_Prefetch`` of this checkpoint's frames (the caller may start
    the next checkpoint's while this one is written); default: one started here."""
    # (checked here, at the call: a generator's body would only check at the first next())
    if not isinstance(recycle, (bool, np.bool_)):
        raise InvalidTypeError(f"recycle must be a bool, got {type(recycle).__name__} {recycle!r:.80}")
    return _stream(dir_fd, ck, k, chunk=chunk, rows=rows, depth=depth, prefetch=prefetch, recycle=bool(recycle))


def _stream(dir_fd: int, ck: Checkpoint, k: int, *, chunk: int, rows: int, depth: int, prefetch, recycle: bool):
    again = Checkpoint(ck.n, ck.run, ck.members)
    small = _load_checkpoint(dir_fd, again, k)
    if (again.transitions, again.add_count) != (ck.transitions, ck.add_count):
        raise _err(ck.members["terminal"].path, "changed since the run directory was scanned")
    pos = small["positions"]
    if pos.size == 0:
        return
    slots = ck.slot(pos)
    term = small["terminal"][slots] != 0
    action = _read_small(dir_fd, ck.members["action"])[slots]
    reward = _read_small(dir_fd, ck.members["reward"])[slots]
    ends = np.ones(pos.shape[0], dtype=bool)
    ends[:-1] = np.diff(pos) != 1
    truncated = ends & ~term
    # run_end[i]: one past the last transition of the contiguous run of positions holding i
    brk = np.flatnonzero(ends) + 1
    run_end = np.repeat(brk, np.diff(np.concatenate([[0], brk])))
    own = prefetch is None
    pf = prefetch or prefetch_frames(dir_fd, ck, k, rows=rows, depth=depth)
    if pf.head < k:
        raise InvalidArgumentError(f"prefetch: a prefetch of {pf.head} head frames cannot hold stacks of {k}")
    try:
        prev = None  # the buffer of the previous chunk, and its window
        i = 0  # next transition (index into pos) to emit
        for p0, buf, m in pf:
            h, t = pf.head, 0
            if prev is not None:  # the previous window's last frames go before this chunk's
                t = min(k, prev[1].shape[0])
                buf[h - t:h] = prev[1][-t:]
                pf.give(prev[0] if recycle else None)  # (None: the pool makes a new one)
            win = buf[h - t:h + m]
            w0 = p0 - t
            w1 = w0 + win.shape[0]
            j = int(np.searchsorted(pos, w1 - 1, side="left"))  # transitions whose next frame is in
            st = np.lib.stride_tricks.as_strided(
                win, shape=(max(0, win.shape[0] - k + 1), k, *ck.frame_shape), strides=(win.strides[0],) + win.strides,
                writeable=False)
            while i < j:
                # one contiguous run of positions at a time: its stacks are slices of the
                # window (views), not gathered copies
                b = min(j, i + chunk, int(run_end[i]))
                q = int(pos[i]) - w0 - k + 1
                yield {"obs": st[q:q + b - i], "next_obs": st[q + 1:q + 1 + b - i], "action": action[i:b],
                       "reward": reward[i:b], "terminated": term[i:b], "truncated": truncated[i:b]}
                i = b
            prev = (buf, win)
        if i != pos.shape[0]:
            raise _err(ck.members["observation"].path, f"gave frames for {i:,} of {pos.shape[0]:,} transitions")
    finally:
        if own:
            pf.close()


def prefetch_frames(dir_fd: int, ck: Checkpoint, k: int, *, rows: int = 2048, depth: int = 4) -> _Prefetch:
    """Start decompressing ``ck``'s frames in a thread, for stacks of ``k`` (see ``stream_transitions``)."""
    return _Prefetch(dir_fd, ck, rows, depth, k)