"""Promise 14, what bigper writes bigper reads (issue 33): a round-trip matrix.

Configs are drawn over the options (storage, frame shapes from 1x1 up, frame
stacks, n-step, envs, rank and proportional, compression with and without a
budget, sequences, fields of several dtypes) and fed a few random steps with
episode ends. Each writer (``close``; ``save`` and ``Snapshots.save``; an
interpreter that exits without ``close``; kill -9; ``convert``) hands its
files to every reader that takes them (``mode="resume"``, ``load``,
``from_hdf5``, ``bigper verify``, ``bigper info``, ``convert``), and each
reader either opens them exactly, compared against a memory buffer fed the
same steps that never stopped (the same data, keys and next sample), or
refuses with a ``BigperError`` for a reason the docs give (``convert`` of
several envs, n-step or sequences). A raw exception, a refusal of what bigper
wrote, or a file ``verify`` passes that a reader refuses fails the test.

The default run draws a bounded number of examples; ``-m slow`` draws more.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import bigper
from bigper.cli import main as cli_main
from bigper.convert import convert

from tests._roundtrip import DTYPES, batch_bytes, build, feed, held, kwargs_of

ROOT = Path(__file__).resolve().parents[2]
B = 5


@st.composite
def specs(draw, storages=("memory", "memmap", "hdf5"), convertible=False):
    """A spec (see ``_roundtrip``); ``convertible``: one ``convert`` takes (an HDF5 storage of one
    stream of one-step transitions with frame stacks of at least 64 bytes a frame)."""
    storage = "hdf5" if convertible else draw(st.sampled_from(storages))
    k = draw(st.integers(1, 4) if convertible else st.one_of(st.none(), st.integers(1, 4)))
    low = 8 if convertible else 1
    h, w = draw(st.integers(low, 12)), draw(st.integers(low, 12))
    odt = "uint8" if k else draw(st.sampled_from(DTYPES))
    obs = [k, h, w] if k else draw(st.sampled_from([[h, w], [h], []]))
    extra = draw(st.dictionaries(st.sampled_from(["a", "b"]),
                                 st.tuples(st.sampled_from([[], [2], [1, 3]]), st.sampled_from(DTYPES)), max_size=2))
    fields = {"obs": [obs, odt], **{n: [list(s), d] for n, (s, d) in extra.items()}}
    sequence = None if convertible else draw(st.one_of(st.none(), st.tuples(st.integers(1, 4), st.integers(0, 2))))
    # (a sequence's learner makes its own n-step targets)
    n_step = 1 if sequence or convertible else draw(st.integers(1, 3))
    if n_step > 1 or draw(st.booleans()):  # n-step returns sum a scalar reward
        fields["reward"] = [[], draw(st.sampled_from(["float16", "float32", "float64"]))]
    compression = draw(st.sampled_from([None, "zstd"])) if k else None
    row = h * w
    budget = None
    if compression:
        # Issue 33 cause 2 (branch h33a): without a budget, frames under 64 bytes get a default
        # budget their own reader refuses; cause 3: a budget that keeps no stack. Both are left
        # to the strict xfails below; here, budgets that hold a frame.
        budget = draw(st.sampled_from([None, row]))
        assume(budget is not None or row >= 64)
    num_envs = 1 if convertible else draw(st.integers(1, 3))
    spec = {"storage": storage, "capacity": draw(st.integers(6, 40)), "fields": fields, "frame_stack": k,
            "n_step": n_step, "num_envs": num_envs,
            "prioritization": draw(st.sampled_from(["proportional", "rank"])), "compression": compression,
            "budget": budget, "sequence": list(sequence) if sequence else None, "seed": draw(st.integers(0, 9)),
            "data_seed": draw(st.integers(0, 2 ** 16)), "steps": draw(st.integers(1, 30)),
            "p_end": draw(st.sampled_from([0.0, 0.1, 0.3])), "levels": draw(st.sampled_from([2, 256]))}
    return spec


def buildable(spec: dict) -> None:
    try:
        build(spec).close()
    except bigper.InvalidArgumentError:  # a combination the constructor refuses, saying why
        assume(False)


# -- what "exactly" means ---------------------------------------------------------------------
def same_as(got, ref, *, keys: bool = True, next_sample: bool = True) -> None:
    """``got`` holds what ``ref`` holds (data in stream order, and keys); with ``next_sample``,
    its next batch is ``ref``'s (same indices, weights, data), or both refuse to sample."""
    a, ka = held(got)
    b, kb = held(ref)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name
    if keys:
        assert ka.tobytes() == kb.tobytes()
    if next_sample:
        try:
            want = ref.sample(B)
        except bigper.BigperError as e:
            with pytest.raises(type(e)):
                got.sample(B)
            return
        assert batch_bytes(got.sample(B)) == batch_bytes(want)


