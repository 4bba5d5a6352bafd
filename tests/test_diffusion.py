"""Tests for diffusion.py and curriculum/gaussian.py. The forward process and posterior are checked against explicit K x K
transition matrices and Bayes' rule in float64; samplers against their target distributions by chi-square tests on
many seeded draws; schedules against finite differences; the curriculum against Duo's reference table and Monte
Carlo."""

import math

import pytest
import torch

from conftest import bayes_posterior, transition_matrix, unit_roundoff
import diffusion
from kernels import gumbel
from curriculum.gaussian import (TOP_K_MAX_TAU, SoftTokens, alpha_table, curriculum_input, curriculum_sample, gamma_to_alpha,
                        gaussian_latent, soft_input, tau_schedule, top_k_latent)
from diffusion import (SCHEDULES, T_MIN, ancestral_step_from_logits, corrector_weights, cosine_schedule,
                       log_linear_schedule, sample_t, sample_xt, sigma_from_alpha)
from kernels.gumbel import block_logsumexp, gumbel_argmax, gumbel_noise, sample_categorical
from laws import ancestral_step, reverse_posterior


U64, U32 = unit_roundoff(torch.float64), unit_roundoff(torch.float32)
# POSTERIOR: Eq. (reverse) (and the matrices it is checked against) in float64, K <= 7: each probability (<= 1) is
# <= 3K products, sums and one division of values <= 1 in each route: the two differ by <= 2 * 21 * U64 = 5e-15;
# a wrong weight moves one by >= 1e-3.
POSTERIOR = dict(rtol=0, atol=1e-14)


