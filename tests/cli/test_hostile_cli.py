"""The command line against bad paths and bad files (issue 23, section 5):
every subcommand, run in a real subprocess with a timeout, answers a path
that is missing, a FIFO, a symlink loop, a dangling symlink, a directory
where a file belongs, a file of random bytes, a truncated snapshot, a file
it cannot read, with one line on stderr naming it and an exit status (2 for
a path it cannot use; 1 where ``info``/``verify`` document "corrupt"),
never a traceback or a hang, and with every file left as it was.

The calls on the shared ``world`` run in one child interpreter between them
(tests/_child_batch.py: each call its own ``python -m bigper`` run, reported
apart, with the world's fingerprint right before it and right after what its
exit does); the others each in a child of their own."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests._child_batch import run_batch
from tests._hostile_snapshot_cases import fingerprint
from tests._snapshot_cases import Stream, feed, make

ROOT = Path(__file__).resolve().parents[2]
SCORE = "import numpy as np\ndef score(batch):\n    return np.ones(len(batch.indices))\n"


def cli(*args, timeout: float = 60, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        r = subprocess.run([sys.executable, "-m", "bigper", *map(str, args)], capture_output=True,
                           text=True, timeout=timeout, env=env, cwd=cwd or ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"bigper {' '.join(map(str, args))} still ran after {timeout} s (a hang)")
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    return r


def one_line(r, *names) -> str:
    """The single stderr line of a refusal; it names each of ``names``."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for n in names:
        assert str(n) in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One of each hostile path, plus a good snapshot, storage and dataset."""
    t = tmp_path_factory.mktemp("cli")
    os.mkfifo(t / "fifo")
    os.symlink(t / "loop2", t / "loop1")
    os.symlink(t / "loop1", t / "loop2")
    os.symlink(t / "nowhere", t / "dangling")
    (t / "emptydir").mkdir()
    (t / "random.bin").write_bytes(np.random.default_rng(0).bytes(5000))
    (t / "userdir").mkdir()
    (t / "userdir" / "notes.txt").write_text("mine")
    stream = Stream(k=None, seed=1)
    buf = make("memmap", t / "mm", stream, capacity=16)
    feed(buf, stream, 5)
    buf.save(t / "snap")
    buf.close()
    shutil.copytree(t / "snap", t / "truncated")
    raw = (t / "truncated" / "manifest.json").read_bytes()
    (t / "truncated" / "manifest.json").write_bytes(raw[:len(raw) // 2])
    shutil.copytree(t / "mm", t / "mm-dangling")
    os.symlink(t / "nowhere", t / "mm-dangling" / "data" / "zz.bin")
    with h5py.File(t / "ds.h5", "w") as f:
        f["observations"] = np.zeros((10, 3), np.float32)
        f["actions"] = np.zeros((10, 1), np.float32)
        f["rewards"] = np.zeros(10, np.float32)
        f["terminals"] = np.zeros(10, bool)
        f["timeouts"] = np.zeros(10, bool)
    (t / "score.py").write_text(SCORE)
    return t


BAD = ["missing", "fifo", "loop1", "dangling", "emptydir", "random.bin"]
NO_SIDECAR = ["userdir", "ds.h5", "fifo", "loop1", "dangling", "random.bin"]
BAD_RUN_DIR = ["fifo", "loop1", "dangling", "random.bin", "random.bin/sub", "userdir"]
BAD_BENCH_DIR = ["fifo", "loop1", "dangling", "random.bin"]

# Every call on ``world`` of the tests below: (test, its parameters) -> (argv, timeout).
WORLD_CALLS = {
    ("info_dangling_in_data",): (lambda w: ["info", w / "mm-dangling"], 60),
    **{("no_sidecar", bad): (lambda w, bad=bad: [
        "reprioritize", w / "ds.h5", "--score", f"{w / 'score.py'}:score", "--priorities", w / bad, "--no-progress"],
        60) for bad in NO_SIDECAR},
    **{("info", bad): (lambda w, bad=bad: ["info", w / bad], 60) for bad in BAD},
    **{("verify", bad): (lambda w, bad=bad: ["verify", w / bad], 60) for bad in BAD},
    **{("truncated", command): (lambda w, command=command: [command, w / "truncated"], 60)
       for command in ["info", "verify"]},
    **{("reprioritize", bad, where): (lambda w, bad=bad, where=where: [
        "reprioritize", w / bad if where == "dataset" else w / "ds.h5",
        "--score", f"{w / 'score.py'}:score" if where == "dataset" else f"{w / bad}:score", "--no-progress"], 60)
       for bad in BAD for where in ["dataset", "score"]},
    **{("demo", bad): (lambda w, bad=bad: [
        "demo", "--path", w / bad, "--steps", "10", "--capacity", "1000", "--no-progress"], 120)
       for bad in BAD_RUN_DIR},
    **{("bench", bad): (lambda w, bad=bad: ["bench", "snapshot", "--dir", w / bad], 120) for bad in BAD_BENCH_DIR},
}

# ``python -m bigper ARGS`` with ``world``'s fingerprint taken right before the call and
# right after what its exit does (pickled to a file of the parent's).
WORLD_CLI = """
import pickle, runpy, sys
from tests._hostile_snapshot_cases import fingerprint
world, prints = sys.argv[1], sys.argv[2]
del sys.argv[1:3]
before = fingerprint(world)


