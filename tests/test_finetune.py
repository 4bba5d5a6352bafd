"""train.py --init SOURCE (fine-tuning) on a tiny synthetic corpus (CPU, offline): the run starts from SOURCE's
weights (a train.py checkpoint, a model folder, a checkpoint in Duo's format), so at step 0 it evaluates to SOURCE's
own validation numbers; its model, tokenizer and length are SOURCE's; the optimizer, schedule, step count and EMA
start fresh; it records where it started; a resumed fine-tuning run continues bit for bit; the flags that
contradict SOURCE are refused in one line; distillation takes the same SOURCEs.

Exactness: every run here has one torch thread (--threads 1) and the same validation batches, draws and estimator
(train.py's evaluate), so the same weights give the same float32 operations in the same order: the validation
numbers are compared bit for bit, and any other weights (the live ones, another step's, random ones) give others."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import curriculum.gaussian as curriculum
import diffusion
import train
from conftest import assert_adam_moments_close, forward_tol, train_in_one_and_two_processes, write_corpus

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
# the run's recipe: the model, tokenizer and length come from SOURCE
RECIPE = ["--batch_size", "8", "--warmup_iters", "5", "--lr", "3e-3", "--num_samples", "0", "--eval_iters", "2",
          "--ema", "0.9", "--log_interval", "5", "--eval_interval", "1000", "--threads", "1"]
MODEL = ["--n_layer", "2", "--n_embd", "64", "--n_head", "2", "--block_size", "32", "--tokenizer", "sp_train:320",
         "--curriculum_iters", "0"]
SOURCE_STEPS = 10


def duo_name(name):
    """This repo's DiT parameter name -> Duo's (s-sahoo/duo models/dit.py DIT), written out here by hand."""
    for ours, theirs in [("wte.weight", "vocab_embed.embedding"), ("sigma_map.", "sigma_map.mlp."),
                         (".attn.qkv.", ".attn_qkv."), (".attn.proj.", ".attn_out."), (".mlp.fc.", ".mlp.0."),
                         (".mlp.out.", ".mlp.2."), (".adaLN.", ".adaLN_modulation."),
                         ("norm_f.", "output_layer.norm_final."), ("adaLN_f.", "output_layer.adaLN_modulation."),
                         ("lm_head.", "output_layer.linear.")]:
        name = name.replace(ours, theirs)
    return name


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """SOURCE: a train.py run (--loss sddlm, EMA 0.9) of SOURCE_STEPS steps that evaluates at its end; its
    checkpoint, its model folder (EMA weights), the same weights in Duo's released layout (a folder with
    config.json and a flat backbone.* state dict, as tests/test_duo_checkpoint.py builds one), and its live weights
    as a model folder."""
    from trained.export import export
    d = tmp_path_factory.mktemp("finetune")
    write_corpus(d / "corpus.txt")
    assert train.main(RECIPE + MODEL + ["--dataset", str(d / "corpus.txt"), "--data_dir", str(d / "data"),
                                        "--out_dir", str(d / "src"), "--loss", "sddlm", "--max_iters",
                                        str(SOURCE_STEPS), "--eval_interval", str(SOURCE_STEPS)]) == 0
    ckpt = torch.load(d / "src" / "ckpt.pt", weights_only=False)
    duo = d / "duo"
    duo.mkdir()
    torch.save({"backbone." + duo_name(k): v for k, v in ckpt["ema"].items()}, duo / "pytorch_model.bin")
    (duo / "config.json").write_text(json.dumps({"n_heads": 2, "model_length": 32}))
    export(d / "src" / "ckpt.pt", d / "live", weights="raw")
    return {"dir": d, "ckpt": str(d / "src" / "ckpt.pt"), "folder": str(d / "src" / "model"), "duo": str(duo),
            "live": str(d / "live"), "state": ckpt, "val": last_val(d / "src"),
            "args": RECIPE + ["--dataset", str(d / "corpus.txt"), "--data_dir", str(d / "data-ft")]}


def records(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def last_val(out_dir):
    return [r for r in records(out_dir) if "val_nelbo" in r][-1]


def step0(out_dir):
    (r,) = [r for r in records(out_dir) if r["step"] == 0]
    return r


def same_validation(a, b, keys=None):
    """The validation numbers two records share (val_*), or those of `keys`, bit for bit (see the module's note)."""
    keys = keys or sorted(k for k in a if k.startswith("val_") and k in b)
    assert keys and {k: a[k] for k in keys} == {k: b[k] for k in keys}


def finetune(source, out_dir, *args):
    return train.main(source["args"] + ["--out_dir", str(out_dir), *args])


def test_a_run_from_a_checkpoint_starts_at_its_validation(source, tmp_path):
    out = tmp_path / "ft"
    assert finetune(source, out, "--init", source["ckpt"], "--loss", "sddlm", "--max_iters", "1") == 0
    first = step0(out)
    same_validation(first, source["val"])          # SOURCE's EMA weights, SOURCE's own numbers at its last step
    assert first["init"] == f"{source['ckpt']} (objective sddlm, step {SOURCE_STEPS}, EMA weights)"
    # its model, tokenizer and length; a fresh schedule, step count, optimizer and EMA; no curriculum (not asked)
    ck, src = torch.load(out / "ckpt.pt", weights_only=False), source["state"]
    assert ck["model_config"] == src["model_config"]
    config = json.loads((out / "config.json").read_text())
    assert config["train_config"]["tokenizer"] == src["meta"]["tokenizer"]
    assert config["train_config"]["block_size"] == 32 and config["train_config"]["curriculum_iters"] == 0
    assert ck["meta"]["tokenizer_sha256"] == src["meta"]["tokenizer_sha256"]
    assert ck["step"] == ck["n_ema"] == 1 and all(int(s["step"]) == 1 for s in ck["optimizer"]["state"].values())
    cfg = train.parse_config(source["args"] + ["--init", source["ckpt"]])
    assert [r["lr"] for r in records(out) if "lr" in r] == [train.lr_at(0, cfg)]   # warm-up from its first step
    # what it started from: checkpoint, config.json, the model folder's config.json and card
    record = {"source": source["ckpt"], "objective": "sddlm", "step": SOURCE_STEPS, "weights": "EMA"}
    assert ck["finetuned_from"] == config["finetuned_from"] == record
    assert json.loads((out / "model" / "config.json").read_text())["finetuned_from"] == record
    card = (out / "model" / "README.md").read_text()
    assert f"| fine-tuned from | `{source['ckpt']}`: objective `sddlm`, step {SOURCE_STEPS}, its EMA weights |" in card


@pytest.mark.parametrize("kind", ["folder", "duo"])
def test_a_run_from_a_folder_or_duo_starts_at_its_numbers(kind, source, tmp_path):
    """The model folder SOURCE's run wrote (EMA weights) and the same weights in Duo's layout, read through
    trained.duo's map: both evaluate at step 0 to SOURCE's last validation. Duo's objective fine-tuned with
    another (sddlm_v1: its val_loss is V1's, the NELBO the same estimator); a Duo checkpoint of a vocabulary Duo
    never released (320) records no tokenizer, so the run is given it."""
    spec = source["folder"] if kind == "folder" else "duo:" + source["duo"]
    extra = [] if kind == "folder" else ["--tokenizer", source["state"]["meta"]["tokenizer"]]
    assert finetune(source, tmp_path / "ft", "--init", spec, "--loss", "sddlm_v1", "--max_iters", "1", *extra) == 0
    same_validation(step0(tmp_path / "ft"), source["val"], ["val_nelbo", "val_ppl", "val_tokens"])
    if kind == "folder":
        assert json.loads((tmp_path / "ft" / "model" / "config.json").read_text())["finetuned_from"]["source"] == \
            source["folder"]
    else:
        assert step0(tmp_path / "ft")["init"] == f"{spec} (objective duo, step None, live weights)"


@pytest.mark.numerics
def test_output_layer_padded_otherwise_keeps_the_sources_numbers(source, tmp_path):
    """--vocab_multiple 128 (Duo's checkpoints have none; the GPU's matrix products like multiples of 128): the
    output layer gains zero padding rows, never returned, so the model computes what SOURCE does. The 384-row
    product may order a logit's sums otherwise: within forward_tol of the whole float32 forward (the bound of
    test_two_process_torchrun_fine_tuning_matches_one_process), though only the head's 64-term sums can move."""
    assert finetune(source, tmp_path / "ft", "--init", source["ckpt"], "--vocab_multiple", "128", "--loss", "sddlm",
                    "--max_iters", "1") == 0
    first = step0(tmp_path / "ft")
    for key in ("val_nelbo", "val_loss"):
        assert math.isclose(first[key], source["val"][key], rel_tol=forward_tol(1400, 1.0)), key
    ck = torch.load(tmp_path / "ft" / "ckpt.pt", weights_only=False)
    assert ck["model_config"]["vocab_multiple"] == 128 and ck["model"]["lm_head.weight"].shape == (384, 64)


def test_init_ema_0_starts_from_the_live_weights(source, tmp_path):
    """--init_ema 0: the checkpoint's live weights, as its export with --weights raw holds them; not the EMA."""
    assert finetune(source, tmp_path / "a", "--init", source["ckpt"], "--init_ema", "0", "--max_iters", "1") == 0
    assert finetune(source, tmp_path / "b", "--init", source["live"], "--max_iters", "1") == 0
    a, b = step0(tmp_path / "a"), step0(tmp_path / "b")
    same_validation(a, b)
    assert a["val_nelbo"] != source["val"]["val_nelbo"] and a["init"].endswith("live weights)")


def test_the_curriculum_is_off_unless_asked_for():
    """Duo's curriculum is for training from random weights: a preset's share of it does not apply to --init."""
    assert train.parse_config([]).curriculum_iters == 450
    assert train.parse_config(["--init", "x"]).curriculum_iters == 0
    assert train.parse_config(["--preset", "small", "--init", "x", "--max_iters", "1000"]).curriculum_iters == 0
    assert train.parse_config(["--init", "x", "--curriculum_share", "0.5"]).curriculum_iters == 450
    assert train.parse_config(["--init", "x", "--curriculum_iters", "7"]).curriculum_iters == 7


def test_an_asked_curriculum_starts_from_the_initial_weights(source, tmp_path, monkeypatch):
    seen, calls = [], []
    real_terms, real_sample = diffusion.loss_terms, curriculum.curriculum_sample

    def terms(model, cfg, x0, t, it, *args):
        seen.append((it, {k: v.detach().clone() for k, v in model.state_dict().items()}))
        return real_terms(model, cfg, x0, t, it, *args)

    def sample(*args, **kwargs):
        calls.append(len(seen))
        return real_sample(*args, **kwargs)
    monkeypatch.setattr(diffusion, "loss_terms", terms)
    monkeypatch.setattr(curriculum, "curriculum_sample", sample)
    assert finetune(source, tmp_path / "ft", "--init", source["ckpt"], "--curriculum_iters", "2",
                    "--max_iters", "3") == 0
    assert [it for it, _ in seen] == [0, 1, 2] and calls == [1, 2]        # the curriculum at steps 0 and 1 only
    first = seen[0][1]
    assert first.keys() == source["state"]["ema"].keys()
    assert all(torch.equal(first[k], v) for k, v in source["state"]["ema"].items())


def test_a_resumed_fine_tuning_run_continues_bit_identically(source, tmp_path):
    """Started with --init, stopped, resumed with --resume 1 and without --init (its checkpoint records the model,
    tokenizer and length it took from SOURCE): the same weights and EMA as the run that did not stop."""
    init = ["--init", source["ckpt"], "--loss", "sddlm_v1"]
    assert finetune(source, tmp_path / "straight", *init, "--max_iters", "4") == 0
    assert finetune(source, tmp_path / "split", *init, "--max_iters", "2") == 0
    assert finetune(source, tmp_path / "split", "--loss", "sddlm_v1", "--max_iters", "4", "--resume", "1") == 0
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=False)
    b = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=False)
    assert a["step"] == b["step"] == 4 and b["finetuned_from"] == a["finetuned_from"]
    for key in ("model", "ema"):
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key