def chi2_quantile(df, z=4.5):
    """Wilson-Hilferty upper quantile of chi^2(df) at a standard-normal z (z = 4.5: p ~ 3e-6)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_frequencies(samples, probs, msg=""):
    """Chi-square test of integer samples (N,) against probs (K,); zero-probability cells must stay empty. The
    threshold is chi2_quantile's (p ~ 3e-6 for a correct sampler); probabilities computed in float32 (1e-7 relative)
    move the expected counts by far less than their sampling noise (sqrt(N p))."""
    probs = probs.double()
    counts = torch.bincount(samples.reshape(-1), minlength=probs.numel()).double()
    N = counts.sum()
    assert (counts[probs == 0] == 0).all(), msg
    keep = probs > 0
    if keep.sum() == 1:
        return
    expected = N * probs[keep]
    stat = ((counts[keep] - expected) ** 2 / expected).sum().item()
    assert stat < chi2_quantile(int(keep.sum()) - 1), f"{msg} chi2={stat:.1f}"


def assert_conditional_frequencies(x0, samples, table, msg=""):
    """Chi-square test, for every value i of x0, of the samples at positions with x0 == i against table[i]."""
    for i in range(table.shape[0]):
        assert_frequencies(samples[x0 == i], table[i], msg=f"{msg} x0={i}")


def softmax_rows(n, K, seed, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(scale * torch.randn(n, K, generator=g, dtype=torch.float64), -1)


# -----------------------------------------------------------------------------
# reverse posterior, Eq. (reverse)

def test_transition_matrices_compose():
    """Sanity of the reference itself: Q_s Q_{t|s} = Q_t (the forward process is Markov)."""
    K, a_t, a_s = 5, 0.3, 0.8
    torch.testing.assert_close(transition_matrix(a_s, K) @ transition_matrix(a_t / a_s, K), transition_matrix(a_t, K),
                               **POSTERIOR)


@pytest.mark.parametrize("soft", [False, True])
def test_reverse_posterior_matches_bayes_rule(soft):
    B, L, K = 3, 5, 6
    g = torch.Generator().manual_seed(0)
    xt = torch.randint(0, K, (B, L), generator=g)
    if soft:   # x_theta: the posterior under the prior x0 ~ x_theta
        x0_probs = softmax_rows(B * L, K, seed=1).view(B, L, K)
    else:      # one-hot x0, half of the positions with x0 == xt
        x0 = torch.where(torch.rand(B, L, generator=g) < 0.5, xt, torch.randint(0, K, (B, L), generator=g))
        x0_probs = torch.nn.functional.one_hot(x0, K).double()
    alpha_t = torch.tensor([[0.2], [0.5], [0.9]], dtype=torch.float64)
    alpha_s = torch.tensor([[0.4], [0.7], [0.95]], dtype=torch.float64)
    q = reverse_posterior(xt, x0_probs, alpha_t, alpha_s, K)
    for b in range(B):
        ref = bayes_posterior(xt[b], x0_probs[b], alpha_t[b].item(), alpha_s[b].item(), K)
        torch.testing.assert_close(q[b], ref, **POSTERIOR)
        q_float = reverse_posterior(xt[b:b + 1], x0_probs[b:b + 1], alpha_t[b].item(), alpha_s[b].item(), K)
        torch.testing.assert_close(q_float[0], ref, **POSTERIOR)
    torch.testing.assert_close(q.sum(-1), torch.ones(B, L, dtype=torch.float64), **POSTERIOR)
    assert (q >= 0).all()


def test_reverse_posterior_final_step_recovers_x0_posterior():
    """alpha_s = 1: x_s = x0, so q(x_s | x_t) is p(x0 | x_t) ∝ x_theta(x0) (K alpha_t 1[x0 = x_t] + 1 - alpha_t)."""
    n, K, a_t = 8, 5, 0.35
    xt = torch.arange(n) % K
    x_theta = softmax_rows(n, K, seed=2)
    q = reverse_posterior(xt[None], x_theta[None], a_t, 1.0, K)[0]
    ref = x_theta * (K * a_t * torch.nn.functional.one_hot(xt, K).double() + 1 - a_t)
    torch.testing.assert_close(q, ref / ref.sum(-1, keepdim=True), **POSTERIOR)
    torch.testing.assert_close(q, bayes_posterior(xt, x_theta, a_t, 1.0, K), **POSTERIOR)
    x0 = (xt + 2) % K   # a one-hot x0 is returned exactly (its 1 and 0s: <= 4 roundings of values <= 1, 4.4e-16)
    e0 = torch.nn.functional.one_hot(x0, K).double()
    torch.testing.assert_close(reverse_posterior(xt[None], e0[None], a_t, 1.0, K)[0], e0, rtol=0, atol=1e-15)


@pytest.mark.parametrize("a_t,a_s", [(0.2, 0.4), (0.05, 0.5), (0.6, 0.6), (0.35, 1.0), (0.9, 0.95)])
def test_posterior_weights_are_bayes_rule_in_float64(a_t, a_s):
    """The three weights of Eq. (reverse) (posterior_weights: the mixture ancestral_step draws from) rebuild the
    Bayes posterior on explicit matrices entry for entry, for a soft x_theta and for one-hot x0 (x0 = x_t and
    x0 != x_t), at a loop level (a_s = a_t: stay put) and on the final step; and the Psi weights rebuild
    kappa q(x_s | x_t, x_theta) + (1 - kappa) q(x0 | x_t, x_theta) Q_s the same way."""
    n, K = 12, 7
    xt = torch.arange(n) % K
    one_hot = torch.nn.functional.one_hot(torch.where(torch.arange(n) < 6, xt, (xt + 3) % K), K).double()
    for x0_probs in (softmax_rows(n, K, seed=3), one_hot):
        p_z = x0_probs.gather(-1, xt[:, None])[:, 0]
        m_x0, m_unif, m_stay = diffusion.posterior_weights(p_z, K, a_t, a_s)
        e_xt = torch.nn.functional.one_hot(xt, K).double()
        law = m_x0[:, None] * x0_probs + m_unif[:, None] / K + m_stay[:, None] * e_xt
        bayes = bayes_posterior(xt, x0_probs, a_t, a_s, K)
        torch.testing.assert_close(law, bayes, **POSTERIOR)
        # three weights (<= 1) of ~4 roundings each, and their sum: <= (3 * 4 + 2) U64 = 1.6e-15
        torch.testing.assert_close(m_x0 + m_unif + m_stay, torch.ones(n, dtype=torch.float64), rtol=0, atol=2e-15)
        for kappa in (0.0, 0.3, 1.0):
            w_theta, w_unif = diffusion.psi_weights(p_z, K, a_t, a_s, kappa)
            law = w_theta[:, None] * x0_probs + w_unif[:, None] / K + (1 - w_theta - w_unif)[:, None] * e_xt
            exact = kappa * bayes + (1 - kappa) * bayes_posterior(xt, x0_probs, a_t, 1.0, K) @ transition_matrix(a_s, K)
            torch.testing.assert_close(law, exact, **POSTERIOR)


@pytest.mark.parametrize("route", ["logits", "probs"])
def test_the_ancestral_step_draws_reverse_posterior(route):
    """Sampling draws from reverse_posterior itself: the fast draw (ancestral_step_from_logits, the sampler's, and
    ancestral_step) against reverse_posterior's own probabilities by chi-square, and with kappa < 1 against
    kappa reverse_posterior(s) + (1 - kappa) (a_s reverse_posterior(1) + (1 - a_s) / K) (the Psi step)."""
    K, N = 6, 20000
    logits = 1.5 * torch.randn(len(PSI_CASES), K, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    logits[2, 1] = float("-inf")
    for i, (z, a_t, a_s, kappa) in enumerate(PSI_CASES):
        x_theta = torch.softmax(logits[i], -1)
        xt = torch.full((1, N), z)
        for k in (1.0, kappa):
            g = torch.Generator().manual_seed(20 + i)
            if route == "logits":
                xs = ancestral_step_from_logits(xt, logits[i].expand(1, N, K).float(), a_t, a_s, g, kappa=k)
            else:
                xs = ancestral_step(xt, x_theta.expand(1, N, K), a_t, a_s, g, kappa=k)
            q = lambda level: reverse_posterior(torch.tensor([[z]]), x_theta[None, None], a_t, level, K)[0, 0]
            assert_frequencies(xs[0], k * q(a_s) + (1 - k) * (a_s * q(1.0) + (1 - a_s) / K), msg=f"case {i} kappa {k}")


def test_sampling_and_reverse_posterior_share_eq_reverse(monkeypatch):
    """One function holds Eq. (reverse)'s numbers for both: replace posterior_weights by a law that always stays
    at x_t, and reverse_posterior becomes e_xt while both sampling steps (and so sample.generate) leave x_t as it is."""
    B, L, K = 2, 50, 9
    g = torch.Generator().manual_seed(1)
    xt = torch.randint(0, K, (B, L), generator=g)
    logits = torch.randn(B, L, K, generator=g)
    assert not torch.equal(ancestral_step_from_logits(xt, logits, 0.3, 0.6, torch.Generator().manual_seed(0)), xt)
    stay = lambda p_z, K, a_t, a_s: (torch.zeros_like(p_z), torch.zeros_like(p_z), torch.ones_like(p_z))
    monkeypatch.setattr(diffusion, "posterior_weights", stay)
    assert torch.equal(reverse_posterior(xt, torch.softmax(logits, -1), 0.3, 0.6, K),
                       torch.nn.functional.one_hot(xt, K).float())
    assert torch.equal(ancestral_step_from_logits(xt, logits, 0.3, 0.6, torch.Generator().manual_seed(0)), xt)
    assert torch.equal(ancestral_step(xt, torch.softmax(logits, -1), 0.3, 1.0, torch.Generator().manual_seed(0)), xt)


# -----------------------------------------------------------------------------
# samplers: frequencies against their target distributions

def test_sample_xt_frequencies_match_discrete_marginal():
    """Eq. (discrete_marginal): P(xt = x0) = alpha + (1-alpha)/K, each other token (1-alpha)/K; alpha per sequence."""
    K, L = 5, 40000
    alpha = torch.tensor([[0.0], [0.25], [0.6], [0.95], [1.0]])
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(0, K, (alpha.shape[0], L), generator=g)
    xt = sample_xt(x0, alpha, K, generator=g)
    for b, a in enumerate(alpha[:, 0].tolist()):
        assert_conditional_frequencies(x0[b], xt[b], transition_matrix(a, K), msg=f"alpha={a}")
    assert torch.equal(xt[-1], x0[-1])
    assert torch.equal(sample_xt(x0, alpha, K, generator=torch.Generator().manual_seed(9)),
                       sample_xt(x0, alpha, K, generator=torch.Generator().manual_seed(9)))


def test_sample_xt_global_draws_match_one_process_corruption():
    """draws=(u, noise): xt = x0 where u < alpha_t, else noise; slicing the global draws per rank gives the
    same corruption as one process corrupting the whole batch."""
    K, Bg, L = 7, 8, 16
    g = torch.Generator().manual_seed(1)
    x0 = torch.randint(0, K, (Bg, L), generator=g)
    alpha = torch.rand(Bg, 1, generator=g)
    u, noise = torch.rand(Bg, L, generator=g), torch.randint(0, K, (Bg, L), generator=g)
    full = sample_xt(x0, alpha, K, draws=(u, noise))
    expected = torch.tensor([[x0[b, l] if u[b, l] < alpha[b, 0] else noise[b, l] for l in range(L)]
                             for b in range(Bg)])
    assert torch.equal(full, expected)
    per_rank = [sample_xt(x0[2 * r:2 * r + 2], alpha[2 * r:2 * r + 2], K,
                          draws=(u[2 * r:2 * r + 2], noise[2 * r:2 * r + 2])) for r in range(Bg // 2)]
    assert torch.equal(torch.cat(per_rank), full)


def test_sample_categorical_frequencies_match_probs():
    K, N = 6, 30000
    probs = softmax_rows(3, K, seed=3)
    probs[1, 2] = 0.0                              # a zero-probability token is never drawn
    probs[1] /= probs[1].sum()
    ids = sample_categorical(probs[:, None, :].expand(3, N, K).float(), generator=torch.Generator().manual_seed(1))
    assert ids.shape == (3, N)
    for c in range(3):
        assert_frequencies(ids[c], probs[c], msg=f"row {c}")


def test_ancestral_step_frequencies_match_reverse_posterior():
    K, N = 6, 20000
    cases = [  # (xt, x0 distribution, alpha_t, alpha_s)
        (2, softmax_rows(1, K, seed=4)[0], 0.3, 0.6),
        (0, softmax_rows(1, K, seed=5)[0], 0.05, 0.5),
        (4, torch.nn.functional.one_hot(torch.tensor(4), K).double(), 0.4, 0.7),   # x0 == xt
        (1, torch.nn.functional.one_hot(torch.tensor(3), K).double(), 0.4, 0.7),   # x0 != xt
        (5, softmax_rows(1, K, seed=6)[0], 0.6, 1.0),                               # final step
    ]
    xt = torch.tensor([c[0] for c in cases])[:, None].expand(-1, N)
    x0_probs = torch.stack([c[1] for c in cases])[:, None, :].expand(-1, N, K).float()
    alpha_t = torch.tensor([[c[2]] for c in cases])
    alpha_s = torch.tensor([[c[3]] for c in cases])
    xs = ancestral_step(xt, x0_probs, alpha_t, alpha_s, generator=torch.Generator().manual_seed(2))
    for i, (z, x0p, a_t, a_s) in enumerate(cases):
        target = bayes_posterior(torch.tensor([z]), x0p[None].float(), a_t, a_s, K)[0]
        assert_frequencies(xs[i], target, msg=f"case {i}")


def test_ancestral_step_with_true_x0_keeps_joint_and_marginal():
    """x_t ~ q_t(.|x0), then x_s ~ q(x_s|x_t,x0): (x_s, x_t) ~ Q_s[x0, x_s] Q_{t|s}[x_s, x_t], so x_s ~ q_s(.|x0)."""
    K, L = 5, 60000
    alpha_t, alpha_s = torch.tensor([[0.3], [0.6]]), torch.tensor([[0.8], [0.9]])
    g = torch.Generator().manual_seed(3)
    x0 = torch.randint(0, K, (2, L), generator=g)
    xt = sample_xt(x0, alpha_t, K, generator=g)
    xs = ancestral_step(xt, torch.nn.functional.one_hot(x0, K).float(), alpha_t, alpha_s, generator=g)
    for b in range(2):
        Qs, Qts = transition_matrix(alpha_s[b].item(), K), transition_matrix(alpha_t[b].item() / alpha_s[b].item(), K)
        assert_conditional_frequencies(x0[b], xs[b], Qs, msg="marginal of x_s")
        joint = Qs[:, :, None] * Qts[None]                    # [x0, x_s, x_t] = Q_s[x0, x_s] Q_{t|s}[x_s, x_t]
        assert_conditional_frequencies(x0[b], xs[b] * K + xt[b], joint.reshape(K, K * K), msg="joint (x_s, x_t)")


def test_ancestral_step_samples_the_marginal_under_prior_x_theta():
    """If x0 ~ x_theta, x_t ~ q_t(.|x0), then x_s ~ q(x_s|x_t, x_theta) has marginal x_theta Q_s."""
    K, N = 5, 60000
    x_theta = softmax_rows(1, K, seed=7)[0]
    g = torch.Generator().manual_seed(4)
    x0 = sample_categorical(x_theta.expand(1, N, K), generator=g)
    xt = sample_xt(x0, 0.35, K, generator=g)
    xs = ancestral_step(xt, x_theta.expand(1, N, K), 0.35, 0.75, generator=g)
    assert_frequencies(xs[0], x_theta @ transition_matrix(0.75, K))


# -----------------------------------------------------------------------------
# schedules and times

def test_log_linear_schedule_and_derivative():
    t = torch.linspace(0.0, 1.0, 11, dtype=torch.float64)
    alpha, dalpha = log_linear_schedule(t)
    torch.testing.assert_close(alpha, 1 - (1 - 1e-3) * t, rtol=0, atol=4 * U64)     # the same 2 roundings of <= 1
    # alpha(1) = 1 - (1 - 1e-3): one rounding of 1 is U64 / 1e-3 = 1.1e-13 of the result
    assert alpha[0].item() == 1.0 and alpha[-1].item() == pytest.approx(1e-3, rel=1e-12)
    h = 1e-6     # linear: no truncation; the rounding of alpha (<= 1) over 2h: 2 U64 / (2 h) = 1.1e-10
    fd = (log_linear_schedule(t + h)[0] - log_linear_schedule(t - h)[0]) / (2 * h)
    torch.testing.assert_close(dalpha, fd, rtol=0, atol=1e-9)
    assert SCHEDULES["loglinear"] is log_linear_schedule and SCHEDULES["cosine"] is cosine_schedule


def test_cosine_schedule_derivative_matches_finite_differences():
    t = torch.linspace(0.01, 0.99, 21, dtype=torch.float64)
    alpha, dalpha = cosine_schedule(t)
    h = 1e-6     # truncation h^2 |alpha'''| / 6 <= 1e-12 (pi/2)^3 / 6 = 7e-13, rounding 2 U64 / (2 h) = 1.1e-10
    fd = (cosine_schedule(t + h)[0] - cosine_schedule(t - h)[0]) / (2 * h)
    torch.testing.assert_close(dalpha, fd, rtol=0, atol=1e-9)
    a0, a1 = cosine_schedule(torch.tensor([0.0, 1.0], dtype=torch.float64))[0].tolist()
    # a few roundings of values <= 1; a1 = 1.2e-6 is a difference of values ~1: U64 / 1.2e-6 = 1e-10 of it
    assert a0 == pytest.approx(1.0, abs=1e-15) and a1 == pytest.approx(1 - math.cos(math.pi / 2 * 1e-3), rel=1e-9)
    assert (alpha.diff() < 0).all()


def test_sigma_is_minus_log_alpha():
    alpha = torch.tensor([1.0, 0.5, 1e-3], dtype=torch.float64)
    torch.testing.assert_close(sigma_from_alpha(alpha), torch.tensor([0.0, math.log(2), math.log(1e3)],
                                                                      dtype=torch.float64), rtol=4 * U64, atol=0)


def test_sample_t_is_stratified_over_the_global_batch():
    n = 64
    t = sample_t(n, generator=torch.Generator().manual_seed(0))
    assert t.shape == (n,) and t.min() >= T_MIN and t.max() <= 1
    stratum = torch.floor((t.double() - T_MIN) / (1 - T_MIN) * n).long()
    assert torch.equal(stratum, torch.arange(n))          # exactly one sample per stratum, in order
    assert torch.equal(t, sample_t(n, generator=torch.Generator().manual_seed(0)))
    assert not torch.equal(t, sample_t(n, generator=torch.Generator().manual_seed(1)))
    # the jitter inside each stratum is U(0, 1): mean 1/2 within 4.5 standard errors (p = 7e-6)
    g = torch.Generator().manual_seed(2)
    frac = torch.cat([(sample_t(8, generator=g).double() - T_MIN) / (1 - T_MIN) * 8 - torch.arange(8)
                      for _ in range(500)])
    assert abs(frac.mean().item() - 0.5) < 4.5 * math.sqrt(1 / 12 / frac.numel())


# -----------------------------------------------------------------------------
# Duo's Gaussian-guided curriculum (duo_spec.md section 2)

# duo_spec.md 2.3: (gamma, alpha, dalpha/dgamma) for GPT-2 with the [PAD] token, K = 50258
DUO_TABLE_GPT2 = [(-4.00, 0.9987, -0.015), (-3.55, 0.9455, -0.311), (-3.50, 0.9283, -0.375),
                  (-3.00, 0.5962, -0.835), (-2.50, 0.2380, -0.522), (-2.00, 0.0720, -0.181),
                  (-1.85, 0.0493, -0.125), (-1.75, 0.0383, -0.097), (-1.00, 0.0062, -0.014)]


def test_gamma_to_alpha_matches_duo_reference_table():
    gamma = torch.tensor([row[0] for row in DUO_TABLE_GPT2], dtype=torch.float64)
    alpha, dalpha = gamma_to_alpha(gamma, 50258)
    # the spec prints alpha to 4 decimals (+-5e-5) and dalpha to 3 (+-5e-4), from its own quadrature: one more
    # printed half-unit each for that (ours: 2049 x 8001 trapezoid points, far finer)
    torch.testing.assert_close(alpha, torch.tensor([r[1] for r in DUO_TABLE_GPT2], dtype=torch.float64),
                               rtol=0, atol=1e-4)
    torch.testing.assert_close(dalpha, torch.tensor([r[2] for r in DUO_TABLE_GPT2], dtype=torch.float64),
                               rtol=0, atol=1e-3)
    assert (alpha.diff() < 0).all()


def test_dalpha_dgamma_matches_finite_differences():
    K = 50258
    gamma = torch.linspace(-4.5, -1.5, 13, dtype=torch.float64)
    # h = 1e-2, a few cells of the table (spacing D = 2^-9, linearly interpolated): truncation h^2 |alpha'''| / 6
    # (<= 4.4 here) = 7.2e-5, plus the interpolation error of alpha, D^2 |alpha''| / 8 (<= 1.4) over 2h: 6.5e-5
    h = 1e-2
    fd = (gamma_to_alpha(gamma + h, K)[0] - gamma_to_alpha(gamma - h, K)[0]) / (2 * h)
    torch.testing.assert_close(gamma_to_alpha(gamma, K)[1], fd, rtol=0, atol=2e-4)
    grid, a, da = alpha_table(K)
    fd_grid = (a[2:] - a[:-2]) / (grid[2:] - grid[:-2])     # on the grid: D^2 |alpha'''| / 6 = 2.8e-6
    torch.testing.assert_close(da[1:-1], fd_grid, rtol=0, atol=1e-5)


def test_gaussian_latent_has_the_stated_mean_and_variance():
    """w = sqrt(sigmoid(-gamma)) e_x0 + sqrt(sigmoid(gamma)) N(0, I)."""
    K, L = 8, 20000
    gamma = torch.tensor([[-3.0], [-1.5]])
    x0 = torch.randint(0, K, (2, L), generator=torch.Generator().manual_seed(0))
    w = gaussian_latent(x0, gamma, K, generator=torch.Generator().manual_seed(1)).double()
    at_x0 = w.gather(-1, x0[..., None])[..., 0]
    others = w.masked_fill(torch.nn.functional.one_hot(x0, K).bool(), float("nan"))
    for b in range(2):
        g = gamma[b].item()
        sig2, mean = 1 / (1 + math.exp(-g)), math.sqrt(1 / (1 + math.exp(g)))
        se = math.sqrt(sig2 / L)
        assert abs(at_x0[b].mean().item() - mean) < 4.5 * se          # 4.5 standard errors: p = 7e-6
        assert abs(others[b].nanmean().item()) < 4.5 * se
        # a Gaussian sample variance has relative standard error sqrt(2 / (n - 1)): 4.5 of them
        assert at_x0[b].var().item() == pytest.approx(sig2, rel=4.5 * math.sqrt(2 / (L - 1)))
        o = others[b][~others[b].isnan()]
        assert o.var().item() == pytest.approx(sig2, rel=4.5 * math.sqrt(2 / (o.numel() - 1)))


def test_argmax_of_gaussian_latent_is_the_uniform_state_marginal():
    """Duo's operator: Pr[argmax w = x0] = alpha + (1-alpha)/K with alpha = T(gamma), the rest uniform (K = 8)."""
    K, L = 8, 40000
    gamma = torch.tensor([[-4.0], [-3.0], [-2.0], [-1.2]], dtype=torch.float64)
    x0 = torch.randint(0, K, (4, L), generator=torch.Generator().manual_seed(0))
    w = gaussian_latent(x0, gamma, K, generator=torch.Generator().manual_seed(1))
    alpha, _ = gamma_to_alpha(gamma, K)
    for b in range(4):
        assert_conditional_frequencies(x0[b], w[b].argmax(-1), transition_matrix(alpha[b].item(), K),
                                       msg=f"gamma={gamma[b].item()}")