def cli(*args) -> tuple[int, str]:
    """``bigper ARGS`` in this process (the CLI's own main; a subprocess test covers the command)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli_main([str(a) for a in args])
        except SystemExit as e:  # argparse
            rc = e.code
    said = out.getvalue() + err.getvalue()
    assert "Traceback" not in said, said
    return rc, said


def verified(path) -> None:
    rc, said = cli("verify", path)
    assert rc == 0 and said.startswith("OK"), said
    rc, said = cli("info", path)
    assert rc == 0, said


# -- the readers -------------------------------------------------------------------------------
def read_storage(spec: dict, path: Path, ref) -> None:
    """Every reader of a storage a writer left at ``path`` (it must be clean or resumable)."""
    storage = spec["storage"]
    verified(path)
    if storage == "hdf5":
        read_dataset(spec, path, ref)
        read_convert(spec, path, ref)
    # ref never stopped: the episode open at the writer's end goes on (continue_episodes), the exact
    # meaning of "the same data, keys and next sample" (promise 4 with the episode continuing)
    with build(spec, storage, path, mode="resume", continue_episodes=True) as got:
        same_as(got, ref)


def read_dataset(spec: dict, path: Path, ref) -> None:
    """``from_hdf5``: the same data in place; keys start at 1.0 (no sidecar); a sample is data of ref."""
    with bigper.PrioritizedReplayBuffer.from_hdf5(path, seed=3) as ds:
        assert ds.config.sequence == ref.config.sequence and len(ds) == len(ref)
        same_as(ds, ref, keys=False, next_sample=False)
        _, keys = held(ds)
        assert (keys == 1.0).all()
        try:
            b = ds.sample(B)
        except bigper.BigperError:
            with pytest.raises(bigper.BigperError):
                ref.sample(B)
            return
        want = ref.gather(b.indices)
        assert set(b.keys()) <= set(want)
        for name in b.keys():
            assert np.asarray(b[name]).tobytes() == np.asarray(want[name]).tobytes(), name
        if b.mask is not None:
            assert b.mask.tobytes() == np.asarray(want["mask"]).tobytes()


def convert_refuses(spec: dict) -> str | None:
    """Why ``convert`` refuses a source of ``spec`` (the documented cases), or None."""
    if spec["num_envs"] != 1 or spec["n_step"] != 1 or spec["sequence"] is not None:
        return "convert reads one stream of one-step transitions"
    if len(spec["fields"]["obs"][0]) != 3 or spec["fields"]["obs"][0][0] > 16:
        return "not a stack of frames"
    return None


def read_convert(spec: dict, path: Path, ref) -> None:
    dst = path.with_name("converted.h5")
    why = convert_refuses(spec)
    live = int((ref.status == 1).sum())
    shape = spec["fields"]["obs"][0]
    if why is None and (live == 0 or int(np.prod(shape[1:])) < 64):
        why = "no sampleable transition" if live == 0 else None
        if live and int(np.prod(shape[1:])) < 64:
            return  # issue 33 cause 2 (branch h33a): see test_convert_of_frames_under_64_bytes_reopens
    event(f"convert: {why or 'converted'}")
    if why is not None:
        with pytest.raises(bigper.InvalidArgumentError, match=why):
            convert(path, dst, progress=False)
        assert not os.path.lexists(dst)
        return
    convert(path, dst, progress=False)
    verified(dst)
    with bigper.PrioritizedReplayBuffer.from_hdf5(dst) as ds:
        got, _ = held(ds)
        cfg = ds.config
    want, _ = held(ref)
    for name in got:  # convert keeps the fields and successors (not discount, a sample-time value)
        if name != "discount":
            assert got[name].tobytes() == want[name].tobytes(), name
    again = path.with_name("again.h5")  # a converted file converts again, to the same transitions
    convert(dst, again, progress=False)
    with bigper.PrioritizedReplayBuffer.from_hdf5(again) as ds:
        twice, _ = held(ds)
    assert {k: v.tobytes() for k, v in twice.items()} == {k: v.tobytes() for k, v in got.items()}
    with bigper.PrioritizedReplayBuffer(**kwargs_of(cfg), storage="hdf5", path=dst, mode="resume") as b:
        assert len(b) == live
    for p in (dst, again):
        os.unlink(p)


# -- the writers -------------------------------------------------------------------------------
def storage_path(spec: dict, d: Path) -> Path:
    return d / ("buf.h5" if spec["storage"] == "hdf5" else "buf")


def roundtrip(spec: dict, writer: str) -> None:
    with tempfile.TemporaryDirectory() as d, build(spec) as ref:
        d = Path(d)
        feed(ref, spec)
        if writer == "close":
            path = storage_path(spec, d)
            with build(spec, spec["storage"], path) as buf:
                feed(buf, spec)
            read_storage(spec, path, ref)
        elif writer in ("save", "snapshots"):
            path = storage_path(spec, d) if spec["storage"] != "memory" else None
            with build(spec, spec["storage"], path) as buf:
                feed(buf, spec)
                snap = buf.save(d / "snap") if writer == "save" else bigper.Snapshots(d / "series").save(buf)
            verified(snap)
            again = d / "again" / ("buf.h5" if spec["storage"] == "hdf5" else "buf")
            loaded = bigper.PrioritizedReplayBuffer.load(snap, path=again if path is not None else None,
                                                         continue_episodes=True)  # ref never stopped
            with loaded:
                same_as(loaded, ref)
            if writer == "snapshots":
                with bigper.Snapshots(d / "series").load_latest(path=again if path is not None else None,
                                                                continue_episodes=True) as b:
                    same_as(b, ref, next_sample=False)
        else:
            raise AssertionError(writer)


WRITERS = ["close", "save", "snapshots"]


def child(spec: dict, d: Path, how: str):
    from tests._child import Child
    from tests._roundtrip import CHILD

    return Child(CHILD, json.dumps(spec), storage_path(spec, d), d / "snap", how, cwd=d)


def commands(*calls) -> list:
    """The real ``bigper`` command, each call ``python -m bigper ARGS`` of its own, all in one
    other interpreter (tests/_child_batch.py: each reported apart, one after another)."""
    from tests._child_batch import BIGPER_CLI, run_batch

    out = run_batch(BIGPER_CLI, {str(i): list(args) for i, args in enumerate(calls)},
                    env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    return [out[str(i)] for i in range(len(calls))]


def exit_without_close(spec: dict) -> None:
    """An interpreter that feeds the buffer and ends without close(): the path resumes exactly
    (promise 13), and ``bigper verify`` and ``bigper info`` (the real command) say so."""
    with tempfile.TemporaryDirectory() as d, build(spec) as ref:
        d = Path(d)
        feed(ref, spec)
        with child(spec, d, "exit") as p:
            p.said("exiting without close")
            if p.end() != 0 or "could not close" in p.stderr():
                p.fail("did not exit cleanly")
        path = storage_path(spec, d)
        for r in commands(("verify", path), ("info", path)):
            assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
        read_storage(spec, path, ref)


def killed(spec: dict, rng) -> None:
    """kill -9 at a step the writer reports, after a snapshot: the snapshot loads exactly as the
    buffer was when it was saved; the storage is either verified and opened by every reader, or
    refused by each with a bigper error (a killed writer's storage is unclean)."""
    half = spec["steps"] // 2
    with tempfile.TemporaryDirectory() as d, build(spec) as ref:
        d = Path(d)
        feed(ref, spec, stop=half)
        with child(spec, d, "kill") as p:
            p.said("saved")
            for _ in range(rng.randrange(spec["steps"] - half + 1)):
                line = p.line()
                if not line.startswith(("step", "done")):
                    p.fail(f"said {line!r}, not a step")
            p.kill()
        again = d / "again" / storage_path(spec, d).name if spec["storage"] != "memory" else None
        with bigper.PrioritizedReplayBuffer.load(d / "snap", path=again, continue_episodes=True) as b:
            same_as(b, ref)  # ref never stopped: the episode open at the snapshot goes on
        if spec["storage"] == "memory":
            return
        path = storage_path(spec, d)
        rc, said = cli("verify", path)
        readers = [lambda: build(spec, spec["storage"], path, mode="resume", read_only=True)]
        if spec["storage"] == "hdf5":
            readers.append(lambda: bigper.PrioritizedReplayBuffer.from_hdf5(path))
        for reader in readers:
            try:
                reader().close()
            except bigper.BigperError as e:
                assert rc != 0, f"verify passed ({said}) what a reader refuses: {e}"
                assert str(path) in str(e) or path.name in str(e), e


def examples(n: int):
    """Hypothesis settings of these tests: ``n`` examples, no deadline (real files and processes)."""
    return settings(max_examples=n, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def interpreter_case(how: str, spec: dict, rng) -> None:
    assume(how == "kill" or spec["storage"] != "memory")  # (a memory buffer that exits leaves nothing)
    if how == "kill":
        assume(spec["steps"] >= 2)
    buildable(spec)
    exit_without_close(spec) if how == "exit" else killed(spec, rng)


def writer_case(writer: str, spec: dict) -> None:
    assume(writer != "close" or spec["storage"] != "memory")  # (close leaves no file of a memory buffer)
    buildable(spec)
    roundtrip(spec, writer)


@pytest.mark.parametrize("how", ["exit", "kill"])
@examples(4)
@given(spec=specs(storages=("memmap", "hdf5")), rng=st.randoms(use_true_random=False))
def test_a_writer_in_another_interpreter_that_exits_or_is_killed(how, spec, rng):
    interpreter_case(how, spec, rng)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "kill"])