REFUSED = {   # flags over --init SOURCE -> the words of the one line that refuses them
    "model flag": (["--n_layer", "3"], "--n_layer 3 contradicts the model of --init"),
    "preset's model": (["--preset", "small"], "--preset small names another model (n_layer 12, n_head 12, n_embd 768"),
    "ar from a diffusion model": (["--loss", "ar"], "the architecture differs"),
    "another tokenizer": (["--tokenizer", "gpt2"], "is not the tokenizer --init"),
    "with --resume": (["--resume", "1"], "--init starts a new run"),
}


def test_flags_contradicting_the_source_are_refused_in_one_line(source, tmp_path):
    """Through the real script, all at once (each fails at start-up): exit code 2, one line, nothing written."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {name: subprocess.Popen([sys.executable, "train.py", *source["args"], "--init", source["ckpt"],
                                    "--out_dir", str(tmp_path / str(i)), *args], cwd=HERE, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for i, (name, (args, _)) in enumerate(REFUSED.items())}
    for i, (name, p) in enumerate(runs.items()):
        _, err = p.communicate(timeout=300)
        lines = err.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and REFUSED[name][1] in lines[0], (name, err)
        assert not (tmp_path / str(i)).exists(), name          # refused before anything is written


def test_distillation_takes_a_duo_checkpoint_as_its_init(source, tmp_path):
    """distill.py --init duo:PATH distils the same weights exactly as --init of the checkpoint they came from."""
    from distillation import distill
    args = ["--batch_size", "8", "--eval_iters", "2", "--num_samples", "0", "--log_interval", "2", "--round_iters",
            "3", "--T", "16", "--warmup_iters", "2", "--max_iters", "2", "--threads", "1",
            "--data_dir", str(source["dir"] / "data")]
    assert distill.main(["--init", source["ckpt"], "--out_dir", str(tmp_path / "a")] + args) == 0
    assert distill.main(["--init", "duo:" + source["duo"], "--out_dir", str(tmp_path / "b")] + args) == 0
    a = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=False)
    for key in ("model", "ema", "teacher"):
        assert a[key].keys() == b[key].keys() and all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key
    assert b["distilled_from"]["ckpt"] == "duo:" + source["duo"]


@pytest.mark.numerics
@pytest.mark.slow
def test_two_process_torchrun_fine_tuning_matches_one_process(source, tmp_path):
    """Every rank starts from SOURCE's weights: under torchrun a fine-tuning run computes one process's gradients,
    as a run from random weights does. Compared as tests/test_train.py's two-process test compares them: at --lr
    1e-30 (the weights stay SOURCE's to float32 rounding) through AdamW's moments (assert_adam_moments_close)."""
    assert finetune(source, tmp_path / "prep", "--init", source["ckpt"], "--max_iters", "1") == 0   # data prepared
    common = [*source["args"], "--init", source["ckpt"], "--loss", "sddlm_v1", "--max_iters", "4", "--lr", "1e-30",
              "--grad_clip", "0", "--lr_schedule", "constant", "--device", "cpu"]
    a, b = train_in_one_and_two_processes(common, tmp_path)
    assert_adam_moments_close(a["optimizer"], b["optimizer"], n_terms=8 * 32)     # 8 sequences of 32 tokens
    # step 0, SOURCE's numbers on 2 ranks, each running half the rows: each per-token NELBO term (>= 0) is a float32
    # forward of ~1400 roundings along its path (2 blocks of 64-, 256- and 32-term sums, the 64-wide head, the
    # 320-way log-sum-exp), so the two means agree to forward_tol(1400, 1) relative (conftest)
    first, second = step0(tmp_path / "one"), step0(tmp_path / "two")
    assert math.isclose(first["val_nelbo"], second["val_nelbo"], rel_tol=forward_tol(1400, 1.0)), (first, second)