@pytest.mark.numerics
def test_soft_input_becomes_onehot_at_argmax_as_tau_goes_to_zero():
    K, L = 8, 5000
    x0 = torch.randint(0, K, (1, L), generator=torch.Generator().manual_seed(0))
    w = gaussian_latent(x0, torch.tensor([[-2.0]]), K, generator=torch.Generator().manual_seed(1))
    for tau in (1.0, 0.1):
        ref = torch.exp((w.double() - w.double().amax(-1, keepdim=True)) / tau)
        # float32 exp(e) / sum, e = (w - max) / tau rounded by <= 2 U32 |e|: <= (2 |e| + K) U32 = 2.1e-6 relative
        # where p >= 1e-6 (|e| <= 14); smaller p err by <= 2 U32 |e| p <= 1.2e-5 p (|e| <= 100 here)
        torch.testing.assert_close(soft_input(w, tau).double(), ref / ref.sum(-1, keepdim=True), rtol=1e-5, atol=1e-10)
    soft = soft_input(w, 1e-3)
    assert torch.equal(soft.argmax(-1), w.argmax(-1))      # the discrete process: xt = argmax w
    top = soft.amax(-1)
    assert (top > 0.99).double().mean() > 0.95
    onehot = torch.nn.functional.one_hot(w.argmax(-1), K).float()
    # at tau = 1e-6 a position is one-hot in float32 unless its two largest w are within 17 tau (e^-17 < U32)
    assert (soft_input(w, 1e-6) - onehot).abs().amax(-1).median() < 1e-6


