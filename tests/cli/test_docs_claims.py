"""What the docs tell a user must be something the user can check: figures
with the command that measures them, versions said for what they are, and
names a user meets explained where they meet them (issue 45 §3)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def _paragraphs():
    for page in _pages():
        for para in re.split(r"\n\s*\n", page.read_text()):
            yield page.relative_to(ROOT), para


def _installed_torch() -> str:
    """The torch version the project installs (``run.sh``)."""
    return re.search(r'"torch==([\d.]+)"', (ROOT / "run.sh").read_text())[1]


def test_no_page_cites_an_issue_for_a_figure():
    """A user cannot look up "the issue's 8x": a page gives the measured figure and its command."""
    bad = [(str(p), m) for p, para in _paragraphs() for m in re.findall(r"[^.]*\bthe issue's\b[^.]*", para)]
    assert not bad, bad


def test_every_torch_version_says_whose_it_is():
    """torch 2.11 (the GPU figures), 2.13.0 (what the project installs) and 2.15 (TorchRL's own
    venv): a paragraph that names another version than the installed one says which machine or
    peer it belongs to, and names the installed one beside it."""
    installed = _installed_torch()
    short = ".".join(installed.split(".")[:2])
    seen = set()
    for page, para in _paragraphs():
        for v in re.findall(r"\btorch (\d+\.\d+(?:\.\d+)?)", para):
            seen.add(v)
            where = f"{page}: torch {v} in {para[:160]!r}"
            if v in (installed, short):
                assert v == installed, f"{where}: say the exact version the project installs, {installed}"
                continue
            assert installed in para, f"{where}: names no {installed}, the version the project installs"
            assert re.search(r"H200|GPU|TorchRL|torchrl", para), f"{where}: says not whose version it is"
    assert seen, "no page names a torch version"


def test_tensorbatch_is_explained_where_users_meet_it():
    for page in ("docs/guide/gpu.md", "docs/api/batch.md"):
        text = (ROOT / page).read_text()
        assert "TensorBatch" in text and "host" in text, page


def test_the_api_reference_says_where_its_signatures_are():
    """The API pages are autodoc directives only: where they are linked, say where to read them."""
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if "(docs/api/index.md)" in line)
    assert "./run.sh docs" in row, row
    assert "./run.sh docs" in (ROOT / "docs" / "api" / "index.md").read_text()
