import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tests on tiny tensors: on a busy 2-core machine a second intra-op thread only adds waiting (10-40x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
