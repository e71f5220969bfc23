"""The README's example runs as written (it is the front door), and runs again."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Example\n"):text.index("## Semantics\n")]
    return re.findall(r"```python\n(.*?)```", section, re.S)[0]


def _run(script: Path, cwd: Path) -> str:
    r = subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def test_readme_example_runs_twice_as_written(tmp_path):
    pytest.importorskip("torch")
    code = _example()
    assert "PrioritizedReplayBuffer(" in code and len(code.splitlines()) <= 40
    assert "mode=" in code and "Snapshots(" in code and "to_torch()" in code
    script = tmp_path / "example.py"
    script.write_text(code)
    first = _run(script, tmp_path)
    assert "new buffer" in first and "loaded snap-00000001: 1000 transitions" in first
    second = _run(script, tmp_path)  # the same script again: it resumes, nothing refused
    assert "resumed 1000 transitions" in second
    assert "loaded snap-00000002: 2000 transitions, {'added': 2000}" in second
    snaps = sorted(p.name for p in (tmp_path / "runs/pong/snaps").glob("snap-*"))
    assert snaps == ["snap-00000001", "snap-00000002"]


def test_readme_lists_every_error_with_its_bases():
    import inspect

    import bigper.errors as errors

    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Errors\n"):]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, re.M))
    classes = {n: c for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, Exception)
               and c.__module__ == errors.__name__}
    assert set(rows) == set(classes)
    for name, cls in classes.items():
        assert [b.strip(" `") for b in rows[name].split(",")] == [b.__name__ for b in cls.__bases__], name
