"""Tests for sample.py: the ancestral sampler against oracles and an exactly solvable toy distribution,
conditioning (prompt, infilling, unsupervised CFG), nucleus filtering, and the command line; the sampling loop
never waits for the device."""

import json
import math
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

import diffusion
from kernels import gumbel
import sample
from plumbing.cli import UsageError
from model import ModelConfig, build_model
from conftest import bayes_posterior, small_model, transition_matrix
from laws import denoiser_probs, reverse_posterior
from sample import (Psi, generate, generate_ar, kappa_from_sigma, nucleus_logits, parse_psi, psi_kappa,
                    remdm_sigma, time_grid)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
TINY = dict(vocab_size=11, block_size=12, n_layer=1, n_head=2, n_embd=16, cond_dim=8)


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py


def random_model(seed=0, **overrides):
    """A tiny DiT with every weight perturbed, so its output depends on every input token and on sigma."""
    torch.manual_seed(seed)
    model = build_model(ModelConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return model


class Recorder:
    """Wraps a denoiser and keeps a copy of every (x, sigma) it is called with."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, x, sigma):
        self.calls.append((x.clone(), sigma.clone()))
        return self.model(x, sigma)


def gen(seed):
    return torch.Generator().manual_seed(seed)


# -----------------------------------------------------------------------------------------------
# the sampler against oracles

@pytest.mark.parametrize("final_step", ["ancestral", "greedy"])
def test_oracle_denoiser_recovers_x0_exactly(final_step):
    """x_theta = one-hot(x0) (logits 40 * e_x0): every posterior step moves toward x0 and the final step lands on it."""
    V = 7
    x0 = torch.randint(0, V, (5, 12), generator=gen(1))
    oracle = lambda x, sigma: 40.0 * F.one_hot(x0, V).float()
    x = generate(oracle, 5, 12, V, 16, final_step=final_step, generator=gen(2), show_progress=False)
    assert torch.equal(x, x0)


def test_final_ancestral_step_alone_lands_on_x0_from_large_t():
    """At t_end = 0.6 (alpha ~ 0.4) a fraction (1 - alpha)(1 - 1/V) ~ 0.51 of the tokens is still wrong after the
    N steps (x_t ~ q_t(. | x0) exactly, the oracle being exact); the final step to alpha_s = 1 has m_unif = 0 and
    m_theta = 1 wherever x_theta[x_t] = 0 (Eq. reverse), so with x_theta = one-hot(x0) it alone must turn every
    one of them into x0."""
    V, B, L = 7, 8, 12
    x0 = torch.randint(0, V, (B, L), generator=gen(1))
    oracle = lambda x, sigma: 40.0 * F.one_hot(x0, V).float()
    before = generate(oracle, B, L, V, 4, t_end=0.6, final_step="none", generator=gen(2), show_progress=False)
    after = generate(oracle, B, L, V, 4, t_end=0.6, final_step="ancestral", generator=gen(2), show_progress=False)
    # 96 tokens, each wrong with probability 0.51 (sd of the fraction 0.05): below 0.3 is 4 sd away
    assert (before != x0).float().mean() > 0.3
    assert torch.equal(after, x0)


@pytest.mark.numerics
@pytest.mark.parametrize("final_step,nfe", [("ancestral", 9), ("greedy", 9), ("none", 8)])
def test_duo_time_grid_and_nfe(final_step, nfe):
    """N = 8 steps on ts = linspace(1, 1e-5, N + 1): the network sees sigma = -log alpha(ts[i]) for i = 0..N-1,
    then once more at t_end for the final step; NFE = N + 1 (N without a final step)."""
    rec = Recorder(lambda x, sigma: torch.zeros(*x.shape, 5))
    generate(rec, 3, 4, 5, 8, final_step=final_step, generator=gen(0), show_progress=False)
    assert len(rec.calls) == nfe
    ts = torch.linspace(1, 1e-5, 9, dtype=torch.float64)
    expected = -torch.log(1 - (1 - 1e-3) * ts)[:nfe]
    seen = torch.stack([sigma[0].double() for _, sigma in rec.calls])
    # sigma from the float64 grid, rounded once to the model's float32: <= 2^-24 sigma (rtol 1e-6 = 17 of those)
    torch.testing.assert_close(seen, expected, rtol=1e-6, atol=1e-7)
    assert all(sigma.shape == (3,) and torch.all(sigma == sigma[0]) for _, sigma in rec.calls)


def test_steps_below_one_raise():
    for steps in (0, 2.5, math.nan):
        with pytest.raises(ValueError, match=f"--steps must be an integer >= 1, got {steps}"):
            generate(random_model(), 2, 12, 11, steps, show_progress=False)


# -----------------------------------------------------------------------------------------------
# an exactly solvable toy distribution: V = 3, L = 2, a fixed table of 9 probabilities

V_TOY = 3
TABLE = torch.tensor([[0.30, 0.02, 0.05],       # p(x0 = (a, b)) = TABLE[a, b]: strongly correlated positions
                      [0.03, 0.25, 0.02],
                      [0.10, 0.01, 0.22]], dtype=torch.float64)


def toy_denoiser(include_own_token):
    """The exact denoiser for the toy data. Eq. (reverse) with x0 := x_theta is the Bayes posterior of x_s
    under the prior x0 ~ x_theta, so it already applies the likelihood q_t(xt^l | x0^l) of the position's own
    noisy token. The true per-position reverse marginal sum_x0 q(x_s|xt,x0) p(x0^l|xt) is therefore obtained with
    x_theta^l = p(x0^l | xt^{-l}), the posterior given the OTHER positions (this is also the minimiser of the
    NELBO). include_own_token=True returns the full posterior p(x0^l | xt), which counts that likelihood twice."""
    def logits(xt, sigma):
        alpha = torch.exp(-sigma.double())[:, None, None]
        q = alpha * F.one_hot(xt, V_TOY) + (1 - alpha) / V_TOY   # q[b, l, v] = q_t(xt^l | x0^l = v)
        p_first = q[:, 1] @ TABLE.T                                # p(x0^0 = a | xt^1) up to a constant
        p_second = q[:, 0] @ TABLE                                 # p(x0^1 = b | xt^0) up to a constant
        p = torch.stack([p_first, p_second], dim=1)
        return (p * q if include_own_token else p).log()
    return logits


def total_variation_to_table(x):
    counts = torch.bincount(x[:, 0] * V_TOY + x[:, 1], minlength=V_TOY ** 2).double()
    return 0.5 * float((counts / counts.sum() - TABLE.flatten()).abs().sum())


TOY_SAMPLES, TOY_STEPS = 4000, 100
# The TV of 4000 samples to their own law over 9 cells: each |n_i / N - p_i| is ~half-normal (sd sqrt(p_i (1 - p_i)
# / N)), so TV has mean <= 0.5 * 9 * sqrt(2 (1/9)(8/9) / (pi N)) = 0.019 (the uniform law's, the largest) and sd
# ~0.5 sqrt(9 (1 - 2/pi) (1/9)(8/9) / N) = 0.0042: 0.05 is 7 sd above the mean (0.035 below: 3.8 sd, p ~ 1e-4);
# the broken samplers below give 0.29-0.7.
TV_TOLERANCE = 0.05


def test_sampler_recovers_the_joint_distribution_of_toy_data():
    x = generate(toy_denoiser(include_own_token=False), TOY_SAMPLES, 2, V_TOY, TOY_STEPS, generator=gen(0),
                 show_progress=False)
    assert total_variation_to_table(x) < TV_TOLERANCE


def test_broken_samplers_fail_the_same_check(monkeypatch):
    ignores_xt = lambda xt, sigma: torch.stack([TABLE.sum(1), TABLE.sum(0)]).log().expand(xt.shape[0], -1, -1)
    x = generate(ignores_xt, TOY_SAMPLES, 2, V_TOY, TOY_STEPS, generator=gen(0), show_progress=False)
    # the broken samplers' exact laws are >= 0.29 from the table; the samples' TV to their own law has mean 0.019,
    # sd 0.0042 (TV_TOLERANCE): 0.2 is 17 sd below
    assert total_variation_to_table(x) > 0.2        # independent positions: the product of the marginals
    x = generate(toy_denoiser(include_own_token=True), TOY_SAMPLES, 2, V_TOY, TOY_STEPS, generator=gen(0),
                 show_progress=False)
    assert total_variation_to_table(x) > 0.2        # the own token's likelihood counted twice
    argmax_of_posterior = lambda xt, p, a_t, a_s, generator=None: reverse_posterior(
        xt, p, a_t, a_s, p.shape[-1]).argmax(-1)
    monkeypatch.setattr(diffusion, "ancestral_step_from_logits", lambda xt, logits, a_t, a_s, generator=None, kappa=1:
                        argmax_of_posterior(xt, torch.softmax(logits.double(), -1), a_t, a_s))
    x = generate(toy_denoiser(include_own_token=False), TOY_SAMPLES, 2, V_TOY, TOY_STEPS, generator=gen(0),
                 show_progress=False)
    assert total_variation_to_table(x) > 0.2        # argmax of the posterior (Duo issue #29)


# -----------------------------------------------------------------------------------------------
# the Psi sampler (predictor-corrector): kappa = 1 is the ancestral sampler; its law on the toy data

@pytest.mark.parametrize("psi", [Psi(("eta",), (1.0,)), Psi(("max_capped",), (0.0,)), Psi(("sigma_constant",), (0.0,))])
def test_psi_with_kappa_one_is_ancestral_sample_for_sample(psi):
    """kappa = 1 (eta = 1, or a ReMDM rate sigma_t = 0) draws the same samples as the ancestral sampler from the
    same seed, with a prompt, an infilled position, nucleus and CFG on."""
    model = random_model()
    fixed = torch.zeros(12, dtype=torch.bool)
    fixed[7] = True
    kw = dict(prompt_ids=[1, 2], fixed_mask=fixed, fixed_ids=torch.full((12,), 5), cfg_w=1.1, top_p=0.9,
              show_progress=False)
    a = generate(model, 3, 12, 11, 8, generator=gen(4), **kw)
    b = generate(model, 3, 12, 11, 8, psi=psi, generator=gen(4), **kw)
    assert torch.equal(a, b)
    c = generate(model, 3, 12, 11, 8, psi=Psi(("eta",), (0.5,)), generator=gen(4), **kw)
    assert not torch.equal(a, c)                           # kappa < 1 does change the samples
    assert (c[:, :2] == torch.tensor([1, 2])).all() and (c[:, 7] == 5).all()   # clean positions held under Psi


def test_remdm_sigma_and_kappa_by_hand():
    """a_t = 0.5, a_s = 0.8: sigma_max = min(1, 0.2 / 0.5) = 0.4 and kappa = 1 - sigma / 0.2, clipped to [0, 1]."""
    close = lambda v: pytest.approx(v, rel=1e-12, abs=1e-15)      # a few float64 operations on values <= 1
    assert remdm_sigma("max_capped", 0.1, 0.5, 0.8) == close(0.1)
    assert remdm_sigma("max_capped", 0.9, 0.5, 0.8) == close(0.4)
    assert remdm_sigma("max_rescale", 0.5, 0.5, 0.8) == close(0.2)
    assert remdm_sigma("max_rescale", 0.5, 0.1, 0.95) == close(0.5 * 0.5)   # (1 - a_s) / a_t = 0.5 < 1
    assert remdm_sigma("max_rescale", 0.5, 0.01, 0.5) == close(0.5)         # capped at 1, not at eta
    assert psi_kappa("max_capped", 0.1, 0.5, 0.8) == close(0.5)
    assert psi_kappa("max_rescale", 0.5, 0.5, 0.8) == close(0.0)
    assert psi_kappa("sigma_constant", 0.05, 0.5, 0.8) == close(0.75)
    assert psi_kappa("sigma_constant", 0.5, 0.5, 0.8) == 0.0                        # clipped
    assert psi_kappa("eta", 0.3, 0.5, 0.8) == 0.3 and kappa_from_sigma(0.7, 1.0) == 1.0


def test_loop_profile_holds_the_level_for_the_middle_steps():
    """--psi_profile loop, 20 steps, fractions 0.4 / 0.5 / 0.1: 8 steps linear from 1 to c, 10 steps from c to c
    (the network sees sigma(c) 11 times in a row), 2 steps linear from c to t_end."""
    psi = parse_psi("psi", "eta,max_capped,eta", "1,0.02,1", "loop", 0.3, "0.4,0.5,0.1")
    ts, phase = time_grid(20, 1e-5, psi)
    assert phase == [0] * 8 + [1] * 10 + [2] * 2
    expected = torch.cat([torch.linspace(1, 0.3, 9, dtype=torch.float64), torch.full((10,), 0.3, dtype=torch.float64),
                          torch.linspace(0.3, 1e-5, 3, dtype=torch.float64)[1:]])
    torch.testing.assert_close(ts, expected, rtol=0, atol=0)         # the same float64 linspaces: exactly
    rec = Recorder(lambda x, sigma: torch.zeros(*x.shape, 5))
    generate(rec, 2, 4, 5, 20, psi=psi, generator=gen(0), show_progress=False)
    sigmas = torch.stack([s[0].double() for _, s in rec.calls])
    assert len(rec.calls) == 21 and torch.all(sigmas[8:19] == sigmas[8])


def test_psi_flags_are_checked_in_words():
    for args, match in [(("euler",), "--sampler"), (("psi", "eta", "1.5"), "--psi_eta"),
                        (("psi", "remdm"), "--psi_kappa"), (("psi", "eta", "0.5,0.5"), "--psi_kappa and --psi_eta"),
                        (("psi", "eta", "0.5", "loop", 0.1, "0.5,0.6,0.1"), "--psi_fracs"),
                        (("psi", "eta", "0.5", "loop", 1.5), "--psi_loop_t")]:
        with pytest.raises(UsageError, match=match):
            parse_psi(*args)
    assert parse_psi("ancestral") is None


def exact_law(steps, psi, denoiser):
    """The law of the sampler's output on the toy data, computed exactly: the 9 x 9 transition matrix of each step
    is the product over the two positions of kappa bayes_posterior(x_t -> s) + (1 - kappa) bayes_posterior(x_t -> 0)
    Q_s (conftest's oracles), from the uniform prior, with the final ancestral step. -> (9,) float64."""
    states = torch.tensor([[a, b] for a in range(V_TOY) for b in range(V_TOY)])
    ts, phase = time_grid(steps, 1e-5, psi)
    alphas = diffusion.log_linear_schedule(ts)[0].tolist() + [1.0]
    p = torch.full((V_TOY ** 2,), 1 / V_TOY ** 2, dtype=torch.float64)
    for i in range(steps + 1):
        a_t, a_s = alphas[i], alphas[i + 1]
        kappa = 1.0 if psi is None or i == steps else psi_kappa(psi.kappa[phase[i]], psi.eta[phase[i]], a_t, a_s)
        x_theta = torch.softmax(denoiser(states, torch.full((9,), -math.log(a_t), dtype=torch.float64)), -1)
        per_position = [kappa * bayes_posterior(states[:, l], x_theta[:, l], a_t, a_s, V_TOY)
                        + (1 - kappa) * bayes_posterior(states[:, l], x_theta[:, l], a_t, 1.0, V_TOY)
                        @ transition_matrix(a_s, V_TOY) for l in range(2)]
        p = p @ (per_position[0][:, states[:, 0]] * per_position[1][:, states[:, 1]])
    return p


def test_psi_sampler_draws_its_exact_law_on_toy_data():
    """generate with Psi (a constant kappa, and a max-capped loop) against exact_law: TV of 4000 samples within
    sampling noise of the exact law (the exact law itself is not the data: see the next test)."""
    for psi in (Psi(("eta",), (0.5,)), parse_psi("psi", "eta,max_capped,eta", "1,0.05,1", "loop", 0.2)):
        x = generate(toy_denoiser(include_own_token=False), TOY_SAMPLES, 2, V_TOY, 16, psi=psi, generator=gen(0),
                     show_progress=False)
        counts = torch.bincount(x[:, 0] * V_TOY + x[:, 1], minlength=V_TOY ** 2).double()
        tv = 0.5 * float((counts / TOY_SAMPLES - exact_law(16, psi, toy_denoiser(False))).abs().sum())
        assert tv < 0.035, (psi, tv)          # 3.8 sd of the TV's sampling noise (TV_TOLERANCE's derivation)


def test_psi_and_ancestral_total_variation_as_steps_grow_exact():
    """What the exact computation shows on the toy data (L = 2, V = 3) with the exact x_theta: the ancestral
    sampler does NOT plateau here (its TV to the data falls ~4x per 4x steps: 0.159, 0.038, 0.009, 0.002 at 4, 16,
    64, 256 steps), and Psi's TV falls as steps grow too, more slowly (kappa = 0.5: 0.171, 0.058, 0.024, 0.012):
    the corrector's renoising from level 0 is per position, so it adds a factorisation error the predictor's
    small steps avoid. With the own token counted twice (a wrong x_theta) neither converges."""
    data = TABLE.flatten()
    tv = lambda steps, psi, own=False: 0.5 * float((exact_law(steps, psi, toy_denoiser(own)) - data).abs().sum())
    grid = (4, 16, 64, 256)
    for psi in (None, Psi(("eta",), (0.5,)), parse_psi("psi", "eta,max_capped,eta", "1,0.02,1", "loop")):
        curve = [tv(n, psi) for n in grid]
        assert all(b < 0.7 * a for a, b in zip(curve, curve[1:])) and curve[-1] < 0.015, (psi, curve)
    assert tv(256, Psi(("eta",), (0.5,))) > 2 * tv(256, None)
    assert min(tv(n, psi, own=True) for n in grid for psi in (None, Psi(("eta",), (0.5,)))) > 0.25


# -----------------------------------------------------------------------------------------------
# Duo's published Psi scripts, step for step

def duo_reference_schedule(steps, schedule, time_profile, modes, high_frac, middle_frac, eps=1e-5):
    """Duo's Psi schedule as its code runs it (Duo spec section 6.2; its generate_samples), written out here on its
    own: n = steps + 1 grid points; n_hi = round(high_frac n), n_mid = round(middle_frac n) of them, the rest low;
    time_profile "linear" or ("loop", c): linspace(1, c, n_hi), c n_mid times, linspace(c, eps, n_lo). Each
    phase's kappas from its own points: pure-posterior 1, constant-X X, or for a ReMDM mode clip(1 - sigma /
    (1 - a_s), 0, 1) of each pair of consecutive points, sigma = X (constant-remdm-X), min(X, (1 - a_s) / a_t)
    (max-capped-X), X min(X, (1 - a_s) / a_t) (max-rescale-X), and 1 for the phase's last point. Step i goes
    from point i to point i + 1 with kappa i. -> [(t, s, kappa)] per step."""
    n = steps + 1
    n_hi, n_mid = round(high_frac * n), round(middle_frac * n)
    sizes = (n_hi, n_mid, n - n_hi - n_mid)
    lin = lambda a, b, m: [a] if m == 1 else [a + (b - a) * j / (m - 1) for j in range(m)]
    if time_profile == "linear":
        points = lin(1.0, eps, n)
    else:
        c = time_profile[1]
        points = lin(1.0, c, n_hi) + [c] * n_mid + lin(c, eps, sizes[2])
    alpha = lambda t: float(diffusion.SCHEDULES[schedule](torch.tensor(t, dtype=torch.float64))[0])
    kappas = []
    for mode, size, start in zip(modes, sizes, (0, n_hi, n_hi + n_mid)):
        seg = points[start:start + size]
        if mode == "pure-posterior" or mode.startswith("constant-") and not mode.startswith("constant-remdm"):
            kappas += [1.0 if mode == "pure-posterior" else float(mode.split("-")[-1])] * size
            continue
        x = float(mode.split("-")[-1])
        for t, s in zip(seg, seg[1:]):
            a_t, a_s = alpha(t), alpha(s)
            sigma = x if mode.startswith("constant-remdm") else (
                min(x, (1 - a_s) / a_t) if mode.startswith("max-capped") else x * min(x, (1 - a_s) / a_t))
            kappas.append(min(1.0, max(0.0, 1 - sigma / (1 - a_s))))
        kappas += [1.0] * (size > 0)
    return [(points[i], points[i + 1], kappas[i]) for i in range(steps)]


# Each of Duo's duo_*.sh Psi scripts (scripts/psi_samplers/): its settings, and the sample.py flags that rerun it
# (README's table). Duo's "linear-constant-linear-0.9-inv" holds t(alpha = 0.9) of its schedule's inverse, which
# leaves out the schedule's eps: t = 1 - 0.9 (log-linear), 1 - (2 / pi) acos(0.1) (cosine).
COSINE_T_09 = 1 - 2 / math.pi * math.acos(0.1)
DUO_PSI_SCRIPTS = {
    "owt/duo_max_rescale_eta.sh": (("loglinear", "linear", ("max-rescale-0.05",) * 3, 0.0, 0.0),
                                   "--psi_kappa max_rescale --psi_eta 0.05 --psi_rescale duo --top_p 0.9"),
    "owt/duo_max_capped_remdm.sh": (("loglinear", "linear", ("max-capped-0.01",) * 3, 0.0, 0.0),
                                    "--psi_kappa max_capped --psi_eta 0.01 --top_p 0.9"),
    "owt/duo_loop_remdm.sh": (("loglinear", ("loop", 1 - 0.9), ("pure-posterior", "constant-remdm-0.01",
                                                                 "pure-posterior"), 0.45, 0.5),
                              "--psi_profile loop --psi_loop_t 0.1 --psi_kappa eta,sigma_constant,eta --psi_eta 1,0.01,1 "
                              "--psi_fracs 0.45,0.5,0.05 --top_p 0.95"),
    "cifar10/duo_max_rescale_eta.sh": (("cosine", "linear", ("max-rescale-0.01",) * 3, 0.0, 0.0),
                                       "--psi_kappa max_rescale --psi_eta 0.01 --psi_rescale duo --noise_schedule cosine"),
    "cifar10/duo_max_capped_remdm.sh": (("cosine", "linear", ("max-capped-0.005",) * 3, 0.0, 0.0),
                                        "--psi_kappa max_capped --psi_eta 0.005 --noise_schedule cosine"),
    "cifar10/duo_constant_remdm.sh": (("cosine", ("loop", COSINE_T_09), ("pure-posterior", "constant-remdm-0.01",
                                                                          "pure-posterior"), 0.45, 0.5),
                                      "--psi_profile loop --psi_loop_t 0.0637685608585 --psi_kappa eta,sigma_constant,eta "
                                      "--psi_eta 1,0.01,1 --psi_fracs 0.45,0.5,0.05 --noise_schedule cosine"),
    "cifar10/duo_psi_pc.sh": (("cosine", "linear", ("pure-posterior", "constant-0.95", "pure-posterior"), 0.5, 0.4),
                              "--psi_kappa eta --psi_eta 1,0.95,1 --psi_fracs 0.5,0.4,0.1 --noise_schedule cosine"),
}


@pytest.mark.parametrize("script", sorted(DUO_PSI_SCRIPTS))
def test_duo_flags_rerun_each_of_duos_psi_scripts_step_for_step(script):
    """sample.py's flags of README's table (--sampler psi --steps 256 ... --psi_grid duo), parsed as the command
    line parses them, give every step the t, s and kappa of duo_reference_schedule on Duo's published settings."""
    import sample
    (schedule, profile, modes, high, middle), flags = DUO_PSI_SCRIPTS[script]
    cfg = sample.parse_flags(sample.SampleConfig, ["--sampler", "psi", "--steps", "256", "--psi_grid", "duo",
                                                   *flags.split()])
    psi = sample.psi_from_flags(cfg, cfg.steps)
    ts, kappas = sample.psi_plan(cfg.steps, cfg.t_end, psi, cfg.noise_schedule or "loglinear")
    reference = duo_reference_schedule(256, schedule, profile, modes, high, middle)
    assert len(kappas) == len(reference) == 256 and len(ts) == 257
    for i, (t, s, kappa) in enumerate(reference):     # float64 grids of values <= 1: ~10 roundings, 1e-15
        assert ts[i].item() == pytest.approx(t, abs=1e-12) and ts[i + 1].item() == pytest.approx(s, abs=1e-12), i
        assert kappas[i] == pytest.approx(kappa, abs=1e-12), (script, i)


@pytest.mark.numerics
def test_generate_runs_duos_schedule_step_for_step(monkeypatch):
    """sample.generate with --psi_grid duo conditions the network on Duo's times and draws each step with Duo's
    kappa (duo_reference_schedule of its loop script, 20 steps), then the final ancestral step."""
    psi = parse_psi("psi", "eta,sigma_constant,eta", "1,0.05,1", "loop", 0.3, "0.45,0.5,0.05", 20, grid="duo")
    reference = duo_reference_schedule(20, "loglinear", ("loop", 0.3),
                                       ("pure-posterior", "constant-remdm-0.05", "pure-posterior"), 0.45, 0.5)
    kappas, real_step = [], diffusion.ancestral_step_from_logits
    monkeypatch.setattr(diffusion, "ancestral_step_from_logits",
                        lambda *a, kappa=1.0: kappas.append(kappa) or real_step(*a, kappa=kappa))
    rec = Recorder(lambda x, sigma: torch.zeros(*x.shape, 5))
    generate(rec, 2, 4, 5, 20, psi=psi, generator=gen(0), show_progress=False)
    alpha = lambda t: diffusion.log_linear_schedule(torch.tensor(t, dtype=torch.float64))[0]
    sigmas = [float(s[0]) for _, s in rec.calls]
    expected = [float(-torch.log(alpha(t))) for t, _, _ in reference] + [float(-torch.log(alpha(reference[-1][1])))]
    assert sigmas == pytest.approx(expected, rel=1e-6)      # float32 sigma: one rounding, 2^-24 relative
    assert kappas == pytest.approx([k for _, _, k in reference] + [1.0], abs=1e-12)    # float64, values <= 1


def test_duo_and_our_psi_settings_differ_where_measured():
    """Duo's OWT max_rescale script (eta = 0.05, 256 steps): sum of (1 - kappa) 2.60 with Duo's cap, 17.80 with
    ReMDM's (ours); the loop script: Duo's grid holds c for 129 steps, two of them no-ops (kappa = 1) at the phase
    edges, 127 correcting, ours 128 correcting; duo_psi_pc's kappa runs 1, 0.95, 1 over 128 / 103 / 25 steps."""
    import itertools
    from sample import psi_plan
    corr = lambda psi: sum(1 - k for k in psi_plan(256, 1e-5, psi)[1])
    duo = parse_psi("psi", "max_rescale", "0.05", steps=256, rescale="duo", grid="duo")
    printed = lambda v: pytest.approx(v, abs=0.005)                    # the figures, to 2 decimals
    assert corr(duo) == printed(2.60)
    assert corr(duo._replace(rescale="remdm")) == printed(17.80)
    assert corr(duo._replace(grid="ours")) == printed(2.60)   # one phase: the grids agree
    loop = parse_psi("psi", "eta,sigma_constant,eta", "1,0.01,1", "loop", 0.1, "0.45,0.5,0.05", 256, grid="duo")
    for psi, held, correcting in ((loop, 129, 127), (loop._replace(grid="ours"), 128, 128)):
        ts, kappas = psi_plan(256, 1e-5, psi)
        assert int((ts[1:] == ts[:-1]).sum()) == held and sum(k < 1 for k in kappas) == correcting
    pc = parse_psi("psi", "eta", "1,0.95,1", "linear", fracs="0.5,0.4,0.1", steps=256, grid="duo")
    runs = [(k, len(list(g))) for k, g in itertools.groupby(psi_plan(256, 1e-5, pc, "cosine")[1])]
    assert runs == [(1.0, 128), (0.95, 103), (1.0, 25)]
    runs = [(k, len(list(g))) for k, g in itertools.groupby(psi_plan(256, 1e-5, pc._replace(grid="ours"))[1])]
    assert runs == [(1.0, 128), (0.95, 102), (1.0, 26)]                      # ours splits the steps themselves


def test_cli_runs_duos_settings_and_records_them(tiny_ckpt, tmp_path):
    """Through the real script: --help names --psi_rescale and --psi_grid; a run with Duo's loop settings records
    them; fractions that round past Duo's grid are one error line."""
    ckpt, _ = tiny_ckpt
    proc = run_cli("--help")
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "--psi_rescale" in stdout and "--psi_grid" in stdout
    out = tmp_path / "duo.jsonl"
    proc = run_cli("--ckpt", ckpt, "--num_samples", 1, "--steps", 8, "--seq_len", 8, "--out", out, "--sampler", "psi",
                   "--psi_profile", "loop", "--psi_kappa", "eta,sigma_constant,eta", "--psi_eta", "1,0.01,1",
                   "--psi_grid", "duo", "--psi_rescale", "duo")
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    psi = json.loads(out.read_text())["settings"]["psi"]
    assert psi["grid"] == "duo" and psi["rescale"] == "duo" and psi["kappa"] == ["eta", "sigma_constant", "eta"]
    with pytest.raises(UsageError, match="--psi_fracs"):
        parse_psi("psi", "eta", "1,0.5,1", "linear", fracs="0.5,0.5,0", steps=2, grid="duo")   # 2 + 2 > 3 points
    for flag, value in (("--psi_grid", "remdm"), ("--psi_rescale", "ours")):
        with pytest.raises(UsageError, match=flag):
            parse_psi("psi", **{flag[6:]: value})


# -----------------------------------------------------------------------------------------------
# conditioning: prompt, infilling, unsupervised CFG

def test_prompt_is_clean_context_and_never_changes():
    """The prompt is in x_t from the very first forward (not noised) and in every later one, and in the output;
    a (B, P) prompt gives each sample its own prefix."""
    rec = Recorder(random_model())
    prompt = torch.tensor([[3, 1, 4], [1, 5, 9]])
    x = generate(rec, 2, 12, 11, 6, prompt_ids=prompt, generator=gen(0), show_progress=False)
    assert torch.equal(x[:, :3], prompt)
    assert all(torch.equal(xt[:, :3], prompt) for xt, _ in rec.calls)
    x1 = generate(random_model(), 4, 12, 11, 6, prompt_ids=torch.tensor([2, 7]), generator=gen(0), show_progress=False)
    assert torch.equal(x1[:, :2], torch.tensor([[2, 7]] * 4))


def test_infilled_positions_never_change():
    rec = Recorder(random_model())
    fixed_mask = torch.zeros(12, dtype=torch.bool)
    fixed_mask[[0, 5, 6, 11]] = True
    fixed_ids = torch.full((12,), 10)
    x = generate(rec, 3, 12, 11, 6, fixed_mask=fixed_mask, fixed_ids=fixed_ids, generator=gen(0), show_progress=False)
    assert torch.all(x[:, fixed_mask] == 10)
    assert all(torch.all(xt[:, fixed_mask] == 10) for xt, _ in rec.calls)
    assert not torch.all(x[:, ~fixed_mask] == 10)


def test_cfg_weight_zero_is_the_plain_sampler_with_one_branch():
    model, prompt = random_model(), torch.tensor([1, 2, 3])
    rec = Recorder(model)
    plain = generate(model, 4, 12, 11, 8, prompt_ids=prompt, generator=gen(5), show_progress=False)
    cfg0 = generate(rec, 4, 12, 11, 8, prompt_ids=prompt, cfg_w=0.0, generator=gen(5), show_progress=False)
    assert torch.equal(plain, cfg0)
    assert all(xt.shape[0] == 4 for xt, _ in rec.calls)


def test_cfg_with_a_prompt_blind_model_is_the_plain_sampler():
    """If the model ignores the prompt positions then p_c = p_u and p_c^(1+w) / p_u^w = p_c: same samples."""
    model, P = random_model(), 3
    blind = lambda x, sigma: model(torch.cat([torch.zeros_like(x[:, :P]), x[:, P:]], dim=1), sigma)
    prompt = torch.tensor([4, 4, 8])
    plain = generate(blind, 4, 12, 11, 8, prompt_ids=prompt, generator=gen(5), show_progress=False)
    guided = generate(blind, 4, 12, 11, 8, prompt_ids=prompt, cfg_w=1.5, generator=gen(5), show_progress=False)
    assert torch.equal(plain, guided)
    unguided_sharp = generate(model, 4, 12, 11, 8, prompt_ids=prompt, generator=gen(5), show_progress=False)
    sharp = generate(model, 4, 12, 11, 8, prompt_ids=prompt, cfg_w=3.0, generator=gen(5), show_progress=False)
    assert not torch.equal(unguided_sharp, sharp)   # a model that reads the prompt is steered by guidance


def test_cfg_runs_one_forward_with_random_tokens_for_the_prompt():
    rec = Recorder(random_model())
    B, P = 4, 5
    prompt = torch.tensor([1, 2, 3, 4, 5])
    generate(rec, B, 12, 11, 6, prompt_ids=prompt, cfg_w=1.1, generator=gen(0), show_progress=False)
    assert len(rec.calls) == 7
    nulls = []
    for xt, sigma in rec.calls:
        assert xt.shape[0] == 2 * B and torch.all(sigma == sigma[0])
        cond, uncond = xt[:B], xt[B:]
        assert torch.equal(cond[:, :P], prompt.expand(B, -1))
        assert torch.equal(uncond[:, P:], cond[:, P:])         # same x_t outside the prompt
        nulls.append(uncond[:, :P])
    assert all(torch.equal(n, nulls[0]) for n in nulls)       # one draw for the whole run
    assert len({tuple(row) for row in nulls[0].tolist()}) == B  # ... per sample
    assert not torch.equal(nulls[0], prompt.expand(B, -1))


# logits <= 3 combined as (1 + w) z_c - w z_u (3 roundings of values <= 9.6: 19.2 u), shifted by the max (19.2 u),
# exponentiated (<= 20 u), summed over 6 and divided (7 u): each probability within ~66 u of itself, in float32 for
# bf16 logits too (float64: 7e-15, 1e-12)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 66 * 2 ** -24),
                                       (torch.bfloat16, 66 * 2 ** -24)])
