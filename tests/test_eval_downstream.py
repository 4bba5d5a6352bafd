"""downstream/ (eval_downstream.py, the estimator scoring.py, the adapter lm_eval_adapter.py), offline: a tiny DiT
trained here (train.py, Duo NELBO, ~600 steps) on a corpus with an obvious rule ("the sky is blue", "the grass is
green", ... in random order) must rank the right colour first and recover it as LAMBADA's last word; the estimator
is checked on stand-in denoisers (only the continuation is noised, t is stratified, both CFG branches see the
same noisy continuation, the guided distribution is p_c^(1+w)/p_u^w); generation is cut at EOS and stop strings
as computed by hand, the rolling bound is the sum of its windows'; the JSONL runner's acc/acc_norm against a hand
computation; the CLI end to end and its one-line errors; when lm-eval is installed, the adapter with lm-eval's own
classes and the harness's own command line on four local tasks (one per request type), each logged response equal
to the same request computed without it."""
import json
import math
import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from conftest import reduction_tol
from conftest import ENV
from data import get_tokenizer
from downstream import eval_downstream as ed, lm_eval_adapter as adapter, scoring
from model import ModelConfig, build_model
from sample import generate_long
from trained.checkpoint import load_checkpoint

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
FACTS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black"}
COLOURS = list(FACTS.values())


