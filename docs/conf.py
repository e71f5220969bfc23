"""Sphinx configuration of bigper's documentation site (built by ``./run.sh docs``).

Sphinx with furo, myst-parser and numpydoc: bigper's docstrings are numpydoc,
which Sphinx renders and checks as they are (the same stack as NumPy, h5py,
SB3 and Gymnasium). The build runs with warnings as errors and nitpicky
cross-references, and numpydoc validation fails a public name without a
docstring or with an undocumented parameter.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

import bigper  # noqa: E402

project = "bigper"
author = "bigper contributors"
copyright = "bigper contributors"
release = version = bigper.__version__

extensions = [
    "sphinx.ext.autodoc",
    "numpydoc",
    "myst_parser",
    "apicheck",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
root_doc = "index"

html_theme = "furo"
html_title = f"bigper {release}"
html_static_path = []
html_show_sourcelink = False
html_copy_source = False

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# Nitpicky: every cross-reference must resolve. Names from other packages
# cannot (the build is offline, without intersphinx): they render as text.
nitpicky = True
nitpick_ignore_regex = [
    ("py:.*", r"(np|numpy|numpy\.typing|npt|os|pathlib|collections\.abc|typing|typing_extensions|"
              r"torch|th|gymnasium|spaces|stable_baselines3|sb3_contrib|ray|threading|types|enum|dataclasses)\..*"),
    ("py:class", r"(Path|PathLike|Mapping|Iterator|Iterable|Callable|Sequence|Any|NamedTuple|"
                 r"ArrayLike|DTypeLike|Self|Literal|Optional|Union)"),
    ("py:class", r"(ReplayBuffer|DQN|ReplayBufferSamples|VecNormalize|GymEnv)"),
    # Internal types in public signatures (not public names themselves): shown as text.
    ("py:class", r"bigper\.(config|storage|prioritization)\..*|bigper\.integrations\.(sb3\.)?_\w+(\.\w+)*|StackLayout"),
    ("py:class", r"(optional|default|array-like|array_like|callable|schedule|.*\(.*)"),
]

autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": True}
autodoc_preserve_defaults = True

numpydoc_show_class_members = False
numpydoc_xref_param_type = False
numpydoc_attributes_as_param_list = True
numpydoc_validation_checks = {"GL08", "PR01", "PR02"}
numpydoc_validation_exclude = {
    r"\.__\w+__$",          # dunder methods: documented by the class
    r"^bigper\.distributed\.",        # checked by apicheck: docstring present
    r"^bigper\.integrations\.sb3\.",  # (their modules are edited elsewhere)
}

os.environ.setdefault("BIGPER_THREADS", "1")
