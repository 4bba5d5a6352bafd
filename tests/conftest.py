"""Shared by the tests: the one-thread fixture, the test process's own signal handlers kept (a script's run_cli
called in-process installs its stop handlers), and the explicit-matrix oracles of the uniform-state process
(Eq. (discrete_marginal) as a K x K transition matrix, Eq. (reverse) by Bayes' rule on those matrices), which live
in test_losses.py (it travels alone with losses.py) and are shared from here; the rounding bounds every float
tolerance of the suite is derived from (below); train.py in one process and in two (the DDP tests); and CI's --skipped_before
(below)."""
import os
import signal
import subprocess
import sys

import pytest
import torch

from plumbing.cli import STOP_SIGNALS
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


# Rounding: every tolerance of the suite is derived from the operation it guards (and says how in one comment),
# never fitted to one CPU: another CPU's kernels (ATEN_CPU_CAPABILITY default / avx2 / avx512) round the same
# operations in another order. u = unit roundoff: one rounding errs by at most u relatively.

def unit_roundoff(dtype):
    """u of a float dtype: 2^-53 float64, 2^-24 float32, 2^-8 bfloat16 (8 significant bits)."""
    return torch.finfo(dtype).eps / 2


def reduction_tol(n, dtype):
    """A sum of n terms in dtype, in any order (blocked, vectorised, pairwise), errs from the exact sum by at most
    gamma_n * sum|terms|, gamma_n = n u / (1 - n u) (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed.,
    Lemma 3.1 and eq. (4.4)); two orders differ by at most twice that. -> 2 gamma_n, relative to sum|terms|."""
    nu = n * unit_roundoff(dtype)
    assert nu < 0.5, (n, dtype)
    return 2 * nu / (1 - nu)


def forward_tol(roundings, size, dtype=torch.float32):
    """Two evaluations of one network on the same weights and inputs whose sums run in other orders (other batch
    shapes, thread counts, ranks): along an output's path `roundings` roundings (its sums' lengths over the layers)
    of values no larger than `size`, each errs by <= roundings * u * size (first order): the two by twice that."""
    return 2 * roundings * size * unit_roundoff(dtype)


def assert_adam_moments_close(state_a, state_b, n_terms, dtype=torch.float32):
    """Two training routes (one process vs DDP, eager vs compiled) from the same weights at a learning rate too
    small to move them (--lr 1e-30: an AdamW step moves a weight by <= lr, far below its rounding), compared
    through AdamW's state (optimizer state_dicts): its first moment m_k = sum_s (1 - beta1) beta1^(k-s) g_s is a
    fixed weighted sum (weights <= 1 in all) of the steps' gradients, each a sum of n_terms token terms, so the
    routes differ by <= reduction_tol(n_terms) times the terms' size, taken as the gradients' weighted RMS
    sqrt(v_k / (1 - beta2^k)) (an entry's terms are as large as the tensor's largest entries). Not the weights
    after real AdamW steps: Adam divides by sqrt(v) + eps, which turns a rounding-level difference of an entry
    that is itself near rounding level into up to 2 lr, and normalises away a wrong gradient scale."""
    tol = reduction_tol(n_terms, dtype)
    beta2 = state_a["param_groups"][0]["betas"][1]
    assert state_a["state"].keys() == state_b["state"].keys() and state_a["state"]
    for i, a in state_a["state"].items():
        b = state_b["state"][i]
        assert float(a["step"]) == float(b["step"]) > 0, i
        scale = (a["exp_avg_sq"].max() / (1 - beta2 ** float(a["step"]))).sqrt().item()
        assert scale > 0, f"parameter {i} never had a gradient: nothing to compare (start from trained weights)"
        torch.testing.assert_close(b["exp_avg"], a["exp_avg"], rtol=0, atol=tol * scale, msg=f"parameter {i}")


# CI's stage 2 (.ci/run): the fast suite has just passed on README's install, so of the fast tests it reruns only
# those that run skipped (for want of an optional extra, now installed); the slow tests all run.

def train_in_one_and_two_processes(args, tmp_path):
    """train.py with `args` in one process (out_dir tmp_path/one) and under torchrun in two (tmp_path/two), one
    torch thread each -> their two checkpoints, loaded (the DDP tests compare them)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, launcher in (("one", []), ("two", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"])):
        r = subprocess.run([sys.executable, *launcher, "train.py", *map(str, args), "--out_dir", str(tmp_path / name)],
                           cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (name, r.stderr[-3000:])
    return [torch.load(tmp_path / name / "ckpt.pt", weights_only=False) for name in ("one", "two")]


def pytest_addoption(parser):
    parser.addoption("--skipped_before", action="store_true",
                     help="of the fast tests run only those the last run without this flag skipped (CI's stage 2)")


SKIPPED = set()                                  # node ids of the tests (and modules) this run skipped


def pytest_runtest_logreport(report):
    if report.skipped:
        SKIPPED.add(report.nodeid)


def pytest_collectreport(report):
    if report.skipped:                           # a module-level importorskip skips the whole module
        SKIPPED.add(report.nodeid)


def pytest_sessionfinish(session):
    config = session.config                      # (-p no:cacheprovider: no cache, nothing recorded)
    if getattr(config, "cache", None) is not None and session.testscollected and not config.option.collectonly and \
            not hasattr(config, "workerinput") and not config.getoption("skipped_before"):
        config.cache.set("sddlm/skipped", sorted(SKIPPED))


# test_losses.py travels alone with losses.py (no pytest.ini there to register a marker): its float32 / bf16 tests
# are marked numerics here
LOSSES_NUMERICS = ("test_bf16_logits_are_scored_in_float32_in_chunks_of_rows",
                   "test_sddlm_v1_is_unbounded_below_without_eps_and_bounded_with_it", "test_usdm_nelbo_is_nonnegative")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith("test_losses.py::") and item.originalname in LOSSES_NUMERICS:
            item.add_marker(pytest.mark.numerics)
    cache = getattr(config, "cache", None)
    skipped = cache.get("sddlm/skipped", None) if cache is not None and config.getoption("skipped_before") else None
    if skipped is None:                          # no flag, or no earlier run recorded: everything selected runs
        return
    wanted = lambda item: item.get_closest_marker("slow") or any(
        item.nodeid == s or item.nodeid.startswith(s + "::") for s in skipped)
    config.hook.pytest_deselected(items=[item for item in items if not wanted(item)])
    items[:] = [item for item in items if wanted(item)]
