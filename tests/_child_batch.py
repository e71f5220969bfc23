"""Many child-interpreter cases in one child: the same script run once per case
(its own ``sys.argv``, fresh globals, ``SystemExit`` as its exit status, and
then what the exit would do: bigper's exit handler closes the buffers still
open, open HDF5 files are closed; a script's ``after_exit()``, if it defines
one, runs after that), each case's stdout and stderr kept apart, so that a
test asserts on each case as if it had run in a fresh ``python -c SCRIPT
ARGS...`` -- without paying an interpreter start and the imports of bigper,
numba and the tests once per case.

A case that crashes the child (a signal, ``os._exit``) or runs past ``timeout``
is reported as that case's result (``returncode`` the child's, or None with
``timed_out``), and the cases after it run in a new child, so one bad case
never hides another's result.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MARK = "\x1e@@child-batch@@"

DRIVER = r"""
import json, os, sys, traceback, warnings
MARK = %r
script_path, cases_path = sys.argv[1], sys.argv[2]
code = compile(open(script_path).read(), "<string>", "exec")
cases = json.load(open(cases_path))
cwd, filters, argv0 = os.getcwd(), warnings.filters[:], sys.argv[0]


def exit_like():
    # What the interpreter's exit would do to what the case left open: the bigper buffers
    # still open closed by bigper's own exit handler, HDF5 files still open closed.
    import gc
    gc.collect()
    # (bigper's exit handler, by its module: imported, not looked up, so that a rename fails here
    # loudly instead of leaving the buffers to the next case)
    if "bigper" in sys.modules:
        from bigper.core.lifecycle import _close_all_at_exit
        _close_all_at_exit()
    h5py = sys.modules.get("h5py")
    if h5py is not None:
        for fid in h5py.h5f.get_obj_ids(types=h5py.h5f.OBJ_FILE):
            h5py.File(fid).close()
    gc.collect()


def mark(what, name):
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        stream.flush()
        os.write(fd, f"\n{MARK} {what} {name}\n".encode())


for name, argv in cases:
    # what a fresh interpreter would give the case: its argv, __main__ globals,
    # the start's working directory and warning filters, no warning shown yet
    os.chdir(cwd)
    warnings.filters[:] = filters
    warnings._filters_mutated()
    for mod in list(sys.modules.values()):
        reg = getattr(mod, "__warningregistry__", None)
        if isinstance(reg, dict):
            reg.clear()
    sys.argv = [argv0, *argv]
    mark("BEGIN", name)
    rc = 0
    g = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(code, g)
    except SystemExit as e:
        rc = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        rc = 1
    try:
        exit_like()
        if callable(g.get("after_exit")):  # the script's own check, after what its exit would have done
            g["after_exit"]()
    except BaseException:
        traceback.print_exc()
        rc = rc or 1
    del g
    mark(f"END{rc}", name)
