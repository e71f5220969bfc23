"""The README is the front door: its example runs as written (and runs again),
it stays short, and every link in it reaches a page (and heading) of docs/."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _example() -> str:
    text = README.read_text()
    start = text.index("## Example\n")
    section = text[start:text.index("\n## ", start)]
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


def test_readme_is_the_front_door_only():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert "bigper demo" in text and "./run.sh demo" in text and "./run.sh test" in text
    header = next(line for line in text.split("## Against other replay buffers")[1].splitlines()
                  if line.startswith("| |"))
    for peer in ("bigper", "cpprb", "TorchRL", "Tianshou", "Reverb", "flashbax", "SB3"):
        assert f"| {peer} |" in header + "|", peer


def slug(heading: str) -> str:
    """The anchor MyST (myst_heading_anchors) gives a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower().replace("`", ""))
    return re.sub(r"\s+", "-", text)


def _headings(page: Path) -> set:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def broken_markdown_links(page: Path) -> list:
    """Local links of a Markdown page whose file or heading does not exist."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_file():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _headings(dest):
            bad.append(f"{target} (no such heading)")
    return bad


def test_every_readme_link_reaches_a_docs_page_and_heading():
    links = re.findall(r"\]\((docs/[^)\s]+)\)", README.read_text())
    assert len(links) >= 10
    assert broken_markdown_links(README) == []


def test_the_link_check_catches_a_missing_page_and_heading(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## Resume after a crash\n\n[x](b.md) [y](a.md#resume-after-a-crash)"
                                   " [z](a.md#nowhere) [w](https://example.org)\n")
    assert broken_markdown_links(tmp_path / "a.md") == ["b.md (no such file)", "a.md#nowhere (no such heading)"]
