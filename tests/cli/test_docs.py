"""Every Python code block of the README and of docs/ runs as written (or,
where it needs a GPU or a long run, in its marked smoke form), and the site
checker catches a link to something missing.

A block runs as a script of its own (the blocks of a page in one child
interpreter, each with fresh globals); the blocks of one page run in order in
one fresh folder, so a page's later block sees what an earlier one wrote (the
restarted job of the snapshots page). A marker comment right before a block:

    <!-- docs-test: smoke OLD => NEW ; OLD2 => NEW2 -->   run with each OLD replaced (each must occur)
    <!-- docs-test: run-by tests/test_x.py -->            run by that test module, which reads the page
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "dev"))
from check_site import broken_links  # noqa: E402

BLOCK = re.compile(r"(?:^<!-- docs-test: (?P<marker>.*?) -->\n)?^```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```",
                   re.S | re.M)
# What a block imports -> the module that must be installed to run it.
NEEDS = {"torch": "torch", "ray": "ray", "stable_baselines3": "stable_baselines3", "ale_py": "ale_py",
         "gymnasium": "gymnasium", "h5py": "h5py", "torchrl": "torchrl", "tensordict": "tensordict",
         "jax": "jax"}


def pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def blocks(page: Path) -> list[dict]:
    """Every fenced block of ``page`` with its language and marker."""
    text = page.read_text()
    return [dict(lang=m["lang"], code=m["code"], marker=m["marker"],
                 line=text.count("\n", 0, m.start()) + 1) for m in BLOCK.finditer(text)]


def python_blocks(page: Path) -> list[dict]:
    return [b for b in blocks(page) if b["lang"] in ("python", "py", "python3", "pycon")]


def as_run(block: dict, page: Path) -> str | None:
    """The code to run for ``block``, or None when another test module runs it."""
    marker, code = block["marker"], block["code"]
    where = f"{page.relative_to(ROOT)}:{block['line']}"
    if marker is None:
        return code
    kind, _, rest = marker.partition(" ")
    if kind == "run-by":
        test = ROOT / rest.strip()
        assert test.is_file(), f"{where}: run-by names no test module: {rest!r}"
        assert str(page.relative_to(ROOT)) in test.read_text(), f"{where}: {rest} does not read this page"
        return None
    assert kind == "smoke", f"{where}: unknown docs-test marker {marker!r}"
    for pair in rest.split(" ; "):
        old, sep, new = pair.partition(" => ")
        assert sep and old.strip(), f"{where}: smoke marker part {pair!r} is not 'OLD => NEW'"
        assert old.strip() in code, f"{where}: smoke replaces {old.strip()!r}, which the block lacks"
        code = code.replace(old.strip(), new.strip())
    return code


def test_every_python_block_runs_or_is_marked():
    seen = 0
    for page in pages():
        for block in python_blocks(page):
            as_run(block, page)  # asserts on a bad marker
            seen += 1
        for block in blocks(page):  # shell-like text is fine; Python under another name is not
            looks_python = re.search(r"^(import \w+|from \w+(\.\w+)* import )", block["code"], re.M)
            assert block["lang"] in ("python", "py", "python3", "pycon") or not looks_python, (
                f"{page.relative_to(ROOT)}:{block['line']}: Python in a ```{block['lang']} block: "
                "mark it python so that it runs")
    assert seen >= 8


def _runnable_pages() -> list[Path]:
    return [p for p in pages() if any(as_run(b, p) is not None for b in python_blocks(p))]


# A block as ``python block.py`` runs it (``__main__``, its own globals, ``__file__``).
_BLOCK = "import runpy, sys\nrunpy.run_path(sys.argv[1], run_name='__main__')\n"


@pytest.mark.parametrize("page", _runnable_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_blocks_run_in_order(page, tmp_path):
    """The page's blocks in one child interpreter, each as a script of its own (``_child_batch``:
    fresh globals, then what its exit would do), one after the other, so that a page does not pay
    an interpreter start and torch's import a block."""
    from tests._child_batch import run_batch

    env = dict(os.environ, PYTHONPATH=str(ROOT), BIGPER_THREADS="1")
    scripts = {}
    for n, block in enumerate(python_blocks(page)):
        code = as_run(block, page)
        if code is None:
            continue
        for mod in sorted({NEEDS[m] for m in re.findall(r"^\s*(?:import|from) (\w+)", code, re.M) if m in NEEDS}):
            pytest.importorskip(mod, reason=f"{page.name}:{block['line']} needs {mod}")
        script = tmp_path / f"block{n}_line{block['line']}.py"
        script.write_text(code)
        scripts[f"line{block['line']}"] = [str(script)]
    results = run_batch(_BLOCK, scripts, env=env, cwd=tmp_path, timeout=600)
    for name in scripts:
        r = results[name]
        assert r.returncode == 0, (f"{page.relative_to(ROOT)}:{name[4:]} failed\n"
                                   + r.stdout[-2000:] + r.stderr[-4000:])


def test_site_checker_reports_every_missing_target_and_nothing_else(tmp_path):
    (tmp_path / "guide").mkdir()
    (tmp_path / "img.png").write_bytes(b"\x89PNG")
    (tmp_path / "index.html").write_text(
        '<a id="top" href="guide/page.html#here">ok</a><a href="guide/gone.html">gone</a>'
        '<img src="img.png"><img src="missing.png"><a href="https://example.org/x">ext</a>'
        '<a href="#top">ok</a><a href="#nowhere">bad anchor</a><a href="../../etc/passwd">out</a>')
    (tmp_path / "guide" / "page.html").write_text('<h1 id="here">x</h1><a href="../index.html">up</a>'
                                                  '<script src="../_static/x.js"></script>')
    problems = broken_links(tmp_path)
    assert sorted(p.split(" -> ")[1].split(" (")[0] for p in problems) == sorted(
        ["guide/gone.html", "missing.png", "#nowhere", "../../etc/passwd", "../_static/x.js"]), problems
    (tmp_path / "_static").mkdir()
    (tmp_path / "_static" / "x.js").write_text("")
    (tmp_path / "guide" / "gone.html").write_text("")
    (tmp_path / "missing.png").write_bytes(b"")
    assert len(broken_links(tmp_path)) == 2  # the bad anchor and the path outside the site remain


def test_every_error_has_a_row_with_its_bases_on_the_errors_page():
    import inspect

    import bigper.errors as errors

    text = (ROOT / "docs" / "api" / "errors.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", text, re.M))
    classes = {n: c for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, Exception)
               and c.__module__ == errors.__name__}
    assert set(rows) == set(classes)
    for name, cls in classes.items():
        assert [b.strip(" `") for b in rows[name].split(",")] == [b.__name__ for b in cls.__bases__], name
        assert f".. autoexception:: bigper.{name}\n" in text, name
