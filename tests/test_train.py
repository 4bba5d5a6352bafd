"""train.py end to end on a tiny synthetic corpus (CPU, offline): every loss learns, resume is exact,
2-process DDP equals 1 process, bad input fails in one line without losing what was written; the paper's presets
(the Appendix table) and their curriculum share, and bad experiment flags refused before any work."""
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook

import curriculum.gaussian as curriculum
import diffusion
import validation
import losses
from model import PRESETS, DiffusionTransformer, ModelConfig
from plumbing.cli import ConfigError
from plumbing.distributed import Env
from plumbing.run import Run
import train
from diffusion import loss_terms, token_mean
from conftest import (assert_adam_moments_close, compiler_missing, grads, reduction_tol, small_model,
                      train_in_one_and_two_processes, unit_roundoff, write_corpus)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
TINY = ["--n_layer", "2", "--n_embd", "64", "--n_head", "2", "--block_size", "32", "--batch_size", "8",
        "--warmup_iters", "5", "--lr", "3e-3", "--num_samples", "0", "--eval_iters", "2", "--ema", "0.9",
        "--log_interval", "5", "--tokenizer", "sp_train:320",
        "--curriculum_iters", "0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    write_corpus(d / "corpus.txt")
    data_dir = d / "data"
    return str(d / "corpus.txt"), str(data_dir)


def run(args, out_dir, corpus):
    path, data_dir = corpus
    return train.main(TINY + ["--dataset", path, "--data_dir", data_dir, "--out_dir", str(out_dir)] + args)


def log_rows(out_dir, key):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [r[key] for r in map(json.loads, f) if key in r]


@pytest.mark.parametrize("loss", ["sddlm", "sddlm_v1", "sddlm_v2", "naive", "duo", "ar"])
def test_every_loss_trains_and_its_loss_goes_down(loss, corpus, tmp_path):
    assert run(["--loss", loss, "--max_iters", "60", "--eval_interval", "60"], tmp_path, corpus) == 0
    rows = log_rows(tmp_path, "loss")
    assert len(rows) == 12 and all(map(lambda v: v == v, rows))
    # From the zero output layer (uniform predictions) every objective here falls by 1.6 (sddlm, which scores only
    # the ~half replaced tokens) to 5.4 nats (V1, V2) in 60 steps at this seed (measured 2026-11-24, torch 2.13,
    # CPU); 1 nat leaves room for platform rounding, and a run whose gradient does not reach the model stays put.
    assert sum(rows[-3:]) / 3 < rows[0] - 1.0, rows
    # The validation NELBO (the exact NLL for 'ar') is reported for every loss so runs are comparable. The exact
    # NLL of 'ar' must beat any model blind to the other tokens: a product of per-position marginals q_l. Packing
    # starts sentences anywhere in a block, so the best q_l is point mass on BOS / EOS at the first / last position
    # and the interior unigram law elsewhere: on the scored tokens at best their plug-in cross-entropy (measured:
    # ppl 5.2 against the bound 9.5; an untrained model scores ~V = 320). A diffusion model's NELBO is an upper
    # bound with the noise of one draw per sequence (sd ~0.3 nats over these 16 sequences), and after 60 steps its
    # mean over draws still sits 0.2-0.6 nats above the context-free NLL (measured over 12-40 draw seeds): it must
    # come within a factor 2 of that bound, far below the untrained ~320.
    bound = context_free_ppl(corpus[1], loss == "ar")
    assert 1 < log_rows(tmp_path, "val_ppl")[-1] < (bound if loss == "ar" else 2 * bound)


def context_free_ppl(data_dir, ar):
    """exp of the per-token NLL, on the validation tokens train.evaluate scores (TINY: 2 batches of 8), of the best
    model that knows the position of BOS and EOS and the interior tokens' frequencies (none of their context)."""
    from data import eval_batches
    x0 = torch.cat([x for x, _ in eval_batches(data_dir, "val", 8, 2)])
    assert (x0[:, 0] == x0[0, 0]).all() and (x0[:, -1] == x0[0, -1]).all()         # every block is framed
    counts = torch.bincount(x0[:, 1:-1].reshape(-1)).double()
    p = counts[counts > 0] / counts.sum()
    interior = float(-(p * p.log()).sum())
    n = x0.shape[1] - 1 if ar else x0.shape[1]           # the AR baseline does not score position 0 (BOS)
    return math.exp(interior * (x0.shape[1] - 2) / n)


def test_resume_continues_bit_identically(corpus, tmp_path):
    common = ["--loss", "sddlm_v1", "--lr_schedule", "constant", "--eval_interval", "1000", "--ckpt_interval", "1000"]
    assert run(common + ["--max_iters", "16"], tmp_path / "straight", corpus) == 0
    assert run(common + ["--max_iters", "8"], tmp_path / "split", corpus) == 0
    assert run(common + ["--max_iters", "16", "--resume", "1"], tmp_path / "split", corpus) == 0
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=False)
    b = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=False)
    assert a["step"] == b["step"] == 16
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
        assert torch.equal(a["ema"][k], b["ema"][k]), k