def test_tau_schedule_is_log_linear_between_its_endpoints():
    # 10 ** (a log-linear exponent <= 3): a few roundings, each scaled by <= ln(10) * 3 = 7: <= 1e-14 relative
    for step in (0, 250_000, 499_999, 500_000, 10 ** 6):    # Duo's scripts: tau = 1e-3 throughout
        assert tau_schedule(step) == pytest.approx(1e-3, rel=1e-12)
    kw = dict(log10_tau_start=-1.0, log10_tau_end=-2.0, start=100, end=200)
    close = lambda v: pytest.approx(v, rel=1e-12)
    assert tau_schedule(0, **kw) == close(0.1) and tau_schedule(100, **kw) == close(0.1)
    assert tau_schedule(150, **kw) == close(10 ** -1.5)
    assert tau_schedule(175, **kw) == close(10 ** -1.75)
    assert tau_schedule(200, **kw) == close(0.01) and tau_schedule(10 ** 6, **kw) == close(0.01)


@pytest.mark.numerics
def test_curriculum_sample_agrees_with_operator_and_argmax():
    K, L, g_min, g_max = 8, 20000, -3.5, -1.75
    t = torch.tensor([1e-3, 0.3, 0.7, 1.0])
    x0 = torch.randint(0, K, (4, L), generator=torch.Generator().manual_seed(0))
    xt, soft, alpha, dalpha = curriculum_sample(x0, t, K, g_min, g_max, tau=1e-3,
                                                generator=torch.Generator().manual_seed(1))
    assert torch.equal(xt, soft.argmax(-1))
    gamma = (g_min + t.double() * (g_max - g_min))[:, None]
    # gamma(t) in float32: <= (1.75 + 3.5) U32 = 3.1e-7 off, times |dalpha/dgamma| <= 0.31 (K = 8), plus alpha's
    # float32 rounding (U32): <= 1.6e-7
    tol = dict(rtol=0, atol=3e-7)
    torch.testing.assert_close(alpha.double(), gamma_to_alpha(gamma, K)[0], **tol)
    lo, hi = (gamma_to_alpha(torch.tensor([g], dtype=torch.float64), K)[0].item() for g in (g_max, g_min))
    assert (alpha >= lo - tol["atol"]).all() and (alpha <= hi + tol["atol"]).all()
    # d alpha / dt by finite differences through gamma(t), dg = 1.75e-3: truncation dg^2 |alpha'''| / 6 * 1.75
    # (|alpha'''| <= 0.4) = 3.5e-7, and the table's interpolation error D^2 |alpha''| / 8 (D = 2^-9,
    # |alpha''| <= 0.29) over 2h: 1.4e-4
    h = 1e-3
    dg = h * (g_max - g_min)
    fd = (gamma_to_alpha(gamma + dg, K)[0] - gamma_to_alpha(gamma - dg, K)[0]) / (2 * h)
    torch.testing.assert_close(dalpha.double(), fd, rtol=0, atol=2e-4)
    assert (dalpha < 0).all()
    for b in range(4):      # Monte Carlo: P(xt = x0) = alpha + (1 - alpha)/K
        p = alpha[b].item() + (1 - alpha[b].item()) / K
        freq = (xt[b] == x0[b]).double().mean().item()
        assert abs(freq - p) < 4.5 * math.sqrt(p * (1 - p) / L)     # 4.5 binomial standard errors: p = 7e-6


