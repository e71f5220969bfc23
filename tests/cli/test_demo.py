"""``bigper demo`` and the command line's front door."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 900  # a shared CI machine; about a minute on an idle 2-core one
ROWS = ("env steps/s", "adds/s", "sample(32) + update_priorities, us", "disk allocated (preallocated)",
        "bytes on disk per slot allocated", "bytes on disk per transition held", "disk the held transitions use",
        "snapshot, s", "restore, s", "restored == original", "beta at the end")


def _bigper(*args, cwd, timeout=TIMEOUT):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "bigper", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_help_lists_every_command(tmp_path):
    from bigper.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    commands = set(sub.choices)
    assert {"demo", "bench"} <= commands
    r = _bigper("--help", cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    for c in commands:
        assert c in r.stdout
    assert _bigper("demo", "--help", cwd=tmp_path, timeout=120).returncode == 0


def _check_run(r, run: Path, steps: int, *, verify: int = 20, prioritization: str = "proportional",
               learn_every: int = 4, batch_size: int = 32):
    from argparse import Namespace

    from bigper.demo.report import human
    from bigper.demo import sample_calls

    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    for row in ROWS:
        assert row in r.stdout, row
    assert f"bigper demo: {steps:,} steps of Pong" in r.stdout
    assert f"{prioritization} prioritization" in r.stdout
    assert f"yes: {verify} of {verify} batches identical" in r.stdout
    png = run / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"{run.name}/demo.png" in r.stdout  # it says where the plot is
    res = json.loads((run / "results.json").read_text())
    assert res["verify_ok"] and res["held"] == min(steps, res["capacity"])
    assert res["prioritization"] == prioritization
    # Disk said both ways: per slot preallocated (each 84x84 frame once, not 8 per transition) and per
    # transition the run holds, with the bytes allocated and the bytes the held transitions fill.
    held, cap = res["held"], res["capacity"]
    assert 7_000 < res["bytes_per_slot"] < 8_000
    assert res["bytes_per_slot"] == pytest.approx(res["disk_bytes"] / cap)
    assert res["bytes_per_transition_held"] == pytest.approx(res["disk_bytes"] / held)
    assert res["disk_used_bytes"] == pytest.approx(res["bytes_per_slot"] * held)
    assert f"{res['bytes_per_slot']:,.0f}" in r.stdout and f"{res['bytes_per_transition_held']:,.0f}" in r.stdout
    assert f"{human(res['disk_bytes'])} for {cap:,} slots" in r.stdout
    assert res["env_steps_per_s"] > 0 and res["adds_per_s"] > 0 and res["sample_update_us"] > 0
    assert (run / "snaps").is_dir() and (run / "restored" / "meta.json").is_file()
    # beta is annealed over exactly the run's sample calls: 1.0 at the last one
    calls = sample_calls(Namespace(steps=steps, learn_every=learn_every, batch_size=batch_size))
    assert res["sample_calls"] == calls > 0 and res["beta_end"] == 1.0
    assert f"beta at the end                           1.000  (0.4 -> 1.0 over the run's {calls:,} sample calls)" in r.stdout
    # disk said before and after, with the command that removes it; memory at the end
    assert r.stdout.count(f"rm -r {run}") == 2 and f"{run} holds" in r.stdout
    assert "memory: peak RSS" in r.stdout and res["peak_rss_bytes"] >= res["peak_rss_anon_bytes"] > 0
    return res


def test_demo_3000_steps_prints_its_table_and_writes_its_png(tmp_path):
    """``bigper demo --steps 3000``, with a capacity CI disks hold (the default is 7.2 GB)."""
    pytest.importorskip("torch")
    pytest.importorskip("ale_py")
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    r = _bigper("demo", "--steps", "3000", "--capacity", "20000", "--path", str(run), cwd=tmp_path)
    _check_run(r, run, 3000)


def test_demo_sizes_its_buffer_to_the_run_with_rank(tmp_path):
    """Without ``--capacity`` a run of fewer steps than 1M preallocates the slots it fills (every
    one of them, so a full disk is still an error at creation), not 7.2 GB of slots it never writes,
    and says so before it starts. The same run takes ``--prioritization rank`` through the same
    checks (snapshot, restore, identical batches): one short run for both, for CI's time."""
    pytest.importorskip("torch")
    pytest.importorskip("ale_py")
    pytest.importorskip("matplotlib")
    from bigper.demo import CAPACITY, estimate_bytes

    run = tmp_path / "run"
    r = _bigper("demo", "--steps", "600", "--verify-batches", "3", "--prioritization", "rank",
                "--path", str(run), cwd=tmp_path)
    res = _check_run(r, run, 600, verify=3, prioritization="rank")
    assert res["capacity"] == res["held"] == 600
    assert res["bytes_per_transition_held"] == pytest.approx(res["bytes_per_slot"])
    assert res["disk_bytes"] < estimate_bytes(600) < estimate_bytes(CAPACITY) / 100
    assert "sized to --steps" in r.stdout


def test_sample_calls_counts_the_learner_steps():
    from argparse import Namespace

    from bigper.demo import learning_start, sample_calls

    for steps in (1, 5, 31, 32, 33, 700, 3000, 50_000):
        for learn_every in (1, 3, 4):
            a = Namespace(steps=steps, learn_every=learn_every, batch_size=32)
            start = learning_start(a)
            want = sum(1 for step in range(steps) if step >= start and step % learn_every == 0)
            assert sample_calls(a) == want, (steps, learn_every)


@pytest.mark.slow
def test_demo_default_capacity(tmp_path):
    """A 1M-capacity buffer asked for by name (about 7.2 GB preallocated), in the default run directory."""
    pytest.importorskip("ale_py")
    from bigper.demo import CAPACITY, estimate_bytes

    if shutil.disk_usage(tmp_path).free < 1.5 * estimate_bytes(CAPACITY):
        pytest.skip("not enough free disk for a 1M-capacity buffer")
    r = _bigper("demo", "--steps", "3000", "--capacity", str(CAPACITY), cwd=tmp_path)
    runs = list((tmp_path / "runs").glob("demo-*"))
    assert len(runs) == 1
    res = _check_run(r, runs[0], 3000)
    assert res["capacity"] == CAPACITY and res["bytes_per_transition_held"] > 300 * res["bytes_per_slot"]
    # Resident memory stays near the working set, not the 7.2 GB of files: nothing
    # maps the whole preallocated buffer in at once (the snapshot's checksums included).
    assert res["peak_rss_bytes"] < 2e9, res["peak_rss_bytes"]


def test_demo_fails_clearly_without_disk_space(tmp_path):
    r = _bigper("demo", "--capacity", str(10**10), "--path", str(tmp_path / "run"), cwd=tmp_path, timeout=120)
    assert r.returncode == 2
    assert "GB" in r.stderr and "--capacity" in r.stderr and "free" in r.stderr
    assert not (tmp_path / "run").exists()


def test_demo_refuses_a_used_directory(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "something").write_text("x")
    r = _bigper("demo", "--path", str(tmp_path / "run"), cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "not an empty directory" in r.stderr


def test_demo_bad_arguments(tmp_path):
    r = _bigper("demo", "--steps", "0", "--path", str(tmp_path / "run"), cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "--steps must be >= 1" in r.stderr
