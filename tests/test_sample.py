"""Tests for sample.py: the ancestral sampler against oracles and an exactly solvable toy distribution,
conditioning (prompt, infilling, unsupervised CFG), nucleus filtering, and the command line."""

import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

import diffusion
from model import ModelConfig, build_model
from sample import denoiser_probs, generate, generate_ar, nucleus, nucleus_logits

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


def test_final_ancestral_step_alone_lands_on_x0_from_a_large_t_end():
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
    torch.testing.assert_close(seen, expected, rtol=1e-6, atol=1e-7)
    assert all(sigma.shape == (3,) and torch.all(sigma == sigma[0]) for _, sigma in rec.calls)


def test_steps_below_one_raise():
    with pytest.raises(ValueError, match="steps must be >= 1"):
        generate(random_model(), 2, 12, 11, 0, show_progress=False)


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
TV_TOLERANCE = 0.05   # sampling noise alone is ~0.015 at 4000 samples; the broken samplers below give 0.29-0.7


def test_sampler_recovers_the_joint_distribution_of_toy_data():
    x = generate(toy_denoiser(include_own_token=False), TOY_SAMPLES, 2, V_TOY, TOY_STEPS, generator=gen(0),
                 show_progress=False)
    assert total_variation_to_table(x) < TV_TOLERANCE


def test_broken_samplers_fail_the_same_check(monkeypatch):
    ignores_xt = lambda xt, sigma: torch.stack([TABLE.sum(1), TABLE.sum(0)]).log().expand(xt.shape[0], -1, -1)
    x = generate(ignores_xt, TOY_SAMPLES, 2, V_TOY, TOY_STEPS, generator=gen(0), show_progress=False)
    assert total_variation_to_table(x) > 0.2        # independent positions: the product of the marginals
    x = generate(toy_denoiser(include_own_token=True), TOY_SAMPLES, 2, V_TOY, TOY_STEPS, generator=gen(0),
                 show_progress=False)
    assert total_variation_to_table(x) > 0.2        # the own token's likelihood counted twice
    argmax_of_posterior = lambda xt, p, a_t, a_s, generator=None: diffusion.reverse_posterior(
        xt, p, a_t, a_s, p.shape[-1]).argmax(-1)
    monkeypatch.setattr(diffusion, "ancestral_step", argmax_of_posterior)
    monkeypatch.setattr(diffusion, "ancestral_step_from_logits", lambda xt, logits, a_t, a_s, generator=None:
                        argmax_of_posterior(xt, torch.softmax(logits.double(), -1), a_t, a_s))
    x = generate(toy_denoiser(include_own_token=False), TOY_SAMPLES, 2, V_TOY, TOY_STEPS, generator=gen(0),
                 show_progress=False)
    assert total_variation_to_table(x) > 0.2        # argmax of the posterior (Duo issue #29)


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


def test_cfg_weight_zero_is_the_plain_sampler_without_a_second_branch():
    model, prompt = random_model(), torch.tensor([1, 2, 3])
    rec = Recorder(model)
    plain = generate(model, 4, 12, 11, 8, prompt_ids=prompt, generator=gen(5), show_progress=False)
    cfg0 = generate(rec, 4, 12, 11, 8, prompt_ids=prompt, cfg_w=0.0, generator=gen(5), show_progress=False)
    assert torch.equal(plain, cfg0)
    assert all(xt.shape[0] == 4 for xt, _ in rec.calls)


def test_cfg_with_a_model_blind_to_the_prompt_is_the_plain_sampler():
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


def test_cfg_runs_one_batched_forward_with_random_tokens_in_place_of_the_prompt():
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


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 2e-6)])
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
    torch.testing.assert_close(p, expected / expected.sum(-1, keepdim=True), rtol=tol, atol=tol * 1e-2)


def test_cfg_without_a_prompt_is_an_error():
    with pytest.raises(ValueError, match="cfg_w"):
        generate(random_model(), 2, 12, 11, 4, cfg_w=1.0, show_progress=False)


# -----------------------------------------------------------------------------------------------
# nucleus filtering on x_theta

def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]], dtype=torch.float64)
    torch.testing.assert_close(nucleus(probs, 0.9), torch.tensor([[0, 0.5, 0.15, 0.3]], dtype=torch.float64) / 0.95)
    torch.testing.assert_close(nucleus(probs, 0.5), torch.tensor([[0, 1.0, 0, 0]], dtype=torch.float64))
    assert nucleus(probs, 1.0) is probs


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.7, 0.95, 0.999])
def test_nucleus_on_logits_is_the_nucleus_of_the_softmax(top_p):
    """The sampler filters logits (float32, in chunks of rows, no float64 vocabulary tensor): softmax of the result
    is nucleus(softmax(logits)) computed in float64; bf16 logits (with ties) keep every token tied with the last
    kept one."""
    z = 2 * torch.randn(6, 40, 97, generator=gen(0), dtype=torch.float64)
    got = nucleus_logits(z, top_p, chunk_elems=7 * 97)
    torch.testing.assert_close(torch.softmax(got, -1), nucleus(torch.softmax(z, -1), top_p), rtol=1e-12, atol=1e-15)
    zb = z.bfloat16()
    kept = nucleus_logits(zb, top_p) > float("-inf")
    cut = torch.where(kept, zb.float(), float("inf")).amin(-1, keepdim=True)
    assert torch.equal(kept, zb.float() >= cut)                   # a threshold on the logits, ties included
    p = torch.softmax(zb.double(), -1)
    mass_above = torch.where(zb.float() > cut, p, 0.0).sum(-1)
    assert (mass_above < top_p + 1e-6).all() and (torch.where(kept, p, 0.0).sum(-1) >= top_p - 1e-6).all()
    assert nucleus_logits(zb, 1.0) is zb


def test_top_p_one_is_no_nucleus_and_tiny_top_p_is_greedy_x_theta():
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


@pytest.mark.slow
def test_cli_bad_input_is_one_line_and_exit_code_2(tiny_ckpt, tmp_path):
    cases = {"longer than the context": ("--prompt_ids", ",".join(["5"] * 40)),
             "--steps": ("--steps", 0),
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