"""


@dataclass
class CaseResult:
    """What ``subprocess.run(..., capture_output=True, text=True)`` would have said for one case."""
    returncode: int | None  # None: the case ran past the timeout (the child was killed)
    stdout: str
    stderr: str
    timed_out: bool = False


def _split(text: str) -> tuple[dict[str, str], dict[str, int], str | None]:
    """Per case: its output, its exit status where it ended; and the case that began and did not end."""
    out: dict[str, str] = {}
    ended: dict[str, int] = {}
    current, start = None, 0
    for m in re.finditer("\n" + re.escape(MARK) + r" (\S+) (\S+)\n", text):
        what, name = m.groups()
        if what == "BEGIN":
            current, start = name, m.end()
        else:
            assert name == current, (name, current)
            out[name], ended[name] = text[start:m.start()], int(what[3:])
            current = None
    if current is not None:
        out[current] = text[start:]
    return out, ended, current


def run_batch(script: str, cases: dict[str, list[str]], *, env=None, cwd=None, timeout: float = 120
              ) -> dict[str, CaseResult]:
    """Run ``script`` once per case (``cases``: name -> the case's argv after the script) in as
    few child interpreters as the cases allow. ``timeout``: seconds one case may take."""
    for name in cases:
        assert name and " " not in name and "\n" not in name, name
    results: dict[str, CaseResult] = {}
    pending = list(cases)
    with tempfile.TemporaryDirectory(prefix="child-batch-") as d:
        script_path = Path(d) / "script.py"
        script_path.write_text(script)
        while pending:
            cases_path = Path(d) / "cases.json"
            cases_path.write_text(json.dumps([[n, [str(a) for a in cases[n]]] for n in pending]))
            out_path, err_path = Path(d) / "out", Path(d) / "err"
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                p = subprocess.Popen([sys.executable, "-c", DRIVER % MARK, str(script_path), str(cases_path)],
                                     stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=cwd)
                timed_out, seen, since = False, -1, time.monotonic()
                while True:
                    try:
                        p.wait(timeout=0.05)
                        break
                    except subprocess.TimeoutExpired:
                        pass
                    n = out_path.read_bytes().count(MARK.encode())  # each case's marks: the clock restarts
                    if n != seen:
                        seen, since = n, time.monotonic()
                    elif time.monotonic() - since > timeout:
                        p.kill()
                        p.wait()
                        timed_out = True
                        break
            outs, ended, current = _split(out_path.read_text(errors="replace"))
            errs, _, _ = _split(err_path.read_text(errors="replace"))
            for name in outs:
                if name in ended:
                    results[name] = CaseResult(ended[name], outs[name], errs.get(name, ""))
            if current is not None:  # the case the child died or hung in
                results[current] = CaseResult(None if timed_out else p.returncode, outs[current],
                                              errs.get(current, ""), timed_out=timed_out)
            elif p.returncode != 0 or timed_out or not outs:
                raise RuntimeError(f"the batch child failed outside any case (rc {p.returncode}, "
                                   f"timed out {timed_out}): {err_path.read_text(errors='replace')[-3000:]}")
            if not any(n in results for n in pending):
                raise RuntimeError(f"the batch child reported no case: {err_path.read_text(errors='replace')[-3000:]}")
            pending = [n for n in pending if n not in results]
    return results


def selected(request, test_name: str, argname: str, values) -> list:
    """The ``values`` of ``argname`` with which this session runs ``test_name`` of the
    requesting fixture's module (so a ``-k`` run of one case prepares only that case)."""
    chosen = {item.callspec.params[argname] for item in request.session.items
              if getattr(item, "originalname", None) == test_name and getattr(item, "module", None) is request.module
              and argname in getattr(getattr(item, "callspec", None), "params", {})}
    return [v for v in values if v in chosen]


# ``python -m bigper ARGS...`` as a batch script: the same __main__ run as -m runs it.
BIGPER_CLI = "import runpy\nrunpy.run_module('bigper', run_name='__main__', alter_sys=True)\n"


class Batch:
    """What ``prepare_and_run`` made and what its child runs said, per case."""

    def __init__(self, prepared: dict, errors: dict, results: dict[str, CaseResult]):
        self.prepared, self.errors, self.results = prepared, errors, results

    def case(self, case):
        """What ``prepare`` returned for ``case`` (its exception, raised, where it failed)."""
        if case in self.errors:
            raise self.errors[case]
        return self.prepared[case]

    def result(self, case, call: str = "") -> CaseResult:
        self.case(case)
        return self.results[f"{case}.{call}" if call else str(case)]


def prepare_and_run(request, tmp_path_factory, test_name: str, argname: str, values, prepare, calls,
                    script: str = BIGPER_CLI, **kw) -> Batch:
    """For a module-scoped fixture of a test parametrized over ``argname``: ``prepare(value, tmp)``
    each selected value in a fresh folder of its own (as the test did in its ``tmp_path``), then
    run every ``calls(value, prepared) -> {call name: argv}`` in one batch of children, in order."""
    prepared, errors = {}, {}
    for v in selected(request, test_name, argname, values):
        try:
            prepared[v] = prepare(v, tmp_path_factory.mktemp(f"{test_name[:40]}-{v}"))
        except Exception as e:  # noqa: BLE001 -- raised by that case's test
            errors[v] = e
    runs = {}
    for v, p in prepared.items():
        for call, argv in calls(v, p).items():
            runs[f"{v}.{call}" if call else str(v)] = argv
    return Batch(prepared, errors, run_batch(script, runs, **kw) if runs else {})


# Child scripts of several tests of one module, every selected case in one batch: a test that
# ran ``Child(SCRIPT, tmp_path, *params)`` and asserted ``said("ok")`` and ``end() == 0`` asks
# ``said_ok(results, request)`` instead, of a module-scoped fixture that returned ``run_scripts``.
_DISPATCH = "import sys\n_code = {codes!r}[sys.argv.pop(1)]\nexec(compile(_code, '<string>', 'exec'), globals())\n"


def _case_key(item) -> str:
    callspec = getattr(item, "callspec", None)
    return f"{item.originalname}[{callspec.id}]" if callspec is not None else item.originalname


def run_scripts(request, tmp_path_factory, scripts: dict[str, tuple[str, tuple[str, ...]]], *, env=None,
                cwd=None, timeout: float = 240) -> dict[str, CaseResult]:
    """``scripts``: test name -> (its script, the names of its parameters that follow its folder on
    the script's argv). Every selected case of those tests of the requesting module (a ``-k`` run
    runs only its own), in the order of ``scripts`` then of the session, each with a fresh folder
    as its ``sys.argv[1]``: case key -> its result."""
    cases = {}
    for name, (_, argnames) in scripts.items():
        for item in request.session.items:
            if getattr(item, "module", None) is request.module and getattr(item, "originalname", None) == name:
                params = getattr(getattr(item, "callspec", None), "params", {})
                cases[_case_key(item)] = [name, tmp_path_factory.mktemp(name[5:40]), *(params[a] for a in argnames)]
    # (case names: no spaces; the key keeps the test id for messages)
    names = {key: re.sub(r"[^\w.\[\]-]", "_", key) for key in cases}
    codes = {name: code for name, (code, _) in scripts.items()}
    results = run_batch(_DISPATCH.format(codes=codes), {names[k]: argv for k, argv in cases.items()},
                        env=env, cwd=cwd, timeout=timeout) if cases else {}
    return {key: results[names[key]] for key in cases}


def said_ok(results: dict[str, CaseResult], request, timeout: float = 240) -> CaseResult:
    """The batched case of the requesting test printed ``ok`` (alone or followed by a space)
    first and exited 0, as ``Child.said("ok")`` and ``Child.end() == 0`` held it."""
    r = results[_case_key(request.node)]
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert not r.timed_out, \
        f"the child printed nothing for {timeout} s; {lines[-5:]!r}; its stderr:\n{r.stderr[-4000:]}"
    assert lines and (lines[0] == "ok" or lines[0].startswith("ok ")), \
        f"the child said {lines[:1]!r}, not 'ok' (exit status {r.returncode}); its stderr:\n{r.stderr[-4000:]}"
    assert r.returncode == 0, f"exit status {r.returncode}; its stderr:\n{r.stderr[-4000:]}"
    return r