@pytest.mark.numerics
def test_cfg_combination_rule(dtype, tol):
    """p~ = p_c^(1+w) / p_u^w renormalised, from one forward of the concatenated batch; the sampler combines
    the logits in their own precision, at least float32 (float32 rounding only, for bf16 logits too)."""
    torch.manual_seed(0)
    logits_c, logits_u = torch.randn(2, 3, 6).to(dtype), torch.randn(2, 3, 6).to(dtype)
    model = lambda x, sigma: torch.cat([logits_c, logits_u]) if x.shape[0] == 4 else logits_c
    xt = torch.zeros(2, 3, dtype=torch.long)
    w = 1.1
    p = denoiser_probs(model, xt, 0.5, null_xt=xt, cfg_w=w)
    p_c, p_u = logits_c.double().softmax(-1), logits_u.double().softmax(-1)
    expected = p_c ** (1 + w) / p_u ** w
    torch.testing.assert_close(p, expected / expected.sum(-1, keepdim=True), rtol=tol, atol=0)


def test_cfg_without_a_prompt_is_an_error():
    with pytest.raises(ValueError, match="cfg_w"):
        generate(random_model(), 2, 12, 11, 4, cfg_w=1.0, show_progress=False)


# -----------------------------------------------------------------------------------------------
# nucleus filtering on x_theta