@pytest.mark.parametrize("block", [256, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_step_from_logits_frequencies_match_reverse_posterior(dtype, block, monkeypatch):
    """The sampler's fast path (float32 block log-sum-exps, float64 per-token weights, two-stage Gumbel-max on the
    logits) draws Eq. (reverse) with x_theta = softmax(logits): chi-square against Bayes' rule, also with a token
    that x_theta excludes (logit -inf, as outside a nucleus) and on the final step; K = 6 in one block, and in
    blocks of 4 (a ragged last one)."""
    monkeypatch.setattr(gumbel, "GUMBEL_BLOCK", block)
    K, N = 6, 20000
    logits = (1.5 * torch.randn(5, K, generator=torch.Generator().manual_seed(4), dtype=torch.float64)).to(dtype)
    logits[1, 3] = float("-inf")
    cases = [(2, 0.3, 0.6), (3, 0.05, 0.5), (4, 0.4, 0.7), (1, 0.2, 0.25), (5, 0.6, 1.0)]   # (xt, alpha_t, alpha_s)
    xt = torch.tensor([c[0] for c in cases])[:, None].expand(-1, N)
    alpha_t, alpha_s = torch.tensor([[c[1]] for c in cases]), torch.tensor([[c[2]] for c in cases])
    xs = ancestral_step_from_logits(xt, logits[:, None, :].expand(-1, N, K), alpha_t, alpha_s,
                                    generator=torch.Generator().manual_seed(2))
    for i, (z, a_t, a_s) in enumerate(cases):
        target = bayes_posterior(torch.tensor([z]), torch.softmax(logits[i:i + 1].double(), -1), a_t, a_s, K)[0]
        assert_frequencies(xs[i], target, msg=f"case {i}")


def test_step_from_logits_makes_ancestral_steps_mixture_choices(monkeypatch):
    """Stay / uniform / x_theta are decided by the same draws as ancestral_step on softmax(logits): every token
    that does not draw from x_theta lands on the same value."""
    monkeypatch.setattr(gumbel, "GUMBEL_BLOCK", 5)
    g = torch.Generator().manual_seed(3)
    B, L, K = 6, 400, 13
    logits = 3 * torch.randn(B, L, K, generator=g)
    xt = torch.randint(0, K, (B, L), generator=g)
    for a_t, a_s in ((0.2, 0.4), (0.7, 0.9), (0.99, 1.0)):
        a = ancestral_step(xt, torch.softmax(logits.double(), -1), a_t, a_s, torch.Generator().manual_seed(5))
        b = ancestral_step_from_logits(xt, logits, a_t, a_s, torch.Generator().manual_seed(5))
        p_z = torch.softmax(logits.double(), -1).gather(-1, xt[..., None])[..., 0]
        u = torch.rand(xt.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        draws_x_theta = u < (a_s - a_t) / (K * a_t * p_z + 1 - a_t)
        assert torch.equal(a[~draws_x_theta], b[~draws_x_theta]) and draws_x_theta.any()


PSI_CASES = [(2, 0.3, 0.6, 0.5), (3, 0.05, 0.5, 0.0), (4, 0.4, 0.4, 0.2), (1, 0.2, 0.25, 0.9), (5, 0.6, 1.0, 0.3)]


@pytest.mark.parametrize("route", ["logits", "probs"])
def test_psi_step_frequencies_match_kappa_predictor_corrector(route):
    """The Psi step draws kappa q(x_s | x_t, x_theta) + (1 - kappa) q(x0 | x_t, x_theta) Q_s: chi-square against
    Bayes' rule on explicit matrices (the predictor: bayes_posterior to s; the corrector: bayes_posterior to
    level 0, then the forward matrix Q_s), at kappa = 0 (pure corrector), at a loop step (a_s = a_t, where the
    predictor stays put), on the final step and with a token x_theta excludes. (xt, alpha_t, alpha_s, kappa)."""
    K, N = 6, 20000
    logits = 1.5 * torch.randn(5, K, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    logits[1, 3] = float("-inf")
    for i, (z, a_t, a_s, kappa) in enumerate(PSI_CASES):
        xt = torch.full((1, N), z)
        g = torch.Generator().manual_seed(10 + i)
        if route == "logits":
            xs = ancestral_step_from_logits(xt, logits[i].expand(1, N, K).float(), a_t, a_s, g, kappa=kappa)
        else:
            xs = ancestral_step(xt, torch.softmax(logits[i], -1).expand(1, N, K), a_t, a_s, g, kappa=kappa)
        x_theta = torch.softmax(logits[i:i + 1], -1)
        predictor = bayes_posterior(torch.tensor([z]), x_theta, a_t, a_s, K)[0]
        corrector = bayes_posterior(torch.tensor([z]), x_theta, a_t, 1.0, K)[0] @ transition_matrix(a_s, K)
        assert_frequencies(xs[0], kappa * predictor + (1 - kappa) * corrector, msg=f"case {i}")


def test_psi_corrector_is_posterior_to_level_zero_renoised_to_s():
    """corrector_weights' three parts rebuild a_s q(x0 | x_t, x_theta) + (1 - a_s)/K token for token (float64),
    and its stay weight is what is left, a_s K a_t x_theta[x_t] / Z."""
    K = 7
    x_theta = softmax_rows(4, K, seed=9)
    xt = torch.tensor([0, 3, 6, 2])
    p_z = x_theta.gather(-1, xt[:, None])[:, 0]
    for a_t, a_s in ((0.2, 0.5), (0.6, 0.6), (0.01, 0.99)):
        m_theta, m_unif = corrector_weights(p_z, K, a_t, a_s)
        m_stay = 1 - m_theta - m_unif
        law = m_theta[:, None] * x_theta + m_unif[:, None] / K + m_stay[:, None] * torch.nn.functional.one_hot(xt, K)
        exact = bayes_posterior(xt, x_theta, a_t, 1.0, K) @ transition_matrix(a_s, K)
        torch.testing.assert_close(law, exact, **POSTERIOR)
        # m_stay = 1 - m_theta - m_unif against its closed form: <= 10 roundings of values <= 1, relative to
        # m_stay >= 3e-3 here: <= 10 U64 / 3e-3 = 3.7e-13
        torch.testing.assert_close(m_stay, a_s * K * a_t * p_z / (K * a_t * p_z + 1 - a_t), rtol=1e-12, atol=0)


@pytest.mark.parametrize("block", [256, 3])
def test_gumbel_argmax_is_an_exact_draw_from_the_softmax(block, monkeypatch):
    """Two-stage Gumbel-max ~ softmax(logits): chi-square per row, bf16 and float32 logits, an excluded token, the
    whole row in one block and in blocks of 3 (3 + 3 + 1), on all rows and on a subset of rows."""
    monkeypatch.setattr(gumbel, "GUMBEL_BLOCK", block)
    K, N = 7, 30000
    logits = 2 * torch.randn(3, K, generator=torch.Generator().manual_seed(6))
    logits[2, 4] = float("-inf")
    logits[1, 6] = -25.0                      # alone in the last block when block = 3: a block of tiny mass
    for dtype in (torch.float32, torch.bfloat16):
        z = logits.to(dtype)
        flat = z[:, None, :].expand(3, N, K).reshape(-1, K)
        ids = gumbel_argmax(flat, torch.Generator().manual_seed(7), chunk_elems=5000 * K).view(3, N)
        rows = torch.arange(1, 3 * N, 2)      # every other row, with the block log-sum-exps of all rows given
        picked = gumbel_argmax(flat, torch.Generator().manual_seed(8), block_lse=block_logsumexp(flat), rows=rows)
        for r in range(3):
            p = torch.softmax(z[r].double(), -1)
            assert_frequencies(ids[r], p, msg=f"{dtype} row {r}")
            assert_frequencies(picked[(rows // N) == r], p, msg=f"{dtype} row {r}, picked rows")


@pytest.mark.numerics
def test_block_logsumexp_equals_float64_logsumexp_of_each_block():
    """One pass, in chunks of rows: each block's log-sum-exp (the last block ragged) to float32 rounding, -inf for
    a block with no mass, and their log-sum-exp is the row's (the sampler's normaliser)."""
    g = torch.Generator().manual_seed(9)
    z = 5 * torch.randn(2, 9, 1000, generator=g)
    z[0, 0, 256:512] = float("-inf")
    # float32 (bf16 logits are lifted to it): a sum of n = 256 exponentials, each <= (1 + |z - max|) U32 off
    # (|z - max| <= 11 where a term is not negligible), errs by <= (n + 12) U32 relative, its log by that: 1.6e-5
    tol = (256 + 12) * U32
    for dtype in (torch.float32, torch.bfloat16):
        x = z.to(dtype)
        got = block_logsumexp(x, 256, chunk_elems=3 * 1000)
        assert got.shape == (2, 9, 4) and got.dtype == torch.float32
        ref = torch.stack([torch.logsumexp(x.double()[..., i:i + 256], -1) for i in range(0, 1000, 256)], -1)
        assert got[0, 0, 1] == float("-inf")
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=tol)
        torch.testing.assert_close(torch.logsumexp(got.double(), -1), torch.logsumexp(x.double(), -1), rtol=0, atol=tol)


@pytest.mark.numerics
def test_gumbel_noise_has_a_float64_like_tail():
    """G = -log(-log(1 - U)), U on a 2^-48 grid: P(G > g) = 1 - exp(-e^-g). Its largest value is ~33 (a float32
    uniform stops at 16.6 and so never draws a token whose logit trails by more than that), and its bulk is Gumbel."""
    hi = torch.tensor([0.0, 0.0, 2.0 ** 23, 2.0 ** 24 - 1])
    lo = torch.tensor([0.0, 2.0 ** 24 - 1, 0.0, 2.0 ** 24 - 1])
    u = (hi + (lo + 0.5) * 2.0 ** -24) * 2.0 ** -24
    g = -torch.log(-torch.log1p(-u))
    # g[2] = -log(log 2) (u = 1/2 + 2^-49) in float32: 3 roundings of values <= 1: <= 3 U32 / log 2 = 2.6e-7
    assert g[0] > 33.0 and 16.6 < g[1] < 17.0 and abs(g[2] + math.log(math.log(2))) < 1e-6 and g[3] == float("-inf")
    x = gumbel_noise((200000,), torch.Generator().manual_seed(0))
    assert x.dtype == torch.float32 and torch.isfinite(x).all()
    for q in (-1.0, 0.0, 1.0, 3.0):
        p = math.exp(-math.exp(-q))                # Gumbel CDF
        assert abs((x <= q).double().mean().item() - p) < 4.5 * math.sqrt(p * (1 - p) / x.numel())   # p = 7e-6


# -----------------------------------------------------------------------------
# the curriculum's input on its top-k coordinates, drawn in O(k) per position (top_k_latent)

def ks_two_sample(a, b):
    """Kolmogorov-Smirnov statistic of two samples (1-D) and its critical value at p = 1e-6."""
    a, b = a.double().reshape(-1).sort().values, b.double().reshape(-1).sort().values
    both = torch.cat([a, b])
    d = (torch.searchsorted(a, both, right=True) / a.numel() - torch.searchsorted(b, both, right=True) / b.numel())
    c = math.sqrt(-math.log(1e-6 / 2) / 2)
    return d.abs().max().item(), c * math.sqrt((a.numel() + b.numel()) / (a.numel() * b.numel()))


def assert_same_categorical(a, b, cells, msg=""):
    """Two-sample chi-square of integer samples a, b (equal sizes) over `cells` categories."""
    ca, cb = (torch.bincount(x.reshape(-1), minlength=cells).double() for x in (a, b))
    keep = (ca + cb) > 0
    stat = ((ca - cb)[keep] ** 2 / (ca + cb)[keep]).sum().item()
    assert stat < chi2_quantile(int(keep.sum()) - 1), f"{msg} chi2={stat:.1f}"


@pytest.mark.parametrize("gamma", [-3.0, 0.0])
def test_top_k_latent_has_the_joint_law_of_the_dense_top_k(gamma):
    """top_k_latent against the top k of the dense w (gaussian_latent + topk) at K = 10, k = 3, by two-sample
    tests: each of the k values, their sum and the top gap (Kolmogorov-Smirnov), and x0 with its rank among
    them (or absent) jointly with the two largest tokens (chi-square over 2 x 4 x 10 x 10 cells; x0 is 1 or 8, so
    that the tokens are tested as token ids, not only as offsets from a uniform x0)."""
    K, k, L = 10, 3, 30000
    x0 = torch.tensor([1, 8]).repeat(L // 2)[None]
    g = torch.tensor([[gamma]])
    values, ids = top_k_latent(x0, g, K, k, torch.Generator().manual_seed(1))
    dense = gaussian_latent(x0, g, K, generator=torch.Generator().manual_seed(2)).topk(k, dim=-1)
    assert (values.diff(dim=-1) < 0).all() and ((ids[..., :, None] == ids[..., None, :]).sum((-1, -2)) == k).all()
    for name, f in [(f"value {j}", lambda v, j=j: v[..., j]) for j in range(k)] + [
            ("sum", lambda v: v.sum(-1)), ("gap", lambda v: v[..., 0] - v[..., 1])]:
        d, crit = ks_two_sample(f(values), f(dense.values))
        assert d < crit, f"{name}: KS {d:.4f} >= {crit:.4f}"

    def pattern(ids):
        rank = torch.where(ids == x0[..., None], torch.arange(k), k).amin(-1)          # k: x0 not in the top k
        return (((x0 == 8) * (k + 1) + rank) * K + ids[..., 0]) * K + ids[..., 1]
    assert_same_categorical(pattern(ids), pattern(dense.indices), 2 * (k + 1) * K * K, msg=f"gamma={gamma}")


def test_top_k_latent_argmax_follows_the_operator_table():
    """At GPT-2's K = 50258 over Duo's gamma range: Pr[argmax w = x0] = T(gamma) + (1 - T(gamma)) / K (the
    alpha_table quadrature; binomial), and a replaced token is uniform over the other K - 1 (chi-square of its
    offset from x0 in 50 bins)."""
    K, L = 50258, 50000
    gamma = torch.tensor([[-3.55], [-3.0], [-2.5], [-1.85]])
    x0 = torch.randint(0, K, (4, L), generator=torch.Generator().manual_seed(0))
    xt, soft = curriculum_input(x0, gamma, K, 1e-3, torch.Generator().manual_seed(1))
    alpha = gamma_to_alpha(gamma.double(), K)[0]
    for b in range(4):
        p = alpha[b].item() + (1 - alpha[b].item()) / K
        freq = (xt[b] == x0[b]).double().mean().item()
        assert abs(freq - p) < 4.5 * math.sqrt(p * (1 - p) / L), f"gamma={gamma[b].item()}: {freq} vs {p}"
        off = (xt[b] - x0[b]) % K
        off = off[off != 0]
        assert_frequencies((off - 1) * 50 // (K - 1), torch.full((50,), 1 / 50), msg=f"gamma={gamma[b].item()}")


@pytest.mark.numerics
@pytest.mark.parametrize("tau", [1e-3, TOP_K_MAX_TAU])
def test_curriculum_soft_input_is_the_dense_softmax_to_rounding(tau):
    """K = 50258, tau = 1e-3 (Duo's) and the largest tau the top-k input is used at, Duo's gamma range: complete the top-k latent to a dense w with its exact conditional
    law (given the k largest coordinates, the others are independent, each truncated below the k-th: N(0,
    sigma~^2), or N(alpha~, sigma~^2) at x0); then the top k of w are the drawn ones, softmax(w / tau) in float64
    puts less than 2^-24 outside them, and curriculum_input's float32 weights equal it to float32 rounding."""
    K, k = 50258, 32
    x0 = torch.randint(0, K, (2, 64), generator=torch.Generator().manual_seed(0))
    gamma = torch.tensor([[-3.55], [-1.85]])
    values, ids = top_k_latent(x0, gamma, K, k, torch.Generator().manual_seed(1))
    xt, soft = curriculum_input(x0, gamma, K, tau, torch.Generator().manual_seed(1), top_k=k)
    assert torch.equal(soft.ids, ids) and torch.equal(xt, ids[..., 0])
    g = torch.Generator().manual_seed(2)
    scale = torch.sqrt(torch.sigmoid(gamma.double()))[..., None]
    mean = torch.zeros(2, 64, K, dtype=torch.float64).scatter_(
        -1, x0[..., None], torch.sqrt(torch.sigmoid(-gamma.double()))[..., None].expand(2, 64, 1))
    below = torch.special.ndtr((values[..., -1:] - mean) / scale)          # P(coordinate < k-th value)
    u = torch.rand(2, 64, K, generator=g, dtype=torch.float64) * below
    w = (mean + scale * torch.special.ndtri(u)).scatter_(-1, ids, values)
    top = w.topk(k, dim=-1)
    assert torch.equal(top.indices, ids) and torch.equal(top.values, values)
    dense = torch.softmax(w / tau, dim=-1)
    assert (1 - dense.gather(-1, ids).sum(-1)).max() < 2 ** -24
    # the weights are computed in float64 and rounded once to float32: <= 2^-24 relative (+ float64's ~k U64),
    # or below float32's smallest normal 2^-126 where they underflow; 2^-23: one ulp either way
    torch.testing.assert_close(soft.probs.double(), dense.gather(-1, ids), rtol=2 ** -23, atol=2 ** -126)


@pytest.mark.numerics
def test_curriculum_input_top_k_is_exact_at_the_papers_settings():
    """K = 50258, tau = 1e-3 over Duo's gamma range, on the dense w: on every position of a draw the (k+1)-th
    coordinate is more than tau (log K + 24 log 2) below the largest, i.e. the weights the top-k input drops are
    below float32 resolution (the regime curriculum_input relies on at tau <= TOP_K_MAX_TAU)."""
    K, k, tau = 50258, 32, 1e-3
    x0 = torch.randint(0, K, (2, 64), generator=torch.Generator().manual_seed(0))
    gamma = torch.tensor([[-3.55], [-1.85]])
    w = gaussian_latent(x0, gamma, K, generator=torch.Generator().manual_seed(1))
    top = w.topk(k + 1, dim=-1).values
    assert ((top[..., 0] - top[..., k]) / tau > math.log(K) + 24 * math.log(2)).all()
    xt, soft = curriculum_input(x0, gamma, K, tau, torch.Generator().manual_seed(1), top_k=k)
    # k = 32 float32 weights (each one rounding off its float64 value, which sum to 1 - < 2^-24) summed in float32
    assert ((soft.probs.sum(-1) - 1).abs() <= (2 * 32 + 2) * U32).all() and torch.equal(xt, soft.ids[..., 0])


def test_curriculum_input_keeps_dense_route_at_high_temperature():
    K = 64
    x0 = torch.randint(0, K, (2, 10), generator=torch.Generator().manual_seed(0))
    gamma = torch.tensor([[-3.0], [-2.0]])
    xt, soft = curriculum_input(x0, gamma, K, 0.1, torch.Generator().manual_seed(1))
    w = gaussian_latent(x0, gamma, K, generator=torch.Generator().manual_seed(1))
    assert torch.equal(xt, w.argmax(-1)) and torch.equal(soft, soft_input(w, 0.1))


def test_curriculum_top_k_route_has_the_uniform_state_marginal():
    """Through the chunked top-k route (K = 64 > k): Pr[xt = x0] = int phi(z - nu) Phi(z)^(K-1) dz, nu =
    exp(-gamma/2) (binomial), and the replaced tokens are uniform over the others (chi-square of xt - x0 mod K)."""
    K, L = 64, 30000
    gamma = torch.tensor([[-3.5], [-1.75]])
    x0 = torch.randint(0, K, (2, L), generator=torch.Generator().manual_seed(0))
    xt, soft = curriculum_input(x0, gamma, K, 1e-3, torch.Generator().manual_seed(1))
    assert isinstance(soft, SoftTokens) and torch.equal(soft.ids[..., 0], xt)
    z = torch.linspace(-10, 20, 30001, dtype=torch.float64)
    for b in range(2):
        nu = math.exp(-gamma[b].item() / 2)
        dens = torch.exp(-0.5 * (z - nu) ** 2 + (K - 1) * torch.special.log_ndtr(z)) / math.sqrt(2 * math.pi)
        p = torch.trapezoid(dens, z).item()
        assert abs((xt[b] == x0[b]).double().mean().item() - p) < 4.5 * math.sqrt(p * (1 - p) / L)
        offset = (xt[b] - x0[b]) % K
        assert_frequencies(offset[offset != 0], torch.cat([torch.zeros(1), torch.full((K - 1,), 1 / (K - 1))]))