def test_resume_mid_curriculum_continues_bit_identically(corpus, tmp_path):
    """Stopped at step 3 of a 5-step curriculum and resumed: the per-rank generator that draws the Gaussian latent
    (gen_local) must come back from the checkpoint, else steps 4-5 see other latents and the weights differ."""
    common = ["--loss", "sddlm", "--lr_schedule", "constant", "--eval_interval", "1000", "--ckpt_interval", "1000",
              "--curriculum_iters", "5", "--batch_size", "4", "--eval_iters", "1"]
    assert run(common + ["--max_iters", "6"], tmp_path / "straight", corpus) == 0
    assert run(common + ["--max_iters", "3"], tmp_path / "split", corpus) == 0
    assert run(common + ["--max_iters", "6", "--resume", "1"], tmp_path / "split", corpus) == 0
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=False)
    b = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=False)
    assert a["step"] == b["step"] == 6
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_curriculum_trains_on_soft_inputs_for_exactly_its_steps(corpus, tmp_path, monkeypatch):
    calls, inputs, real = [], [], curriculum.curriculum_sample

    def spy(x0, t, vocab_size, gamma_min, gamma_max, tau, generator=None):
        calls.append((gamma_min, gamma_max, tau))
        return real(x0, t, vocab_size, gamma_min, gamma_max, tau, generator)
    monkeypatch.setattr(curriculum, "curriculum_sample", spy)
    real_loss_terms = diffusion.loss_terms

    def record(model, cfg, x0, t, it, *args):
        inputs.append(it)
        return real_loss_terms(model, cfg, x0, t, it, *args)
    monkeypatch.setattr(diffusion, "loss_terms", record)
    monkeypatch.setattr(validation, "loss_terms", record)      # validation during training
    args = ["--loss", "sddlm", "--max_iters", "20", "--curriculum_iters", "10", "--gamma_min", "-3.5",
            "--gamma_max", "-1.0", "--eval_interval", "20", "--grad_accum", "2"]
    assert run(args, tmp_path, corpus) == 0
    # 10 curriculum steps x 2 micro-batches with Duo's range and tau = 1e-3; none after, none in evaluation
    assert calls == [(-3.5, -1.0, 1e-3)] * 20 and inputs[:40].count(9) == 2 and 10 in inputs
    assert all(v == v for v in log_rows(tmp_path, "loss"))


def test_the_curriculums_end_is_logged_where_the_loss_jumps(corpus, tmp_path, capsys):
    """Issue 36: the demo's training loss jumps from 2.11 to 2.90 when its curriculum ends, and nothing said why.
    Now the run says it at that step, on the console and as a log.jsonl event right after the step's loss, which
    figures/plot.py reads (and marks); the message's alpha_t range of the curriculum is checked against its
    definition, P(argmax of the Gaussian latent = x0) = (1 + (K - 1) alpha) / K, estimated from 20,000 latents
    (binomial SE of P <= 0.0036, so alpha within 4 SE K / (K - 1) = 0.015; the message rounds to 0.001)."""
    import re
    from figures import plot
    args = ["--loss", "sddlm", "--max_iters", "6", "--curriculum_iters", "3", "--log_interval", "1",
            "--eval_interval", "1000", "--gamma_min", "-3.5", "--gamma_max", "-1.0"]
    assert run(args, tmp_path, corpus) == 0
    records = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    events = [(i, r) for i, r in enumerate(records) if "event" in r and r["event"] != "end"]
    assert len(events) == 1 and events[0][1]["event"] == "curriculum_end" and events[0][1]["step"] == 3
    i, event = events[0]
    assert records[i - 1] == {**records[i - 1], "step": 3} and "loss" in records[i - 1] and records[i + 1]["step"] == 4
    assert f"step 3: {event['message']}" in capsys.readouterr().out
    lo, hi = map(float, re.search(r"alpha_t in \[([\d.]+), ([\d.]+)\] \(the Gaussian", event["message"]).groups())
    K = json.load(open(tmp_path / "config.json"))["model_config"]["vocab_size"]
    g = torch.Generator().manual_seed(0)
    for gamma, alpha in ((-1.0, lo), (-3.5, hi)):
        eps = torch.randn(20_000, K, generator=g, dtype=torch.float64)
        latent = math.sqrt(torch.sigmoid(torch.tensor(gamma)).item()) * eps
        latent[:, 0] += math.sqrt(torch.sigmoid(torch.tensor(-gamma)).item())       # x0 = coordinate 0
        P = float((latent.argmax(1) == 0).double().mean())
        assert abs((K * P - 1) / (K - 1) - alpha) < 0.015, (gamma, alpha, P)
    assert "from step 4" in event["message"] and "[0.001, 0.999] (loglinear)" in event["message"]
    assert plot.training_curves(str(tmp_path))["curriculum_end"] == 3


TRAINED_STEPS = 6


def trained_copies(loss, corpus, tmp_path, names):
    """TRAINED_STEPS real steps of `loss`, copied into the folders `names` to resume from: from the zero-initialised
    output and adaLN layers most parameters get no gradient at first, after a few steps every one has one."""
    assert run(["--loss", loss, "--max_iters", str(TRAINED_STEPS), "--eval_interval", "1000", "--lr_schedule",
                "constant"], tmp_path / "trained", corpus) == 0
    for name in names:
        shutil.copytree(tmp_path / "trained", tmp_path / name)