def nucleus(probs, top_p):
    """The reference sample.nucleus_logits is checked against, on probabilities: keep the smallest set of most
    likely tokens whose mass reaches top_p, renormalised. probs (..., V) -> (..., V); top_p >= 1 returns probs
    unchanged; the most likely token is always kept."""
    if top_p >= 1:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p            # mass of the strictly more likely tokens
    sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return kept / kept.sum(-1, keepdim=True)


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]], dtype=torch.float64)
    tol = dict(rtol=4 * 2 ** -53, atol=0)             # float64: a 3-term sum and a division
    torch.testing.assert_close(nucleus(probs, 0.9), torch.tensor([[0, 0.5, 0.15, 0.3]], dtype=torch.float64) / 0.95,
                               **tol)
    torch.testing.assert_close(nucleus(probs, 0.5), torch.tensor([[0, 1.0, 0, 0]], dtype=torch.float64), **tol)
    assert nucleus(probs, 1.0) is probs


@pytest.mark.numerics
@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.7, 0.95, 0.999])
def test_nucleus_on_logits_is_the_nucleus_of_the_softmax(top_p):
    """The sampler filters logits (float32, in chunks of rows, no float64 vocabulary tensor): softmax of the result
    is nucleus(softmax(logits)) computed in float64; bf16 logits (with ties) keep every token tied with the last
    kept one."""
    z = 2 * torch.randn(6, 40, 97, generator=gen(0), dtype=torch.float64)
    got = nucleus_logits(z, top_p, chunk_elems=7 * 97)
    # float64 softmaxes and renormalisations over 97: <= 2 * 200 U64 = 4.4e-14 relative; dropped tokens exactly 0
    torch.testing.assert_close(torch.softmax(got, -1), nucleus(torch.softmax(z, -1), top_p), rtol=1e-12, atol=1e-15)
    zb = z.bfloat16()
    kept = nucleus_logits(zb, top_p) > float("-inf")
    cut = torch.where(kept, zb.float(), float("inf")).amin(-1, keepdim=True)
    assert torch.equal(kept, zb.float() >= cut)                   # a threshold on the logits, ties included
    p = torch.softmax(zb.double(), -1)
    mass_above = torch.where(zb.float() > cut, p, 0.0).sum(-1)
    # the sampler cuts on float32 probabilities and their cumulative sums (97 terms: within 2 (97 + 13) 2^-24 =
    # 1.3e-5 of the float64 ones), so the mass it keeps reaches top_p to that
    margin = 2 * (97 + 13) * 2 ** -24
    assert (mass_above < top_p + margin).all() and (torch.where(kept, p, 0.0).sum(-1) >= top_p - margin).all()
    assert nucleus_logits(zb, 1.0) is zb