def facts(rng, k):
    return " ".join(f"the {s} is {FACTS[s]} ." for s in rng.choices(list(FACTS), k=k))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny DiT (2 layers, width 64, SentencePiece vocab 320, block 32) trained 600 steps with the Duo NELBO.
    One thread: deterministic and, on a shared 2-core machine, faster than two."""
    import train
    d = tmp_path_factory.mktemp("downstream")
    rng = random.Random(0)
    # documents of facts, EOS between them (a lone .txt would end each paragraph in a blank line, and this small
    # model then learns to expect "\n" at the end of a short input: the scorer is what is tested here)
    (d / "corpus.jsonl").write_text("".join(json.dumps({"text": facts(rng, 6)}) + "\n" for _ in range(400)))
    threads, handlers = torch.get_num_threads(), {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    torch.set_num_threads(1)
    try:
        rc = train.main([
            "--dataset", str(d / "corpus.jsonl"), "--data_dir", str(d / "data"), "--out_dir", str(d / "out"),
            "--tokenizer", "sp_train:320", "--block_size", "32", "--n_layer", "2", "--n_head", "2", "--n_embd", "64",
            "--batch_size", "16", "--max_iters", "600", "--warmup_iters", "10", "--lr", "6e-3", "--loss", "duo",
            "--ema", "0", "--num_samples", "0", "--eval_iters", "1", "--eval_interval", "100000",
            "--ckpt_interval", "100000", "--log_interval", "100", "--seed", "1", "--beta2", "0.999",
            "--curriculum_iters", "0"])
        assert rc == 0
        ckpt_path = str(d / "out" / "ckpt.pt")
        model, ckpt = load_checkpoint(ckpt_path)
        tok = get_tokenizer(ckpt["meta"]["tokenizer"])
        yield dict(model=model, tok=tok, ckpt=ckpt_path, dir=d)
    finally:
        torch.set_num_threads(threads)
        for s, h in handlers.items():
            signal.signal(s, h)


def colour_items(seed=1, per_subject=2):
    """Four-way questions whose context holds a few other true facts first (~20 tokens, like training blocks)."""
    rng = random.Random(seed)
    return [{"context": facts(rng, 4) + f" the {s} is", "choices": COLOURS, "gold": COLOURS.index(c)}
            for s, c in FACTS.items() for _ in range(per_subject)]


# -----------------------------------------------------------------------------------------------
# the estimator on stand-in denoisers

class StubDenoiser(torch.nn.Module):
    """Logits = a fixed random table of the input token plus one of the row's token sum (so the context
    matters and CFG changes the result); `favour` (L,) ids add +30 to those tokens. Records its inputs."""

    def __init__(self, vocab_size=13, block_size=16, favour=None, time_cond=True):
        super().__init__()
        self.config = ModelConfig(vocab_size=vocab_size, block_size=block_size, n_layer=1, n_head=1, n_embd=2,
                                  time_cond=time_cond)
        g = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(vocab_size, vocab_size, generator=g))
        self.favour = favour
        self.inputs = []

    def forward(self, x, sigma=None):
        self.inputs.append((x.clone(), sigma.clone()))
        V = self.config.vocab_size
        logits = self.table[x] + self.table[x.sum(1) % V][:, None]
        if self.favour is not None:
            logits = torch.nn.functional.one_hot(self.favour[-x.shape[1]:], V) * 30.0 + 0 * logits
        return logits


CTX, CONT = [1, 5, 2, 7, 3], [4, 9, 6]


def test_only_the_continuation_is_noised_and_t_is_stratified():
    model, J = StubDenoiser(), 64
    nelbo = scoring.conditional_nelbo(model, CTX, CONT, mc_draws=J, batch_size=24, seed=0)
    assert nelbo.shape == (J,) and (nelbo >= 0).all()
    x = torch.cat([x for x, _ in model.inputs])
    sigma = torch.cat([s for _, s in model.inputs])
    assert [len(x) for x, _ in model.inputs] == [24, 24, 16]         # batch_size draws per forward
    assert (x[:, :len(CTX)] == torch.tensor(CTX)).all()           # the context is never corrupted
    t = (1 - torch.exp(-sigma.double())) / (1 - 1e-3)             # sigma = -log alpha_t, alpha_t = 1 - (1-eps) t
    strata = ((t - 1e-3) / (1 - 1e-3) * J).floor().long()
    assert sorted(strata.tolist()) == list(range(J))              # one t in each of the J strata of [1e-3, 1]
    # Eq. (discrete_marginal): a continuation token survives with probability alpha_t + (1 - alpha_t) / V
    assert_survival_law(x[:, len(CTX):], t, model.config.vocab_size)


def assert_survival_law(cont_t, t, V):
    """The count of surviving tokens, a sum of independent Bernoulli(p_j), p_j = alpha_j + (1 - alpha_j) / V,
    within 4.5 standard deviations of its mean (p ~ 7e-6), in each third of [1e-3, 1] and over all draws."""
    alpha = 1 - (1 - 1e-3) * t
    p = (alpha + (1 - alpha) / V)[:, None].expand(cont_t.shape)
    kept = (cont_t == torch.tensor(CONT)).double()
    for part in (t < 1 / 3, (t >= 1 / 3) & (t < 2 / 3), t >= 2 / 3, t >= 0):
        mean, var = p[part].sum(), (p[part] * (1 - p[part])).sum()
        assert abs(kept[part].sum() - mean) < 4.5 * var.sqrt(), (kept[part].sum(), mean, var.sqrt())


def test_continuation_tokens_survive_with_alpha_t_plus_uniform():
    """4000 draws x 3 tokens: the law separates alpha_t + (1 - alpha_t)/V from alpha_t alone (a replacement that
    never redraws x0) by 0.5 x 12000 / 13 = 460 tokens, ~9 standard deviations (sd ~ 49)."""
    model, J = StubDenoiser(), 4000
    scoring.conditional_nelbo(model, CTX, CONT, mc_draws=J, batch_size=J, seed=3)
    (x, sigma), = model.inputs
    assert_survival_law(x[:, len(CTX):], (1 - torch.exp(-sigma.double())) / (1 - 1e-3), model.config.vocab_size)


def test_cfg_branches_share_the_noisy_continuation_in_one_pass():
    model = StubDenoiser()
    scoring.conditional_nelbo(model, CTX, CONT, mc_draws=4, batch_size=4, cfg_w=1.1, seed=0)
    (x, sigma), = model.inputs                                    # ONE forward of 2 x 4 rows
    cond, uncond = x.chunk(2)
    n = len(CTX)
    assert (cond[:, :n] == torch.tensor(CTX)).all()
    assert torch.equal(cond[:, n:], uncond[:, n:]) and torch.equal(*sigma.chunk(2))
    assert (uncond[:, :n] != torch.tensor(CTX)).any() and uncond.max() < model.config.vocab_size
    # the null contexts are fresh per row (random tokens), not one fixed sequence
    assert len({tuple(r) for r in uncond[:, :n].tolist()}) > 1


@pytest.mark.numerics
def test_guided_distribution_is_the_normalised_power_ratio():
    model, w = StubDenoiser(), 1.7
    xt = torch.tensor([CTX + [0, 11, 6]] * 2)
    null = torch.tensor([[8, 8, 0, 12, 4], [3, 3, 3, 3, 3]])
    sigma = torch.tensor([0.5, 2.0])
    log_p = scoring.guided_log_probs(model, xt, sigma, len(CTX), cfg_w=w, null_ctx=null)
    # independent route: two separate forwards, probabilities in float64, p_c^(1+w) / p_u^w renormalised
    p_c = torch.softmax(model(xt, sigma).double(), -1)[:, len(CTX):]
    p_u = torch.softmax(model(torch.cat([null, xt[:, len(CTX):]], 1), sigma).double(), -1)[:, len(CTX):]
    ratio = p_c ** (1 + w) / p_u ** w
    # float32: two log-softmaxes of V = 13 logits <= 7 (each within (V + 13) u = 1.6e-6), combined with weights
    # 1 + w and w (x (1 + 2w) = 4.4), renormalised by one more (1.6e-6, and 2 u of |values| <= 4.4 * 20): a
    # probability within <= 1.7e-5 of itself
    torch.testing.assert_close(log_p.exp().double(), ratio / ratio.sum(-1, keepdim=True), rtol=2e-5, atol=0)


@pytest.mark.numerics
def test_cfg_with_w0_is_no_cfg_exactly_and_continuous_in_w():
    model = StubDenoiser()
    plain = scoring.conditional_nelbo(model, CTX, CONT, mc_draws=6, seed=3)
    assert torch.equal(scoring.conditional_nelbo(model, CTX, CONT, mc_draws=6, seed=3, cfg_w=0.0), plain)
    # a vanishing w through the two-branch path gives the same numbers: the null prompt has its own generator,
    # so the continuation's noise is identical with and without CFG
    tiny = scoring.conditional_nelbo(model, CTX, CONT, mc_draws=6, seed=3, cfg_w=1e-7)
    # w = 1e-7 moves a guided log-probability by <= 2 w max|log p_c - log p_u| (<= 14 here) = 2.8e-6, and the
    # NELBO (>= 4 here) by that times its sensitivity (<= 10 x its value over 3 tokens): <= 8.4e-5 of it; the
    # two-branch path's float32 renormalisation adds ~1.6e-6 per log-probability: rtol 1e-4 (atol 1e-5 for its
    # terms ~1)
    torch.testing.assert_close(tiny, plain, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(scoring.conditional_nelbo(model, CTX, CONT, mc_draws=6, seed=3, cfg_w=1.1), plain)


@pytest.mark.numerics
def test_a_perfect_denoiser_has_log_likelihood_zero_and_argmax():
    gold = torch.tensor(CTX + CONT)
    perfect = StubDenoiser(favour=gold)
    # the exact value is ~ -prefactor x e^-30 (the +30 logit gap) ~ -1e-11; float32 gives log p(gold) = 0 and the
    # NELBO's log(1 + c) terms bit for bit (the same op on the same value): what is left is the rounding of
    # e^-30-sized terms (measured -1.4e-8)
    assert -1e-6 < scoring.conditional_loglik(perfect, CTX, CONT, mc_draws=16, seed=0) <= 0
    assert scoring.argmax_at_t1(perfect, CTX, CONT, seed=0)
    wrong = StubDenoiser(favour=gold.roll(1))
    assert scoring.conditional_loglik(wrong, CTX, CONT, mc_draws=16, seed=0) < -10
    assert not scoring.argmax_at_t1(wrong, CTX, CONT, seed=0)


def test_context_cut_from_the_left_too_long_continuation_refused():
    x0, n_ctx = scoring.join_context(list(range(10)), [20, 21, 22], block_size=8)
    assert x0.tolist() == [[5, 6, 7, 8, 9, 20, 21, 22]] and n_ctx == 5
    assert scoring.join_context([1, 2], [3] * 8, block_size=8)[1] == 0
    with pytest.raises(scoring.EvalError, match="does not fit"):
        scoring.join_context([1], [3] * 9, block_size=8)


def test_a_model_without_time_conditioning_ignores_sigma():
    torch.manual_seed(0)
    model = build_model(dict(arch="llama", time_cond=False, vocab_size=17, block_size=16, n_layer=1, n_head=2,
                             n_embd=16)).eval()
    x = torch.randint(0, 17, (2, 8))
    assert torch.equal(model(x, torch.tensor([0.1, 5.0])), model(x, None))
    ll = scoring.conditional_loglik(model, CTX, CONT, mc_draws=4, cfg_w=1.1, seed=0)
    assert math.isfinite(ll) and ll < 0


# -----------------------------------------------------------------------------------------------
# generate_until and loglikelihood_rolling on a stand-in denoiser and a character tokenizer

CHARS = " abcdefg.xy"     # ids 0 and 3..12; 1 = BOS and 2 = EOS decode to nothing


class CharTokenizer:
    spec, bos_id, eos_id = "chars", 1, 2

    def encode(self, text):
        return [0 if c == " " else 2 + CHARS.index(c) for c in text]

    def decode(self, ids):
        return "".join(" " if i == 0 else CHARS[i - 2] if i > 2 else "" for i in ids)


def test_lm_eval_model_args_choose_the_psi_sampler():
    """sampler=psi with the loop profile's phases separated by "/" (lm-eval splits --model_args at commas) reaches
    sample.generate through generate_until: the same continuation as the Scorer with that Psi, unlike the ancestral
    sampler's; a bad psi_eta is one error naming it."""
    pytest.importorskip("lm_eval", reason="lm-eval is optional (pip install lm-eval) and not installed here")
    from types import SimpleNamespace
    from downstream.lm_eval_sddlm import SDDLMHarness
    from sample import parse_psi
    scorer = scoring.Scorer(StubDenoiser(), CharTokenizer(), seed=0, progress=False)
    harness = SDDLMHarness(scorer=scorer, sampler="psi", psi_kappa="eta/max_capped/eta", psi_eta="1/0.3/1",
                           psi_profile="loop", psi_loop_t=0.5, steps=16)
    psi = parse_psi("psi", "eta,max_capped,eta", "1,0.3,1", "loop", 0.5, steps=16)
    assert harness.psi == psi
    requests = [("xy", {"until": [], "max_gen_toks": 12}), ("ab", {"until": [], "max_gen_toks": 12})]
    got = harness.generate_until([SimpleNamespace(args=r) for r in requests])
    assert got == scorer.generate_until(requests, steps=16, final_step=harness.final_step, psi=psi)
    assert got != scorer.generate_until(requests, steps=16, final_step=harness.final_step)
    with pytest.raises(scoring.EvalError, match="psi_eta"):
        SDDLMHarness(scorer=scorer, sampler="psi", psi_eta="2")