def after_exit():
    with open(prints, "wb") as f:
        pickle.dump((before, fingerprint(world)), f)


runpy.run_module("bigper", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def world_cli(world, tmp_path_factory):
    """Every call of WORLD_CALLS, run by one child interpreter (a batch: each call reported
    apart, a hang or a crash ends only its own call): key -> (result, world's fingerprint
    before and after the call)."""
    prints = tmp_path_factory.mktemp("prints")
    names = {key: "-".join(key).replace("/", "_") for key in WORLD_CALLS}
    world_before = fingerprint(world)
    results = {}
    for timeout in sorted({t for _, t in WORLD_CALLS.values()}):
        results.update(run_batch(WORLD_CLI, {names[k]: [world, prints / names[k], *argv(world)]
                                             for k, (argv, t) in WORLD_CALLS.items() if t == timeout},
                                 env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=timeout))
    world_after = fingerprint(world)
    out = {}
    for key, name in names.items():
        f = prints / name
        out[key] = (results[name], pickle.loads(f.read_bytes()) if f.exists() else None)
    return out, world_before, world_after


def world_call(world_cli, *key):
    """The result of the batched call ``key``, checked as ``cli`` checks a call; the world's
    fingerprints right before and after it (the exit's effects included)."""
    calls, world_before, world_after = world_cli
    r, prints = calls[key]
    argv, timeout = WORLD_CALLS[key]
    if r.timed_out:
        pytest.fail(f"bigper {' '.join(map(str, argv(Path('WORLD'))))} still ran after {timeout} s (a hang)")
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    assert prints is not None, (r.returncode, r.stdout, r.stderr)
    assert world_after == world_before  # and the whole batch changed nothing either
    return r, prints


def test_info_on_a_storage_with_a_dangling_symlink_in_data(world_cli):
    r, (before, after) = world_call(world_cli, "info_dangling_in_data")
    assert r.returncode == 0, r.stderr
    assert "capacity 16" in r.stdout and "zz.bin" in r.stdout  # the stray entry is named, not followed
    assert after == before


@pytest.mark.parametrize("bad", NO_SIDECAR)
def test_reprioritize_priorities_that_are_no_sidecar(world, world_cli, bad):
    r, (before, after) = world_call(world_cli, "no_sidecar", bad)
    assert r.returncode == 2, r.stdout + r.stderr
    one_line(r, world / bad)
    assert after == before


@pytest.mark.parametrize("bad", BAD)
def test_info_on_a_bad_path(world, world_cli, bad):
    r, (before, after) = world_call(world_cli, "info", bad)
    assert r.returncode == 2, r.stdout + r.stderr
    one_line(r, world / bad)
    assert after == before


@pytest.mark.parametrize("bad", BAD)
def test_verify_on_a_bad_path(world, world_cli, bad):
    r, (before, after) = world_call(world_cli, "verify", bad)
    # (an empty directory holds nothing of a snapshot: "not a snapshot or storage", exit 2, never
    # CORRUPT, which a cron check reads as damage; issue 45)
    assert r.returncode == 2, r.stdout + r.stderr
    assert str(world / bad) in r.stdout + r.stderr
    assert "CORRUPT" not in r.stdout, r.stdout
    assert after == before


@pytest.mark.parametrize("command", ["info", "verify"])
def test_a_truncated_snapshot_is_corrupt(world_cli, command):
    r, (before, after) = world_call(world_cli, "truncated", command)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "manifest.json" in r.stdout + r.stderr
    assert after == before


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("where", ["dataset", "score"])
def test_reprioritize_on_a_bad_path(world, world_cli, bad, where):
    r, (before, after) = world_call(world_cli, "reprioritize", bad, where)  # (WORLD_CALLS: the call)
    assert r.returncode == 2, r.stdout + r.stderr
    one_line(r, world / bad)
    assert after == before


@pytest.mark.parametrize("bad", BAD_RUN_DIR)
def test_demo_on_a_bad_run_directory(world, world_cli, bad):
    r, (before, after) = world_call(world_cli, "demo", bad)
    assert r.returncode == 2, r.stdout + r.stderr
    one_line(r, world / bad)
    assert after == before


@pytest.mark.parametrize("bad", BAD_BENCH_DIR)
def test_bench_on_a_bad_directory(world, world_cli, bad):
    r, (before, after) = world_call(world_cli, "bench", bad)
    assert r.returncode == 2, r.stdout + r.stderr
    one_line(r, world / bad)
    assert after == before


def test_a_snapshot_member_that_cannot_be_read(world, tmp_path):
    """chmod 000 means nothing to root: the real 'cannot open' is a member that
    is a FIFO (open would block) or a directory where a file belongs."""
    snap = tmp_path / "snap"
    shutil.copytree(world / "snap", snap)
    os.unlink(snap / "data" / "obs.bin")
    os.mkfifo(snap / "data" / "obs.bin")
    shutil.copytree(world / "snap", tmp_path / "snap2")
    os.unlink(tmp_path / "snap2" / "data" / "obs.bin")
    (tmp_path / "snap2" / "data" / "obs.bin").mkdir()
    before = fingerprint(tmp_path)
    for s in (snap, tmp_path / "snap2"):
        for command in ("verify", "info"):
            r = cli(command, s)
            assert r.returncode in ((1,) if command == "verify" else (0, 1)), r.stdout + r.stderr
            if command == "verify":
                assert "obs.bin" in r.stdout
    assert fingerprint(tmp_path) == before


@pytest.mark.parametrize("content", [b"def score(:\n", b"\x00\xff" * 100, b"\xff\xfe\x00garbage"])
def test_reprioritize_with_a_score_file_that_is_not_python(world, tmp_path, content):
    (tmp_path / "bad.py").write_bytes(content)
    before = fingerprint(world, tmp_path)
    r = cli("reprioritize", world / "ds.h5", "--score", f"{tmp_path / 'bad.py'}:score", "--no-progress")
    assert r.returncode == 2, r.stdout + r.stderr
    one_line(r, tmp_path / "bad.py")
    assert fingerprint(world, tmp_path) == before


# Root reads any file (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH): as root, the CLI runs as root
# without those two capabilities, so a mode-000 file is refused to it as to any user, while
# the checkout, the interpreter and the temporary folders (all root's) stay reachable
# wherever they are (a clone in a 0700 folder, an interpreter under /root).
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
          "--inh-caps=-dac_override,-dac_read_search"]


