"""validation.py: evaluation during training does not depend on the world size: one checkpoint's validation NELBO,
objective and token count, and its Gen PPL and entropy, are the same for 1, 2 and 4 processes. Each rank's part is
computed here as that rank computes it (Env rank r of W); the all-reduce that follows in a run is their sum.
The slow test runs the real thing: torchrun with 2 gloo processes against one process, same checkpoint. Also:
evaluation runs the compiled model; sample quality logged during training equals the kept checkpoint's scored
afterwards; --eval_iters 0 validates the whole split; DDP splits the samples over the ranks and pools them; the
end-of-run samples use the run's autocast and nucleus."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import data
import metrics
import validation
import train
from data import get_tokenizer, load_meta
from metrics import entropies, gen_ppl, load_judge
from model import ModelConfig, build_model
from plumbing.distributed import Env
from sample import generate
from trained.checkpoint import load_checkpoint
from validation import GEN_GROUPS
from conftest import HERE, forward_tol, write_corpus
from test_train import TINY

# A rank evaluates its sequences in batches of another shape than one process does: float32 forwards summing in
# other orders, < 900 roundings along a logit's path (2 layers of d = 64, 4d, L = 32, V = 320) of values <= 10:
# within forward_tol(900, 10) = 1.1e-3 of the losses' sizes, pooled alike; a sequence scored twice or with another
# rank's draws moves the pooled NELBO by its Monte Carlo noise (~2%), a wrong count shows exactly.
RANKS_REL = forward_tol(900, 10)

ARGS = ["--n_layer", "2", "--n_embd", "64", "--n_head", "2", "--block_size", "32", "--batch_size", "8",
        "--warmup_iters", "2", "--lr", "3e-3", "--num_samples", "0", "--ema", "0.9", "--tokenizer", "sp_train:320",
        "--eval_interval", "1000", "--device", "cpu", "--threads", "1", "--gen_steps", "4", "--gen_num_samples", "6",
        "--curriculum_iters", "0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("world")
    write_corpus(d / "corpus.txt", 2000)
    args = ARGS + ["--dataset", str(d / "corpus.txt"), "--data_dir", str(d / "data")]
    assert train.main(args + ["--max_iters", "6", "--out_dir", str(d / "out"), "--eval_iters", "1"]) == 0
    return d, args, torch.load(d / "out" / "ckpt.pt", weights_only=False)


def rank_runs(args, ckpt, world_size):
    """The run of each rank r of world_size, holding the checkpoint's weights and EMA."""
    cfg = train.parse_config(args)
    mcfg = train.ModelConfig(**ckpt["model_config"])
    runs = []
    for r in range(world_size):
        env = Env(torch.device("cpu"), rank=r, world_size=world_size)      # ddp False: no collective here
        run = train.build_run(cfg, mcfg, env)
        run.raw_model.load_state_dict(ckpt["model"])
        for e, v in zip(run.ema, ckpt["ema"].values()):
            e.copy_(v)
        runs.append((run, env))
    return cfg, runs


@pytest.mark.numerics
@pytest.mark.parametrize("loss, eval_iters", [("sddlm_v1", 3), ("sddlm", 0), ("ar", 2)])
def test_validation_is_the_same_for_1_2_and_4_processes(trained, loss, eval_iters, one_thread):
    d, args, ckpt = trained
    if loss == "ar":      # the AR baseline's exact NLL: its own (causal) checkpoint
        assert train.main(args + ["--max_iters", "2", "--loss", "ar", "--out_dir", str(d / "ar"), "--eval_iters",
                                  "1"]) == 0
        ckpt = torch.load(d / "ar" / "ckpt.pt", weights_only=False)
    args = args + ["--loss", loss, "--eval_iters", str(eval_iters)]
    meta = load_meta(str(d / "data"))
    results = {}
    for world_size in (1, 2, 4):
        cfg, runs = rank_runs(args, ckpt, world_size)
        sums = sum(validation.evaluate(run, cfg, str(d / "data"), env) for run, env in runs)
        results[world_size] = validation.validation_record(sums, str(d / "data"))
    # the validation set: eval_iters global batches of --batch_size sequences (0: every sequence), at any size
    sequences = min(eval_iters * 8, meta["val_sequences"]) if eval_iters else meta["val_sequences"]
    assert eval_iters or meta["val_sequences"] % 8, "the whole split should end in a partial global batch"
    for world_size in (2, 4):
        scored = 31 if loss == "ar" else 32                   # the AR baseline does not score position 0 (BOS)
        assert results[world_size]["val_tokens"] == results[1]["val_tokens"] == sequences * scored
        for key in ("val_nelbo", "val_ppl", "val_loss"):
            assert results[world_size][key] == pytest.approx(results[1][key], rel=RANKS_REL), key
        # a standard error from the rounds' spread: each round's value moves by <= RANKS_REL of its size, so the SE
        # by <= 2 RANKS_REL x that size (the spread's norm, triangle inequality): absolute, on the estimate's scale
        for key, scale in (("val_nelbo_se", "val_nelbo"), ("val_loss_se", "val_loss"), ("val_ppl_se", "val_ppl")):
            size = abs(results[1][scale]) * (results[1]["val_nelbo"] if key == "val_ppl_se" else 1)
            assert results[world_size][key] == pytest.approx(results[1][key], abs=2 * RANKS_REL * size), key
    assert 1 < results[1]["val_ppl"] < 320                    # a trained model, better than uniform over K = 320


