"""Tests for losses.py, which travel with it: copy the two files alone, `python -m pytest test_losses.py`.
Every loss is checked against an independent route: brute-force float64 formulas written from the paper with
explicit loops, hand-derived gradients, central finite differences, Monte Carlo with a stated tolerance, and (for
the Duo NELBO) the discrete-time ELBO built from explicit transition matrices; on bf16 logits, against float64
logits holding the same rounded values."""

import math

import pytest
import torch
import torch.nn.functional as F

from losses import (EPS, ar_loss, log_probs, naive_denoising_loss, sddlm_loss, sddlm_v1_loss,
                    sddlm_v2_loss, usdm_nelbo_loss)

B, L, V = 2, 6, 7

# Tolerances: each derived from the computation it guards, as one comment says. u = unit roundoff (one rounding
# errs by at most u relatively); a computation of n roundings errs by <= ~n u times the sizes of what it handles.
U64, U32 = 2.0 ** -53, 2.0 ** -24
# EXACT: a loss, log-probability or gradient against the brute-force float64 route. An entry is a log-softmax over
# V = 7 logits of size <= 40 (make_case, scale <= 12) and a few products: <= 3V roundings of values <= 44 in each
# route, so the two differ by <= 2 * 21 * 44 * U64 = 2e-13 (the gradients' entries are <= 3, far less); a wrong
# term moves an entry by >= 1e-6.
EXACT = dict(rtol=0, atol=1e-12)


def make_case(seed=0, scale=2.0, dtype=torch.float64):
    """Small batch with both kinds of positions: xt == x0 (kept) and xt != x0 (replaced), and negatives
    that sometimes coincide with x0 or xt."""
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(B, L, V, generator=g, dtype=torch.float64)).to(dtype)
    x0 = torch.randint(0, V, (B, L), generator=g)
    changed = torch.tensor([[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 1, 0]], dtype=torch.bool)
    xt = torch.where(changed, (x0 + torch.randint(1, V, (B, L), generator=g)) % V, x0)
    neg = torch.randint(0, V, (B, L), generator=g)
    neg[0, 0], neg[1, 1] = x0[0, 0], xt[1, 1]          # a negative equal to x0, one equal to xt
    return logits, x0, xt, neg


# -----------------------------------------------------------------------------
# brute-force float64 references, one token at a time with python floats

def softmax_row(row):
    m = max(row)
    e = [math.exp(v - m) for v in row]
    s = sum(e)
    return [v / s for v in e]


def brute(fn, logits, *ids):
    """Apply fn(p: list of floats, *token ids) at every (b, l) -> (B, L) float64."""
    out = torch.empty(logits.shape[:2], dtype=torch.float64)
    for b in range(logits.shape[0]):
        for l in range(logits.shape[1]):
            p = softmax_row(logits[b, l].double().tolist())
            out[b, l] = fn(p, *(int(i[b, l]) for i in ids))
    return out


def naive_ref(p, x0):
    return -math.log(p[x0])


def sddlm_ref(p, x0, xt):
    return -math.log(p[x0]) if xt != x0 else 0.0


def v1_ref(eps):
    def f(p, x0, xt, neg):
        return (math.log(p[neg] + eps) - math.log(p[x0] + eps)) if xt != x0 else 0.0
    return f


def usdm_printed(p, x0, z, alpha, dalpha):
    """Eq. (usdm) term by term, with Duo's sign +alpha'/(K alpha) (the paper prints -alpha'/(K alpha))."""
    K = len(p)
    xbar = [K * alpha * (j == x0) + (1 - alpha) for j in range(K)]
    xbar_th = [K * alpha * p[j] + (1 - alpha) for j in range(K)]
    bracket = K / xbar[z] - K / xbar_th[z] - sum(
        xbar[j] / xbar[z] * math.log(xbar_th[z] * xbar[j] / (xbar_th[j] * xbar[z])) for j in range(K))
    return dalpha / (K * alpha) * bracket


def usdm_printed_torch(logits, x0, xt, alpha, dalpha):
    """The same formula in torch float64 ops, used as an autograd reference. alpha, dalpha (B, 1)."""
    K = logits.shape[-1]
    p = torch.softmax(logits, -1)
    a = alpha.unsqueeze(-1)
    xbar = K * a * torch.nn.functional.one_hot(x0, K) + (1 - a)
    xbar_th = K * a * p + (1 - a)
    xb_z = xbar.gather(-1, xt[..., None])
    xbt_z = xbar_th.gather(-1, xt[..., None])
    bracket = (K / xb_z - K / xbt_z).squeeze(-1) - (xbar / xb_z * torch.log(xbt_z * xbar / (xbar_th * xb_z))).sum(-1)
    return dalpha / (K * alpha) * bracket


def kl(p, q):
    return (p * (p / q).log()).sum(-1)


# the uniform-state process written out: explicit K x K matrices (tests/ share these through conftest.py)

def log_linear_schedule(t, eps=1e-3):
    """Duo's log-linear schedule alpha_t = 1 - (1 - eps) t and alpha'_t, in float64 (as diffusion.py's, which
    tests/test_losses_travel.py checks this copy against: test_losses.py imports nothing from the project)."""
    t = torch.as_tensor(t, dtype=torch.float64)
    return 1 - (1 - eps) * t, torch.full_like(t, -(1 - eps))


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


# -----------------------------------------------------------------------------
# values against the paper's formulas

def test_naive_loss_is_cross_entropy_at_every_position():
    logits, x0, xt, _ = make_case()
    torch.testing.assert_close(naive_denoising_loss(logits, x0), brute(naive_ref, logits, x0), **EXACT)