def unprivileged(cmd: list) -> list:
    return [*NO_DAC, *cmd] if os.geteuid() == 0 else cmd


@pytest.fixture
def unreadable(world, tmp_path):
    """Copies of a snapshot, a storage and a dataset whose key file is mode 000."""
    if os.geteuid() == 0:
        probe = tmp_path / "probe"
        probe.write_bytes(b"x")
        os.chmod(probe, 0)
        if shutil.which("setpriv") is None or subprocess.run(
                unprivileged(["cat", str(probe)]), capture_output=True).returncode == 0:
            pytest.skip("running as root without a way to drop CAP_DAC_OVERRIDE: no way to be refused a read")
    d = tmp_path / "unreadable"
    d.mkdir()
    shutil.copytree(world / "snap", d / "snap")
    shutil.copytree(world / "mm", d / "mm")
    shutil.copy(world / "ds.h5", d / "ds.h5")
    shutil.copy(world / "score.py", d / "score.py")
    (d / "numba").mkdir()
    for f in ("snap/manifest.json", "mm/meta.json", "ds.h5"):
        os.chmod(d / f, 0)
    yield d


def cli_unprivileged(d: Path, *args, code=None):
    cmd = unprivileged([sys.executable, *(["-c", code] if code else ["-m", "bigper"]), *map(str, args)])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(d / "numba")}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=d)
    except subprocess.TimeoutExpired:
        pytest.fail(f"bigper {' '.join(map(str, args))} still ran after 60 s")
    assert "Traceback" not in r.stderr, r.stderr
    return r


def test_the_unprivileged_cli_runs_the_checkout_under_test(unreadable):
    r = cli_unprivileged(unreadable, code="import bigper; print(bigper.__file__)")
    assert r.returncode == 0 and r.stdout.strip() == str(ROOT / "bigper" / "__init__.py"), r.stdout + r.stderr


@pytest.mark.parametrize("command", ["info", "verify", "reprioritize"])
@pytest.mark.parametrize("target", ["snap", "mm", "ds.h5"])
def test_an_unreadable_file(unreadable, command, target):
    before = fingerprint(unreadable / target)
    extra = ["--score", f"{unreadable / 'score.py'}:score", "--no-progress"] if command == "reprioritize" else []
    r = cli_unprivileged(unreadable, command, unreadable / target, *extra)
    assert r.returncode in (1, 2), r.stdout + r.stderr
    said = (r.stdout + r.stderr).strip()
    assert str(unreadable / target) in said, said
    if r.returncode == 2:
        one_line(r)
    assert fingerprint(unreadable / target) == before