def test_lm_eval_model_arg_stride_generates_past_the_block():
    """stride= reaches generate_until: max_gen_toks 40 past block_size 16, the Scorer's continuation with that
    stride; a stride outside [1, block_size] is one error naming it."""
    pytest.importorskip("lm_eval", reason="lm-eval is optional (pip install lm-eval) and not installed here")
    from types import SimpleNamespace
    from downstream.lm_eval_sddlm import SDDLMHarness
    scorer = scoring.Scorer(StubDenoiser(), CharTokenizer(), seed=0, progress=False)
    harness = SDDLMHarness(scorer=scorer, stride=3, steps=2)
    requests = [("xy", {"until": [], "max_gen_toks": 40})]
    got = harness.generate_until([SimpleNamespace(args=r) for r in requests])
    assert got == scorer.generate_until(requests, steps=2, final_step=harness.final_step, stride=3)
    assert got != scorer.generate_until(requests, steps=2, final_step=harness.final_step, stride=8)
    with pytest.raises(scoring.EvalError, match="stride"):
        SDDLMHarness(scorer=scorer, stride=17)


def test_generate_until_cuts_at_eos_then_before_first_stop():
    """The stand-in denoiser is sure of one token per position (the sampler then returns them all but surely):
    the continuation 'ab.cd' EOS 'ef' after the context, cut by hand."""
    tok = CharTokenizer()
    ctx = [tok.bos_id] + tok.encode("xyxy")                 # 5 ids; with 8 generated: L = 13 <= block_size 16
    cont = tok.encode("ab.cd") + [tok.eos_id] + tok.encode("ef")
    scorer = scoring.Scorer(StubDenoiser(favour=torch.tensor(ctx + cont)), tok, seed=0, progress=False)
    requests = [("xyxy", {"until": ["."], "max_gen_toks": 8}),
                ("xyxy", {"until": "c", "max_gen_toks": 8, "do_sample": False}),
                ("xyxy", {"until": ["zz"], "max_gen_toks": 8})]
    assert scorer.generate_until(requests, steps=4) == ["ab", "ab.", "ab.cd"]
    # max_gen_toks tokens exactly (the stand-in aligns its favourites with the end of its input)
    three = scoring.Scorer(StubDenoiser(favour=torch.tensor(ctx + tok.encode("ab."))), tok, seed=0, progress=False)
    assert three.generate_until([("xyxy", {"until": [], "max_gen_toks": 3})], steps=4) == ["ab."]
    # a context longer than the window is cut from the left: the favoured tokens are aligned at the end
    long = scoring.Scorer(StubDenoiser(favour=torch.tensor([5] * 30 + cont)), tok, seed=0, progress=False)
    assert long.generate_until([("ab" * 20, {"until": ["."], "max_gen_toks": 8})], steps=4) == ["ab"]
    # max_gen_toks beyond the window: 100 tokens after the whole context, in windows of block_size 16 (stride 5)
    free = scoring.Scorer(StubDenoiser(), tok, seed=0, progress=False)
    ctx = [tok.bos_id] + tok.encode("x" * 20)
    ids = scoring.generate_continuation(free.model, ctx, 100, steps=2, stride=5)
    assert ids == generate_long(free.model, 1, 121, 13, 2, stride=5, prompt_ids=ctx, generator=torch.Generator()
                                .manual_seed(0), show_progress=False)[0, 21:].tolist()
    text = free.generate_until([("x" * 20, {"until": [], "max_gen_toks": 100})], steps=2, stride=5)[0]
    assert text == free.decode_after(ctx, ids[:ids.index(tok.eos_id)] if tok.eos_id in ids else ids)
    assert {x.shape[1] for x, _ in free.model.inputs} == {16}