def test_sddlm_loss_is_cross_entropy_on_replaced_tokens_only():
    logits, x0, xt, _ = make_case()
    ref = brute(sddlm_ref, logits, x0, xt)
    torch.testing.assert_close(sddlm_loss(logits, x0, xt), ref, **EXACT)
    assert (ref[xt != x0] > 0).all()


@pytest.mark.parametrize("eps", [0.0, 1e-6, 0.05])
def test_sddlm_v1_matches_negative_sampling_with_eps_on_both(eps):
    logits, x0, xt, neg = make_case()
    ref = brute(v1_ref(eps), logits, x0, xt, neg)
    torch.testing.assert_close(sddlm_v1_loss(logits, x0, xt, neg=neg, eps=eps), ref, **EXACT)


@pytest.mark.parametrize("eps", [0.0, 1e-6, 0.05])
def test_sddlm_v2_uses_the_noisy_token_as_the_negative(eps):
    logits, x0, xt, _ = make_case()
    ref = brute(v1_ref(eps), logits, x0, xt, xt)
    torch.testing.assert_close(sddlm_v2_loss(logits, x0, xt, eps=eps), ref, **EXACT)


def test_default_eps_is_used_by_sddlm_v1_and_v2():
    logits, x0, xt, neg = make_case(scale=12.0)   # tiny probabilities, where eps matters
    ref = brute(v1_ref(EPS), logits, x0, xt, neg)
    torch.testing.assert_close(sddlm_v1_loss(logits, x0, xt, neg=neg), ref, **EXACT)
    assert not torch.allclose(ref, brute(v1_ref(0.0), logits, x0, xt, neg))     # eps moves some entry by >> 1e-5
    ref_v2 = brute(v1_ref(EPS), logits, x0, xt, xt)            # V2: the negative is xt itself
    torch.testing.assert_close(sddlm_v2_loss(logits, x0, xt), ref_v2, **EXACT)
    assert not torch.allclose(ref_v2, brute(v1_ref(0.0), logits, x0, xt, xt))
    assert 0 < EPS <= 1 / (10 * 50258)   # well below 1/V for GPT-2 (and Llama's 1/32000), as documented


def test_sddlm_losses_vanish_where_xt_equals_x0():
    logits, x0, xt, neg = make_case()
    logits.requires_grad_(True)
    kept = xt == x0
    random_neg = sddlm_v1_loss(logits, x0, xt, generator=torch.Generator().manual_seed(1))
    for loss, active in ((sddlm_loss(logits, x0, xt), ~kept), (sddlm_v1_loss(logits, x0, xt, neg=neg), neg != x0),
                         (random_neg, None), (sddlm_v2_loss(logits, x0, xt), ~kept)):
        grad, = torch.autograd.grad(loss.sum(), logits)
        assert (loss[kept] == 0).all() and (grad[kept] == 0).all()
        if active is not None:      # elsewhere the loss is live (unless the negative is x0 itself)
            assert (grad[~kept & active].abs().sum(-1) > 0).all()
    assert (naive_denoising_loss(logits, x0)[kept] > 0).all()   # the naive loss does not mask


def test_ar_loss_is_next_token_cross_entropy_on_hand_example():
    x = torch.tensor([[0, 1, 0, 2]])
    logits = torch.tensor([[[0.0, math.log(2), 0.0],      # p = (1/4, 1/2, 1/4), next token 1 -> log 2
                            [math.log(3), 0.0, 0.0],      # p = (3/5, 1/5, 1/5), next token 0 -> log 5/3
                            [0.0, 0.0, 0.0],              # uniform,             next token 2 -> log 3
                            [100.0, -100.0, 7.0]]], dtype=torch.float64)   # last position: no target
    expected = torch.tensor([[math.log(2), math.log(5 / 3), math.log(3)]], dtype=torch.float64)
    torch.testing.assert_close(ar_loss(logits, x), expected, **EXACT)
    torch.testing.assert_close(ar_loss(logits[:, :-1], x), expected, **EXACT)


def test_ar_loss_matches_bruteforce_and_ignores_last_logits():
    logits, x, _, _ = make_case()
    logits.requires_grad_(True)
    loss = ar_loss(logits, x)
    assert loss.shape == (B, L - 1)
    ref = brute(naive_ref, logits[:, :-1].detach(), x[:, 1:])
    torch.testing.assert_close(loss, ref, **EXACT)
    grad, = torch.autograd.grad(loss.sum(), logits)
    assert (grad[:, -1] == 0).all()