# Routes that must compute the same gradients resume those weights for 3-4 more steps at --lr 1e-30 (an AdamW step
# moves a weight by <= lr: they stay the trained ones to float32 rounding, so every step compares the same
# function on its batch) and --grad_clip 0 (clipping to norm 1 would hide a gradient of the wrong scale).
SAME_WEIGHTS = ["--resume", "1", "--lr", "1e-30", "--grad_clip", "0", "--eval_interval", "1000",
                "--lr_schedule", "constant"]


@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.parametrize("head", ["auto", "fused"])      # the CPU's plain logits, and the fused head CUDA takes
def test_two_process_torchrun_matches_one_process(head, corpus, tmp_path):
    """Each of 4 steps' gradients (the 2 ranks' all-reduced means of 4 sequences each) equals one process's on
    all 8, to float32 rounding: compared through AdamW's moments (conftest.assert_adam_moments_close)."""
    path, data_dir = corpus
    trained_copies("sddlm_v1", corpus, tmp_path, ("one", "two"))
    common = TINY + ["--dataset", path, "--data_dir", data_dir, "--loss", "sddlm_v1", "--device", "cpu", "--head",
                     head, "--max_iters", str(TRAINED_STEPS + 4)] + SAME_WEIGHTS
    a, b = train_in_one_and_two_processes(common, tmp_path)
    assert_adam_moments_close(a["optimizer"], b["optimizer"], n_terms=8 * 32)     # 8 sequences of 32 tokens


@pytest.mark.numerics
def test_grad_accumulation_matches_one_big_batch(corpus, tmp_path):
    """--grad_accum 4 sums four micro-batch gradients of loss / 4 on the same data, times and noise as one batch
    of 8: at every step the optimizer receives the one batch's gradient, to float32 rounding. Compared where the
    optimizer receives it, on trained weights that stay put (SAME_WEIGHTS). Not the weights after AdamW steps:
    Adam divides by sqrt(v) + 1e-8, which turns a rounding-level difference of an entry that is itself near
    rounding level into up to 2 lr, and normalises away a wrong scale."""
    trained_copies("duo", corpus, tmp_path, ("one", "accum"))
    grads = {}
    hook = register_optimizer_step_pre_hook(lambda opt, args, kwargs: grads[key].append(
        [p.grad.clone() for group in opt.param_groups for p in group["params"]]))
    common = ["--loss", "duo", "--max_iters", str(TRAINED_STEPS + 3)] + SAME_WEIGHTS
    try:
        for key, extra in (("one", []), ("accum", ["--grad_accum", "4"])):
            grads[key] = []
            assert run(common + extra, tmp_path / key, corpus) == 0
    finally:
        hook.remove()
    assert len(grads["one"]) == len(grads["accum"]) == 3
    # An entry sums the N = 8 x 32 tokens' terms, grouped 1 x 256 or 4 x 64 (each term a product through the 2
    # blocks, rounded a few times more): two float32 orders differ by <= reduction_tol(N) * sum|terms|, with
    # sum|terms| ~ the tensor's largest entry (tokens' terms agree in sign no more than its largest entry allows)
    tol = reduction_tol(8 * 32, torch.float32)
    for step, (a, b) in enumerate(zip(grads["one"], grads["accum"])):
        for i, (ga, gb) in enumerate(zip(a, b)):
            torch.testing.assert_close(gb, ga, rtol=0, atol=tol * ga.abs().max().item(), msg=f"step {step}, {i}")
        assert all(g.abs().max() > 0 for g in a)         # every parameter's gradient is compared


def test_every_rank_builds_rank_0s_weights_then_its_own_dropout():
    """DDP broadcasts rank 0's weights at wrap time, not its EMA: a rank > 0 that built its model from its own seed
    kept an EMA of other random weights (its evaluation and export would differ). Every rank builds the model and the
    EMA from --seed; only torch's RNG afterwards (dropout) is per rank."""
    cfg = train.TrainConfig(ema=0.999, seed=3)
    mcfg = ModelConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=16, cond_dim=8, dropout=0.1)
    runs, after = [], []
    for rank in (0, 1):
        runs.append(train.build_run(cfg, mcfg, Env(torch.device("cpu"), rank=rank, world_size=2)))
        after.append(torch.rand(4))
    for a, b in zip(runs[0].raw_model.state_dict().values(), runs[1].raw_model.state_dict().values()):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(runs[0].ema, runs[1].ema))
    assert all(torch.equal(a, p) for a, p in zip(runs[1].ema, runs[1].raw_model.parameters()))
    assert not torch.equal(*after)                     # the dropout masks differ between ranks