def test_rolling_windows_partition_the_document_and_fill_it():
    for n_doc, block, context, n_prefix in [(40, 16, 1, 1), (40, 16, 5, 1), (15, 16, 1, 1), (7, 8, 0, 0),
                                            (33, 8, 7, 2), (1, 4, 3, 1)]:
        ids = list(range(100, 100 + n_prefix)) + list(range(n_doc))
        windows = scoring.rolling_windows(ids, n_prefix, block, context)
        assert sum((piece for _, piece in windows), []) == ids[n_prefix:]       # every token scored once
        start = n_prefix
        for k, (ctx, piece) in enumerate(windows):
            assert 1 <= len(piece) <= block - context and len(ctx) + len(piece) <= block
            assert ctx == ids[start - len(ctx):start]                           # the tokens just before
            assert len(ctx) == min(start, block - len(piece))                   # as many as fit
            start += len(piece)
    with pytest.raises(scoring.EvalError, match="rolling_context"):
        scoring.rolling_windows([1, 2, 3], 0, 8, 8)


def test_rolling_loglikelihood_is_the_sum_of_the_window_bounds():
    tok = CharTokenizer()
    text = "abcdefg.xy " * 3 + "abc"                       # 36 tokens: pieces of 15, 15, 6 after BOS
    ids = [tok.bos_id] + tok.encode(text)
    model = StubDenoiser()
    scorer = scoring.Scorer(model, tok, mc_draws=8, batch_size=8, seed=5, progress=False)
    # by hand: window k scores ids[1 + 15k : 1 + 15(k+1)] given the tokens before it that fit 16, seed 5 + k
    windows = [(ids[0:1], ids[1:16]), (ids[15:16], ids[16:31]), (ids[21:31], ids[31:37])]
    expected = sum(scoring.conditional_loglik(model, c, x, mc_draws=8, seed=5 + k) for k, (c, x) in enumerate(windows))
    got, empty = scorer.loglikelihood_rolling([text, ""], cfg_w=0.0, context=1)
    assert got == pytest.approx(expected, rel=1e-12) and got < 0 and empty == 0.0    # the same calls; float64 sums
    # a denoiser sure of every token of the document "aaa...": log p = 0 (the bound is tight) over all windows;
    # one sure of "b" everywhere: far below
    a, b = tok.encode("ab")
    sure = scoring.Scorer(StubDenoiser(favour=torch.full((16,), a)), tok, mc_draws=8, seed=5, progress=False)
    # as the perfect denoiser above, over 3 windows (measured 5e-7)
    assert abs(sure.loglikelihood_rolling(["a" * 36])[0]) < 1e-5
    wrong = scoring.Scorer(StubDenoiser(favour=torch.full((16,), b)), tok, mc_draws=8, seed=5, progress=False)
    assert wrong.loglikelihood_rolling(["a" * 36])[0] < -100


def test_offline_hub_detected_up_front_errors_name_the_variable(monkeypatch):
    for v in (*adapter.OFFLINE_VARS, "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")      # nothing listens on port 1: refused at once
    assert adapter.lm_eval_failure(ConnectionError("Couldn't reach 'allenai/ai2_arc' on the Hub")).endswith(
        "set HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 to fail at once instead of retrying)")
    note = adapter.hub_offline_check(timeout=1.0)
    assert "127.0.0.1:1 is unreachable" in note and "HF_DATASETS_OFFLINE=1" in note
    assert all(os.environ[v] == "1" for v in adapter.OFFLINE_VARS)
    assert "local Hugging Face cache" in adapter.lm_eval_failure(ConnectionError("Couldn't reach 'x' on the Hub"), "t")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")                 # the user's choice is left alone: no probe
    assert adapter.hub_offline_check(timeout=1.0) is None


# -----------------------------------------------------------------------------------------------
# the built-in runner (no model)

def test_builtin_runner_acc_and_acc_norm_match_by_hand(tmp_path):
    # (context, choices, gold, stub log-likelihoods); by hand: argmax ll | argmax ll / len(choice)
    rows = [("q1", ["a", "bbbb"], 1, [-1.0, -2.0]),            # 0 wrong | -1 vs -0.5 -> 1 right
            ("q2", ["xx", "y"], 1, [-3.0, -2.5]),              # 1 right | -1.5 vs -2.5 -> 0 wrong
            ("q3", ["p", "q", "r"], 1, [-5.0, -1.0, -3.0]),    # 1 right | 1 right
            ("q4", ["long one", "s"], 1, [-4.0, -3.9])]        # 1 right | -0.5 vs -3.9 -> 0 wrong
    items = [{"context": c, "choices": ch, "gold": g} for c, ch, g, _ in rows]
    table = {(c, " " + choice): ll for c, ch, _, lls in rows for choice, ll in zip(ch, lls)}
    seen = []

    def stub_loglikelihood(pairs):
        seen.extend(pairs)
        return [(table[p], False) for p in pairs]

    # the standard errors: of the mean of 4 outcomes 0 / 1, sqrt(p (1 - p) / (n - 1)) (lm-eval's acc_stderr)
    assert ed.run_multiple_choice(items, stub_loglikelihood) == {
        "acc": 3 / 4, "acc_se": math.sqrt(3 / 4 * 1 / 4 / 3), "acc_norm": 2 / 4, "acc_norm_se": math.sqrt(1 / 4 / 3),
        "n": 4}
    assert seen == list(table)                    # one (context, " " + choice) request per choice, in order
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps(i) for i in items) + "\n")
    assert ed.read_jsonl(str(path)) == ("multiple_choice", items)
    path.write_text(json.dumps({"context": "c", "choices": ["a"], "gold": 3}) + "\n")
    with pytest.raises(scoring.EvalError, match=r"mc.jsonl:1"):
        ed.read_jsonl(str(path))
    assert ed.lambada_request({"text": "the sky is blue"}) == ("the sky is", " blue")


