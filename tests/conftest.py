"""Test-wide settings. In CI (``CI`` set) Hypothesis runs derandomized, so a
submission's result does not depend on which examples a run happens to draw;
locally it explores afresh each run."""

import os
import subprocess

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session", autouse=True)
def _sb3_logs_in_the_session_tmp(tmp_path_factory):
    """Stable-Baselines3 makes a ``$TMPDIR/SB3-<date>`` folder for every model's logger
    unless ``SB3_LOGDIR`` names one: hundreds a run, left in /tmp. They go to this session's
    temporary folder instead (pytest keeps the last few), children included."""
    if "SB3_LOGDIR" in os.environ:  # (the caller's choice)
        yield
        return
    os.environ["SB3_LOGDIR"] = str(tmp_path_factory.mktemp("sb3-logs"))
    try:
        yield
    finally:
        os.environ.pop("SB3_LOGDIR", None)


def mounted_tmpfs(tmp_path, size: str):
    """A real tmpfs of ``size`` (``3m``; root mounts it) at ``tmp_path/fs``: a full disk
    without filling the machine's. A generator for a fixture: unmounted after the test."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode:
        pytest.fail(f"cannot mount a tmpfs (these tests need root): {r.stderr.decode()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 3 MB tmpfs (``mounted_tmpfs``)."""
    yield from mounted_tmpfs(tmp_path, "3m")


def fill_disk(path) -> None:
    """Take every free byte of ``path``'s filesystem with the file ``path``
    (a small tmpfs: the next write that needs a block fails with ENOSPC)."""
    with open(path, "wb", buffering=0) as f:
        for size in (65536, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (``./run.sh test`` runs the suite on 2 xdist workers): each file on one
    worker, so a module-scoped fixture (a Ray instance, a recording, a batch of child runs)
    is made once, and the Ray files on the same worker, so they share its local instance
    (tests/_ray_local.py) instead of each worker starting its own. Other --dist: xdist's own."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileRayTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/distributed" if path.startswith("tests/distributed/") else path

    return LoadFileRayTogether(config, log)