def cli(args, tmp_path, corpus):
    path, data_dir = corpus
    base = TINY + ["--dataset", path, "--data_dir", data_dir, "--out_dir", str(tmp_path / "out"), "--max_iters", "2"]
    return subprocess.run([sys.executable, "train.py", *base, *args], cwd=HERE, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("args, words", [
    (["--loss", "elbo"], "unknown --loss 'elbo'"),
    (["--preset", "huge"], "unknown --preset 'huge'"),
    (["--batch_size", "6", "--grad_accum", "4"], "not divisible"),
    (["--lr_schedule", "step"], "unknown --lr_schedule"),
    (["--vocab_size", "16"], "smaller than the tokenizer's vocabulary"),
    (["--resume", "1"], "no checkpoint"),
])
def test_bad_input_is_one_line_and_nonzero(args, words, tmp_path, corpus):
    r = cli(args, tmp_path, corpus)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_missing_and_empty_dataset_fail_cleanly(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for dataset in [str(tmp_path / "nope.txt"), str(empty)]:
        r = subprocess.run([sys.executable, "train.py", "--dataset", dataset, "--data_dir", str(tmp_path / "d"),
                            "--out_dir", str(tmp_path / "o")], cwd=HERE, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_run_is_never_overwritten_nor_resumed_incompatibly(corpus, tmp_path):
    r = cli(["--max_iters", "2"], tmp_path, corpus)
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "out"               # the last lines say where the checkpoint, the model folder, the samples went
    assert r.stdout.strip().splitlines()[-5:] == [
        f"training finished at step 2; log: {out / 'log.jsonl'}",
        f"  checkpoint:   {out / 'ckpt.pt'} (--resume 1 with a higher --max_iters continues it)",
        f"  model folder: {out / 'model'} (python sample.py --ckpt {out / 'model'}; pretrained.SDDLM.from_pretrained)",
        "  samples:      none (--num_samples 0)",
        f"  curves:       python figures/plot.py --runs {out} (PNGs in {out / 'plots'})"]
    assert (out / "model" / "model.safetensors").is_file()
    ckpt = tmp_path / "out" / "ckpt.pt"
    before = ckpt.read_bytes()
    r = cli([], tmp_path, corpus)                                     # same out_dir, no --resume
    assert r.returncode == 2 and "exists" in r.stderr
    r = cli(["--resume", "1", "--n_embd", "32"], tmp_path, corpus)    # different model
    assert r.returncode == 2 and "cannot resume" in r.stderr
    r = cli(["--resume", "1", "--loss", "duo"], tmp_path, corpus)     # different objective
    assert r.returncode == 2 and "cannot resume" in r.stderr
    assert ckpt.read_bytes() == before


@pytest.mark.slow
def test_sigint_saves_a_resumable_checkpoint(corpus, tmp_path):
    import signal
    import time
    path, data_dir = corpus
    args = TINY + ["--dataset", path, "--data_dir", data_dir, "--out_dir", str(tmp_path), "--max_iters", "100000",
                   "--eval_interval", "100000", "--ckpt_interval", "100000"]
    p = subprocess.Popen([sys.executable, "train.py", *args], cwd=HERE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not os.path.exists(tmp_path / "log.jsonl") and time.time() < deadline:
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-2000:]
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ck["step"] >= 5 and "continue with --resume 1" in out


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(corpus, tmp_path, monkeypatch):
    real = diffusion.loss_terms

    def poisoned(model, cfg, x0, t, it, *args):
        loss, extra = real(model, cfg, x0, t, it, *args)
        return (loss * float("nan") if it >= 7 else loss), extra

    monkeypatch.setattr(diffusion, "loss_terms", poisoned)
    with pytest.raises(FloatingPointError, match="last good checkpoint"):
        run(["--max_iters", "20", "--ckpt_interval", "4", "--log_interval", "3", "--eval_interval", "1000"],
            tmp_path, corpus)
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ck["step"] == 4 and all(torch.isfinite(v).all() for v in ck["model"].values())


def test_objectives_table_gives_each_loss_its_own_arguments():
    """diffusion.OBJECTIVES is the one place --loss picks a function: each entry must pass that loss the right
    tensors (V1 its negatives and eps, V2 eps, the NELBO alpha_t and its derivative)."""
    g = torch.Generator().manual_seed(0)
    V = 11
    logits = torch.randn(2, 5, V, generator=g, dtype=torch.float64)
    x0, xt, neg = (torch.randint(0, V, (2, 5), generator=g) for _ in range(3))
    alpha_t, dalpha_t = torch.tensor([[0.3], [0.7]], dtype=torch.float64), torch.full((2, 1), -0.999, dtype=torch.float64)
    c = diffusion.Corrupted(x0, xt, xt, neg, alpha_t, dalpha_t)
    expected = {"sddlm": losses.sddlm_loss(logits, x0, xt),
                "sddlm_v1": losses.sddlm_v1_loss(logits, x0, xt, neg=neg, eps=0.01),
                "sddlm_v2": losses.sddlm_v2_loss(logits, x0, xt, eps=0.01),
                "naive": losses.naive_denoising_loss(logits, x0),
                "duo": losses.usdm_nelbo_loss(logits, x0, xt, alpha_t, dalpha_t),
                "duo_lean": losses.usdm_nelbo_loss(logits, x0, xt, alpha_t, dalpha_t),   # the same, memory-lean
                "ar": losses.ar_loss(logits, x0)}
    assert list(diffusion.OBJECTIVES) == list(expected)
    assert {n for n, o in diffusion.OBJECTIVES.items() if o.full_logits} == {"duo"}
    assert {n for n, o in diffusion.OBJECTIVES.items() if o.causal} == {"ar"}
    for name, ref in expected.items():
        # the same function on the same float64 values (duo_lean: the same formula in row chunks, a 11-term sum
        # in another grouping: <= 2 * 43 U64 of the NELBO's term sizes, <= 10 here: 1e-13)
        torch.testing.assert_close(diffusion.OBJECTIVES[name](logits, c, 0.01), ref, rtol=0, atol=1e-12 * (name == "duo_lean"),
                                   msg=name)
    assert not torch.equal(expected["sddlm_v1"], losses.sddlm_v1_loss(logits, x0, xt, neg=neg))   # eps matters


# -----------------------------------------------------------------------------------------------
# one training step on a stand-in model: what the model is fed and what the loss is given

class SpyModel(torch.nn.Module):
    """Logits = one learnable row per vocabulary entry, the same at every position; records every (input, sigma)."""

    def __init__(self, vocab_size):
        super().__init__()
        self.config = ModelConfig(vocab_size=vocab_size, block_size=64, n_layer=1, n_head=1, n_embd=8)
        self.bias = torch.nn.Parameter(torch.zeros(vocab_size))
        self.calls = []

    def forward(self, x, sigma=None, return_head=False):
        self.calls.append((x.clone(), None if sigma is None else sigma.clone()))
        return self.bias.expand(*x.shape[:2], -1)


def spy_step(loss, vocab_size, batch, length, seed=0, **overrides):
    """One train.train_step of SpyModel on uniform x0 -> (model, x0, gen_shared's state before the step)."""
    cfg = train.TrainConfig(loss=loss, batch_size=batch, block_size=length, ema=0, warmup_iters=0, seed=seed,
                            **overrides)
    model = SpyModel(vocab_size)
    run = Run(model, model, torch.optim.SGD(model.parameters(), lr=0.1), None, None,
                    gen_shared=torch.Generator().manual_seed(seed), gen_local=torch.Generator().manual_seed(seed + 1))
    x0 = torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed + 2))
    state = run.gen_shared.get_state()
    train.train_step(run, cfg, Env(torch.device("cpu")), x0)
    return model, x0, state


@pytest.mark.numerics
def test_training_conditions_the_model_on_minus_log_alpha_t():
    """The network sees sigma = -log alpha_t (as Duo), alpha_t = 1 - (1 - 1e-3) t of the step's stratified times
    (during the curriculum: Duo's T(gamma_t)), the times replayed here from the shared generator's first draw,
    t_i = 1e-3 + (1 - 1e-3)(u_i + i)/n."""
    n = 16
    model, _, state = spy_step("sddlm", 11, n, 8, grad_accum=2)
    u = torch.rand(n, generator=torch.Generator().set_state(state)).double()
    t = 1e-3 + (1 - 1e-3) * (u + torch.arange(n)) / n
    sigma = torch.cat([s for _, s in model.calls]).double()
    assert len(model.calls) == 2
    # float32 t (3 roundings of values <= 1) and alpha = 1 - 0.999 t (2 more, absolute, near t = 1): alpha within
    # 5 u of itself absolutely, so -log alpha within 5 u / alpha, plus its own rounding u sigma
    u32, alpha = unit_roundoff(torch.float32), 1 - (1 - 1e-3) * t
    assert ((sigma + torch.log(alpha)).abs() <= 5 * u32 / alpha - u32 * torch.log(alpha)).all()
    # during the curriculum: alpha_t = T(gamma_t), gamma_t = gamma_min + t (gamma_max - gamma_min)
    model, _, state = spy_step("sddlm", 11, n, 8, curriculum_iters=1)
    u = torch.rand(n, generator=torch.Generator().set_state(state)).double()
    t = 1e-3 + (1 - 1e-3) * (u + torch.arange(n)) / n
    alpha_t = curriculum.gamma_to_alpha(-3.55 + t * (-1.85 + 3.55), 11)[0]
    (_, sigma), = model.calls
    # float32 gamma (<= (3 * 1.7 + 3.55 + 1.85) u = 10.5 u off) moves alpha by |dalpha/dgamma| (<= 0.4 at K = 11)
    # times that, alpha's float32 lookup adds 2 u: -log alpha within (0.4 * 10.5 + 2) u / alpha + u sigma
    assert ((sigma.double() + torch.log(alpha_t)).abs() <= (0.4 * 10.5 + 2) * u32 / alpha_t
            - u32 * torch.log(alpha_t)).all()


def test_sddlm_v1_negatives_are_uniform_and_independent_of_xt(monkeypatch):
    """Eq. (negative): x_hat ~ U(V), drawn apart from the corruption. Chi-square tests (z = 4.5, p ~ 3e-6) of the
    negatives the loss receives: their frequencies against U(V), and their joint tables with x_t and with the
    replacement tokens of Eq. (discrete_marginal) (diffusion.draw_noise's second draw) against independence."""
    from test_diffusion import assert_frequencies, chi2_quantile
    V, seen, noise = 5, [], []
    real_loss, real_noise = losses.sddlm_v1_loss, diffusion.draw_noise
    monkeypatch.setattr(losses, "sddlm_v1_loss", lambda out, x0, xt, neg, eps: (
        seen.append((xt, neg)) or real_loss(out, x0, xt, neg=neg, eps=eps)))
    monkeypatch.setattr(diffusion, "draw_noise", lambda *a: noise.append(real_noise(*a)) or noise[-1])
    spy_step("sddlm_v1", V, 64, 64)
    (xt, neg), = seen
    assert_frequencies(neg, torch.full((V,), 1 / V), "negatives")

    def independence(a, b):
        table = torch.bincount(a.reshape(-1) * V + b.reshape(-1), minlength=V * V).view(V, V).double()
        expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
        return ((table - expected) ** 2 / expected).sum().item()
    assert independence(neg, xt) < chi2_quantile((V - 1) ** 2), "negatives depend on x_t"
    assert independence(neg, noise[0][1]) < chi2_quantile((V - 1) ** 2), "negatives depend on the replacement tokens"


def test_sigterm_in_fine_tunings_first_evaluation_keeps_init(corpus, tmp_path, monkeypatch):
    """Issue 44: a stop signal during a fine-tuning run's step-0 evaluation (SOURCE's own numbers, the "init"
    record) trained a step before it stopped, so the resumed run never logged where it started. It stops at step 0
    (exit 130) and --resume 1 evaluates again: the log's step-0 record names SOURCE."""
    import signal
    import time
    args = TINY + ["--dataset", corpus[0], "--data_dir", corpus[1], "--max_iters", "2", "--eval_interval", "2"]
    assert train.main(args + ["--out_dir", str(tmp_path / "src")]) == 0
    real = train.evaluate

    def interrupted(run, *rest):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)                    # the evaluation would go on; the signal must end it
        raise AssertionError("not interrupted")
    monkeypatch.setattr(train, "evaluate", interrupted)
    ft = args + ["--out_dir", str(tmp_path / "ft")]
    assert train.main(ft + ["--init", str(tmp_path / "src" / "ckpt.pt")]) == 130
    monkeypatch.setattr(train, "evaluate", real)
    assert train.main(ft + ["--resume", "1"]) == 0
    log = [json.loads(line) for line in (tmp_path / "ft" / "log.jsonl").read_text().splitlines()]
    (first,) = [r for r in log if r.get("step") == 0 and "init" in r]
    assert first["init"].startswith(str(tmp_path / "src" / "ckpt.pt")) and "val_nelbo" in first