@pytest.mark.numerics
def test_gen_ppl_and_entropy_are_equal_for_1_2_and_4_processes(trained, one_thread):
    d, args, ckpt = trained
    tok = get_tokenizer(load_meta(str(d / "data"))["tokenizer"])
    table = torch.randn(tok.vocab_size + 1, 16, generator=torch.Generator().manual_seed(0))
    judge = metrics.Judge("bigram", lambda ids, attn: table[ids] @ table[:tok.vocab_size].T, tok.encode, tok.eos_id,
                           context=64)                     # scores a text by its tokens: other samples, other score
    results, samples = {}, {}
    for world_size in (1, 2, 4):
        cfg, runs = rank_runs(args + ["--loss", "sddlm_v1"], ckpt, world_size)
        drawn = []
        real = validation.score_samples

        def spy(ids, *a, **k):
            drawn.extend(map(tuple, ids))
            return real(ids, *a, **k)
        validation.score_samples = spy
        try:
            sums = sum(validation.sample_quality(run, cfg, env, judge, tok) for run, env in runs)
        finally:
            validation.score_samples = real
        results[world_size], samples[world_size] = validation.gen_metrics(sums, cfg, judge), sorted(drawn)
    assert len(samples[1]) == 6 and len(set(samples[1])) == 6
    for world_size in (2, 4):
        assert samples[world_size] == samples[1]
        assert results[world_size]["gen_samples"] == 6
        # the same samples (checked above) scored by the bigram judge in other groups: 16-term products and a
        # 320-term log-sum-exp of logits <= 20 in float32; the entropy from the same ids is exact float64 counting
        assert results[world_size]["gen_ppl"] == pytest.approx(results[1]["gen_ppl"], rel=forward_tol(16 + 333, 20))
        assert results[world_size]["gen_entropy"] == pytest.approx(results[1]["gen_entropy"], rel=1e-12)
        for key in ("gen_ppl_se", "gen_nll_se", "gen_entropy_se", "gen_ppl_lo", "gen_ppl_hi"):   # pooled moments
            assert results[world_size][key] == pytest.approx(results[1][key], rel=1e-9), key


def test_sample_groups_cover_every_sample_once_at_any_size():
    for n in (1, 6, 8, 9, 64, 100):
        for world_size in (1, 2, 3, 8, 16):
            groups = [g for r in range(world_size) for g in validation.sample_groups(n, r, world_size)]
            assert sorted(groups) == validation.sample_groups(n, 0, 1) and sum(s for _, s in groups) == n


def evaluate_on_rank(rank, world_size, init_file, args, ckpt_path, data_dir, out_file):
    """One rank of a gloo process group (torch.multiprocessing.spawn): train.py's evaluation of the checkpoint,
    reduced over the ranks as in a run (plumbing.signals.reduced_unless_stopped); rank 0 writes the record."""
    import torch.distributed as dist
    from plumbing.signals import reduced_unless_stopped
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        ckpt = torch.load(ckpt_path, weights_only=False)
        cfg, runs = rank_runs(args, ckpt, world_size)
        run, env = runs[rank]
        env.ddp = True
        sums = reduced_unless_stopped({"signal": None, "raise": False}, env,
                                      lambda: validation.evaluate(run, cfg, data_dir, env))
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(validation.validation_record(sums, data_dir), f)
    finally:
        dist.destroy_process_group()


