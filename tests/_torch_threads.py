"""One torch thread for a test module's tests: import ``one_torch_thread``
into the module (an autouse fixture); on the shared 2-core machine more
threads only contend."""

import pytest


@pytest.fixture(autouse=True)
def one_torch_thread():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