def test_top_p_one_is_no_nucleus_and_tiny_top_p_is_greedy():
    model = random_model()
    xt = torch.randint(0, 11, (3, 12), generator=gen(0))
    p = denoiser_probs(model, xt, 0.3)
    assert torch.equal(denoiser_probs(model, xt, 0.3, top_p=1.0), p)
    greedy = denoiser_probs(model, xt, 0.3, top_p=1e-9)
    assert torch.equal(greedy, F.one_hot(p.argmax(-1), 11).double())
    a = generate(model, 3, 12, 11, 5, generator=gen(3), show_progress=False)
    b = generate(model, 3, 12, 11, 5, top_p=1.0, generator=gen(3), show_progress=False)
    assert torch.equal(a, b)


def test_ar_sampler_follows_a_deterministic_next_token_oracle():
    V = 9
    oracle = lambda x: 40.0 * F.one_hot((x + 2) % V, V).float()   # logits at l predict token l + 1
    x = generate_ar(oracle, 2, 6, bos_id=1, generator=gen(0), show_progress=False)
    assert x.tolist() == [[1, 3, 5, 7, 0, 2]] * 2
    x = generate_ar(oracle, 2, 5, prompt_ids=torch.tensor([4, 4]), generator=gen(0), show_progress=False)
    assert x.tolist() == [[4, 4, 6, 8, 1]] * 2