@examples(30)
@given(spec=specs(), rng=st.randoms(use_true_random=False))
def test_a_writer_in_another_interpreter_that_exits_or_is_killed_many(how, spec, rng):
    interpreter_case(how, spec, rng)


@pytest.mark.parametrize("writer", WRITERS)
@examples(20)
@given(spec=specs())
def test_what_a_writer_wrote_every_reader_opens_exactly(writer, spec):
    writer_case(writer, spec)


@examples(8)
@given(spec=specs(convertible=True))
def test_what_convert_wrote_every_reader_opens_exactly(spec):
    writer_case("close", spec)  # the storage's readers, then convert's file into every reader


@pytest.mark.slow
@pytest.mark.parametrize("writer", WRITERS)
@examples(150)
@given(spec=specs())
def test_what_a_writer_wrote_every_reader_opens_exactly_many(writer, spec):
    writer_case(writer, spec)


@pytest.mark.slow
@examples(80)
@given(spec=specs(convertible=True))
def test_what_convert_wrote_every_reader_opens_exactly_many(spec):
    writer_case("close", spec)


# -- issue 33 causes 2 and 3 (the budget rule), held here too ------------------------------------
def tiny_frames_spec(storage: str) -> dict:
    return {"storage": storage, "capacity": 30, "fields": {"obs": [[4, 2, 2], "uint8"]}, "frame_stack": 4,
            "n_step": 1, "num_envs": 1, "prioritization": "proportional", "compression": "zstd", "budget": None,
            "sequence": None, "seed": 0, "data_seed": 1, "steps": 25, "p_end": 0.1, "levels": 256}


