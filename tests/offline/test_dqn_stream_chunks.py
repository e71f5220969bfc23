"""A DQN Replay checkpoint streamed in chunks of any size: the transitions are the format's.

``stream_transitions`` reads a checkpoint's frames in chunks of ``rows`` into
recycled buffers and puts the last frames of each window before the next
chunk (``dqn_replay._Prefetch``), so a stack may span two, or (``rows`` below
the stack size) several chunks, and a wrapped checkpoint splits at its
cursor. Every chunk size, ``extend`` size and queue depth must give exactly
the reference the format's rules build from the same files
(``_dqn_replay_files.reference``), stack for stack, whichever buffers were
reused.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from bigper.errors import InvalidArgumentError
from bigper.offline.dqn_replay import open_run, prefetch_frames, scan_run, stream_transitions

from tests.offline._dqn_replay_files import K, Recorder, play, reference


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Pong saved at cursors inside the ring (checkpoints 1 and 2 wrap), short episodes."""
    run = tmp_path_factory.mktemp("chunks") / "run"
    frames, act, rew, ends = play("Pong", 1300, seed=3, max_len=29)
    rec = Recorder(400, horizon=2)
    for t in range(frames.shape[0]):
        rec.add(frames[t], act[t], rew[t], ends[t])
        if t in (500, 933, 1299):
            rec.save(run, (500, 933, 1299).index(t))
    return run


@pytest.fixture(scope="module")
def refs(run):
    return {ck.n: reference(run, ck.n) for ck in scan_run(run)}


def streamed(run, ck, chunk, rows, depth, ahead, recycle=True):
    fd = open_run(run)
    try:
        pf = prefetch_frames(fd, ck, K, rows=rows, depth=depth) if ahead else None
        out = {k: [] for k in ("obs", "next_obs", "action", "reward", "terminated")}
        try:
            for d in stream_transitions(fd, ck, K, chunk=chunk, rows=rows, depth=depth, prefetch=pf,
                                        recycle=recycle):
                assert d["action"].shape[0] <= chunk
                for k in out:  # recycled: copies (the stacks hold only until the next dict); else kept as given
                    out[k].append(np.array(d[k]) if recycle else d[k])
        finally:
            if pf is not None:
                pf.close()
        return {k: np.concatenate(v) if v else np.zeros(0) for k, v in out.items()}
    finally:
        os.close(fd)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunk=st.integers(1, 90), rows=st.integers(1, 70), depth=st.integers(1, 3), ahead=st.booleans(),
       recycle=st.booleans())
def test_every_chunk_size_gives_the_formats_transitions(run, refs, chunk, rows, depth, ahead, recycle):
    """Recycled (convert's way) or not: without ``recycle`` every dict kept, uncopied, to the
    end still holds its own stacks."""
    for ck in scan_run(run):
        ref, got = refs[ck.n], streamed(run, ck, chunk, rows, depth, ahead, recycle)
        assert got["action"].shape[0] == ref["action"].shape[0] > 0, ck.n
        for mine, theirs in (("obs", "obs"), ("next_obs", "next_obs"), ("action", "action"),
                             ("reward", "reward"), ("terminated", "terminal")):
            assert got[mine].tobytes() == ref[theirs].astype(got[mine].dtype).tobytes(), (ck.n, mine)


def test_a_stream_left_early_stops_its_thread_and_the_next_one_is_whole(run, refs):
    """A consumer that stops after a few dicts (a failed extend) closes the prefetch: its
    thread ends though every recycled buffer is still out, and a new stream starts clean."""
    ck = scan_run(run)[1]
    fd = open_run(run)
    try:
        pf = prefetch_frames(fd, ck, K, rows=3, depth=1)
        gen = stream_transitions(fd, ck, K, chunk=2, rows=3, depth=1, prefetch=pf, recycle=True)
        for _ in range(5):
            next(gen)
        gen.close()
        pf.close()
        assert not pf.t.is_alive()
    finally:
        os.close(fd)
    got = streamed(run, ck, 7, 5, 2, True)
    assert got["obs"].tobytes() == refs[ck.n]["obs"].tobytes()


def test_a_prefetch_without_room_for_the_stack_is_refused(run):
    ck = scan_run(run)[0]
    fd = open_run(run)
    try:
        pf = prefetch_frames(fd, ck, K - 1, rows=8)
        try:
            with pytest.raises(InvalidArgumentError, match="prefetch: a prefetch of 3 head frames cannot hold stacks of 4"):
                next(stream_transitions(fd, ck, K, prefetch=pf))
        finally:
            pf.close()
    finally:
        os.close(fd)
