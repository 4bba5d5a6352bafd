"""Shared by the tests: the one-thread fixture, the test process's own signal handlers kept (a script's run_cli
called in-process installs its stop handlers), and the explicit-matrix oracles of the uniform-state process
(Eq. (discrete_marginal) as a K x K transition matrix, Eq. (reverse) by Bayes' rule on those matrices), which live
in test_losses.py (it travels alone with losses.py) and are shared from here."""
import signal

import pytest
import torch

from plumbing.signals import STOP_SIGNALS
from test_losses import bayes_posterior, transition_matrix  # noqa: F401  (the oracles, for the tests)


@pytest.fixture(autouse=True)
def _signal_handlers():
    """Each test starts and ends with pytest's handlers: cli.run_cli, called in-process, replaces them."""
    old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    yield
    for s, h in old.items():
        if h is not None:
            signal.signal(s, h)


@pytest.fixture(scope="module")
def one_thread():
    """Tests on tiny tensors: on a busy 2-core machine a second intra-op thread only adds waiting (10-40x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
