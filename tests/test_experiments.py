"""The paper's experiments as train.py runs: the owt / lm1b presets are the Appendix table, sample quality logged
during training equals an evaluation of the kept checkpoint from outside the run, kept checkpoints and
full-split validation, and the DDP split of the samples pools exactly the draws of each rank."""
import json
import os
import subprocess
import sys

import pytest
import torch

import train
from data import load_meta
from metrics import entropy, gen_ppl, load_judge
from validation import GEN_GROUPS
from model import PRESETS, DiffusionTransformer, ModelConfig
from trained.checkpoint import load_checkpoint
from plumbing.cli import ConfigError
from sample import generate
from test_train import TINY, _corpus

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root


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
    _corpus(tmp_path / "corpus.txt")
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


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    """A tiny corpus, an AR judge trained on it, and one sddlm run with sample quality every 4 steps."""
    d = tmp_path_factory.mktemp("exp")
    _corpus(d / "corpus.txt")
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
    (seed, count) share with sample.generate, pool, score with metrics.gen_ppl / entropy."""
    model, ckpt = load_checkpoint(ckpt_path)
    judge = load_judge(judge_path, "cpu")
    ids = []
    for seed, count in seeds_and_counts:
        g = torch.Generator().manual_seed(seed)
        ids += generate(model, count, model.config.block_size, model.config.vocab_size, steps, generator=g,
                        show_progress=False).tolist()
    return gen_ppl(ids, judge, max_length=model.config.block_size, show_progress=False), entropy(ids), ckpt


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