# -----------------------------------------------------------------------------------------------
# the trained model

@pytest.mark.slow
def test_scorer_ranks_the_right_choice_first_well_above_chance(trained):
    scorer = scoring.Scorer(trained["model"], trained["tok"], mc_draws=16, batch_size=16, seed=0, progress=False)
    for w in (0.0, ed.PAPER_CFG_W):
        res = ed.run_multiple_choice(colour_items(), lambda pairs: scorer.loglikelihood(pairs, cfg_w=w))
        assert res["n"] == 8 and res["acc"] >= 0.75 and res["acc_norm"] >= 0.75, (w, res)   # chance: 0.25


@pytest.mark.slow
def test_mc_spread_over_seeds_shrinks_with_more_draws(trained):
    """Std over 32 seeds of the J-draw estimate, J = 2 vs 128 (1/sqrt(J) predicts 8x). The per-draw NELBO is
    heavy-tailed (a noise token that happens to be another colour at small t costs ~ log(K/t)/t), so a
    10-token continuation and a 2x margin keep this robust."""
    scorer = scoring.Scorer(trained["model"], trained["tok"], progress=False)
    ctx, cont = scorer.encode("the coal is black . the sky is blue .", " the snow is white . the grass is green .")

    def spread(draws):
        return torch.tensor([scoring.conditional_loglik(trained["model"], ctx, cont, mc_draws=draws, batch_size=128,
                                                   seed=s) for s in range(32)]).std().item()
    few, many = spread(2), spread(128)
    assert many < few / 2, (few, many)


@pytest.mark.numerics
@pytest.mark.slow
def test_estimate_is_fixed_by_its_seed_whatever_the_batch_size(trained):
    m = trained["model"]
    scorer = scoring.Scorer(m, trained["tok"], progress=False)
    ctx, cont = scorer.encode(colour_items()[3]["context"], " green")
    for w in (0.0, 1.1):
        a = scoring.conditional_nelbo(m, ctx, cont, mc_draws=12, batch_size=12, cfg_w=w, seed=7)
        assert torch.equal(a, scoring.conditional_nelbo(m, ctx, cont, mc_draws=12, batch_size=12, cfg_w=w, seed=7))
        # the same draws through batches of 5: float32 forwards whose matmuls block differently (sums of <= 4d =
        # 256 and V = 320 terms along a logit's path): reduction_tol(576) = 6.9e-5 of the terms' sizes (~ the NELBO)
        tol = dict(rtol=reduction_tol(256 + 320, torch.float32), atol=1e-5)
        torch.testing.assert_close(a, scoring.conditional_nelbo(m, ctx, cont, mc_draws=12, batch_size=5, cfg_w=w, seed=7),
                                   **tol)
        assert not torch.allclose(a, scoring.conditional_nelbo(m, ctx, cont, mc_draws=12, batch_size=12, cfg_w=w, seed=8),
                                  **tol)


@pytest.mark.slow
def test_lambada_protocols_recover_an_obvious_last_word(trained):
    scorer = scoring.Scorer(trained["model"], trained["tok"], mc_draws=16, seed=0, lambada_steps=8, progress=False)
    rng = random.Random(2)
    items = [{"text": facts(rng, 4) + f" the {s} is {c}"} for s, c in FACTS.items()]
    for w in (0.0, ed.PAPER_CFG_W):
        res = ed.run_lambada(items, scorer, w)
        assert res["acc_generate"] >= 0.75 and res["acc_argmax"] >= 0.75 and res["perplexity"] < 2, (w, res)
    # a wrong last word is much less likely than the right one
    (ll_right, _), (ll_wrong, _) = scorer.loglikelihood([("the sky is", " blue"), ("the sky is", " black")])
    assert ll_right > ll_wrong + 1


# -----------------------------------------------------------------------------------------------
# command line

def write_jsonl(path, items):
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return str(path)


def test_accuracies_carry_binomial_standard_errors():
    """An accuracy is a binomial proportion over the items: its standard error is that of the mean of the n
    outcomes 0 / 1, exactly sqrt(p (1 - p) / (n - 1)) (here against the sample standard deviation of the
    outcomes, computed apart); the table prints each metric ± its SE, in percent for accuracies; LAMBADA's
    perplexity ± the delta method's SE over the passages (perplexity x the SE of the mean of -ll)."""
    import statistics
    for hits, n in ((3, 4), (0, 10), (7, 7), (512, 1000)):
        outcomes = [1.0] * hits + [0.0] * (n - hits)
        assert ed.accuracy_se(hits, n) == pytest.approx(statistics.stdev(outcomes) / math.sqrt(n), rel=1e-12, abs=0)
    assert ed.accuracy_se(1, 1) is None

    class Stub:
        def loglikelihood(self, pairs, cfg_w, check, desc=""):
            return [(-v, v < 1.5) for v in (1.0, 2.0, 0.5, 3.0)][:len(pairs)]

        def generate_matches(self, pairs, cfg_w, desc=""):
            return [True, False, False, False][:len(pairs)]
    res = ed.run_lambada([{"text": f"a passage ending in word{i}"} for i in range(4)], Stub())
    nll = [1.0, 2.0, 0.5, 3.0]
    assert res["perplexity"] == pytest.approx(math.exp(1.625))
    assert res["perplexity_se"] == pytest.approx(math.exp(1.625) * statistics.stdev(nll) / 2, rel=1e-12)
    assert (res["acc_argmax"], res["acc_generate"]) == (0.5, 0.25)
    assert res["acc_argmax_se"] == pytest.approx(math.sqrt(0.25 / 3)) and res["acc_generate_se"] == pytest.approx(
        math.sqrt(3 / 16 / 3))
    table = ed.markdown_table([{"task": "lambada", "setting": "no CFG", "cfg_w": 0.0, "runner": "builtin", **res}])
    assert "| 25.00 ± 25.00 | 50.00 ± 28.87 |" in table and f"| {math.exp(1.625):.2f} ± " in table
    assert "_se" not in table.splitlines()[0]                   # no column of its own


