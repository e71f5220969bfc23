"""The house rules of the code layout: one direction of imports, checked.

- bigper/: the import-linter contracts in ``.importlinter`` (layers, ray and
  torch confined to their rooms), run with the venv's ``lint-imports``; its
  report is the failure message.
- ``import bigper`` and every core module stay light: no torch, Ray, SB3,
  Gymnasium or matplotlib in a fresh interpreter.
- tools/: no import cycle between its scripts (imports inside functions
  included), no file over 400 lines, and ``tools/bench.py`` imports a
  workload's module only when that workload runs.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
MAX_LINES = 400


def _run(code: str, *args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


# -- bigper/ --------------------------------------------------------------------------


def test_import_linter_contracts_hold():
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.fail(f"{exe} is not installed: import-linter is in the dev extra (pip install -e '.[dev]')")
    p = subprocess.run([str(exe), "--no-cache", "--config", str(ROOT / ".importlinter")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, f"lint-imports exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    assert "BROKEN" not in p.stdout


def test_contract_file_names_every_top_level_module():
    """The layers contract is exhaustive for bigper's direct children; this
    test says which module is missing in words a reader of a failure needs."""
    text = (ROOT / ".importlinter").read_text()
    block = text.split("layers =", 1)[1].split("\n[", 1)[0]
    placed = {name.strip() for line in block.splitlines() for name in line.split("|") if name.strip()}
    pkg = ROOT / "bigper"
    children = {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"}
    children |= {p.parent.name for p in pkg.glob("*/__init__.py")}
    assert children - placed == set(), f"modules of bigper/ not placed in .importlinter's layers: " \
                                       f"{sorted(children - placed)}"
    assert placed - children == set(), f".importlinter places modules that do not exist: {sorted(placed - children)}"


CORE_LIGHT = """
import importlib, pathlib, sys
import bigper
heavy = ("torch", "ray", "stable_baselines3", "gymnasium", "matplotlib", "ale_py", "cv2", "jax")
skip = ("bigper.__main__", "bigper.distributed", "bigper.integrations", "bigper.examples")
root = pathlib.Path(bigper.__file__).parent
# a walk of the files, not pkgutil.walk_packages: that imports every package it enters
names = sorted(".".join(("bigper",) + p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
               for p in root.rglob("*.py"))
names = [n for n in names if not n.startswith(skip)]
for name in names:
    importlib.import_module(name)
print(len(names), sorted(k for k in heavy if k in sys.modules))
"""


def test_core_imports_no_heavy_extra():
    """Every module outside distributed/integrations/examples imports without
    torch, JAX, Ray, SB3, Gymnasium or matplotlib: those load inside the functions
    that need them (``import bigper`` stays light)."""
    p = _run(CORE_LIGHT)
    assert p.returncode == 0, p.stderr
    count, loaded = p.stdout.strip().split(" ", 1)
    assert int(count) > 20, p.stdout
    assert loaded == "[]", f"heavy extras imported at module level: {loaded}"


# -- tools/ ---------------------------------------------------------------------------


def _tools_modules() -> dict[str, Path]:
    """Every Python file of tools/ (tools/dev/'s maintainer scripts aside) by the
    name it is imported as with tools/ on sys.path: ``bench``, ``benchkit``,
    ``workloads.atari.child``, ``workloads.atari`` (its ``__init__.py``)."""
    out = {}
    for path in sorted(TOOLS.rglob("*.py")):
        parts = path.relative_to(TOOLS).with_suffix("").parts
        if parts[0] == "dev":
            continue
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _tools_graph() -> dict[str, set[str]]:
    """module -> the tools/ modules it imports, from the AST (every import
    statement, inside functions too; ``from package import module`` is an
    import of the module)."""
    modules = _tools_modules()

    def known(name: str) -> str | None:  # the longest prefix of ``name`` that is a module of tools/
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in modules:
                return ".".join(parts[:i])
        return None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base]).strip(".")
                deps |= {known(f"{base}.{a.name}") for a in node.names}
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" \
                    and node.args and isinstance(node.args[0], ast.Constant):
                deps.add(known(str(node.args[0].value)))
        graph[name] = {d for d in deps if d} - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_tools_graph_follows_package_imports(tmp_path, monkeypatch):
    """``from workloads.x import y`` and ``import workloads.x.y`` are edges to the module
    ``workloads.x.y``; a name that is not a module is an edge to its package."""
    for rel, text in {"bench.py": "", "benchkit.py": "", "workloads/__init__.py": "",
                      "workloads/x/__init__.py": "C = 1\n",
                      "workloads/x/main.py": "from workloads.x import y\nfrom workloads.x import C\n",
                      "workloads/x/y.py": "import benchkit\ndef f():\n    import workloads.z.data\n",
                      "workloads/z/__init__.py": "", "workloads/z/data.py": "from . import _k\n",
                      "workloads/z/_k.py": "from .. import x\n", "dev/script.py": "import bench\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "TOOLS", tmp_path)
    graph = _tools_graph()
    assert "dev.script" not in graph
    assert graph["workloads.x.main"] == {"workloads.x.y", "workloads.x"}
    assert graph["workloads.x.y"] == {"benchkit", "workloads.z.data"}
    assert graph["workloads.z.data"] == {"workloads.z._k"} and graph["workloads.z._k"] == {"workloads.x"}


def test_tools_have_no_import_cycle():
    graph = _tools_graph()
    assert "benchkit" in graph and graph["benchkit"] == set(), graph.get("benchkit")
    assert "workloads.tree.main" in graph and "workloads.tree.peers" in graph["workloads.tree.main"], graph
    cyc = _cycle(graph)
    assert cyc is None, f"import cycle in tools/: {' -> '.join(cyc)}"
    # the command line imports no workload at module level (it dispatches, by
    # importlib), and no script imports the command line back
    assert {m for m in graph["bench"] if m.startswith("workloads")} == set(), graph["bench"]
    assert sorted(n for n, deps in graph.items() if "bench" in deps) == []


def test_tools_are_grouped_by_workload():
    """tools/ holds the command line, the shared helpers and one package per workload
    under workloads/ (plus dev/ and results/); every workload of the command line is
    the ``main`` module of its own package there."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_tools_bench", TOOLS / "bench.py")  # not "bench" in sys.modules
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert sorted(p.name for p in TOOLS.glob("*.py")) == ["bench.py", "benchkit.py"]
    assert sorted(p.name for p in TOOLS.iterdir() if p.is_dir() and p.name != "__pycache__") == \
        ["dev", "results", "workloads"]
    packages = sorted(p.parent.name for p in (TOOLS / "workloads").glob("*/__init__.py"))
    assert sorted(p.name for p in (TOOLS / "workloads").iterdir() if p.is_dir() and p.name != "__pycache__") \
        == packages
    assert {name: module for name, (module, _) in bench.WORKLOADS.items()} == \
        {name: f"workloads.{name}.main" for name in bench.WORKLOADS}
    assert set(bench.WORKLOADS) <= set(packages), sorted(set(bench.WORKLOADS) - set(packages))


TOOLS_NAMES = """
import importlib.util, sys
tools, names = sys.argv[1], sys.argv[2:]
print([n for n in names if importlib.util.find_spec(n) is not None])  # without tools/ on sys.path
sys.path.insert(0, tools)
print([n for n in names if not importlib.util.find_spec(n).origin.startswith(tools)])
theirs = ("ray", "torch", "torchrl", "h5py", "numpy", "codecs", "cpprb", "tianshou", "stable_baselines3")
print([n for n in theirs if (s := importlib.util.find_spec(n)) and (s.origin or "").startswith(tools)])
"""


def test_tools_names_shadow_nothing_installed():
    """The names tools/ puts on sys.path (its modules and packages) are nobody else's, and
    the workload packages (ray/, torchrl/, codecs/, ...) live under workloads/, so an
    ``import ray`` with tools/ on sys.path still finds Ray (looked up, not imported)."""
    names = sorted({p.stem for p in TOOLS.glob("*.py")} | {"workloads"})
    p = _run(TOOLS_NAMES, str(TOOLS), *names)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:3] == ["[]", "[]", "[]"], p.stdout