@pytest.mark.parametrize("writer", ["close", "save"])
def test_compressed_frames_under_64_bytes_without_a_budget_reopen(writer):
    spec = tiny_frames_spec("hdf5")
    roundtrip(spec, writer)


def test_convert_of_frames_under_64_bytes_reopens(tmp_path):
    """(Was a strict xfail, issue 33 cause 2: convert of 4x4 frames wrote a file that from_hdf5
    refused. The case itself lacked 'rewards', so it failed at the convert for another reason
    and hid that the bug was fixed.)"""
    import h5py

    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (44, 4, 4), dtype=np.uint8)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["observations"] = np.stack([frames[i:i + 4] for i in range(40)])
        f["next_observations"] = np.stack([frames[i + 1:i + 5] for i in range(40)])
        f["actions"], f["terminals"] = np.zeros(40, np.int64), np.zeros(40, bool)
        f["rewards"] = np.zeros(40, np.float32)
    convert(tmp_path / "d.h5", tmp_path / "z.h5", progress=False)
    rc, said = cli("verify", tmp_path / "z.h5")
    assert rc == 0, said
    with bigper.PrioritizedReplayBuffer.from_hdf5(tmp_path / "z.h5") as ds:
        assert len(ds) == 40


def test_a_budget_either_is_refused_or_keeps_transitions():
    spec = dict(tiny_frames_spec("memory"), fields={"obs": [[4, 8, 8], "uint8"]}, budget=1, steps=40, p_end=0.0)
    try:
        buf = build(spec)
    except bigper.InvalidArgumentError:
        return  # refused at construction, saying why: one of the two answers the issue asks for
    with buf:
        feed(buf, spec)
        assert int((buf.status == 1).sum()) > 0
