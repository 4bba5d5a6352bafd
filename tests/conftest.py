"""Shared by the tests: the one-thread fixture, the test process's own signal handlers kept (a script's run_cli
called in-process installs its stop handlers), and the explicit-matrix oracles of the uniform-state process
(Eq. (discrete_marginal) as a K x K transition matrix, Eq. (reverse) by Bayes' rule on those matrices)."""
import signal

import pytest
import torch

from plumbing.signals import STOP_SIGNALS


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


def transition_matrix(alpha, K):
    """Q[x, y] = q(y | x) = alpha 1[x = y] + (1 - alpha) / K, float64; alpha a float or (n,) -> (K, K) or (n, K, K)."""
    alpha = torch.as_tensor(alpha, dtype=torch.float64)[..., None, None]
    return alpha * torch.eye(K, dtype=torch.float64) + (1 - alpha) / K


def bayes_posterior(xt, x0_probs, alpha_t, alpha_s, K):
    """q(x_s | x_t) under the prior x0 ~ x0_probs, by Bayes' rule on explicit matrices:
    proportional to sum_x x0(x) Q_s[x, x_s] Q_{t|s}[x_s, x_t].
    xt (n,), x0_probs (n, K), alphas floats or (n,) -> (n, K)."""
    alpha_t, alpha_s = (torch.as_tensor(a, dtype=torch.float64).expand(xt.shape) for a in (alpha_t, alpha_s))
    prior_s = torch.einsum("nx,nxy->ny", x0_probs.double(), transition_matrix(alpha_s, K))
    likelihood = transition_matrix(alpha_t / alpha_s, K)[torch.arange(xt.numel()), :, xt]
    joint = prior_s * likelihood
    return joint / joint.sum(-1, keepdim=True)
