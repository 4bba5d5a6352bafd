"""Tests for eval_ppl.py: each metric against an independent computation (manual loops, hand-made sequences,
the loss functions called directly) and the command line end to end on a tiny prepared corpus."""

import json
import math
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

import diffusion
import losses
from eval_ppl import zero_shot_blocks
from metrics import (Judge, entropies, gen_ppl, judge_windows, mean_se, nelbo_ppl, ratio_moments, ratio_summary,
                     stratified_times, t95)
from model import ModelConfig, build_model
from conftest import forward_tol, unit_roundoff
from test_losses import usdm_sizes

U32 = unit_roundoff(torch.float32)
# The judge's logits in padded batches against the same model on one sequence: float32 forwards whose matmuls
# block differently, < 250 roundings along a logit's path (d = 16, 4d, L = 16, V = 13 sums) of values <= 10 (the
# perturbed model's activations and logits): an NLL within 2 * 250 * 10 * U32 = 3e-4, and so the pooled one and
# log Gen PPL (relative error of Gen PPL); an EOS rule scored wrongly moves it by >= 1e-2.
GEN_PPL_REL = 3e-4

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py


def perturbed(config, seed=0):
    """The model with every weight perturbed (the output layer starts at zero, i.e. uniform predictions)."""
    torch.manual_seed(seed)
    model = build_model(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return model


V, EOS = 13, 2
CAUSAL = ModelConfig(vocab_size=V, block_size=16, n_layer=1, n_head=2, n_embd=16, cond_dim=8, causal=True,
                     time_cond=False)


def tiny_judge(context=16):
    model = perturbed(CAUSAL)
    return Judge(name="tiny", logits=lambda ids, attn: model(ids), encode=lambda s: [ord(c) % V for c in s],
                 eos_id=EOS, context=context), model


def manual_gen_nll(model, seq):
    """Duo's rules by hand: position 0 is never scored; a token is scored unless it is an EOS other than the
    sequence's first EOS (text after an EOS is still scored). -> (sum of NLL, number of scored tokens)."""
    with torch.no_grad():
        log_p = torch.log_softmax(model(torch.tensor([seq]))[0].double(), dim=-1)
    first_eos = seq.index(EOS) if EOS in seq else None
    total, count = 0.0, 0
    for j in range(1, len(seq)):
        if seq[j] != EOS or j == first_eos:
            total -= float(log_p[j - 1, seq[j]])
            count += 1
    return total, count


# -----------------------------------------------------------------------------------------------
# Gen PPL

SAMPLES = [[5, EOS, 7, 7, EOS, 9, EOS],      # first EOS scored, later EOS not, text after EOS scored: 4 tokens
           [EOS, 4, 4, EOS, 6],               # first EOS at position 0 (never scored), so the next EOS is not: 3
           [1, 3, 5, 8, 10, 12],              # no EOS: 5
           [EOS, EOS]]                         # nothing: 0


@pytest.mark.numerics
def test_gen_ppl_is_exp_of_pooled_nll_with_duo_eos_rules():
    judge, model = tiny_judge()
    result = gen_ppl(SAMPLES, judge, batch_size=3, show_progress=False)     # padded batches of different lengths
    parts = [manual_gen_nll(model, s) for s in SAMPLES]
    total, count = sum(p[0] for p in parts), sum(p[1] for p in parts)
    assert count == result["tokens"] == 12
    assert result["gen_ppl"] == pytest.approx(math.exp(total / count), rel=GEN_PPL_REL)
    assert result["judge"] == "tiny" and result["retokenized"] is False


@pytest.mark.numerics
def test_gen_ppl_and_entropy_carry_standard_errors():
    """The samples are the draws: Gen PPL's NLL is a ratio estimator over them (sum of NLL / scored tokens), its
    standard error the delta method's, sum_j (n_j - R m_j)^2 / (N (N - 1) mbar^2), here from each sample's NLL by
    hand (manual_gen_nll) in float64; the PPL's by the delta method and its 95% interval exp(nll -+ t SE), t =
    3.182446 Student's 97.5% quantile on N - 1 = 3 degrees of freedom (a table's, not 1.96: SE is estimated); the
    entropy's the standard error of a mean of the samples' own entropies."""
    judge, model = tiny_judge()
    result = gen_ppl(SAMPLES, judge, batch_size=3, show_progress=False)
    parts = [manual_gen_nll(model, s) for s in SAMPLES]
    R = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    mbar = sum(p[1] for p in parts) / len(parts)
    se = math.sqrt(sum((n - R * m) ** 2 for n, m in parts) / (len(parts) * (len(parts) - 1))) / mbar
    # each sample's NLL within GEN_PPL_REL of its size (batched forwards), so the SE within 2 GEN_PPL_REL of the
    # samples' norm over the same denominator (triangle inequality), the interval's log ends within both
    se_tol = 2 * GEN_PPL_REL * math.sqrt(sum(n * n for n, _ in parts) / (len(parts) * (len(parts) - 1))) / mbar
    assert result["nll_se"] == pytest.approx(se, abs=se_tol) and se > 10 * se_tol
    assert result["gen_ppl_se"] == pytest.approx(result["gen_ppl"] * result["nll_se"], rel=1e-12)
    assert (result["gen_ppl_lo"], result["gen_ppl_hi"]) == pytest.approx(
        (math.exp(R - 3.182446 * se), math.exp(R + 3.182446 * se)), rel=GEN_PPL_REL * R + 2 * se_tol)
    from validation import score_samples
    ids = [[5, 5, 7, 7], [1, 2, 3, 4], [3, 3, 3, 3]]
    row = score_samples(ids, ["some text", "more text", "and more"], None, judge, 2, None, label="m", steps=4)
    values = [math.log(2), math.log(4), 0.0]
    mean = sum(values) / 3
    assert row["entropy"] == pytest.approx(mean) and row["entropy_se"] == pytest.approx(
        math.sqrt(sum((v - mean) ** 2 for v in values) / 2 / 3), rel=1e-12)


def test_judge_windows_by_hand():
    assert judge_windows(10, 4, 3) == [(0, 4, 1), (3, 7, 4), (6, 10, 7)]
    assert judge_windows(10, 4, 2) == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    assert judge_windows(11, 4, 3) == [(0, 4, 1), (3, 7, 4), (6, 10, 7), (7, 11, 10)]     # the last one: 1 new
    assert judge_windows(3, 4, 2) == [(0, 3, 1)] and judge_windows(0, 4, 2) == []
    with pytest.raises(ValueError, match="stride"):
        judge_windows(10, 4, 4)                  # a window would score a token with nothing before it


@pytest.mark.numerics
@pytest.mark.parametrize("stride", [1, 2, 3])
def test_gen_ppl_past_the_judge_is_brute_force_per_token(stride):
    """A sample truncated to 10 tokens, judge context 4: gen_ppl's sliding windows give the pooled NLL of scoring
    each token j >= 1 in a forward of its own, given the tokens before it back to the start of the window that
    scores it: all of them for j < 4, else the window ending at min(4 + k stride, 10) for the first k with
    j < that end (so between 4 - stride and 3 tokens of context); Duo's EOS rule over the whole sample. The
    forwards differ in length and batching, so the sums agree to float32 rounding (GEN_PPL_REL)."""
    judge, model = tiny_judge(context=4)
    seq = [3, 4, EOS, 6, 7, EOS, 9, 10, 11, 12, 1]
    result = gen_ppl([seq, seq[:3]], judge, max_length=10, stride=stride, batch_size=3, show_progress=False)
    seq = seq[:10]
    total, count = manual_gen_nll(model, seq[:3])           # the short sample: one window
    for j in range(1, 10):
        if seq[j] == EOS and j != seq.index(EOS):
            continue
        end = 4 if j < 4 else min(4 + ((j - 4) // stride + 1) * stride, 10)
        start = max(0, end - 4)
        assert j < 4 or 4 - stride <= j - start <= 3
        with torch.no_grad():
            log_p = torch.log_softmax(model(torch.tensor([seq[start:j]]))[0, -1].double(), -1)
        total, count = total - float(log_p[seq[j]]), count + 1
    assert count == result["tokens"] == 8 + 2
    assert result["gen_ppl"] == pytest.approx(math.exp(total / count), rel=GEN_PPL_REL)


def test_gen_ppl_of_text_is_gen_ppl_of_its_retokenization():
    judge, _ = tiny_judge()
    texts = ["hello there", "abc"]
    from_text = gen_ppl(texts, judge, show_progress=False)
    from_ids = gen_ppl([judge.encode(t) for t in texts], judge, show_progress=False)
    # the same ids through the same calls in this process: equal but for float64 sums in another order
    assert from_text["retokenized"] and from_text["gen_ppl"] == pytest.approx(from_ids["gen_ppl"], rel=1e-12)


# -----------------------------------------------------------------------------------------------
# entropy

def test_entropy_of_hand_made_sequences():
    close = lambda v: pytest.approx(v, rel=1e-12)          # float64: a few roundings of values <= log 4
    assert entropies([[0, 0, 1, 1]]) == [close(math.log(2))]
    assert entropies([[3, 3, 3, 3]]) == [0.0]
    assert entropies([[0, 1, 2, 3]]) == [close(math.log(4))]
    assert entropies(torch.tensor([[0, 0, 1, 1], [5, 5, 5, 5]])) == [close(math.log(2)), 0.0]   # one per sample
    assert entropies([[0, 0, 0, 1]]) == [close(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))]


# -----------------------------------------------------------------------------------------------
# NELBO perplexity

DIT = ModelConfig(vocab_size=V, block_size=16, n_layer=1, n_head=2, n_embd=16, cond_dim=8)


class Recording(torch.nn.Module):
    """The model, keeping every (x_t, sigma, logits in float64) it is called with."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.calls = model, model.config, []

    def forward(self, x, sigma=None):
        logits = self.model(x, sigma)
        self.calls.append((x.clone(), sigma.double(), logits.double()))
        return logits


def printed_nelbo(logits, x0, z, alpha, dalpha):
    """Eq. (usdm) term by term in Python floats (Duo's sign +alpha'/(K alpha)): one token, logits a list."""
    K, m = len(logits), max(logits)
    e = [math.exp(v - m) for v in logits]
    p = [v / sum(e) for v in e]
    xbar = [K * alpha * (j == x0) + (1 - alpha) for j in range(K)]
    xbar_th = [K * alpha * p[j] + (1 - alpha) for j in range(K)]
    bracket = K / xbar[z] - K / xbar_th[z] - sum(
        xbar[j] / xbar[z] * math.log(xbar_th[z] * xbar[j] / (xbar_th[j] * xbar[z])) for j in range(K))
    return dalpha / (K * alpha) * bracket


@pytest.mark.numerics
def test_nelbo_ppl_is_exp_of_the_printed_token_mean_nelbo():
    """Independent of the code under test: the model's own inputs and outputs, alpha_t = exp(-sigma), the
    log-linear alpha' = -(1 - 1e-3), Eq. (usdm) written out in float64, pooled over the unmasked tokens of every
    sequence. Each round of D = 3 forwards per batch puts every sequence's times one in each stratum h of [1e-3, 1]
    with edges 1e-3 + (1 - 1e-3) (h / D)^2, weighted by the stratum's width; a sequence's estimate is the mean of its
    2 rounds, the standard error sqrt(sum_i var_i) / T with var_i the rounds' unbiased variance / 2."""
    model = Recording(perturbed(DIT))
    data = torch.Generator().manual_seed(0)
    x0s = [torch.randint(0, V, (6, 16), generator=data), torch.randint(0, V, (3, 16), generator=data)]
    masks = [torch.ones(6, 16, dtype=torch.bool), torch.arange(16).expand(3, 16) < torch.tensor([[16], [9], [4]])]
    D, R = 3, 2
    result = nelbo_ppl(model, list(zip(x0s, masks)), V, seed=7, mc_draws=D, rounds=R, show_progress=False)
    assert len(model.calls) == 2 * R * D
    per_round = torch.zeros(R, 9, dtype=torch.float64)        # [round, sequence]: its weighted NELBO sum
    count, sizes = 0, 0.0
    for k, (xt, sigma, logits) in enumerate(model.calls):
        batch, r, h = divmod(k, R * D)[0], (k % (R * D)) // D, k % D
        x0, mask, first = (x0s[0], masks[0], 0) if batch == 0 else (x0s[1], masks[1], 6)
        alpha = torch.exp(-sigma)
        t = (1 - alpha) / (1 - 1e-3)
        lo, hi = 1e-3 + (1 - 1e-3) * (h / D) ** 2, 1e-3 + (1 - 1e-3) * ((h + 1) / D) ** 2
        assert bool(((t >= lo - 1e-6) & (t <= hi + 1e-6)).all()), (k, t, lo, hi)     # float32 t, float64 edges
        # one over t's density in its stratum, over the length of [1e-3, 1]: log-uniform in the first, else uniform
        weight = t * math.log(hi / lo) / (1 - 1e-3) if h == 0 else torch.full_like(t, (hi - lo) / (1 - 1e-3))
        sizes += (weight[:, None] * usdm_sizes(logits, x0, xt, alpha[:, None], -(1 - 1e-3)))[mask].sum().item()
        for b, l in mask.nonzero().tolist():
            per_round[r, first + b] += float(weight[b]) * printed_nelbo(
                logits[b, l].tolist(), int(x0[b, l]), int(xt[b, l]), float(alpha[b]), -(1 - 1e-3))
            count += r == 0 and h == 0
    assert result["tokens"] == count == 6 * 16 + 16 + 9 + 4
    nll = float(per_round.mean(0).sum()) / count
    se = math.sqrt(float((per_round.var(0) / R).sum())) / count
    # Two roundings apart: t recovered from the model's float32 input (alpha_t = 1 - (1 - 1e-3) t rounded to U32,
    # so t to U32 / t <= U32 / 1e-3, and sigma again), which the first stratum's weight and the formula carry; and
    # the code's float32 NELBO against the float64 printed one, <= 2 (3V + 10) U32 of its terms' sizes
    # (test_losses.usdm_sizes), pooled relative to the total. Each round's value moves by that share of its size,
    # so the SE (the rounds' spread) by <= 2 x that share of the rounds' norm (triangle inequality).
    rel = 2 * U32 / 1e-3 + 2 * (3 * V + 10) * U32 * sizes / abs(float(per_round.sum()))
    assert result["nll"] == pytest.approx(nll, rel=rel)
    assert result["ppl"] == pytest.approx(math.exp(nll), rel=rel * nll)
    se_tol = 2 * rel * math.sqrt(float((per_round ** 2).sum()) / (R * (R - 1))) / count
    assert result["nll_se"] == pytest.approx(se, abs=se_tol) and se > 10 * se_tol
    assert result["ppl_se"] == pytest.approx(result["ppl"] * result["nll_se"], rel=1e-12)
    # the interval's t on Satterthwaite's degrees of freedom (sum_i var_i)^2 / sum_i (var_i^2 / (R - 1)): with R = 2
    # that is (|d|_2 / |d|_4)^4 of the rounds' differences d (9,), each norm moved by <= the SE's tolerance relative
    # to |d|_2 (|d|_4 >= |d|_2 / 9^(1/4)): the ratio by <= 4 (1 + 9^(1/4)) times that
    var = per_round.var(0) / R
    dof = float(var.sum() ** 2 / (var ** 2).sum()) * (R - 1)
    assert result["dof"] == pytest.approx(dof, rel=4 * (1 + 9 ** 0.25) * se_tol / se) and 1 < dof < 9
    assert result["ppl_lo"] == pytest.approx(math.exp(result["nll"] - t95(result["dof"]) * result["nll_se"]), rel=1e-9)
    assert result["estimator"] == "nelbo" and result["mc_draws"] == R * D and result["rounds"] == R


def test_stratified_times_cover_strata_and_are_unbiased():
    """One time in each stratum [a_h, b_h), weighted by one over its density over the length of [t_min, 1]: uniform,
    (b_h - a_h) / (1 - t_min), but log-uniform in the first, t log(b_0 / a_0) / (1 - t_min); the weighted sum's
    mean over many rounds is E_{t ~ U[t_min, 1]} f(t): for f = 1/t (the NELBO's heavy part near t_min), 1/sqrt(t)
    and t^2 within 4 standard errors of the rounds' own spread (CLT: the mean of 20,000 independent rounds) of the
    exact integral; and the first stratum's part of f = 1/t is exactly log(b_0 / t_min) / (1 - t_min) in every
    round (no 1/t left in its draws), up to float64 rounding."""
    t_min, D = 1e-3, 5
    g = torch.Generator().manual_seed(0)
    rounds = [stratified_times(D, g, t_min) for _ in range(20_000)]
    edges = [t_min + (1 - t_min) * (h / D) ** 2 for h in range(D + 1)]
    for t, w in rounds[:50]:
        assert all(edges[h] <= t[h] < edges[h + 1] for h in range(D))
        assert w.tolist() == pytest.approx([float(t[0]) * math.log(edges[1] / edges[0]) / (1 - t_min)] + [
            (edges[h + 1] - edges[h]) / (1 - t_min) for h in range(1, D)], rel=1e-12)
    for f, exact in ((lambda t: 1 / t, math.log(1 / t_min) / (1 - t_min)),
                     (lambda t: t ** -0.5, 2 * (1 - math.sqrt(t_min)) / (1 - t_min)),
                     (lambda t: t * t, (1 - t_min ** 3) / 3 / (1 - t_min))):
        values = torch.stack([(w * f(t)).sum() for t, w in rounds])
        assert abs(float(values.mean()) - exact) < 4 * float(values.std()) / math.sqrt(len(values)), f
        assert float(values.std()) > 0
    first = math.log(edges[1] / t_min) / (1 - t_min)
    assert all(float(w[0] / t[0]) == pytest.approx(first, rel=1e-13) for t, w in rounds[:100])


def test_ratio_standard_error_is_the_delta_method_of_resamples():
    """ratio_summary's moments form against the float64 brute force sum_j (n_j - R m_j)^2 / (N (N - 1) mbar^2)
    term by term, and its SE against the spread of R over 2,000 independent samples of N = 200 units from one
    population (units with correlated n and m, as per-sample NLL and token counts are). The spread's own relative
    error is 1 / sqrt(2 (2000 - 1)) = 1.6% (a sample standard deviation); the delta method's, O(CV(m)^2 / N) <
    0.5% here; the mean of the reported SEs varies by 0.1% (their spread / sqrt(2000)): 4 x 1.6% + 0.5% bounds it."""
    g = torch.Generator().manual_seed(0)
    m_pop = torch.randint(20, 120, (10_000,), generator=g).double()
    n_pop = m_pop * (4 + torch.rand(10_000, generator=g, dtype=torch.float64)) + 30 * torch.randn(10_000, generator=g,
                                                                                                   dtype=torch.float64)
    idx = torch.randint(0, 10_000, (200,), generator=g)
    n, m = n_pop[idx], m_pop[idx]
    R, se = ratio_summary(ratio_moments(n, m))
    brute_R = sum(n.tolist()) / sum(m.tolist())
    brute = math.sqrt(sum((a - brute_R * b) ** 2 for a, b in zip(n.tolist(), m.tolist())) / (200 * 199)) / (
        sum(m.tolist()) / 200)
    assert R == pytest.approx(brute_R, rel=1e-14) and se == pytest.approx(brute, rel=1e-9)
    draws, reported = [], []
    for _ in range(2000):
        idx = torch.randint(0, 10_000, (200,), generator=g)
        r, e = ratio_summary(ratio_moments(n_pop[idx], m_pop[idx]))
        draws.append(r)
        reported.append(e)
    spread = float(torch.tensor(draws).std())
    assert abs(sum(reported) / len(reported) / spread - 1) < 4 / math.sqrt(2 * 1999) + 0.005
    assert ratio_summary(ratio_moments([3.0], [2.0])) == (1.5, None)          # one unit: no standard error
    x = [0.5, 2.0, 3.5, 1.0]
    assert mean_se(4, sum(x), sum(v * v for v in x)) == pytest.approx(
        math.sqrt(sum((v - 1.75) ** 2 for v in x) / 3 / 4), rel=1e-12)


def toy_split(n=12, seed=0):
    data = torch.Generator().manual_seed(seed)
    x0 = torch.randint(0, V, (n, 16), generator=data)
    mask = torch.arange(16).expand(n, 16) < torch.randint(4, 17, (n, 1), generator=data)
    return x0, mask


def test_nelbo_standard_error_is_the_spread_over_seeds():
    """The issue's symptom: the NELBO moved with --seed by more than anything said. Now the variance each estimate
    reports (nll_se^2, unbiased from its own rounds) must equal the variance of the estimates over 300 seeds; the
    two estimates of one variance are compared within 4 standard errors of their difference, each SE computed from
    its own 300 values (the SE of a sample variance: the spread of the squared deviations / sqrt(300); of a mean
    of reported variances: their spread / sqrt(300))."""
    model = perturbed(DIT)
    x0, mask = toy_split()
    runs = [nelbo_ppl(model, [(x0, mask)], V, seed=s, mc_draws=2, rounds=2, show_progress=False) for s in range(300)]
    nll = torch.tensor([r["nll"] for r in runs], dtype=torch.float64)
    reported = torch.tensor([r["nll_se"] ** 2 for r in runs], dtype=torch.float64)
    deviations = (nll - nll.mean()) ** 2
    empirical = float(deviations.sum()) / 299
    tolerance = 4 * math.sqrt(float(deviations.var()) / 300 + float(reported.var()) / 300)
    assert abs(float(reported.mean()) - empirical) < tolerance, (float(reported.mean()), empirical, tolerance)
    assert empirical > 1e-4                                   # the draws do move the estimate: the test can fail


def test_t95_is_students_quantile():
    """Student's t 97.5% quantiles from a table (Abramowitz and Stegun 26.10; 1 and 2 in closed form: tan(0.475 pi),
    sqrt(2) 0.95 / sqrt(1 - 0.95^2)), the normal's at infinity."""
    table = {1: 12.706205, 2: 4.302653, 3: 3.182446, 5: 2.570582, 10: 2.228139, 30: 2.042272, 120: 1.979930,
             5000: 1.960438, math.inf: 1.959964}
    assert all(t95(dof) == pytest.approx(t, abs=2e-6) for dof, t in table.items())


def test_nelbo_interval_covers_95_for_one_sequence_and_a_split():
    """The 95% interval of one sequence's NELBO (2 rounds: its SE on 1 degree of freedom, t95 = 12.7, not 1.96) and
    of a split of 3 covers the truth in 95% of 300 independent estimates at the defaults (2 rounds of 8), within 4
    binomial standard errors (1.3%) and 1%. A sequence's draws depend on its index, so K copies of a split side by
    side are K independent estimates of it, each summarised as nelbo_ppl does (round_sums, nelbo_summary); the
    truth is the mean of 2 rounds of 300 other copies (seed 1): its error 6% of one estimate's, a shift that moves
    the coverage by < 1%."""
    from metrics import nelbo_summary, round_sums, sequence_nelbo
    model = perturbed(DIT)
    x0, mask = toy_split()
    for n in (1, 3):
        x, m = x0[:n].repeat(300, 1), mask[:n].repeat(300, 1)
        nats, tokens = sequence_nelbo(model, x, m, 0, range(2), seed=1)
        truth = math.exp(float(nats.mean(0).sum()) / float(tokens.sum()))
        nats, tokens = sequence_nelbo(model, x, m, 0, range(2), seed=0)
        runs = [nelbo_summary(round_sums(nats[:, k * n:(k + 1) * n], tokens[k * n:(k + 1) * n])) for k in range(300)]
        assert runs[0]["dof"] == pytest.approx(1.0) if n == 1 else 1 < runs[0]["dof"] < 3
        cover = sum(r["ppl_lo"] <= truth <= r["ppl_hi"] for r in runs) / 300
        assert abs(cover - 0.95) < 4 * math.sqrt(0.95 * 0.05 / 300) + 0.01, (n, cover)


def test_nelbo_chi_square_over_seeds_within_its_99_quantile():
    """Over 12 seeds the estimates' chi-square about their weighted mean, sum_s (x_s - xbar)^2 / SE_s^2 with xbar
    weighted by 1 / SE_s^2, is within its 99% quantile on 11 degrees of freedom (24.72, a table's): at a --rel_se
    that one sequence reaches at ~16 rounds (stopping instead when an SE on 1 degree of freedom was below it by
    chance, after 2 rounds, made it 234) and at fixed --rounds 2 on a split of 48 sequences."""
    model = perturbed(DIT)
    x0, mask = toy_split(48)
    one = [(x0[:1], mask[:1])]        # --rel_se: reached at ~24 rounds, by luck at 2
    reached = 1.5 * nelbo_ppl(model, one, V, seed=99, mc_draws=4, rounds=32, show_progress=False)["rel_se"]
    for split, rel_se in ((one, reached), ([(x0, mask)], 0.0)):
        runs = [nelbo_ppl(model, split, V, seed=s, mc_draws=4, rel_se=rel_se, show_progress=False) for s in range(12)]
        x, w = torch.tensor([r["nll"] for r in runs]), torch.tensor([r["nll_se"] ** -2 for r in runs])
        chi2 = float((w * (x - (w * x).sum() / w.sum()) ** 2).sum())
        assert chi2 < 24.72, (rel_se, chi2, [r["rounds"] for r in runs])


@pytest.mark.numerics
def test_nelbo_draws_belong_to_the_sequence_not_the_batch():
    """Sequence i's draws come from (seed, i, round) only: the split in batches of 12, of 5 or one at a time gives
    the same estimate, and two checkpoints scored with one seed see the same times and corruptions (common random
    numbers: their difference is far more precise than either number). Other batch shapes are float32 forwards
    summing in other orders: < 250 roundings along a logit's path (d = 16, 4d, L = 16, V = 13) of values <= 10,
    each token's NELBO term within forward_tol(250, 10) of its size, and so the pooled NELBO; the SE (the rounds'
    spread) moves by <= 2 x that of the rounds' size (triangle inequality), bounded by the NELBO's; other draws
    move the NELBO by its Monte-Carlo error, ~10% here."""
    model, other = perturbed(DIT, 0), perturbed(DIT, 1)
    x0, mask = toy_split()
    whole = nelbo_ppl(model, [(x0, mask)], V, seed=3, mc_draws=3, rounds=2, show_progress=False)
    rel = forward_tol(250, 10)
    for size in (5, 1):
        split = list(zip(x0.split(size), mask.split(size)))
        r = nelbo_ppl(model, lambda: iter(split), V, seed=3, mc_draws=3, rounds=2, show_progress=False)
        assert r["nll"] == pytest.approx(whole["nll"], rel=rel)
        assert r["nll_se"] == pytest.approx(whole["nll_se"], abs=2 * rel * whole["nll"])
    seen = {}
    for name, m in (("a", model), ("b", other)):
        seen[name] = Recording(m)
        nelbo_ppl(seen[name], [(x0, mask)], V, seed=3, mc_draws=3, rounds=2, show_progress=False)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(seen["a"].calls, seen["b"].calls))
    assert nelbo_ppl(model, [(x0, mask)], V, seed=4, mc_draws=3, rounds=2, show_progress=False)["nll"] != whole["nll"]


def test_rel_se_adds_rounds_until_reached_and_the_rounds_nest(capsys):
    """--rel_se: rounds are added until the PPL's relative standard error is at most the target; the result is the
    fixed-rounds estimate at that count (the rounds nest: round r's draws never depend on how many follow), and at
    --max_rounds it stops, above the target. The added rounds are said before they run (an untrained model can take
    --max_rounds / --rounds times as long)."""
    model = perturbed(DIT)
    x0, mask = toy_split()
    two = nelbo_ppl(model, [(x0, mask)], V, seed=5, mc_draws=2, rounds=2, show_progress=False)
    target = two["rel_se"] / 2                                  # needs about 4x the rounds
    r = nelbo_ppl(model, [(x0, mask)], V, seed=5, mc_draws=2, rounds=2, rel_se=target, show_progress=False)
    assert r["rel_se"] <= target and r["rounds"] > 2 and r["mc_draws"] == 2 * r["rounds"]
    fixed = nelbo_ppl(model, [(x0, mask)], V, seed=5, mc_draws=2, rounds=r["rounds"], show_progress=False)
    assert r["nll"] == fixed["nll"] and r["nll_se"] == fixed["nll_se"]
    capsys.readouterr()
    capped = nelbo_ppl(model, [(x0, mask)], V, seed=5, mc_draws=2, rounds=2, rel_se=target, max_rounds=3)
    assert capped["rounds"] == 3 and capped["rel_se"] > target
    said = f"relative SE {100 * two['rel_se']:.2f}% after 2 rounds, above --rel_se {100 * target:g}%: 1 more round ("
    assert said in capsys.readouterr().err


@pytest.mark.numerics
def test_ar_checkpoint_gets_its_exact_perplexity():
    model = perturbed(CAUSAL)
    x0 = torch.randint(0, V, (4, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 16, dtype=torch.bool)
    mask[1, 10:] = False
    result = nelbo_ppl(model, [(x0, mask)], V, show_progress=False)
    with torch.no_grad():
        log_p = torch.log_softmax(model(x0).double(), dim=-1)
    nll = [-float(log_p[b, l - 1, x0[b, l]]) for b in range(4) for l in range(1, 16) if mask[b, l]]
    assert result["estimator"] == "ar_exact" and result["tokens"] == len(nll) == 4 * 15 - 6
    # the same float32 logits; a float32 log-softmax errs by <= (V + 13) U32 + 2 U32 |lse| (|lse| <= 8): 3e-6 in
    # the mean NLL, the relative error of the perplexity
    assert result["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=(V + 13 + 16) * U32)


def cyclic_corpus(n, generator, length=16, vocab=8):
    """Repetitive toy text: each sequence counts up modulo `vocab` from a random start."""
    return (torch.randint(0, vocab, (n, 1), generator=generator) + torch.arange(length)) % vocab


def test_nelbo_ppl_of_a_trained_model_is_below_uniforms():
    config = ModelConfig(vocab_size=8, block_size=16, n_layer=1, n_head=2, n_embd=32, cond_dim=16)
    torch.manual_seed(0)
    uniform = build_model(config).eval()      # zero-initialised output layer: logits 0, x_theta uniform
    model = build_model(config)
    g = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(120):
        x0 = cyclic_corpus(32, g)
        alpha_t, dalpha_t = (a.unsqueeze(-1) for a in diffusion.log_linear_schedule(diffusion.sample_t(32, g)))
        xt = diffusion.sample_xt(x0, alpha_t, 8, g)
        loss = losses.usdm_nelbo_loss(model(xt, -torch.log(alpha_t[:, 0])), x0, xt, alpha_t, dalpha_t).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    val = [cyclic_corpus(32, torch.Generator().manual_seed(9)) for _ in range(4)]
    ppl = {name: nelbo_ppl(m.eval(), val, 8, seed=1, show_progress=False)["ppl"]
           for name, m in [("uniform", uniform), ("trained", model)]}
    assert all(math.isfinite(p) for p in ppl.values())
    assert ppl["trained"] < 0.8 * ppl["uniform"], ppl


# -----------------------------------------------------------------------------------------------
# zero-shot wrapping

def test_zero_shot_blocks_join_documents_without_eos():
    blocks = zero_shot_blocks([[10, 11, 12], [13, 14], [15, 16, 17, 18], [19]], seq_len=5, bos_id=0, eos_id=1)
    assert blocks.tolist() == [[0, 10, 11, 12, 1], [0, 13, 14, 15, 1], [0, 16, 17, 18, 1]]   # 19 dropped
    assert blocks.dtype == torch.long
    assert zero_shot_blocks([[5]], seq_len=5, bos_id=0, eos_id=1).shape == (0, 5)


# -----------------------------------------------------------------------------------------------
# command line, end to end on a tiny prepared corpus

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A prepared corpus, a diffusion checkpoint and an AR judge checkpoint on its tokenizer (train.py's format)."""
    from pydoc_data.topics import topics
    from data import load_meta
    from prepare import prepare_dataset
    tmp = tmp_path_factory.mktemp("eval")
    text = tmp / "corpus.txt"
    text.write_text("\n\n".join(topics[k] for k in sorted(topics)[:20]))
    data_dir = prepare_dataset(str(text), "sp_train:400", str(tmp / "data"), block_size=32, progress=False)
    meta = load_meta(data_dir)
    paths = {}
    for name, extra in [("diffusion", {}), ("ar", dict(causal=True, time_cond=False))]:
        config = ModelConfig(vocab_size=meta["vocab_size"], block_size=32, n_layer=1, n_head=2, n_embd=16,
                             cond_dim=8, **extra)
        model = perturbed(config)
        paths[name] = tmp / f"{name}.pt"
        torch.save({"model": model.state_dict(), "ema": None, "optimizer": None, "model_config": asdict(config),
                    "train_config": {"loss": "ar" if extra else "sddlm", "noise_schedule": "loglinear",
                                     "data_dir": data_dir}, "meta": meta, "step": 3, "data_state": None, "rng": None},
                   paths[name])
    return dict(tmp=tmp, text=text, data_dir=data_dir, **paths)


def run_main(capsys, *args):
    import eval_ppl
    assert eval_ppl.main([str(a) for a in args]) == 0
    stdout = capsys.readouterr().out
    result = json.loads(stdout[:stdout.rindex("}") + 1])
    table = stdout[stdout.rindex("}") + 1:].strip().splitlines()
    return result, table


@pytest.mark.numerics
def test_cli_nelbo_and_zeroshot(setup, capsys):
    out = setup["tmp"] / "nelbo.json"
    result, table = run_main(capsys, "--ckpt", setup["diffusion"], "--metric", "nelbo", "--batch_size", 8,
                             "--out", out, "--mc_draws", 2, "--rel_se", 0.001, "--max_rounds", 2)
    assert json.loads(out.read_text()) == result
    row = result["results"][0]
    assert row["estimator"] == "nelbo" and math.isfinite(row["ppl"]) and row["tokens"] > 0
    assert row["ppl_lo"] < row["ppl"] < row["ppl_hi"] and row["rel_se"] > 0.001
    # rel_se is the NLL's SE and ppl_se = ppl * rel_se: ppl_se / ppl gives it back within its two float64 roundings
    assert math.isclose(row["rel_se"], row["ppl_se"] / row["ppl"], rel_tol=2 * unit_roundoff(torch.float64))
    assert table[0].startswith("| data |") and len(table) == 4
    assert (f"PPL {row['ppl']:.2f} ± {row['ppl_se']:.2f}" in table[3] and "4 draws per sequence (2 rounds of 2)" in
            table[3] and "--rel_se 0.001 not reached at --max_rounds 2" in table[3]), table[3]
    result, _ = run_main(capsys, "--ckpt", setup["ar"], "--metric", "zeroshot", "--dataset", setup["text"],
                         "--seq_len", 32, "--max_batches", 2, "--batch_size", 4)
    row = result["results"][0]
    assert row["estimator"] == "ar_exact" and row["blocks"] == 8 and row["tokens"] == 8 * 31
    assert row["ppl_se"] == row["nll_se"] == 0 and row["mc_draws"] == 0      # exact: no draws, no error


def test_cli_genppl_sweep_names_its_judge_and_scores_ids(setup, capsys):
    result, table = run_main(capsys, "--ckpt", setup["diffusion"], "--metric", "genppl", "--judge", setup["ar"],
                             "--steps", "2,3", "--num_samples", 2, "--save_samples", setup["tmp"] / "s.jsonl")
    rows = result["results"]
    assert [r["steps"] for r in rows] == [2, 3] and len(table) == 4 + 2          # the table, then a line per row
    assert all(r["gen_ppl_lo"] < r["gen_ppl"] < r["gen_ppl_hi"] and r["entropy_se"] > 0 for r in rows)
    assert f"Gen PPL {rows[1]['gen_ppl']:.2f} ± {rows[1]['gen_ppl_se']:.2f}" in table[5]
    assert all(r["judge"].startswith(f"ar:{setup['ar']}") and "ids scored directly" in r["tokenization"]
               for r in rows)
    assert all(math.isfinite(r["gen_ppl"]) and r["samples"] == 2 for r in rows)
    again, _ = run_main(capsys, "--metric", "genppl", "--judge", setup["ar"], "--samples", setup["tmp"] / "s.jsonl")
    assert [(r["steps"], r["samples"]) for r in again["results"]] == [(2, 2), (3, 2)]      # one row per run
    assert [r["gen_ppl"] for r in again["results"]] == [r["gen_ppl"] for r in rows]
    psi, _ = run_main(capsys, "--ckpt", setup["diffusion"], "--metric", "genppl", "--judge", setup["ar"],
                      "--steps", "3", "--num_samples", 2, "--sampler", "psi", "--psi_kappa", "max_capped",
                      "--psi_eta", "0.5")
    assert rows[0]["sampler"] == "ancestral" and psi["results"][0]["sampler"] == "psi max_capped=0.5"
    assert math.isfinite(psi["results"][0]["gen_ppl"]) and psi["results"][0]["gen_ppl"] != rows[1]["gen_ppl"]


def test_cli_genppl_past_the_block_samples_and_judges_in_windows(setup, capsys):
    """--seq_len 80 on block_size 32: diffusion samples in windows of 16 new tokens, AR samples with a sliding
    window; the row's Gen PPL is gen_ppl of the saved samples under the judge's own 32-token windows."""
    from metrics import load_judge
    saved = setup["tmp"] / "long.jsonl"
    result, _ = run_main(capsys, "--ckpt", setup["diffusion"], "--metric", "genppl", "--judge", setup["ar"],
                         "--steps", "2", "--num_samples", 2, "--seq_len", 80, "--save_samples", saved)
    row = result["results"][0]
    records = [json.loads(line) for line in saved.read_text().splitlines()]
    assert (row["seq_len"], row["stride"]) == (80, 16) and [len(r["ids"]) for r in records] == [80, 80]
    judge = load_judge(str(setup["ar"]), torch.device("cpu"))
    assert row["gen_ppl"] == gen_ppl([r["ids"] for r in records], judge, show_progress=False)["gen_ppl"]
    ar, _ = run_main(capsys, "--ckpt", setup["ar"], "--metric", "genppl", "--judge", setup["ar"], "--num_samples", 2,
                     "--seq_len", 80)
    assert ar["results"][0]["seq_len"] == 80 and math.isfinite(ar["results"][0]["gen_ppl"])


@pytest.mark.slow
def test_cli_never_substitutes_an_unavailable_judge(setup):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cases = {"gpt2-large": "--judge path/to/ar_ckpt.pt", str(setup["diffusion"]): "must be autoregressive"}
    procs = {judge: subprocess.Popen([sys.executable, os.path.join(HERE, "eval_ppl.py"), "--metric", "genppl",
                                      "--judge", judge, "--ckpt", str(setup["diffusion"]), "--steps", "2"],
                                     cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for judge in cases}
    for judge, proc in procs.items():
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 2, stderr
        assert len(stderr.strip().splitlines()) == 1 and stderr.startswith("error:") and cases[judge] in stderr


def test_cli_refuses_mc_draws_and_too_long_genppl_in_one_line(setup):
    """--mc_draws 10^12: a round's draws of one batch (>= 24 bytes a draw and token) fit no machine's memory: one
    `error:` line naming --mc_draws and exit code 2 before a draw is made (not torch's failed allocation, nor, for
    a size the kernel overcommits, its out-of-memory killer without a word). genppl's --seq_len 10^15: the same,
    naming the flags, before a sample is drawn."""
    import eval_ppl
    with pytest.raises(eval_ppl.UsageError, match=r"the --mc_draws 1000000000000 draws of a batch of 2 x 32 tokens "
                                                  r"need at least .*; lower --mc_draws"):
        eval_ppl.main(["--ckpt", str(setup["diffusion"]), "--metric", "nelbo", "--batch_size", "2",
                       "--mc_draws", str(10 ** 12), "--rel_se", "0", "--max_batches", "1"])
    with pytest.raises(eval_ppl.UsageError, match=r"--num_samples 4 x --seq_len 1000000000000000: .* lower --seq_len"):
        eval_ppl.main(["--ckpt", str(setup["diffusion"]), "--metric", "genppl", "--judge", str(setup["ar"]),
                       "--num_samples", "4", "--seq_len", str(10 ** 15), "--steps", "1"])


def test_cli_genppl_samples_that_is_a_folder_is_said_so(setup, tmp_path):
    import eval_ppl
    with pytest.raises(eval_ppl.UsageError, match=rf"--samples {tmp_path}: a folder; give the JSONL file"):
        eval_ppl.main(["--metric", "genppl", "--judge", str(setup["ar"]), "--samples", str(tmp_path)])


def test_cli_zeroshot_past_the_trained_length_is_refused(setup):
    """--seq_len 1024 on a model trained at 128 scored 8x the trained length without a word: now one line naming
    --seq_len, the model's block_size and the fix."""
    import eval_ppl
    with pytest.raises(eval_ppl.UsageError, match=r"--seq_len 64: .* up to the model's block_size 32 \(the length "
                                                  r"it was trained at\); use --seq_len 32 or less"):
        eval_ppl.main(["--ckpt", str(setup["diffusion"]), "--metric", "zeroshot", "--dataset", str(setup["text"]),
                       "--seq_len", "64"])


def test_nelbo_progress_counts_sequences_within_a_batch(monkeypatch):
    """One batch of long blocks sat at "0/1 batch" for minutes: the bar counts sequences, shows their total and
    moves with each forward of a batch."""
    import metrics
    seen = []

    class Bar(metrics.tqdm):
        def update(self, n=1):
            super().update(n)
            seen.append((self.n, self.total, self.unit))
    monkeypatch.setattr(metrics, "tqdm", Bar)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    model = build_model(ModelConfig(vocab_size=8, block_size=6, n_layer=1, n_head=1, n_embd=8, cond_dim=4)).eval()
    nelbo_ppl(model, [torch.randint(0, 8, (4, 6))], seed=1, mc_draws=2, rounds=2, n_sequences=4)
    assert list(dict.fromkeys(n for n, total, unit in seen if total == 4 and unit == "seq")) == [1, 2, 3, 4], seen