def test_paper_presets_are_the_appendix_table_and_duo_data():
    """Appendix Table (training_hyper) for both small-model settings; the LM1B data / curriculum of Duo's scripts."""
    for name in ("owt", "lm1b"):
        cfg = train.parse_config(["--preset", name])
        table = dict(lr=3e-4, lr_schedule="linear", warmup_iters=2500, beta1=0.9, beta2=0.999, weight_decay=0.0,
                     batch_size=512, max_iters=1_000_000, ema=0.9999)
        assert {k: getattr(cfg, k) for k in table} == table, name
        assert cfg.gen_interval > 0 and cfg.judge == "gpt2-large" and cfg.gen_steps == 1000 and cfg.keep_every > 0
    owt, lm1b = train.parse_config(["--preset", "owt"]), train.parse_config(["--preset", "lm1b", "--max_iters", "7"])
    assert (owt.dataset, owt.tokenizer, owt.block_size, owt.wrap) == ("openwebtext", "gpt2", 1024, True)
    assert (owt.gamma_min, owt.gamma_max) == (-3.55, -1.85)
    assert (lm1b.dataset, lm1b.tokenizer, lm1b.block_size, lm1b.wrap) == ("lm1b", "hf:bert-base-uncased", 128, False)
    assert (lm1b.gamma_min, lm1b.gamma_max) == (-3.5, -1.75)
    assert lm1b.max_iters == 7 and lm1b.curriculum_iters == 4       # explicit flags win; the curriculum keeps its half
    assert train.parse_config(["--preset", "lm1b"]).curriculum_iters == 500_000
    small = train.parse_config(["--preset", "small"])               # the OWT recipe without the judge
    assert small.gen_interval == 0 and {k: v for k, v in vars(small).items() if not k.startswith(("gen_", "judge",
                                        "keep", "preset"))} == {k: v for k, v in vars(owt).items()
                                                                if not k.startswith(("gen_", "judge", "keep", "preset"))}
    # Duo's parameter counts (spec section 4): DiT-small at K = 50258 and at K = 30522
    for name, params in (("owt", 169_627_218), ("lm1b", 139_292_986)):
        with torch.device("meta"):
            assert DiffusionTransformer(ModelConfig(**PRESETS[name])).num_params() == params


