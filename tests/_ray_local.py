"""One local 2-CPU Ray instance for the test modules that need "a laptop"
(test_ray, test_ray_laptop): started by the first that asks, left running for
the next (each start costs 5-15 s on this machine), stopped at exit by Ray's
own atexit hook or by a module that needs another cluster (test_ray_nodes)."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def local_ray(module_name: str):
    """Start (or reuse) the local instance; workers import bigper from this
    checkout and the calling test module by value."""
    import ray
    from ray import cloudpickle

    if not ray.is_initialized():
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, before) if p)
        try:
            ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 * 2**20,
                     log_to_driver=False, configure_logging=False)
        finally:
            if before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = before
    cloudpickle.register_pickle_by_value(sys.modules[module_name])
    return ray