@pytest.mark.parametrize("script", ["atari/child.py", "atari/loop.py", "atari/scale.py", "codecs/frames.py"])
def test_a_child_script_started_by_path_finds_benchkit_and_its_siblings(script, tmp_path):
    """The scripts a workload starts by path in a child process import from tools/ (benchkit,
    workloads.*) from any working directory (torchrl/side.py: tests/cli/test_bench_torchrl.py)."""
    args = [] if script == "atari/scale.py" else ["--help"]  # scale.py's child runs only with --child
    p = subprocess.run([sys.executable, str(TOOLS / "workloads" / script), *args], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert args == [] or "usage:" in p.stdout, p.stdout


def test_tools_files_stay_small():
    long = {str(p.relative_to(TOOLS)): n for p in TOOLS.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"files in tools/ over {MAX_LINES} lines (split them by job): {long}"


BENCH_LAZY = """
import sys
sys.path.insert(0, "tools")
import bench
mine = lambda: sorted(m for m in sys.modules if m.startswith(("bench", "workloads")))
bench.build_parser()
before = mine()
bench.build_parser("tree")
after = mine()
bench.WORKLOADS["nosuch"] = ("workloads.nosuch.main", "a workload whose module is not there")
rc = bench.main(["nosuch"])
print(before, after, rc)
"""


def test_bench_imports_a_workload_only_to_run_it():
    p = _run(BENCH_LAZY)
    assert p.returncode == 0, p.stderr
    before, rest = p.stdout.strip().split("] ", 1)
    assert before == "['bench'", p.stdout
    assert "'workloads.tree.main'" in rest, p.stdout
    assert "'workloads.atari.main'" not in rest and "'workloads.storage.main'" not in rest, p.stdout
    assert rest.endswith(" 2"), p.stdout
    missing = os.path.join("tools", "workloads", "nosuch", "main.py")
    assert "bench nosuch: its module" in p.stderr and f"{missing} is not there" in p.stderr, p.stderr


def test_bench_help_lists_every_workload():
    p = subprocess.run([sys.executable, str(TOOLS / "bench.py"), "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for name in ("tree", "atari", "storage", "snapshot", "offline", "ray", "sb3"):
        assert f"    {name} " in p.stdout, p.stdout


def test_the_development_map_names_every_module_and_package_and_nothing_else():
    """docs/development.md's "Files" map: one line per module and package
    directly under bigper/, each naming one that exists."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "development.md").read_text()
    block = text[text.index("```\nbigper/\n") + len("```\nbigper/\n"):]
    block = block[:block.index("\ntests/")]
    named = [m.group(1) for m in re.finditer(r"^  (\S+)", block, re.M)]
    have = sorted([p.name for p in (root / "bigper").glob("*.py")]
                  + [p.name + "/" for p in (root / "bigper").iterdir()
                     if p.is_dir() and (p / "__init__.py").exists()])
    assert sorted(named) == have, (sorted(set(have) - set(named)), sorted(set(named) - set(have)))


def test_no_module_writes_or_reads_a_batchs_dict():
    """A batch's trip to a device travels in its ``transport`` field (issue 42), never as
    ``__dict__`` entries another module sets and ``to_torch`` reads back; ``Batch.make`` (the
    class's own constructor) is the one place that fills a batch's ``__dict__``."""
    import re

    batch_dict = re.compile(r"\b(b|batch|target)\.__dict__")  # (the names a batch goes by in bigper/)
    found = []
    for path in sorted((ROOT / "bigper").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if batch_dict.search(code) and not (path.name == "batch.py" and "b.__dict__.update(" in code):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