def test_a_presets_curriculum_is_for_diffusion_not_ar(tmp_path):
    """--preset owt --loss ar (the paper's AR baseline) trains without the preset's curriculum; the diffusion losses
    keep it; --curriculum_iters given with --loss ar is still refused before any work."""
    for preset in ("owt", "lm1b", "small"):
        assert train.parse_config(["--preset", preset, "--loss", "ar"]).curriculum_iters == 0
        assert train.parse_config(["--preset", preset, "--loss", "sddlm"]).curriculum_iters == 500_000
    for given in (["--curriculum_iters", "5"], ["--curriculum_iters=5"]):
        assert train.parse_config(["--loss", "ar"] + given).curriculum_iters == 5
        with pytest.raises(ConfigError, match="--curriculum_iters applies to diffusion losses"):
            train.main(TINY + ["--loss", "ar", "--dataset", str(tmp_path / "none.txt"),
                               "--out_dir", str(tmp_path / "o")] + given)


def test_a_presets_curriculum_keeps_its_share_and_on_resume(tmp_path):
    """The tiny preset's curriculum is half of its run (the paper's 500K of 1M): --max_iters moves it along unless
    --curriculum_iters is given; a run resumed with a higher --max_iters keeps the curriculum it started with."""
    tiny = train.parse_config([])
    assert train.TRAIN_PRESETS["tiny"]["curriculum_share"] == 0.5 and tiny.curriculum_share == 0.5
    assert (tiny.max_iters, tiny.curriculum_iters) == (900, 450)
    assert train.parse_config(["--max_iters", str(2 * tiny.max_iters)]).curriculum_iters == 2 * tiny.curriculum_iters
    assert train.parse_config(["--preset", "small", "--max_iters", "1000"]).curriculum_iters == 500
    assert train.parse_config(["--max_iters", "60", "--curriculum_iters", "7"]).curriculum_iters == 7
    assert TINY[-2:] == ["--curriculum_iters", "0"]
    write_corpus(tmp_path / "corpus.txt")
    base = TINY[:-2] + ["--dataset", str(tmp_path / "corpus.txt"), "--data_dir", str(tmp_path / "data"),
                        "--out_dir", str(tmp_path / "o"), "--eval_interval", "1000"]
    config = lambda: json.loads((tmp_path / "o" / "config.json").read_text())["train_config"]
    assert train.main(base + ["--max_iters", "4"]) == 0
    assert config()["curriculum_iters"] == 2
    assert train.main(base + ["--max_iters", "12", "--resume", "1"]) == 0   # the share of 12 steps would be 6
    assert config()["curriculum_iters"] == 2
    assert torch.load(tmp_path / "o" / "ckpt.pt", weights_only=False)["train_config"]["curriculum_iters"] == 2