@pytest.mark.numerics
@pytest.mark.slow
def test_one_and_two_gloo_processes_give_the_same_validation(trained, tmp_path):
    import torch.multiprocessing as mp
    d, args, ckpt = trained
    args = args + ["--loss", "sddlm_v1", "--eval_iters", "0"]
    cfg, runs = rank_runs(args, ckpt, 1)
    one = validation.validation_record(validation.evaluate(*runs[0][:1], cfg, str(d / "data"), runs[0][1]),
                                       str(d / "data"))
    mp.spawn(evaluate_on_rank, args=(2, str(tmp_path / "init"), args, str(d / "out" / "ckpt.pt"), str(d / "data"),
                                     str(tmp_path / "two.json")), nprocs=2)
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["val_tokens"] == one["val_tokens"] == load_meta(str(d / "data"))["val_sequences"] * 32
    for key in ("val_nelbo", "val_ppl", "val_loss"):
        assert two[key] == pytest.approx(one[key], rel=RANKS_REL), key


@pytest.mark.numerics
def test_validation_is_eval_ppls_estimator_on_the_same_draws(trained, one_thread, monkeypatch,
                                                                                   capsys):
    """Issue 36: training printed PPL 181.7 for the demo and eval_ppl.py 150.0, 184.7, 194.2 with its seeds, with no
    error bars: other draws of a noisy estimator. Now training's validation NELBO is eval_ppl.py's estimator at its
    defaults on the same draws: the run's log and eval_ppl.py's first two rounds (--rel_se 0) on the same weights
    and sequences give the same NELBO and standard error (within RANKS_REL, and the SE within 2 RANKS_REL of the
    NELBO: see test_validation_is_the_same_for_1_2_and_4_processes); an
    evaluation at other weights sees the same times and corruptions (curves compare like with like); and eval_ppl.py
    with another seed agrees with the log within 4 standard errors of the difference of two independent estimates."""
    import eval_ppl as ep
    d, args, ckpt = trained
    record = [json.loads(line) for line in open(d / "out" / "log.jsonl") if "val_nelbo" in line][-1]
    seen, real = [], metrics.nelbo_per_token

    def spy(model, x0, t, vocab_size, autocast, generator=None, draws=None):
        seen.append((t.clone(), draws[0].clone(), draws[1].clone()))
        return real(model, x0, t, vocab_size, autocast, generator, draws)
    monkeypatch.setattr(metrics, "nelbo_per_token", spy)

    def eval_ppl_cli(*extra):      # the run validated eval_iters 1 x batch 8: the split's first 8 sequences
        out = d / f"nelbo{len(seen)}.json"
        assert ep.main(["--ckpt", str(d / "out" / "ckpt.pt"), "--batch_size", "8", "--max_batches", "1",
                        "--out", str(out), *extra]) == 0
        return json.loads(out.read_text())["results"][0]
    same = eval_ppl_cli("--rel_se", "0")
    by_eval_ppl, seen[:] = list(seen), []
    assert record["val_nelbo"] == pytest.approx(same["nll"], rel=RANKS_REL)
    assert record["val_nelbo_se"] == pytest.approx(same["nll_se"], abs=2 * RANKS_REL * same["nll"])
    assert same["nll_se"] > 4 * RANKS_REL * same["nll"]           # that tolerance is under half of the SE
    # the interval exp(nll -+ 1.96 SE): relative errors of nll and 1.96 SE, times the nll, add
    assert (record["val_ppl_lo"], record["val_ppl_hi"]) == pytest.approx(
        (same["ppl_lo"], same["ppl_hi"]), rel=5 * RANKS_REL * same["nll"])
    cfg, runs = rank_runs(args + ["--loss", "sddlm", "--eval_iters", "1"], ckpt, 1)
    run, env = runs[0]
    validation.evaluate(run, cfg, str(d / "data"), env)
    first, seen[:] = list(seen), []
    with torch.no_grad():
        for e in run.ema:                                   # other weights: a later evaluation of the run
            e.mul_(0.9)
    validation.evaluate(run, cfg, str(d / "data"), env)
    for draws in (seen, by_eval_ppl):
        assert len(draws) == len(first) == 2 * metrics.VAL_DRAWS
        assert all(all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(first, draws))
    times, real_terms = [], validation.loss_terms                  # the objective's own draws: t ~ U[1e-3, 1]

    def spy_terms(model, cfg, x0, t, *rest):
        times.extend(t.tolist())
        return real_terms(model, cfg, x0, t, *rest)
    monkeypatch.setattr(validation, "loss_terms", spy_terms)
    cfg, runs = rank_runs(args + ["--loss", "sddlm", "--eval_iters", "0"], ckpt, 1)
    validation.evaluate(*runs[0][:1], cfg, str(d / "data"), runs[0][1])
    n = len(times)          # the mean of n uniform times: 0.5005 within 4 SE, SE = sqrt(1 / 12 / n)
    assert n == 2 * load_meta(str(d / "data"))["val_sequences"] and min(times) >= 1e-3
    assert abs(sum(times) / n - 0.5005) < 4 * math.sqrt(0.999 ** 2 / 12 / n)
    other = eval_ppl_cli("--rel_se", "0", "--seed", "1")
    assert other["nll"] != same["nll"]
    assert abs(other["nll"] - record["val_nelbo"]) < 4 * math.hypot(other["nll_se"], record["val_nelbo_se"])