# -----------------------------------------------------------------------------------------------
# command line

@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A checkpoint in train.py's format with a small SentencePiece tokenizer in its meta."""
    from pydoc_data.topics import topics
    from data import get_tokenizer, train_sentencepiece
    tmp = tmp_path_factory.mktemp("ckpt")
    spm_path = train_sentencepiece([topics[k] for k in sorted(topics)[:20]], str(tmp / "tokenizer"), 400)
    tok = get_tokenizer("sp:" + spm_path)
    config = ModelConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16, cond_dim=8)
    model = build_model(config)
    meta = dict(tokenizer=tok.spec, vocab_size=tok.vocab_size, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)
    path = tmp / "ckpt.pt"
    torch.save({"model": model.state_dict(), "ema": model.state_dict(), "optimizer": None,
                "model_config": asdict(config), "train_config": {"loss": "sddlm", "noise_schedule": "loglinear"},
                "meta": meta, "step": 7, "data_state": None, "rng": None}, path)
    return path, tok


def run_cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, os.path.join(HERE, "sample.py"), *map(str, args)], cwd=HERE, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_cli_writes_and_appends_jsonl(tiny_ckpt, tmp_path, capsys):
    ckpt, tok = tiny_ckpt
    out = tmp_path / "samples.jsonl"
    args = ["--ckpt", ckpt, "--prompt", "The", "--num_samples", 3, "--batch_size", 2, "--steps", 4, "--seq_len", 16,
            "--cfg_w", 1.1, "--top_p", 0.9, "--out", out]
    proc = run_cli(*args)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "--- sample 2 ---" in stdout
    import sample
    assert sample.main([str(a) for a in args]) == 0           # the same run again, in-process: appended
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 6
    prompt = [tok.bos_id] + tok.encode("The")
    assert all(r["ids"][:len(prompt)] == prompt and len(r["ids"]) == 16 for r in records)
    assert records[0]["settings"]["cfg_w"] == 1.1 and records[0]["settings"]["nfe"] == 5
    assert [r["ids"] for r in records[:3]] == [r["ids"] for r in records[3:]]   # same seed, same samples