@pytest.mark.slow
def test_cli_writes_json_and_table_and_cfg_w0_row_equals_no_cfg(trained, tmp_path, capsys):
    mc = write_jsonl(tmp_path / "colours.jsonl", colour_items(per_subject=1))
    rng = random.Random(3)
    lam = write_jsonl(tmp_path / "lambada.jsonl",
                      [{"text": facts(rng, 3) + f" the {s} is {c}"} for s, c in FACTS.items()])
    out = tmp_path / "res" / "results.json"
    argv = ["--ckpt", trained["ckpt"], "--jsonl", f"{mc},{lam}", "--mc_draws", "8", "--cfg", "both", "--cfg_w", "0",
            "--cfg_w_task", "colours=1.1", "--limit", "3", "--lambada_steps", "4", "--device", "cpu",
            "--out", str(out)]
    assert ed.main(argv) == 0
    res = json.loads(out.read_text())
    rows = {(r["task"], r["setting"]): r for r in res["results"]}
    assert set(rows) == {("colours", "no CFG"), ("colours", "CFG"), ("lambada", "no CFG"), ("lambada", "CFG")}
    assert rows["colours", "CFG"]["cfg_w"] == 1.1 and rows["lambada", "CFG"]["cfg_w"] == 0
    assert rows["colours", "no CFG"]["n"] == 3 and 0 <= rows["colours", "CFG"]["acc_norm"] <= 1
    # --cfg on with w = 0 is exactly --cfg off
    strip = lambda r: {k: v for k, v in r.items() if k not in ("setting",)}
    assert strip(rows["lambada", "CFG"]) == strip(rows["lambada", "no CFG"])
    assert set(rows["lambada", "CFG"]) >= {"acc_generate", "acc_argmax", "perplexity"}
    assert "acc_argmax" in res["definitions"] and res["config"]["mc_draws"] == 8
    table = (tmp_path / "res" / "results.md").read_text()
    assert "| colours | CFG | 1.1 | builtin | 3 |" in table and "acc_generate" in table
    assert "| lambada | no CFG |" in capsys.readouterr().out


def run_cli(args):
    return subprocess.run([sys.executable, os.path.join(HERE, "downstream/eval_downstream.py"), *args], capture_output=True,
                          text=True, cwd=HERE, timeout=120)


@pytest.mark.slow
def test_cli_errors_exit_nonzero_with_one_line(trained, tmp_path):
    good = write_jsonl(tmp_path / "ok.jsonl", colour_items(per_subject=1))
    long = write_jsonl(tmp_path / "long.jsonl",
                       [{"context": "the sky is", "choices": ["blue " * 40, "green"], "gold": 0}])
    cases = {
        "checkpoint not found": ["--ckpt", str(tmp_path / "missing.pt"), "--jsonl", good],
        "file not found": ["--ckpt", trained["ckpt"], "--jsonl", str(tmp_path / "missing.jsonl")],
        "unknown task 'arc_easy'": ["--ckpt", trained["ckpt"], "--tasks", "arc_easy", "--builtin", "1",
                                    "--data_dir", str(tmp_path)],
        "context window": ["--ckpt", trained["ckpt"], "--jsonl", long, "--device", "cpu"],
    }
    for expected, args in cases.items():
        proc = run_cli(args)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0] and "Traceback" not in proc.stderr, proc.stderr


# -----------------------------------------------------------------------------------------------
# lm-eval adapter

@pytest.mark.slow
def test_lm_eval_adapter_with_lm_evals_own_classes(trained):
    pytest.importorskip("lm_eval", reason="lm-eval is optional (pip install lm-eval) and not installed here")
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import LM
    from lm_eval.api.registry import get_model
    from downstream import lm_eval_sddlm  # noqa: F401  (importing it registers "sddlm")
    cls = adapter.lm_eval_model_class()
    assert get_model("sddlm") is cls and issubclass(cls, LM)
    assert get_model("dummy").__name__ == "DummyLM"        # registering ours does not hide the harness's models
    # as lm-eval builds it from --model_args and --batch_size: every value a string
    extras = {"batch_size": "4", "max_batch_size": None, "device": "cpu"}
    lm = cls.create_from_arg_string(f"ckpt={trained['ckpt']},mc_draws=4,cfg_w=1.1,use_ema=false,seed=3", extras)
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=("the snow is", " " + c), idx=i)
            for i, c in enumerate(COLOURS)]
    out = lm.loglikelihood(reqs)
    assert len(out) == 4 and all(type(ll) is float and type(g) is bool for ll, g in out)
    assert max(range(4), key=lambda i: out[i][0]) == COLOURS.index("white")
    assert lm.final_step == "greedy"         # final_step=auto for this Duo-NELBO checkpoint (diffusion.default_final_step)
    assert cls.create_from_arg_string(f"ckpt={trained['ckpt']},final_step=ancestral", extras).final_step == "ancestral"
    bad = {"unknown sddlm model argument\\(s\\) mc_draw;": "mc_draw=8", "rolling_context must be in": "rolling_context=32",
           "final_step must be one of": "final_step=best", "cfg_w='high' is not a valid float": "cfg_w=high",
           "lambada_steps must be >= 1, got 0": "lambada_steps=0"}
    for message, arg in bad.items():
        with pytest.raises(scoring.EvalError, match=message):
            cls.create_from_arg_string(f"ckpt={trained['ckpt']},{arg}", extras)


TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: {output_type}
{docs}
metric_list:
{metrics}
"""


def write_tasks(d, seed=5):
    """Four offline lm-eval tasks over local JSONL files, one per request type -> {task name: items}."""
    rng = random.Random(seed)
    items = {"colours_mc": colour_items(per_subject=1),
             "colours_lambada": [{"text": facts(rng, 4) + f" the {s} is {c}"} for s, c in FACTS.items()],
             "colours_gen": [{"context": facts(rng, 3) + f" the {s} is", "answer": c} for s, c in FACTS.items()],
             "colours_doc": [{"text": facts(rng, 10)}, {"text": facts(rng, 2)}]}
    docs = {
        "colours_mc": ("multiple_choice", 'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
                       'doc_to_target: "{{gold}}"', ["acc", "acc_norm"]),
        "colours_lambada": ("loglikelihood", "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
                            "doc_to_target: \"{{' ' + text.split(' ')[-1]}}\"", ["perplexity", "acc"]),
        "colours_gen": ("generate_until", 'doc_to_text: "{{context}}"\ndoc_to_target: "{{answer}}"\n'
                        'generation_kwargs:\n  until: ["."]\n  max_gen_toks: 6\n  do_sample: false\n'
                        'filter_list:\n  - name: word\n    filter:\n      - function: regex\n'
                        '        regex_pattern: "(\\\\w+)"\n      - function: take_first', ["exact_match"]),
        "colours_doc": ("loglikelihood_rolling", 'doc_to_text: ""\ndoc_to_target: "{{text}}"',
                        ["word_perplexity", "byte_perplexity", "bits_per_byte"])}
    for name, (output_type, doc, metrics) in docs.items():
        (d / f"{name}.yaml").write_text(TASK_YAML.format(
            name=name, path=write_jsonl(d / f"{name}.jsonl", items[name]), output_type=output_type, docs=doc,
            metrics="\n".join(f"  - metric: {m}" for m in metrics)))
    return items


@pytest.mark.slow
def test_harness_serves_every_request_type_as_the_scorer(trained, tmp_path):
    """`python -m downstream.lm_eval_sddlm` (lm-eval's own CLI function) with four local tasks, one per request type; every
    response it logged equals the same request computed here without the harness: the Scorer for loglikelihood,
    sample.generate for generate_until, the sum of per-window conditional NELBOs for loglikelihood_rolling; and
    the metrics it reports follow from those responses."""
    pytest.importorskip("lm_eval", reason="lm-eval is optional (pip install lm-eval) and not installed here")
    import glob
    import re
    from diffusion import default_final_step
    from sample import generate
    items = write_tasks(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    args = ["--model", "sddlm", "--model_args", f"ckpt={trained['ckpt']},mc_draws=4,steps=6,seed=3",
            "--tasks", ",".join(items), "--include_path", str(tmp_path), "--device", "cpu", "--batch_size", "4",
            "--output_path", str(tmp_path / "out"), "--log_samples"]
    proc = subprocess.run([sys.executable, "-m", "downstream.lm_eval_sddlm", *args], capture_output=True, text=True, cwd=HERE,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOWER BOUND on log p(text)" in proc.stderr and "do_sample are not used" in proc.stderr

    def logged(task):
        path, = glob.glob(str(tmp_path / "out" / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        return [json.loads(line) for line in open(path)]
    results = json.loads(open(glob.glob(str(tmp_path / "out" / "**" / "results_*.json"), recursive=True)[0]).read())
    results = {task: {k.split(",")[0]: v for k, v in r.items()} for task, r in results["results"].items()}

    model, tok = trained["model"], trained["tok"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # as the subprocess: the same float32 sums, bit for bit
    try:
        scorer = scoring.Scorer(model, tok, mc_draws=4, batch_size=4, seed=3, progress=False)
        # loglikelihood: multiple choice and LAMBADA-style
        for task in ("colours_mc", "colours_lambada"):
            acc = []
            for s in logged(task):
                pairs = [(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()]
                ours = scorer.loglikelihood(pairs)
                theirs = [(float(ll), g == "True") for (ll, g), in s["resps"]]
                assert [g for _, g in theirs] == [g for _, g in ours]
                # the same float32 sums in both processes (one thread each, the same kernels); the harness keeps
                # a Python float: 1e-6 leaves 16 float32 ulps should it pass through a float32
                assert [ll for ll, _ in theirs] == pytest.approx([ll for ll, _ in ours], rel=1e-6)
                acc.append(max(range(len(ours)), key=lambda k: ours[k][0]) == s["doc"]["gold"] if task == "colours_mc"
                           else ours[0][1])
            assert results[task]["acc"] == pytest.approx(sum(acc) / len(acc), rel=1e-12)   # a mean of 0/1 values
        lls = [float(s["resps"][0][0][0]) for s in logged("colours_lambada")]
        assert results["colours_lambada"]["perplexity"] == pytest.approx(math.exp(-sum(lls) / len(lls)), rel=1e-12)
        # generate_until: 6 tokens after [BOS] + context by sample.generate, then cut at EOS and at "."; the
        # final step the harness's final_step=auto picks for this checkpoint (a NELBO model: greedy)
        final_step = default_final_step(torch.load(trained["ckpt"], map_location="cpu", weights_only=True))
        assert final_step == "greedy"
        right = []
        for s in logged("colours_gen"):
            ctx = [tok.bos_id] + tok.encode(s["doc"]["context"])
            ids = generate(model, 1, len(ctx) + 6, model.config.vocab_size, 6, prompt_ids=torch.tensor(ctx),
                           final_step=final_step, generator=torch.Generator().manual_seed(3),
                           show_progress=False)[0, len(ctx):].tolist()
            ids = ids[:ids.index(tok.eos_id)] if tok.eos_id in ids else ids
            text = tok.decode(ctx + ids)[len(tok.decode(ctx)):].split(".")[0]
            assert s["resps"] == [[text]], (s["resps"], text)
            right.append(re.findall(r"\w+", text)[:1] == [s["doc"]["answer"]])
        assert results["colours_gen"]["exact_match"] == sum(right) / len(right) >= 0.75
        # loglikelihood_rolling: windows of 32 tokens after BOS, 31 new ones each, draws seeded 3 + window
        words, total, n_windows = 0, 0.0, []
        for s in logged("colours_doc"):
            ids = [tok.bos_id] + tok.encode(s["doc"]["text"])
            starts = range(1, len(ids), 31)
            bound = sum(scoring.conditional_loglik(model, ids[max(0, a - (32 - len(ids[a:a + 31]))):a], ids[a:a + 31],
                                              mc_draws=4, batch_size=4, seed=3 + k) for k, a in enumerate(starts))
            assert float(s["resps"][0][0]) == pytest.approx(bound, rel=1e-6) and bound < 0   # as above
            words, total = words + len(re.split(r"\s+", s["doc"]["text"])), total + bound
            n_windows.append(len(starts))
        assert n_windows[0] >= 2            # the long document spans several windows
        # the harness sums the logged (float32-derived) values in float64: relative to the sum, <= 1e-6 as above
        assert results["colours_doc"]["word_perplexity"] == pytest.approx(math.exp(-total / words), rel=1e-5)
    finally:
        torch.set_num_threads(threads)

    # a mistyped model argument: one line, exit code 2, before the checkpoint is loaded
    args[args.index("--model_args") + 1] = f"ckpt={trained['ckpt']},mc_draw=8"
    proc = subprocess.run([sys.executable, "-m", "downstream.lm_eval_sddlm", *args], capture_output=True, text=True, cwd=HERE,
                          env=env, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: unknown sddlm model argument(s) mc_draw; known:")


@pytest.mark.slow
def test_cli_through_lm_eval_on_offline_tasks(trained, tmp_path, monkeypatch):
    """eval_downstream's CLI with local task YAMLs (no download): a multiple-choice task and a LAMBADA-style
    loglikelihood task whose acc is the adapter's is_greedy, reported as acc_argmax; a task whose data file is
    missing fails alone (the others' results are written, the exit is an error naming it); an unknown task name
    is an error before any work."""
    pytest.importorskip("lm_eval", reason="lm-eval is optional (pip install lm-eval) and not installed here")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    write_tasks(tmp_path)
    (tmp_path / "broken.yaml").write_text(TASK_YAML.format(
        name="broken", path=tmp_path / "missing.jsonl", output_type="loglikelihood",
        docs='doc_to_text: "{{text}}"\ndoc_to_target: "{{text}}"', metrics="  - metric: perplexity"))
    out = tmp_path / "lm.json"
    argv = ["--ckpt", trained["ckpt"], "--tasks", "colours_mc,broken,colours_lambada", "--include_path", str(tmp_path),
            "--mc_draws", "8", "--cfg", "both", "--device", "cpu", "--out", str(out)]
    with pytest.raises(scoring.EvalError, match=r"2 of 6 task runs failed: broken \(no CFG\), broken \(CFG\); the other"):
        ed.main(argv)
    res = json.loads(out.read_text())
    rows = {(r["task"], r["setting"]): r for r in res["results"]}
    assert set(rows) == {(t, s) for t in ("colours_mc", "colours_lambada") for s in ("no CFG", "CFG")}
    assert [(f["task"], f["setting"]) for f in res["failed"]] == [("broken", "no CFG"), ("broken", "CFG")]
    assert "lm-eval failed on task 'broken'" in res["failed"][0]["error"]
    mc = rows["colours_mc", "CFG"]
    assert mc["runner"] == "lm-eval" and mc["n"] == 4 and mc["acc"] >= 0.75 and "acc_norm" in mc
    lam = rows["colours_lambada", "no CFG"]
    assert set(lam) >= {"acc_argmax", "perplexity"} and "acc" not in lam
    assert "FAILED broken (CFG)" in (tmp_path / "lm.md").read_text()
    with pytest.raises(scoring.EvalError, match="unknown lm-eval task\\(s\\) colours_mcq"):
        ed.main(argv[:3] + ["colours_mcq"] + argv[4:])


@pytest.mark.slow
def test_lm_eval_reports_a_missing_checkpoint_before_the_device(tmp_path):
    pytest.importorskip("lm_eval")
    p = subprocess.run([sys.executable, "-m", "downstream.lm_eval_sddlm", "--model", "sddlm", "--model_args",
                        f"ckpt={tmp_path / 'missing.pt'}", "--tasks", "arc_easy", "--device", "cuda"],
                       capture_output=True, text=True, env={**ENV, "HF_DATASETS_OFFLINE": "1"}, cwd=tmp_path,
                       timeout=300)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert p.returncode == 2 and errors == [f"error: checkpoint not found: {tmp_path / 'missing.pt'} "
                                            f"(--model_args ckpt=PATH)"], p.stderr[-2000:]


@pytest.mark.slow
def test_eval_downstream_takes_a_model_folder(run_ar, tmp_path):
    (tmp_path / "mc.jsonl").write_text('{"context": "the cat", "choices": [" sees", " likes"], "gold": 0}\n')
    for ckpt in (os.path.join(run_ar.out, "model"), run_ar.ckpt):
        p = subprocess.run([sys.executable, os.path.join(HERE, "downstream", "eval_downstream.py"), "--ckpt", ckpt,
                            "--jsonl", tmp_path / "mc.jsonl", "--mc_draws", "2", "--out", tmp_path / "r.json"],
                           capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=300)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert json.loads((tmp_path / "r.json").read_text())["results"][0]["n"] == 1
        os.remove(tmp_path / "r.json")
        os.remove(tmp_path / "r.md")


def test_scorer_refuses_an_unknown_greedy_check():
    """A direct caller's misspelt protocol is one error naming both, never read as protocol (a) 'generate'."""
    scorer = scoring.Scorer(StubDenoiser(), CharTokenizer(), seed=0, progress=False)
    with pytest.raises(scoring.EvalError, match="greedy_check must be one of argmax, generate, got 'argmx'"):
        scorer.loglikelihood([("xy", "ab")], greedy_check="argmx")