def test_evaluation_runs_the_compiled_model(prepared, one_thread):
    """Evaluation calls run.eval_model (train.py sets it to the compiled raw model when the run compiles) with the EMA
    weights swapped in, and scores what the plain model scores."""
    cfg = train.TrainConfig(batch_size=8, block_size=16, eval_iters=2, ema=0.5)
    meta = data.load_meta(prepared)
    mcfg = ModelConfig(vocab_size=meta["vocab_size"], block_size=16, n_layer=1, n_head=2, n_embd=32)
    env = Env(torch.device("cpu"))
    run = train.build_run(cfg, mcfg, env)
    for e in run.ema:
        e.add_(0.01)
    eager = validation.evaluate(run, cfg, prepared, env)
    calls = []

    class Spy(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model, self.config = model, model.config

        def forward(self, *args, **kwargs):
            calls.append(self.model.training)
            return self.model(*args, **kwargs)
    run.eval_model = Spy(run.raw_model)
    assert torch.equal(validation.evaluate(run, cfg, prepared, env), eager)
    assert calls and not any(calls)                                   # eval mode, every call


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    """A tiny corpus, an AR judge trained on it, and one sddlm run with sample quality every 4 steps."""
    d = tmp_path_factory.mktemp("exp")
    write_corpus(d / "corpus.txt")
    base = TINY + ["--dataset", str(d / "corpus.txt"), "--data_dir", str(d / "data")]
    assert train.main(base + ["--loss", "ar", "--max_iters", "30", "--out_dir", str(d / "ar")]) == 0
    gen = ["--gen_interval", "4", "--gen_num_samples", "6", "--gen_steps", "5", "--gen_seed", "3",
           "--judge", str(d / "ar" / "ckpt.pt"), "--keep_every", "4", "--eval_iters", "0", "--eval_interval", "4"]
    assert train.main(base + ["--loss", "sddlm", "--max_iters", "8", "--out_dir", str(d / "run")] + gen) == 0
    return d, base, gen


def rows(out_dir, key):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [r for r in map(json.loads, f) if key in r]


GROUPS = [(3 * GEN_GROUPS + k, 1) for k in range(6)]   # --gen_seed 3, 6 samples: groups of one (seed, count)


def expected_quality(ckpt_path, judge_path, seeds_and_counts, steps):
    """Gen PPL and entropy of a kept checkpoint computed outside the run: load its EMA weights, draw each
    (seed, count) share with sample.generate, pool, score with metrics.gen_ppl / entropies."""
    model, ckpt = load_checkpoint(ckpt_path)
    judge = load_judge(judge_path, "cpu")
    ids = []
    for seed, count in seeds_and_counts:
        g = torch.Generator().manual_seed(seed)
        ids += generate(model, count, model.config.block_size, model.config.vocab_size, steps, generator=g,
                        show_progress=False).tolist()
    entropy = sum(entropies(ids)) / len(ids)
    return gen_ppl(ids, judge, max_length=model.config.block_size, show_progress=False), entropy, ckpt


# The same samples (their token ids must be equal) scored by the same AR judge in the run and here, in batches of
# other shapes or threads: float32 forwards whose sums differ in order, < 900 roundings along a logit's path (2
# layers of d = 64, 4d, L = 32, V = 320) of values <= 10: each NLL within 2 * 900 * 10 * 2^-24 = 1.1e-3, and so
# log Gen PPL (the relative error of Gen PPL); other samples move it by far more.
JUDGE_REL = 1.1e-3


@pytest.mark.numerics
@pytest.mark.slow
def test_logged_sample_quality_equals_the_checkpoints_afterwards(judged):
    d, _, _ = judged
    logged = rows(d / "run", "gen_ppl")
    assert [r["step"] for r in logged] == [4, 8]
    for r in logged:
        assert r["gen_judge"].startswith("ar:") and str(d / "ar" / "ckpt.pt") in r["gen_judge"]
        assert (r["gen_samples"], r["gen_steps"], r["gen_seed"]) == (6, 5, 3)
        ppl, ent, ckpt = expected_quality(d / "run" / f"ckpt_{r['step']}.pt", str(d / "ar" / "ckpt.pt"), GROUPS, 5)
        assert ckpt["step"] == r["step"] and "optimizer" not in ckpt
        assert r["gen_ppl"] == pytest.approx(ppl["gen_ppl"], rel=JUDGE_REL)
        assert r["gen_entropy"] == pytest.approx(ent, rel=1e-9)      # from the same token ids: float64 counts
    assert logged[0]["gen_ppl"] != logged[1]["gen_ppl"]       # the curve moves with the model
    final = torch.load(d / "run" / "ckpt.pt", weights_only=False)
    kept = torch.load(d / "run" / "ckpt_8.pt", weights_only=False)
    for k in final["ema"]:
        assert torch.equal(final["ema"][k], kept["ema"][k]), k


@pytest.mark.slow
def test_eval_iters_zero_validates_the_whole_split(judged):
    d, _, _ = judged
    meta = load_meta(str(d / "data"))
    val = rows(d / "run", "val_tokens")
    assert val and all(r["val_tokens"] == meta["val_sequences"] * meta["block_size"] for r in val)


@pytest.mark.numerics
@pytest.mark.slow
def test_ddp_splits_the_samples_over_ranks_and_pools_them(judged, tmp_path):
    """Two ranks: rank r draws the groups r, r + 2, r + 4 of validation.sample_groups (6 samples: 6 groups of one);
    the logged Gen PPL is the pooled score of both shares, the samples of one process, and validation of the whole
    split still counts every token once."""
    d, base, gen = judged
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *base,
           "--loss", "sddlm", "--max_iters", "4", "--out_dir", str(tmp_path / "two"), "--device", "cpu", *gen]
    p = subprocess.run(cmd, cwd=HERE, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r, = rows(tmp_path / "two", "gen_ppl")
    ppl, ent, _ = expected_quality(tmp_path / "two" / "ckpt_4.pt", str(d / "ar" / "ckpt.pt"), GROUPS, 5)
    assert r["gen_samples"] == 6
    assert r["gen_ppl"] == pytest.approx(ppl["gen_ppl"], rel=JUDGE_REL)
    assert r["gen_entropy"] == pytest.approx(ent, rel=1e-9)          # the same ids: float64 counts
    meta = load_meta(str(d / "data"))
    assert rows(tmp_path / "two", "val_tokens")[-1]["val_tokens"] == meta["val_sequences"] * meta["block_size"]


@pytest.mark.usefixtures("one_thread")
def test_end_of_run_samples_use_the_runs_autocast_and_nucleus(monkeypatch):
    """validation.print_samples (the samples at the end of train.py's run) hands the run's --dtype (bf16 autocast on
    CUDA by default) and --sample_top_p to the sampler, the diffusion one and the AR one; the tiny preset (the CPU
    demo) prints its samples with top-p 0.8, the paper's presets with the full distribution."""
    import contextlib
    import types
    import validation
    import train
    seen = {}

    def fake(sampler):
        def generate(*args, **kwargs):
            seen.update(kwargs, sampler=sampler)
            return torch.zeros(1, 4, dtype=torch.long)
        return generate
    monkeypatch.setattr(validation, "generate", fake("diffusion"))
    monkeypatch.setattr(validation, "generate_ar", fake("ar"))
    monkeypatch.setattr(validation, "get_tokenizer", lambda spec: types.SimpleNamespace(decode=lambda ids: "", bos_id=0))
    monkeypatch.setattr(validation, "ema_weights", lambda run: contextlib.nullcontext(run.raw_model))
    for loss in ("sddlm", "ar"):
        seen.clear()
        model = build_model(ModelConfig(vocab_size=40, block_size=4, n_layer=1, n_head=2, n_embd=16, cond_dim=8,
                                        causal=loss == "ar"))
        cfg = train.TrainConfig(loss=loss, dtype="bfloat16", num_samples=1, block_size=4, sample_steps=2,
                                sample_top_p=0.7)
        validation.print_samples(types.SimpleNamespace(raw_model=model), cfg, {"tokenizer": "x"},
                               types.SimpleNamespace(device=torch.device("cpu")))
        assert seen["dtype"] == torch.bfloat16 and seen["top_p"] == 0.7
        assert seen["sampler"] == ("ar" if loss == "ar" else "diffusion")      # the (causal) model picks the sampler
    assert train.parse_config([]).sample_top_p == 0.8
    assert train.parse_config(["--preset", "small"]).sample_top_p == 1.0