def test_default_out_is_samples_jsonl_beside_the_checkpoint(tiny_ckpt, tmp_path,
                                                                                                  monkeypatch):
    """Issue 36: README's sample command left samples.jsonl in the current folder (the repository). The default is
    now beside what --ckpt names: run/ckpt.pt and the model folder run/model -> run/samples.jsonl; a samples.jsonl
    there that sample.py did not write is refused (one line) and left as it was."""
    import shutil
    import sample
    from trained.export import export
    from plumbing.cli import UsageError
    ckpt, _ = tiny_ckpt
    run, elsewhere, other = tmp_path / "run", tmp_path / "elsewhere", tmp_path / "other"
    for d in (run, elsewhere, other):
        d.mkdir()
    shutil.copy(ckpt, run / "ckpt.pt")
    shutil.copy(ckpt, other / "ckpt.pt")
    export(str(run / "ckpt.pt"), str(run / "model"))
    monkeypatch.chdir(elsewhere)
    args = ["--num_samples", "1", "--steps", "2", "--seq_len", "8"]
    assert sample.main(["--ckpt", str(run / "ckpt.pt"), *args]) == 0
    assert sample.main(["--ckpt", str(run / "model") + os.sep, *args]) == 0       # a folder, named with its slash
    records = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [r["settings"]["ckpt"] for r in records] == [str(run / "ckpt.pt"), str(run / "model") + os.sep]
    assert os.listdir(elsewhere) == [] and not (run / "model" / "samples.jsonl").exists()
    (other / "samples.jsonl").write_text("my own notes\n")
    with pytest.raises(UsageError, match=r"other/samples.jsonl exists and was not written by sample.py"):
        sample.main(["--ckpt", str(other / "ckpt.pt"), *args])
    assert (other / "samples.jsonl").read_text() == "my own notes\n" and os.listdir(elsewhere) == []