@pytest.mark.parametrize("args, words", [(["--keep_every", "-1"], "--keep_every"), (["--eval_iters", "-2"], "--eval_iters"),
                                         (["--gen_interval", "5", "--gen_num_samples", "0"], "--gen_num_samples"),
                                         (["--sample_top_p", "0"], r"--sample_top_p must be in \(0, 1\]"),
                                         (["--sample_top_p", "1.5"], "--sample_top_p")])
def test_bad_experiment_flags_fail_before_any_work(args, words, tmp_path):
    with pytest.raises(ConfigError, match=words):
        train.main(TINY + ["--dataset", str(tmp_path / "none.txt"), "--out_dir", str(tmp_path / "o")] + args)


# -----------------------------------------------------------------------------
# the training step's fast paths against the plain ones: the Head route, bf16 autocast, torch.compile, seeds

@pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors, one thread
@pytest.mark.numerics
@pytest.mark.parametrize("name", ["sddlm_v1", "ar", "duo_lean"])
@pytest.mark.parametrize("autocast", [False, True])
def test_training_loss_on_the_head_equals_the_loss_on_the_logits(name, autocast):
    """--head fused gives the objectives a Head (kept or recomputed logits); the loss and every parameter
    gradient equal the same objective on the model's logits, --head plain (float64, or bf16 autocast within bf16
    rounding)."""
    model, tcfg = small_model(name, vocab_size=61, vocab_multiple=16)
    model = model if autocast else model.double()
    x0 = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(1))
    t = diffusion.sample_t(4, torch.Generator().manual_seed(2))
    out = {}
    for route in ("fused", "fused_recompute", "plain"):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            per_token, output = loss_terms(model, dataclasses.replace(tcfg, head=route), x0, t, 0,
                                           torch.Generator().manual_seed(3))
            loss = token_mean(per_token, None)
        assert isinstance(output, torch.Tensor) == (route == "plain")
        loss.backward()
        out[route] = (loss.detach().double(), grads(model).double())
    l_l, g_l = out["plain"]
    for route in ("fused", "fused_recompute"):
        l_h, g_h = out[route]
        if autocast:
            # the same bf16 logits; the loss is float32 sums of V = 64 terms: 2 (V + 13 + 80) U32 = 1.9e-5 relative
            assert abs(l_h - l_l) < 1e-4 * abs(l_l)
            # the logits' gradient and W's are rounded to bf16 at different points (per chunk / once): <= 4
            # roundings per entry, then bf16 matmuls backward through the blocks (inputs rounded again): in norm
            # <= ~5 BF16_U = 2e-2 (measured 3e-4)
            assert (g_h - g_l).norm() < 2e-2 * g_l.norm()
        else:
            # float64: the loss a sum of 64 token terms and V-term sums (< 200 roundings of values <= 10): 4e-13;
            # each gradient entry sums <= 64 token terms through 2 blocks (< 1000 roundings of the terms' sizes,
            # <= the loss's 10): <= 2 * 1000 * 10 * U64 = 2.2e-12, inside atol 1e-11
            torch.testing.assert_close(l_h, l_l, rtol=0, atol=1e-12)
            torch.testing.assert_close(g_h, g_l, rtol=0, atol=1e-11)


@pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors, one thread
@pytest.mark.numerics
def test_bf16_autocast_training_gradients_are_close_to_float32():
    model, tcfg = small_model("sddlm_v1")
    x0 = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(1))
    t = diffusion.sample_t(4, torch.Generator().manual_seed(2))
    out = {}
    for name, ctx in (("f32", torch.autocast("cpu", enabled=False)), ("bf16", torch.autocast("cpu", torch.bfloat16))):
        model.zero_grad()
        with ctx:
            loss = token_mean(loss_terms(model, tcfg, x0, t, 0, torch.Generator().manual_seed(3))[0], None)
        loss.backward()
        out[name] = (loss.item(), grads(model))
    (l32, g32), (l16, g16) = out["f32"], out["bf16"]
    # autocast rounds each matmul's inputs and output to bf16 (3 BF16_U per matmul, ~10 matmuls on a token's path):
    # a token's loss moves by ~sqrt(30) BF16_U = 2e-2 relative, independently across the 64 tokens: the mean
    # by ~3e-3 (measured 2.5e-3), 1e-2 = 4 of those; a gradient entry, a sum over tokens of such products, by
    # <= ~sqrt(2 x 30) BF16_U = 3e-2 in norm, 5e-2 (measured 5e-3); cosine > 0.998 is a relative error < 6.3e-2
    assert abs(l16 - l32) < 1e-2 * abs(l32)
    assert (g16 - g32).norm() < 5e-2 * g32.norm()
    assert F.cosine_similarity(g16, g32, dim=0) > 0.998


@pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors, one thread
@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.skipif(compiler_missing() is not None, reason=str(compiler_missing()))
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
@pytest.mark.parametrize("name,curriculum", [("sddlm_v1", 0), ("duo", 0), ("sddlm", 10)])
def test_compile_matches_eager_logits_and_training_gradients(name, curriculum):
    """The compiled model (the Head output, the full logits for 'duo', the curriculum's top-k input) gives the
    eager logits, losses and gradients; under bf16 autocast too."""
    model, tcfg = small_model(name, n_layer=1, vocab_size=61, vocab_multiple=16, curriculum_iters=curriculum,
                              head="fused")
    compiled = torch.compile(model)
    x0 = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(1))
    t = diffusion.sample_t(4, torch.Generator().manual_seed(2))
    for autocast in (False, True):
        out = {}
        for kind, m in (("eager", model), ("compiled", compiled)):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss, output = loss_terms(m, tcfg, x0, t, 0, torch.Generator().manual_seed(3))
            token_mean(loss, None).backward()
            logits = output if isinstance(output, torch.Tensor) else F.linear(output.hidden, output.weight,
                                                                              output.bias)[..., :61]
            out[kind] = (logits.detach().float(), loss.detach(), grads(model))
        # eager vs Inductor's fused float32 kernels (sums reordered: d = 32, V = 64, B L = 64 terms, < 200
        # roundings of values <= 10 in a loss or logit): <= 2 * 200 * 10 * U32 ~ 2.4e-4 worst case, 1e-5 holds the
        # measured; bf16 autocast: the same matmuls round inputs and outputs to bf16 in either order (a few
        # BF16_U = 1.2e-2 relative, on values <= 2 in size)
        tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["compiled"][0], out["eager"][0], **tol)
        torch.testing.assert_close(out["compiled"][1], out["eager"][1], **tol)
        gap = (out["compiled"][2] - out["eager"][2]).norm() / out["eager"][2].norm()
        assert gap < (2e-2 if autocast else 1e-5), gap


@pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors, one thread
@pytest.mark.parametrize("name", list(diffusion.OBJECTIVES))
def test_training_step_is_finite_and_identical_for_same_seeds(name):
    """train.train_step (the step train.py and bench/bench.py run): only its explicit generators may matter."""
    runs = []
    for global_seed in (100, 200):  # dropout is 0, so the global seed must change nothing
        model, tcfg = small_model(name, perturb=0.0)
        gen = torch.Generator().manual_seed(7)
        run = Run(model, model, *train.make_optimizer(model, tcfg, torch.device("cpu")), loader=None,
                        gen_shared=gen, gen_local=gen)
        torch.manual_seed(global_seed)
        step_losses = []
        for it in range(2):
            x0 = torch.randint(0, 61, (4, 16), generator=gen)
            step_losses.append(train.train_step(run, tcfg, Env(torch.device("cpu")), x0))
        ema = run.ema
        runs.append((torch.stack(step_losses), [p.detach().clone() for p in model.parameters()], ema))
    (losses_a, params_a, ema_a), (losses_b, params_b, ema_b) = runs
    assert torch.isfinite(losses_a).all()
    # bit for bit: the same process, shapes and thread count (one_thread), deterministic CPU kernels
    assert torch.equal(losses_a, losses_b)
    assert all(torch.equal(a, b) for a, b in zip(params_a + ema_a, params_b + ema_b))
    assert any(not torch.equal(a, e) for a, e in zip(params_a, ema_a))  # the step did move the weights
