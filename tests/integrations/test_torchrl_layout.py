"""The TorchRL key <-> bigper field mapping (``bigper.integrations._torchrl_layout``)
under Hypothesis: a bijection onto names bigper accepts, that never takes one
of bigper's own names, and whose layouts survive the trip through a config
(what a resumed path or a loaded snapshot has to go on)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigper.config import check_name
from bigper.core.layout import own_names
from bigper.errors import InvalidArgumentError
from bigper.integrations._torchrl_layout import (
    DONE,
    REWARD,
    TERMINATED,
    TRUNCATED,
    Layout,
    field_name,
    key_of,
)

# keys as TorchRL spells them: any text, "next" often, characters that need escaping often
parts = st.one_of(st.sampled_from(["next", "pixels", "reward", "done", "obs", "a.b", "-", "--", "", "_", "é"]),
                  st.text(max_size=8))
keys = st.lists(parts, min_size=1, max_size=4).map(tuple)


@given(keys)
def test_field_name_is_a_valid_name_and_spells_its_key(key):
    try:
        name = field_name(key)
    except InvalidArgumentError as e:  # only for keys whose name would pass the 128-character limit
        assert "at most 128" in str(e)
        return
    assert check_name(name) == name
    assert key_of(name) == key
    assert name not in own_names() and name not in ("obs", "reward", "next_obs")
    assert not name.startswith("next_")  # a successor name never equals a field name


@given(keys, keys)
def test_distinct_keys_get_distinct_names(a, b):
    if a != b and len(field_name_or_none(a) or "") and len(field_name_or_none(b) or ""):
        assert field_name(a) != field_name(b)


def field_name_or_none(key):
    try:
        return field_name(key)
    except InvalidArgumentError:
        return None


@given(st.text(alphabet="t-_0123456789abcdefxyzABC", max_size=24))
def test_key_of_refuses_or_inverts(name):
    try:
        key = key_of(name)
    except InvalidArgumentError:
        return
    assert field_name(key) == name  # anything key_of reads is exactly what field_name writes


def test_names_read_as_documented():
    assert field_name(("action",)) == "t--action"
    assert field_name(("collector", "traj_ids")) == "t--collector--traj_ids"
    assert field_name(("a.b",)) == "t--a-00002eb"
    with pytest.raises(InvalidArgumentError, match="at most 128"):
        field_name(("x" * 200,))


specs = st.tuples(st.lists(st.integers(1, 3), max_size=2).map(tuple),
                  st.sampled_from([np.uint8, np.int64, np.float32, np.bool_]).map(np.dtype))


@st.composite
def leaf_sets(draw):
    """Leaves of a TorchRL step: the episode flags, a reward, pixels, and extra keys at the
    root, under "next" (with or without a root counterpart) and nested deeper."""
    k = draw(st.sampled_from([None, 2, 4]))
    n_step = draw(st.sampled_from([1, 3]))
    leaves = {TERMINATED: ((1,), np.dtype(bool)), DONE: ((1,), np.dtype(bool)),
              REWARD: ((1,), np.dtype(np.float32))}
    if draw(st.booleans()):
        leaves[("terminated",)] = leaves[("done",)] = ((1,), np.dtype(bool))
    if k is not None:
        c = draw(st.integers(1, 3))
        leaves[("pixels",)] = leaves[("next", "pixels")] = ((k * c, 3, 2), np.dtype(np.uint8))
    for key in draw(st.lists(keys, max_size=5, unique=True)):
        special = {DONE, TERMINATED, TRUNCATED, REWARD, ("pixels",), ("next", "pixels")}
        if key in leaves or key[:1] == ("pixels",) or key[:2] in special or ("next",) + key[:1] in special:
            continue
        if any(key[:i] in leaves or k2[:len(key)] == key for i in range(1, len(key)) for k2 in leaves):
            continue  # a key is a leaf or a node, never both
        spec = draw(specs)
        leaves[key] = spec
        if key[0] != "next" and draw(st.booleans()):
            leaves[("next",) + key] = spec
    return leaves, k, n_step


@settings(max_examples=200)
@given(leaf_sets())
def test_layouts_cover_every_leaf_and_survive_a_config(case):
    leaves, k, n_step = case
    try:
        lay = Layout.from_leaves(leaves, obs_key="pixels", frame_stack=k, n_step=n_step)
    except InvalidArgumentError as e:
        assert "at most 128" in str(e)
        return
    assert set(lay.source) == set(leaves)  # every leaf is written somewhere ...
    names = list(lay.source.values())
    assert len(set(names)) == len(names)  # ... and nowhere twice
    for key, name in lay.source.items():
        base = name.removeprefix("next_")
        assert base in lay.fields
        assert (name == base) or base in lay.next_of
        if k is None or key not in (("pixels",), ("next", "pixels")):
            if name != "reward":
                assert lay.fields[base] == leaves[key]
    for n in list(lay.fields) + [f"next_{n}" for n in lay.next_of]:
        assert n not in own_names()
        check_name(n)
    back = Layout.from_config(lay.fields, lay.next_of, obs_key="pixels", frame_stack=k, n_step=n_step)
    assert back.leaves == {kk: (tuple(s), np.dtype(d)) for kk, (s, d) in leaves.items()}
    assert back.source == lay.source


def test_refusals_name_the_key():
    base = {TERMINATED: ((1,), np.dtype(bool)), REWARD: ((1,), np.dtype(np.float32))}
    with pytest.raises(InvalidArgumentError, match=r"\('next', 'terminated'\) or \('next', 'done'\)"):
        Layout.from_leaves({REWARD: ((1,), np.dtype(np.float32))}, obs_key="pixels", frame_stack=None, n_step=1)
    with pytest.raises(InvalidArgumentError, match="frame_stack=4 stores the frames of obs_key='pixels'"):
        Layout.from_leaves(base, obs_key="pixels", frame_stack=4, n_step=1)
    odd = {**base, ("pixels",): ((6, 2, 2), np.dtype(np.uint8))}
    odd[("next", "pixels")] = odd[("pixels",)]
    with pytest.raises(InvalidArgumentError, match=r"not a stack of 4 frames on its first axis"):
        Layout.from_leaves(odd, obs_key="pixels", frame_stack=4, n_step=1)
    wide = {**base, REWARD: ((2,), np.dtype(np.float32))}
    with pytest.raises(InvalidArgumentError, match=r"n_step=3 sums \('next', 'reward'\)"):
        Layout.from_leaves(wide, obs_key="pixels", frame_stack=None, n_step=3)
    with pytest.raises(InvalidArgumentError, match="must hold one bool per item"):
        Layout.from_leaves({**base, TERMINATED: ((1,), np.dtype(np.uint8))}, obs_key="pixels",
                           frame_stack=None, n_step=1)