def test_cli_psi_records_its_settings_and_eta_one_is_ancestral(tiny_ckpt, tmp_path):
    """--sampler psi runs on a checkpoint and records its settings; --psi_eta 1 writes the ancestral samples."""
    import sample
    ckpt, _ = tiny_ckpt
    base = ["--ckpt", ckpt, "--num_samples", 2, "--steps", 6, "--seq_len", 16, "--final_step", "ancestral"]
    runs = {name: tmp_path / f"{name}.jsonl" for name in ("ancestral", "eta1", "loop")}
    extra = {"ancestral": [], "eta1": ["--sampler", "psi", "--psi_eta", 1],
             "loop": ["--sampler", "psi", "--psi_profile", "loop", "--psi_kappa", "eta,max_capped,eta",
                      "--psi_eta", "1,0.5,1", "--psi_loop_t", 0.3]}
    for name, out in runs.items():
        assert sample.main([str(a) for a in base + extra[name] + ["--out", out]]) == 0
    rec = {name: [json.loads(line) for line in out.read_text().splitlines()] for name, out in runs.items()}
    assert [r["ids"] for r in rec["eta1"]] == [r["ids"] for r in rec["ancestral"]]
    assert rec["loop"][0]["settings"]["sampler"] == "psi" and rec["ancestral"][0]["settings"]["sampler"] == "ancestral"
    assert rec["loop"][0]["settings"]["psi"]["kappa"] == ["eta", "max_capped", "eta"]
    assert rec["loop"][0]["settings"]["psi"]["eta"] == [1.0, 0.5, 1.0]


@pytest.mark.slow
def test_cli_bad_input_is_one_line_and_exit_code_2(tiny_ckpt, tmp_path):
    cases = {"longer than the context": ("--prompt_ids", ",".join(["5"] * 40)),
             "--steps": ("--steps", 0),
             "--psi_kappa": ("--sampler", "psi", "--psi_kappa", "remdm"),
             "checkpoint not found": ("--ckpt", "no/such/ckpt.pt")}
    procs = {message: run_cli("--ckpt", tiny_ckpt[0], "--out", tmp_path / "s.jsonl", *args)
             for message, args in cases.items()}                 # run side by side
    for message, proc in procs.items():
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 2, (message, stderr)
        assert len(stderr.strip().splitlines()) == 1 and stderr.startswith("error:") and message in stderr, stderr
    assert not (tmp_path / "s.jsonl").exists()


def test_cli_cfg_without_a_prompt_is_an_error_not_a_silent_no_op(tiny_ckpt):
    import sample
    with pytest.raises(sample.UsageError, match="--cfg_w needs --prompt"):
        sample.main(["--ckpt", str(tiny_ckpt[0]), "--cfg_w", "1.1", "--out", ""])


