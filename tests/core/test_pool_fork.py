"""The shared thread pool (``bigper/common/pool.py``) across ``fork()``: a child
inherits the parent's pool object but none of its threads, so a job sent to it
waited for ever (found beside issue 43 §3: a forked child's first large decode
hung). The child now makes a pool of its own."""

import os
import subprocess
import sys
import textwrap


def test_a_forked_child_runs_jobs_on_a_pool_of_its_own():
    script = textwrap.dedent("""
        import os, signal, sys
        os.environ["BIGPER_THREADS"] = "2"
        from bigper.common import pool as _pool
        seen = []
        _pool.for_ranges(lambda lo, hi: seen.append((lo, hi)), 100, 10)  # the parent's pool is made here
        assert len(seen) == 2, seen
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a hang ends the child with SIGALRM, not the test run
            got = []
            _pool.for_ranges(lambda lo, hi: got.append((lo, hi)), 100, 10)
            os._exit(0 if sorted(got) == [(0, 50), (50, 100)] else 3)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "child 0" in r.stdout, (r.stdout, r.stderr[-2000:])
