"""Fail the docs build when a public name is missing from the API reference
or has no docstring.

The public names are those of ``bigper.__all__``, ``bigper.distributed`` and
``bigper.integrations.sb3`` (their ``__all__``), and every public method,
property and attribute each of their classes defines itself. numpydoc's
validation (``conf.py``) then checks the parameters of the core's names.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect

from sphinx.util import logging

log = logging.getLogger(__name__)

PUBLIC_MODULES = ("bigper", "bigper.distributed", "bigper.integrations.sb3")


def public_names() -> dict[str, object]:
    """``qualified name -> object`` of every public name the reference must show."""
    names: dict[str, object] = {}
    for modname in PUBLIC_MODULES:
        mod = importlib.import_module(modname)
        for name in mod.__all__:
            if name.startswith("__"):
                continue
            obj = getattr(mod, name)
            names[f"{modname}.{name}"] = obj
            if inspect.isclass(obj) and not issubclass(obj, BaseException):
                fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
                for member, value in vars(obj).items():
                    if member.startswith("_") or member in fields:  # fields: the class's Parameters
                        continue
                    names[f"{modname}.{name}.{member}"] = value
    return names


def _doc(obj) -> str | None:
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    return getattr(obj, "__doc__", None) if callable(obj) or inspect.isclass(obj) else "data"


def _record(app, what, name, obj, options, lines):
    app.env.bigper_documented = getattr(app.env, "bigper_documented", set()) | {name}


def _check(app, env):
    documented = getattr(env, "bigper_documented", set())
    for name, obj in sorted(public_names().items()):
        if name not in documented:
            log.warning("apicheck: public name %s is not in the API reference", name)
        doc = _doc(obj)
        if not (doc and doc.strip()):
            log.warning("apicheck: public name %s has no docstring", name)


def setup(app):
    app.connect("autodoc-process-docstring", _record)
    app.connect("env-check-consistency", _check)
    return {"version": "1", "parallel_read_safe": False, "env_version": 1}