def test_lm_eval_model_args_take_duos_psi_settings(tiny_ckpt):
    """downstream/lm_eval_sddlm.py's model arguments psi_rescale and psi_grid reach the sampler as sample.py's flags."""
    pytest.importorskip("lm_eval", reason="lm-eval is optional (pip install lm-eval) and not installed here")
    from downstream.lm_eval_sddlm import SDDLMHarness
    harness = SDDLMHarness(ckpt=str(tiny_ckpt[0]), sampler="psi", psi_kappa="eta/sigma_constant/eta",
                           psi_eta="1/0.01/1", psi_profile="loop", psi_rescale="duo", psi_grid="duo", steps=8,
                           device="cpu")
    assert harness.psi == parse_psi("psi", "eta,sigma_constant,eta", "1,0.01,1", "loop", steps=8, rescale="duo",
                                    grid="duo")


def test_cli_prompt_ids_with_an_empty_id_are_an_error(tiny_ckpt, tmp_path):
    """--prompt_ids "," or "1,,2" was read as no prompt (or as 1,2): a malformed value, refused in one line before
    anything is written; a trailing comma is harmless and accepted."""
    import sample
    for bad in (",", "1,,2", " , "):
        with pytest.raises(sample.UsageError, match="--prompt_ids must be comma-separated integers"):
            sample.main(["--ckpt", str(tiny_ckpt[0]), "--prompt_ids", bad, "--out", str(tmp_path / "s.jsonl")])
    assert not (tmp_path / "s.jsonl").exists()
    assert sample.main(["--ckpt", str(tiny_ckpt[0]), "--prompt_ids", "5,6,", "--steps", "1", "--num_samples", "1",
                        "--out", str(tmp_path / "s.jsonl")]) == 0
    assert json.loads((tmp_path / "s.jsonl").read_text())["ids"][:2] == [5, 6]


def test_cli_without_the_tokenizer_refuses_and_names_the_fix(tiny_ckpt, tmp_path):
    """An old checkpoint (no copy of its tokenizer) whose tokenizer file is gone wrote ids only with exit 0: now
    one line naming the missing file and the fix, and nothing written."""
    import sample
    from plumbing.cli import UsageError
    ckpt, tok = tiny_ckpt
    state = torch.load(ckpt, weights_only=True)
    state["meta"] = dict(state["meta"], tokenizer=f"sp:{tmp_path}/moved/tokenizer.model")
    torch.save(state, tmp_path / "old.pt")
    with pytest.raises(UsageError, match=r"SentencePiece model not found: .*moved/tokenizer.model.*: the samples' "
                                         r"text needs it; put that tokenizer back .*hub/pretrained.py --ckpt"):
        sample.main(["--ckpt", str(tmp_path / "old.pt"), "--steps", "2", "--num_samples", "1"])
    assert sorted(os.listdir(tmp_path)) == ["old.pt"]


def test_samples_saved_before_a_closed_or_ascii_stdout(tiny_ckpt, tmp_path):
    """Issue 44: `sample.py | head -1` kept the first batch only ("error: Broken pipe", exit 2), and a non-ASCII
    prompt under PYTHONIOENCODING=ascii ended in a traceback with nothing saved. Each batch is saved, then shown
    (plumbing.cli.show): the closed pipe ends the showing quietly, what stdout cannot encode is escaped; exit 0."""
    base = [sys.executable, os.path.join(HERE, "sample.py"), "--ckpt", str(tiny_ckpt[0]), "--num_samples", "16",
            "--batch_size", "2", "--steps", "2", "--seq_len", "16"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    with open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(base + ["--out", str(tmp_path / "a.jsonl")], cwd=HERE, env=env, stdout=subprocess.PIPE,
                                stderr=err)
        assert proc.stdout.readline() == b"--- sample 0 ---\n"
        proc.stdout.close()                                  # the reader goes, as `head -1` does
        assert proc.wait(timeout=120) == 0, (tmp_path / "err").read_text()
    assert len((tmp_path / "a.jsonl").read_text().splitlines()) == 16
    p = subprocess.run(base + ["--prompt", "café", "--out", str(tmp_path / "b.jsonl")], cwd=HERE, capture_output=True,
                       env=dict(env, PYTHONIOENCODING="ascii"), timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr.decode(), p.stderr.decode()[-2000:]
    records = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert len(records) == 16 and all(r["text"].startswith("café") for r in records)
    assert p.stdout.decode("ascii").count("caf\\xe9") == 16


SYNC_OPS = ("aten.nonzero", "aten._local_scalar_dense", "aten.masked_select", "aten.item", "aten.unique",
            "aten._unique2", "aten.equal", "aten.is_nonzero")   # ops whose result the host must wait for on a GPU


def sync_ops_of(fn):
    """How many ops that make the host wait for the device (a count, a value read on the host) fn runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += str(func.overloadpacket) in SYNC_OPS
            return func(*args, **(kwargs or {}))

    with Watch() as watch:
        fn()
    return watch.count


@pytest.mark.parametrize("psi", [None, sample.Psi(("eta",), (0.4,)), sample.parse_psi("psi", "eta,sigma_constant,eta",
                                                                                       "1,0.05,1", "loop")])
def test_the_sampling_loop_never_waits_for_the_device(psi):
    """sample.generate's steps (the denoiser with CFG and nucleus, then the reverse step, plain or Psi) run no op
    that makes the host wait for the GPU: the count of such ops does not grow with the steps (the old step counted
    the tokens that draw from x_theta, one wait per step)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=40, block_size=12, n_layer=1, n_head=2, n_embd=16, cond_dim=8)).eval()
    run = lambda steps: sync_ops_of(lambda: sample.generate(model, 3, 12, 40, steps, prompt_ids=[1, 2], cfg_w=1.1,
                                                            top_p=0.9, psi=psi, show_progress=False,
                                                            generator=torch.Generator().manual_seed(0)))
    assert run(2) == run(7) <= 1


# -----------------------------------------------------------------------------
# the sampler holds no float64 tensor over the vocabulary, also with CFG and top-p

def test_sampler_builds_no_float64_vocab_tensor_with_cfg_top_p(monkeypatch):
    """Every tensor any op of sample.generate returns is watched: float64 appears only for per-token values,
    never (B, L, V) nor (B, L, blocks of V); with CFG and nucleus filtering too."""
    monkeypatch.setattr(gumbel, "GUMBEL_BLOCK", 8)        # V = 61 in 8 blocks
    from torch.utils._python_dispatch import TorchDispatchMode
    from sample import generate

    class Watch(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                    self.largest = max(self.largest, t.numel())
            return out

    model, _ = small_model("sddlm", vocab_size=61)
    B, L = 3, 16
    for kw in (dict(), dict(cfg_w=1.5, prompt_ids=[1, 2, 3], top_p=0.9)):
        with Watch() as watch:
            x = generate(model, B, L, 61, 4, generator=torch.Generator().manual_seed(0), show_progress=False, **kw)
        assert x.shape == (B, L) and x.max() < 61
        assert 0 < watch.largest <= 2 * B * L, kw       # per-token scalars (the CFG batch is 2B)
