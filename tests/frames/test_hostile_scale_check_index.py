"""The chunked frame index check (``SegmentLog.check_index(fw, chunk)``) attacked at
its seams.

Each chunk carries on from the frame before it (its segment, where it ends,
its dictionary), so the entries an attacker would pick are the first and the
last of a chunk: the one whose expected offset comes from the chunk before,
the one whose end the next chunk starts from. Here every frame of a real
compressed log (segments opened and capped, a budget that drops old frames)
has each field of its entry nudged in turn, and the check with chunks of 1,
2, 3, 5 and 8 frames (every frame a first or a last of some chunk) must give
the whole check's verdict, in the same words. A frame whose entry is rewritten
to its own value (no change) must pass at every chunk size. A nudged length
the index cannot tell (a closed segment's last frame) fails that frame's
decode with bigper's error.
"""

from __future__ import annotations

import numpy as np
import pytest

from bigper.errors import CorruptSnapshotError

from tests import hook
from tests.frames.test_check_index_chunks import retrained  # noqa: F401 (fixture)
from tests.frames.test_compression import Feed, make, noise


def _verdict(log, fw, chunk):
    try:
        return "ok", log.check_index(fw, chunk=chunk)
    except CorruptSnapshotError as e:
        return "refused", str(e)


@pytest.fixture(scope="module", params=[("memory", None), ("memmap", 24)], ids=["memory", "memmap-budget"])
def logged(request, tmp_path_factory):
    kind, budget = request.param
    rng = np.random.default_rng(5)
    src = noise(rng, 40, (6, 6), np.uint8)
    src[::3] = src[0]  # (repeats: frames of several lengths)
    buf = make(kind, tmp_path_factory.mktemp("ci"), shape=(6, 6), k=3, capacity=50, budget=budget)
    Feed(src, 3, seed=5).run(buf, 90)
    index = buf.storage.writable_arrays["frame_index"]
    kept = index.copy()
    yield buf, index, kept
    index[:] = kept
    buf.close()


@pytest.mark.parametrize("what,delta", [("offset", 1), ("offset", -1), ("length", 1), ("length", -1),
                                        ("gen", 1), ("gen", -1), ("offset", 0)])
def test_every_frame_nudged_gives_the_whole_checks_verdict_at_every_chunk_seam(logged, what, delta):
    buf, index, kept = logged
    log, fw = hook.log(buf), hook.frames(buf).fw
    lo = max(log.oldest(), fw - log.F, 0)
    assert fw - lo > 20 and log.g >= 1  # (more than one segment)
    refused = 0
    try:
        for f in range(lo, fw):
            o, ln, d = (int(a[0]) for a in hook.entries(buf, index, [f % log.F]))
            new = {"offset": o + delta, "length": ln + delta, "gen": max(0, d + delta)}[what]
            hook.set_entries(buf, index, [f % log.F], **{what: new})
            whole = _verdict(log, fw, fw + 1)
            if delta == 0:
                assert whole == ("ok", fw - lo), f
            refused += whole[0] == "refused"
            for chunk in (1, 2, 3, 5, 8):
                assert _verdict(log, fw, chunk) == whole, (f, chunk, f - lo)
            if what == "length" and whole[0] == "ok":
                # (the last frame of a closed segment: nothing after it says where it ends;
                # its decode does, as bigper's error, never another frame's bytes)
                with pytest.raises(CorruptSnapshotError, match=rf"frame {f} .*does not decompress"):
                    log.decode(np.array([f], dtype=np.int64))
            index[:] = kept
    finally:
        index[:] = kept
    if what == "offset" and delta:
        assert refused == fw - lo  # (every nudged offset is off)


@pytest.mark.parametrize("delta", [-1, 1])
def test_every_generation_nudged_across_retrained_dictionaries_at_every_seam(retrained, delta):
    """The log of four games whose dictionary was retrained every 40 frames: a frame's
    generation one back (or on) is caught where it breaks the order, whichever
    chunk it starts or ends."""
    buf, index, kept = retrained
    log, fw = hook.log(buf), hook.frames(buf).fw
    lo = max(log.oldest(), fw - log.F, 0)
    gens = hook.entries(buf, index, np.arange(lo, fw) % log.F)[2]
    changes = np.flatnonzero(np.diff(gens)) + 1 + lo  # the first frames of a new generation
    assert changes.size >= 2
    refused = 0
    try:
        for f in range(lo, fw):
            d = int(hook.entries(buf, index, [f % log.F])[2][0])
            if d + delta < 0:
                continue
            hook.set_entries(buf, index, [f % log.F], gen=d + delta)
            whole = _verdict(log, fw, fw + 1)
            refused += whole[0] == "refused"
            assert _verdict(log, fw, 3) == whole, f
            # (the seams where it matters: the chunk starts at the changed frame)
            assert _verdict(log, fw, max(1, f - lo)) == whole, f
            index[:] = kept
    finally:
        index[:] = kept
    assert refused >= changes.size
