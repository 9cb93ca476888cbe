import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny-model ops are overhead-bound: one intra-op thread is faster, above all on a shared CI box."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