@pytest.mark.parametrize("chunk_rows", [1, 5, 12])   # 5: a ragged last chunk; 12: every row in one chunk
def test_bf16_logits_are_scored_in_float32_in_chunks_of_rows(chunk_rows):
    """log_probs lifts bf16 logits to float32 a chunk of rows at a time: the log-probabilities of the bf16 values
    to float32 rounding, and the gradient onehot - softmax formed in float32 and rounded once to bf16 (each entry
    within one bf16 rounding of the exact one), whatever the chunk size."""
    logits, x0, xt, neg = make_case(scale=1.0)
    logits.scatter_(-1, x0[..., None], 5.0)          # p(x0) ~ 0.95: p - 1 rounded twice would err by ~20 roundings
    bf = logits.bfloat16().requires_grad_(True)
    exact = bf.detach().double()                                   # the same values, in float64
    log_p_x0, log_p_neg = log_probs(bf, x0, neg, chunk_elems=chunk_rows * V)
    assert log_p_x0.dtype == torch.float32
    # float32 log p = (z - m) - log sum exp(z - m): 2 roundings of |log p| and the log of a 7-term sum (<= 9 u32
    # absolute): <= 2 u32 |log p| + 9 u32 = 1.2e-7 |log p| + 5.4e-7, inside 1e-6 + 1e-6 |log p|
    torch.testing.assert_close(log_p_x0.double(), -brute(naive_ref, exact, x0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(log_p_neg.double(), -brute(naive_ref, exact, neg), rtol=1e-6, atol=1e-6)
    grad, = torch.autograd.grad(log_p_x0.sum(), bf)
    ref = onehot(x0) - torch.softmax(exact, -1)
    assert grad.dtype == torch.bfloat16
    # one bf16 rounding (u = 2^-8) of the float32 onehot - softmax, itself within ~V u32 = 4e-7 relative of ref
    assert ((grad.double() - ref).abs() <= 2.0 ** -8 * ref.abs() * (1 + 1e-3)).all()


# -----------------------------------------------------------------------------
# gradients: hand-derived, and central finite differences (gradcheck, float64)

def onehot(ids, K=V):
    return torch.nn.functional.one_hot(ids, K).double()


def dlogp_eps(p, ids, eps):
    """d/dz log(p_j + eps) = p_j / (p_j + eps) * (e_j - p)."""
    pj = p.gather(-1, ids[..., None])
    return pj / (pj + eps) * (onehot(ids) - p)


@pytest.mark.parametrize("eps", [0.0, 1e-6, 0.05])
def test_loss_gradients_match_analytic_softmax_gradients(eps):
    logits, x0, xt, neg = make_case()
    logits.requires_grad_(True)
    w = torch.randn(B, L, generator=torch.Generator().manual_seed(3), dtype=torch.float64)  # upstream grads
    p = torch.softmax(logits.detach(), -1)
    mask = (xt != x0).double()[..., None]
    ce = p - onehot(x0)
    expected = {
        "naive": ce,
        "sddlm": ce * mask,
        "sddlm_v1": (dlogp_eps(p, neg, eps) - dlogp_eps(p, x0, eps)) * mask,
        "sddlm_v2": (dlogp_eps(p, xt, eps) - dlogp_eps(p, x0, eps)) * mask,
    }
    losses = {
        "naive": naive_denoising_loss(logits, x0),
        "sddlm": sddlm_loss(logits, x0, xt),
        "sddlm_v1": sddlm_v1_loss(logits, x0, xt, neg=neg, eps=eps),
        "sddlm_v2": sddlm_v2_loss(logits, x0, xt, eps=eps),
    }
    for name, loss in losses.items():
        grad, = torch.autograd.grad((loss * w).sum(), logits)
        torch.testing.assert_close(grad, expected[name] * w[..., None], **EXACT, msg=name)


def test_ar_gradient_is_softmax_minus_onehot_of_next_token():
    logits, x, _, _ = make_case()
    logits.requires_grad_(True)
    grad, = torch.autograd.grad(ar_loss(logits, x).sum(), logits)
    expected = torch.zeros_like(grad)
    expected[:, :-1] = torch.softmax(logits.detach()[:, :-1], -1) - onehot(x[:, 1:])
    torch.testing.assert_close(grad, expected, **EXACT)


def test_usdm_gradient_matches_autograd_of_the_printed_formula():
    logits, x0, xt, _ = make_case()
    alpha = torch.tensor([[0.3], [0.85]], dtype=torch.float64)
    dalpha = torch.full_like(alpha, -(1 - 1e-3))
    logits.requires_grad_(True)
    g1, = torch.autograd.grad(usdm_nelbo_loss(logits, x0, xt, alpha, dalpha).sum(), logits)
    g2, = torch.autograd.grad(usdm_printed_torch(logits, x0, xt, alpha, dalpha).sum(), logits)
    # both backpropagate ~4K roundings of terms of size <= K / (1 - alpha) * |alpha'| / (K alpha) <= 47 (alpha
    # = 0.85): <= 2 * 28 * 47 * U64 = 3e-13 per entry
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)


def test_loss_gradients_match_central_finite_differences():
    logits, x0, xt, neg = make_case(scale=1.0)
    logits = logits[:, :4].clone().requires_grad_(True)
    x0, xt, neg = x0[:, :4], xt[:, :4], neg[:, :4]
    alpha = torch.tensor([[0.2], [0.9]], dtype=torch.float64)
    fns = [
        lambda z: naive_denoising_loss(z, x0),
        lambda z: sddlm_loss(z, x0, xt),
        lambda z: sddlm_v1_loss(z, x0, xt, neg=neg, eps=1e-2),
        lambda z: sddlm_v2_loss(z, x0, xt, eps=1e-2),
        lambda z: usdm_nelbo_loss(z, x0, xt, alpha, -(1 - 1e-3)),
        lambda z: ar_loss(z, x0),
    ]
    # a central difference at h = 1e-6 errs by h^2 |f'''| / 6 (<= 1e-11 for these O(1)-curved losses) plus the
    # rounding of f (|f| <= 10): 10 U64 / h = 1e-9: well inside atol 1e-7 + rtol 1e-5, far from a wrong gradient
    for fn in fns:
        assert torch.autograd.gradcheck(fn, (logits,), eps=1e-6, atol=1e-7, rtol=1e-5)


# -----------------------------------------------------------------------------
# SDDLM-V1's negative term: Appendix A.1

def test_sddlm_v1_is_sddlm_minus_uniform_kl_up_to_constant():
    """E_{neg ~ U(V)} L_V1 = L_SDDLM - KL(U || p) - log V on replaced tokens (eps = 0: exact)."""
    logits, x0, xt, _ = make_case()
    logits.requires_grad_(True)
    mean_v1 = sum(sddlm_v1_loss(logits, x0, xt, neg=torch.full_like(x0, v), eps=0.0) for v in range(V)) / V
    p = torch.softmax(logits, -1)
    kl_u = kl(torch.full_like(p, 1 / V), p)
    mask = (xt != x0).double()
    expected = sddlm_loss(logits, x0, xt) - (kl_u + math.log(V)) * mask
    torch.testing.assert_close(mean_v1, expected, **EXACT)
    # ... and so are its gradients: the regulariser is exactly -KL(U || p) in expectation
    g1, = torch.autograd.grad(mean_v1.sum(), logits)
    g2, = torch.autograd.grad(expected.sum(), logits)
    torch.testing.assert_close(g1, g2, **EXACT)


def test_sddlm_v1_with_small_eps_stays_close_to_uniform_kl_form():
    logits, x0, xt, _ = make_case()
    p = torch.softmax(logits, -1)
    mean_v1 = sum(sddlm_v1_loss(logits, x0, xt, neg=torch.full_like(x0, v), eps=EPS) for v in range(V)) / V
    mask = (xt != x0).double()
    expected = sddlm_loss(logits, x0, xt) - (kl(torch.full_like(p, 1 / V), p) + math.log(V)) * mask
    bound = 2 * EPS / p.min()   # |log(p + eps) - log p| <= eps / p, on both terms
    assert (mean_v1 - expected).abs().max() <= bound
    assert (mean_v1 - expected).abs().max() > 0


def test_sddlm_v1_random_negatives_converge_to_the_expectation():
    """neg=None draws neg ~ U(V) with the given generator; the mean over N copies of each token must
    match the exact average over V within 4.5 standard errors (the std is computed exactly)."""
    logits, x0, xt, _ = make_case()
    N = 4000
    per_v = torch.stack([sddlm_v1_loss(logits, x0, xt, neg=torch.full_like(x0, v)) for v in range(V)])  # (V, B, L)
    exact, std = per_v.mean(0), per_v.std(0, unbiased=False)
    big = lambda t: t.repeat(N, *[1] * (t.dim() - 1))
    draws = sddlm_v1_loss(big(logits), big(x0), big(xt), generator=torch.Generator().manual_seed(7))
    mc = draws.view(N, B, L).mean(0)
    # 4.5 standard errors: p = 7e-6 for each of the 12 entries (normal law of a mean of 4000); + 1e-12: the kept
    # tokens' losses are exactly 0 (std 0), and a float64 mean of N terms <= 20 rounds by <= N * 20 * U64 = 1e-11
    assert ((mc - exact).abs() <= 4.5 * std / math.sqrt(N) + 1e-11).all()
    again = sddlm_v1_loss(big(logits), big(x0), big(xt), generator=torch.Generator().manual_seed(7))
    assert torch.equal(draws, again)


# -----------------------------------------------------------------------------
# eps: bounded gradients and a bounded loss

def tiny_negative_case(neg_logit):
    logits = torch.zeros(1, 1, V, dtype=torch.float64)
    logits[0, 0, 3] = neg_logit
    x0, xt, neg = torch.tensor([[0]]), torch.tensor([[1]]), torch.tensor([[3]])
    return logits, x0, xt, neg


@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_eps_switches_off_a_tiny_negatives_gradient(eps):
    """d loss / d z_neg = p_n/(p_n+eps) (1 - p_n) + p_x/(p_x+eps) p_n: ~1 without eps, ~p_n/eps ~ 1e-8 with it."""
    logits, x0, xt, neg = tiny_negative_case(-30.0)
    logits.requires_grad_(True)
    grad, = torch.autograd.grad(sddlm_v1_loss(logits, x0, xt, neg=neg, eps=eps).sum(), logits)
    p = softmax_row(logits[0, 0].tolist())
    pn, px = p[3], p[0]
    expected = pn / (pn + eps) * (1 - pn) + px / (px + eps) * pn
    assert grad[0, 0, 3].item() == pytest.approx(expected, rel=1e-12)     # ~20 float64 roundings: <= 2e-15
    if eps == 0:
        assert grad[0, 0, 3].item() == pytest.approx(1.0, abs=1e-12)     # (1 - p_n) + p_n = 1, to ~4 U64
    else:
        assert 0 < grad[0, 0, 3].item() < 1e-7                           # p_n / eps = 1.3e-8


def test_sddlm_v1_unbounded_below_without_eps_bounded_with_it():
    losses0 = [sddlm_v1_loss(*tiny_negative_case(z)[:3], neg=tiny_negative_case(z)[3], eps=0.0).item()
               for z in (-30.0, -60.0, -120.0)]
    # keeps falling with the neg logit: log p_neg - log p_x0 = z_neg - z_x0 exactly, rounded in float64 log-softmax
    # values <= 122: <= 4 * 122 * U64 = 5e-14
    assert losses0[1] == pytest.approx(losses0[0] - 30, abs=1e-12)
    assert losses0[2] == pytest.approx(losses0[1] - 60, abs=1e-12)
    logits, x0, xt, neg = tiny_negative_case(-1e4)
    p_x = 1 / (V - 1)                                                # the other logits are all 0
    assert sddlm_v1_loss(logits, x0, xt, neg=neg, eps=EPS).item() == pytest.approx(
        math.log(EPS) - math.log(p_x + EPS), rel=1e-12)   # limit: log eps - log(p_x + eps) (p_neg = 0); ~10 roundings
    # over random, very peaked logits the loss never goes below log(eps) - log(1 + eps)
    g = torch.Generator().manual_seed(5)
    z = 40 * torch.randn(64, 32, V, generator=g, dtype=torch.float64)
    x0, xt, neg = (torch.randint(0, V, (64, 32), generator=g) for _ in range(3))
    for dtype in (torch.float64, torch.float32):
        loss = sddlm_v1_loss(z.to(dtype), x0, xt, neg=neg, eps=EPS)
        # near the bound p_neg << eps and p_x0 ~ 1: log(p_neg + eps) - log(p_x0 + eps) is a few roundings of values
        # <= |log eps| = 13.8 (their exact parts cancel no further): <= 4 * 13.8 * U32 = 3.3e-6 in float32
        assert loss.min().item() >= math.log(EPS) - math.log(1 + EPS) - 1e-5
        assert loss.min().item() < math.log(EPS) + 1       # the bound is approached


# -----------------------------------------------------------------------------
# the Duo / USDM continuous-time NELBO, Eq. (usdm)

ALPHAS = (1e-3, 0.05, 0.3, 0.7, 0.97, 0.999)


def usdm_printed_sizes(logits, x0, xt, alpha, dalpha):
    """sum of |terms| of Eq. (usdm) as printed, per token (B, L), float64: K/x_bar_z, K/x_bar_theta_z and each
    x_bar_j/x_bar_z (1 + |log ratio|) (a log's rounding is absolute), times |alpha'/(K alpha)|. The printed form
    subtracts terms of size K/(1 - alpha), so its rounding is relative to these, not to the (smaller) loss."""
    K = logits.shape[-1]
    p = torch.softmax(logits.double(), -1)
    alpha, dalpha = (torch.as_tensor(v, dtype=torch.float64) for v in (alpha, dalpha))
    while alpha.dim() < x0.dim():
        alpha, dalpha = alpha.unsqueeze(-1), dalpha.unsqueeze(-1)
    a = alpha.unsqueeze(-1)
    xbar = K * a * torch.nn.functional.one_hot(x0, K) + (1 - a)
    xbar_th = K * a * p + (1 - a)
    xb_z, xbt_z = xbar.gather(-1, xt[..., None]), xbar_th.gather(-1, xt[..., None])
    logs = torch.log(xbt_z * xbar / (xbar_th * xb_z)).abs()
    return (dalpha / (K * alpha)).abs() * ((K / xb_z + K / xbt_z).squeeze(-1) + (xbar / xb_z * (1 + logs)).sum(-1))


def usdm_sizes(logits, x0, xt, alpha, dalpha):
    """sum of |terms| of usdm_nelbo_loss's own rearranged form, per token (B, L), float64: the sizes its rounding
    is relative to (r, 1, |log r|, and the K-term sums of KL_K), times |alpha' / (alpha x_bar_z)|."""
    K = logits.shape[-1]
    log_p = torch.log_softmax(logits.double(), -1)
    alpha, dalpha = (torch.as_tensor(v, dtype=torch.float64) for v in (alpha, dalpha))
    a = 1 - alpha
    log_c = torch.log(K * alpha) - torch.log(a)
    u = torch.nn.functional.softplus(log_c.unsqueeze(-1) + log_p)
    u_x, u_z = (u.gather(-1, i[..., None]).squeeze(-1) for i in (x0, xt))
    log1p_c = torch.nn.functional.softplus(log_c)
    log_r = torch.where(xt == x0, log1p_c, torch.zeros_like(u_z)) - u_z
    kl_sizes = (a + K * alpha) * (log1p_c + u_x) + a * (u.sum(-1) + u_x)
    x_bar_z = torch.where(xt == x0, a + K * alpha, a)
    return (dalpha / (alpha * x_bar_z)).abs() * (log_r.exp() + 1 + log_r.abs() + log1p_c + u_z + kl_sizes / K)


# Eq. (usdm) in float64 or float32 (implementation vs printed form): ~3K + 10 roundings (a K-term log-softmax, K
# softplus, a K-term sum, ~10 more), each relative to the sizes above: <= 2 (3K + 10) u times them.
USDM_ROUNDINGS = 2 * (3 * V + 10)


def test_usdm_nelbo_matches_printed_formula_with_duo_sign():
    logits, x0, xt, _ = make_case()
    for alpha in ALPHAS:
        dalpha = -(1 - 1e-3)
        ref = brute(lambda p, a, z: usdm_printed(p, a, z, alpha, dalpha), logits, x0, xt)
        got = usdm_nelbo_loss(logits, x0, xt, alpha, dalpha)
        tol = USDM_ROUNDINGS * U64 * (usdm_printed_sizes(logits, x0, xt, alpha, dalpha) + usdm_sizes(logits, x0, xt,
                                                                                                      alpha, dalpha))
        assert ((got - ref).abs() <= tol).all(), f"alpha={alpha}"
        # the paper's printed sign (-alpha'/(K alpha)) would make every term <= 0
        assert (ref >= 0).all()
    per_seq, dalpha = torch.tensor([[0.2], [0.9]], dtype=torch.float64), -0.5 * torch.ones(2, 1, dtype=torch.float64)
    got, ref = usdm_nelbo_loss(logits, x0, xt, per_seq, dalpha), usdm_printed_torch(logits, x0, xt, per_seq, dalpha)
    tol = USDM_ROUNDINGS * U64 * (usdm_printed_sizes(logits, x0, xt, per_seq, dalpha) + usdm_sizes(logits, x0, xt,
                                                                                                    per_seq, dalpha))
    assert ((got - ref).abs() <= tol).all()


def usdm_prefactor(alpha, x0, xt, K, dalpha=-(1 - 1e-3)):
    """-alpha' / (alpha x_bar_z): the size of one unit of the bracket, for scale-aware tolerances."""
    x_bar_z = torch.where(xt == x0, K * alpha + 1 - alpha, 1 - alpha)
    return -dalpha / (alpha * x_bar_z)


def test_usdm_nelbo_is_nonnegative():
    g = torch.Generator().manual_seed(2)
    n, K = 4000, 7
    logits = 6 * torch.randn(n, 1, K, generator=g, dtype=torch.float64)
    x0 = torch.randint(0, K, (n, 1), generator=g)
    xt = torch.where(torch.rand(n, 1, generator=g) < 0.5, x0, torch.randint(0, K, (n, 1), generator=g))
    alpha = 10 ** (-3 * torch.rand(n, 1, generator=g, dtype=torch.float64))              # 1e-3 .. 1
    alpha = torch.where(torch.rand(n, 1, generator=g) < 0.3, 1 - alpha + 1e-3, alpha)   # and close to 1
    alpha = alpha.float().double()            # exactly representable in float32, for the comparison below
    sizes = usdm_sizes(logits, x0, xt, alpha, -(1 - 1e-3))
    loss = usdm_nelbo_loss(logits, x0, xt, alpha, -(1 - 1e-3))
    assert (loss >= -USDM_ROUNDINGS * U64 * sizes).all()      # non-negative up to its rounding
    assert (loss > 0).float().mean() > 0.99
    # float32 (the training path): non-negative up to float32 rounding of its terms, and float64's value to it
    loss32 = usdm_nelbo_loss(logits.float(), x0, xt, alpha.float(), -(1 - 1e-3)).double()
    assert (loss32 >= -USDM_ROUNDINGS * U32 * sizes).all()
    assert ((loss32 - loss).abs() <= USDM_ROUNDINGS * (U32 + U64) * sizes).all()


def test_usdm_nelbo_is_zero_for_a_perfect_denoiser():
    logits, x0, xt, _ = make_case()
    for alpha in ALPHAS:
        # logits -> scale * onehot(x0), p_theta -> e_x0: the loss falls to 0 (to rounding of its prefactor)
        losses = [usdm_nelbo_loss(s * onehot(x0), x0, xt, alpha, -(1 - 1e-3)) for s in (5.0, 10.0, 20.0, 80.0)]
        assert (losses[0] > losses[1]).all() and (losses[1] > losses[2]).all()
        # at logits 80 onehot p_theta = e_x0 to e^-80: log1p_c - u_x and log r are roundings of log(1 + c) <= 9
        # (alpha <= 0.999), so the loss <= 2 U64 * 9 * (a + K alpha) / K * prefactor <= 2e-15 prefactor
        assert (losses[3].abs() <= 1e-14 * usdm_prefactor(torch.tensor(alpha), x0, xt, V)).all()
    assert (usdm_nelbo_loss(logits, x0, xt, 0.5, -1.0) > 1e-3).all()   # an imperfect one: >= 2.2 here, not rounding


# The Duo NELBO is the dt -> 0 limit of the discrete-time ELBO's diffusion term. With L = 1 and K = 4 every
# expectation over x_t is an exact sum, and the posterior comes from explicit K x K matrices (test_diffusion).

K_ELBO, X0, T_MIN = 4, 1, 1e-3
GEN = torch.Generator().manual_seed(0)
W_XT = 1.5 * torch.randn(K_ELBO, K_ELBO, generator=GEN, dtype=torch.float64)   # denoiser logits given x_t
U_T = 1.5 * torch.randn(K_ELBO, K_ELBO, generator=GEN, dtype=torch.float64)    # ... and their slope in t


def denoiser_logits(z, t, fixed):
    """p_theta(. | x_t = z, t): one fixed distribution, or a function of x_t and t. z (n,), t (n,) -> (n, K)."""
    if fixed:
        return W_XT[0].expand(z.shape[0], K_ELBO)
    return W_XT[z] + t[:, None] * U_T[z]


def discrete_elbo_diffusion_term(T, fixed):
    """sum_k E_{x_t ~ q_t(.|x0)} KL(q(x_s|x_t,x0) || q(x_s|x_t,x_theta)), t_k = t_min + (1-t_min) k/T, s = t_{k-1};
    all T steps and K values of x_t at once (rows k * K + z)."""
    k = torch.arange(1, T + 1, dtype=torch.float64).repeat_interleave(K_ELBO)
    z = torch.arange(K_ELBO).repeat(T)
    t, s = T_MIN + (1 - T_MIN) * k / T, T_MIN + (1 - T_MIN) * (k - 1) / T
    a_t, a_s = log_linear_schedule(t)[0], log_linear_schedule(s)[0]
    e0 = torch.eye(K_ELBO, dtype=torch.float64)[X0].expand(T * K_ELBO, K_ELBO)
    q_t = (e0[:, None, :] @ transition_matrix(a_t, K_ELBO))[:, 0].gather(-1, z[:, None])[:, 0]  # q_t(z | x0)
    p_theta = torch.softmax(denoiser_logits(z, t, fixed), -1)
    q_true = bayes_posterior(z, e0, a_t, a_s, K_ELBO)
    q_model = bayes_posterior(z, p_theta, a_t, a_s, K_ELBO)
    return (q_t * kl(q_true, q_model)).sum().item()


def integrated_usdm_nelbo(fixed, n=20001):
    """int_{t_min}^1 E_{x_t ~ q_t} usdm_nelbo_loss dt by the trapezoid rule in u = log t (the integrand has a
    log singularity towards t = 0), exact enumeration over x_t."""
    u = torch.linspace(math.log(T_MIN), 0.0, n, dtype=torch.float64)
    t = u.exp()
    alpha, dalpha = log_linear_schedule(t)
    z = torch.arange(K_ELBO).repeat(n)
    tt = t.repeat_interleave(K_ELBO)
    logits = denoiser_logits(z, tt, fixed)[:, None, :]
    loss = usdm_nelbo_loss(logits, torch.full((n * K_ELBO, 1), X0), z[:, None],
                           alpha.repeat_interleave(K_ELBO)[:, None], dalpha.repeat_interleave(K_ELBO)[:, None])
    q_t = alpha[:, None] * torch.eye(K_ELBO, dtype=torch.float64)[X0] + (1 - alpha[:, None]) / K_ELBO
    return torch.trapezoid((q_t * loss.view(n, K_ELBO)).sum(-1) * t, u).item()


def test_usdm_nelbo_is_the_dt_to_zero_limit_of_the_posterior_kl():
    """For each x_t: KL(q(x_s|x_t,x0) || q(x_s|x_t,x_theta)) / dt -> loss, with first-order error in dt."""
    e0 = torch.eye(K_ELBO, dtype=torch.float64)[X0].expand(K_ELBO, K_ELBO)
    z = torch.arange(K_ELBO)
    p_theta = torch.softmax(W_XT, -1)
    for t in (0.01, 0.4, 0.95):
        a_t, da_t = (float(v) for v in log_linear_schedule(t))
        loss = usdm_nelbo_loss(W_XT[:, None, :], torch.full((K_ELBO, 1), X0), z[:, None], a_t, da_t)[:, 0]
        errs = []
        for dt in (1e-4, 1e-5):
            a_s = float(log_linear_schedule(t - dt)[0])
            ratio = kl(bayes_posterior(z, e0, a_t, a_s, K_ELBO), bayes_posterior(z, p_theta, a_t, a_s, K_ELBO)) / dt
            errs.append((ratio - loss).abs().max().item())
        # first order: the gap is dt times a t-derivative of the integrand (alpha'/alpha <= 100 for t >= 0.01, so
        # <= 100 loss), <= 1e-3 loss at dt = 1e-5; float64 rounding of KL / dt adds ~K U64 / dt = 1e-10
        assert errs[1] < 1e-3 * loss.abs().max().item()
        assert errs[1] < errs[0] / 5          # the error shrinks ~linearly with dt (10x here; 5x: half of that)


def test_discrete_elbo_equals_integrated_usdm_nelbo_for_every_T():
    """With p_theta independent of x_t and t, q(x_s|x_t,x_theta) is the exact reversal of the forward chain
    started from x0 ~ p_theta, so the discrete sum telescopes: for EVERY T it equals
    KL(q_tmin(.|x0) || q_tmin(.|p)) - KL(q_1(.|x0) || q_1(.|p)), and so must the integral of the Duo loss."""
    p = torch.softmax(W_XT[0], -1)
    e0 = torch.eye(K_ELBO, dtype=torch.float64)[X0]
    a0, a1 = (float(log_linear_schedule(t)[0]) for t in (T_MIN, 1.0))
    marg = lambda x, a: x @ transition_matrix(a, K_ELBO)
    closed = (kl(marg(e0, a0), marg(p, a0)) - kl(marg(e0, a1), marg(p, a1))).item()
    integral = integrated_usdm_nelbo(fixed=True)
    # the trapezoid rule errs by O(h^2): at n = 20001 points 16x less than at 5001, whose gap to 20001 the next test
    # bounds by 1e-6 relative; and float64 sums of n terms (n U64 = 2e-12)
    assert integral == pytest.approx(closed, rel=1e-6)
    for T in (4, 64):      # the telescoping sum is exact: float64 rounding of T K KL terms, <= 256 * 4 U64 = 1e-13
        assert discrete_elbo_diffusion_term(T, fixed=True) == pytest.approx(closed, rel=1e-10)


def test_discrete_elbo_converges_to_usdm_nelbo_like_one_over_T():
    """A denoiser that depends on x_t and t: the T-step diffusion term approaches the integral of the Duo
    loss with an O(1/T) gap (T * gap settles to a constant)."""
    integral = integrated_usdm_nelbo(fixed=False)
    # quadrature converged: O(h^2), so the n = 20001 rule errs by 1/15 of its gap to n = 5001 (< 1e-6 relative)
    assert integrated_usdm_nelbo(fixed=False, n=5001) == pytest.approx(integral, rel=1e-6)
    gaps = {T: discrete_elbo_diffusion_term(T, fixed=False) - integral for T in (64, 256, 1024)}
    # O(1/T): gap_T = c / T + O(1/T^2), so quartering T quarters the gap up to the second order's relative share
    # (~c'/T: +-25% at T = 64, +-12% at 256), and gap_1024 ~ gap_64 / 16 (measured 1.6e-5 of the integral)
    assert abs(gaps[1024]) < 1e-4 * integral
    assert 3.0 < gaps[64] / gaps[256] < 5.0 and 3.5 < gaps[256] / gaps[1024] < 4.5

# -----------------------------------------------------------------------------
# the objectives on bf16 logits against float64 logits holding the same rounded values

BF16_U = 2.0 ** -8      # unit roundoff of bf16 (8 significant bits): one rounding errs by at most this, relatively


def lse_tol(V):
    """A float32 log-sum-exp of V values: the sum of exp(z - max) (each <= (1 + |z - max|) U32 off, |z - max| <= 12
    where a term is not negligible) errs by <= (V + 13) U32 relative in any order, so its log by that absolutely;
    the final max + log adds one rounding of |lse| (the caller's rtol)."""
    return (V + 13) * U32


def loss_case(V=1000, B=2, L=48, seed=5):
    """bf16 logits (B, L, V), x0, xt corrupted at alpha_t 0.3 / 0.8, negatives, and an upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(B, L, V, generator=g)).bfloat16()
    x0 = torch.randint(0, V, (B, L), generator=g)
    alpha_t = torch.tensor([[0.3], [0.8]])
    keep = torch.rand(B, L, generator=g) < alpha_t                     # Eq. (discrete_marginal): kept, else uniform
    xt = torch.where(keep, x0, torch.randint(0, V, (B, L), generator=g))
    neg = torch.randint(0, V, (B, L), generator=g)
    upstream = torch.randn(B, L, generator=g)
    return logits, x0, xt, neg, alpha_t, upstream


LOSS_CALLS = {
    "naive": lambda z, x0, xt, neg, a: naive_denoising_loss(z, x0),
    "sddlm": lambda z, x0, xt, neg, a: sddlm_loss(z, x0, xt),
    "sddlm_v1": lambda z, x0, xt, neg, a: sddlm_v1_loss(z, x0, xt, neg=neg),
    "sddlm_v2": lambda z, x0, xt, neg, a: sddlm_v2_loss(z, x0, xt),
    "duo": lambda z, x0, xt, neg, a: usdm_nelbo_loss(z, x0, xt, a, -(1 - 1e-3)),
    "ar": lambda z, x0, xt, neg, a: F.pad(ar_loss(z, x0), (0, 1)),
}


@pytest.mark.parametrize("name", list(LOSS_CALLS))
def test_every_loss_on_bf16_logits_matches_float64(name):
    logits, x0, xt, neg, alpha_t, upstream = loss_case()
    bf = logits.clone().requires_grad_(True)
    f64 = logits.double().requires_grad_(True)
    call = LOSS_CALLS[name]
    low, ref = call(bf, x0, xt, neg, alpha_t), call(f64, x0, xt, neg, alpha_t.double())
    assert low.dtype == torch.float32
    # the inputs are exact in both; only float32 accumulation separates the values: log p = z - lse within
    # lse_tol(V) + 2 U32 |lse| (|lse| <= 40), V1 / V2 subtract two such; the NELBO within its rounding of the
    # sizes of its terms (test_losses.usdm_sizes), ~3V + 10 roundings
    if name == "duo":
        tol = 2 * (3 * 1000 + 10) * U32 * usdm_sizes(f64.detach(), x0, xt, alpha_t.double(), -(1 - 1e-3))
        assert ((low.double() - ref.detach()).abs() <= tol).all()
    else:
        torch.testing.assert_close(low.double(), ref.detach(), rtol=0, atol=2 * (lse_tol(1000) + 80 * U32))
    g_low, = torch.autograd.grad((low * upstream).sum(), bf)
    g_ref, = torch.autograd.grad((ref * upstream.double()).sum(), f64)
    # d loss / d logit_v = w (p_v - [v = target]) (a difference of two such terms for V1/V2): autograd adds
    # the bf16-rounded parts (w p_v from the log-sum-exp, -w from each gather) in bf16, <= 4 roundings of
    # numbers <= |w|; the NELBO is float32 throughout and rounded once at the end
    bound = BF16_U * (g_ref.abs().max().item() if name == "duo" else 4 * upstream.abs().max().item())
    torch.testing.assert_close(g_low.double(), g_ref, rtol=0, atol=bound)


def confident_case(V=512, B=4, L=32):
    """Logits whose target token has probability 0.9 to 0.99: the regime of a model that is learning."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(B, L, V, generator=g)
    x0 = torch.randint(0, V, (B, L), generator=g)
    logits.scatter_(-1, x0[..., None], 9.0 + 2 * torch.rand(B, L, 1, generator=g))
    return logits.bfloat16(), x0


def target_grad_error(grad, ref, x0):
    at = lambda t: t.gather(-1, x0[..., None]).squeeze(-1).double()
    return ((at(grad) - at(ref)).abs() / at(ref).abs()).max().item()


def test_sddlm_target_logit_gradient_is_rounded_once_in_bf16():
    """At p(x0) ~ 0.9-0.99 (a model that is learning) the target entry p - 1 of the gradient is formed in float32
    and rounded once to bf16; a gather plus a separate log-sum-exp would round it twice (~13% error at p = 0.9)."""
    logits, x0 = confident_case()
    p = torch.softmax(logits.double(), -1)
    assert 0.9 < p.gather(-1, x0[..., None]).min() and p.gather(-1, x0[..., None]).max() < 0.995
    bf = logits.clone().requires_grad_(True)
    g, = torch.autograd.grad(naive_denoising_loss(bf, x0).sum(), bf)
    ref = p - F.one_hot(x0, logits.shape[-1]).double()
    # float32 p (V = 512: <= (V + 13) U32 = 3.1e-5 relative) minus 1 magnifies by p / (1 - p) <= 200 (6.3e-3),
    # then one bf16 rounding (3.9e-3): <= 1.02e-2 < 4 BF16_U = 1.6e-2; a second rounding would err by ~13%
    assert target_grad_error(g, ref, x0) <= 4 * BF16_U


@pytest.mark.parametrize("name", ["naive", "sddlm", "sddlm_v1", "sddlm_v2", "ar"])
def test_sddlm_family_keeps_no_float32_vocab_tensor_for_backward(name):
    logits, x0, xt, neg, alpha_t, _ = loss_case()
    big = []

    def pack(t):
        if t.dtype != torch.bfloat16 and t.numel() >= logits[0].numel():
            big.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        LOSS_CALLS[name](logits.clone().requires_grad_(True), x0, xt, neg, alpha_t)
    assert big == []
