import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny-model ops are overhead-bound: one intra-op thread is faster, above all on a shared CI box."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def paged_kernel():
    """The paged decode kernel compiles here (torch.compile needs a C++ compiler on the CPU): under CI a
    machine without one is a broken CI, elsewhere its tests are skipped (the engine then serves with the
    gathered path, which every other test covers)."""
    import os
    import shutil

    if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
        if os.environ.get("CI"):
            pytest.fail("no C++ compiler under CI: the paged decode kernel cannot compile")
        from handler.model import paged_attention

        # what such a machine must still get right: the probe says so, and "auto" keeps gathering
        p = paged_attention.probe("cpu", torch.float32, 4, 2, 32, 16, rows=4)
        assert not p.ok and not p.faster, p
        pytest.skip(f"no C++ compiler: the paged decode kernel cannot build on the CPU ({p.reason[:80]})")
