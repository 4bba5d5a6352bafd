"""Model folders (hub/pretrained.py; written by trained/export.py, read by trained/folder.py): the folder holds exactly the checkpoint's EMA (or live) tensors, gives the
checkpoint's logits and samples, carries its own tokenizer and refuses another one, samples with the schedule
and final step its config names, scores text with the NELBO (exact NLL for the AR baseline, checked by brute
force), uploads offline to a stand-in hub and loads back from it; every script's --ckpt reads it."""
import hashlib
import json
import math
import os
import socket
import subprocess
import sys
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import unit_roundoff
from conftest import ENV, one_error, unshare_available
import diffusion
from hub import pretrained
from hub.pretrained import SDDLM
import losses
from model import ModelConfig, build_model
from plumbing import cli
import sample
from test_losses import usdm_sizes
from trained.checkpoint import load_checkpoint, load_model
from trained.export import export
from trained.folder import is_model_folder

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
TEXT = "the cat sees the dog . the bird likes the fish ."


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    from data import train_sentencepiece
    d = tmp_path_factory.mktemp("tok")
    return train_sentencepiece([TEXT * 3, "a tree finds a house .\n" * 20], str(d / "tokenizer"), 300)


def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def fake_checkpoint(path, tok_path, loss="sddlm", schedule="loglinear", causal=False):
    """A checkpoint as train.py saves it (weights, a different EMA, optimizer and RNG state), of a random model
    whose every weight is non-zero (the DiT's head is zero-initialised)."""
    from data import get_tokenizer
    tok = get_tokenizer("sp:" + tok_path)
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32, cond_dim=16,
                     time_cond=not causal, causal=causal)
    model = build_model(mc)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ema = {k: v.detach() + 0.05 * torch.randn_like(v) for k, v in model.named_parameters()}
    meta = dict(tokenizer="sp:" + tok_path, tokenizer_sha256=tok.fingerprint, vocab_size=tok.vocab_size,
                bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)
    torch.save({"model": model.state_dict(), "ema": ema, "optimizer": {"state": {}, "param_groups": []},
                "model_config": asdict(mc), "train_config": {"loss": loss, "noise_schedule": schedule},
                "meta": meta, "step": 7, "n_ema": 7, "rng": {"torch": torch.get_rng_state()}}, path)
    return str(path)


def logits_of(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
    with torch.no_grad():
        return model(x) if model.config.causal else model(x, torch.full((2,), 0.7))


def test_folder_holds_the_ema_tensors_and_gives_their_logits(tmp_path, tok_path):
    from safetensors.torch import load_file
    ckpt_path = fake_checkpoint(tmp_path / "ckpt.pt", tok_path, loss="duo", schedule="cosine")
    folder, used = export(ckpt_path, tmp_path / "model")
    saved = torch.load(ckpt_path, weights_only=True)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    assert used == "ema" and tensors.keys() == saved["ema"].keys()
    assert all(torch.equal(tensors[k], saved["ema"][k]) for k in tensors)
    model_f, info = load_model(folder, "cpu")
    model_c, _ = load_checkpoint(ckpt_path, use_ema=True)
    assert torch.equal(logits_of(model_f), logits_of(model_c))
    config = json.load(open(os.path.join(folder, "config.json")))
    assert (config["objective"], config["noise_schedule"], config["final_step"], config["weights"]) == \
        ("duo", "cosine", "greedy", "ema")     # Duo's greedy tail for a NELBO model (diffusion.default_final_step)
    assert config["tokenizer"]["sha256"] == sha256(tok_path) == sha256(os.path.join(folder, "tokenizer.model"))
    assert info["step"] == 7 and info["train_config"]["loss"] == "duo" and info["ema"] is not None
    # the live weights on request, and the folder is what a reader of weights needs only (no optimizer, no RNG)
    raw, used = export(ckpt_path, tmp_path / "raw", weights="raw")
    assert used == "raw" and torch.equal(logits_of(load_model(raw, "cpu", use_ema=False)[0]),
                                         logits_of(load_checkpoint(ckpt_path, use_ema=False)[0]))
    assert not torch.equal(logits_of(load_model(raw, "cpu")[0]), logits_of(model_c))
    with pytest.raises(cli.UsageError, match="holds EMA weights only"):
        load_model(folder, "cpu", use_ema=False)


def test_folder_carries_its_own_tokenizer_and_refuses_another(tmp_path, tok_path):
    import shutil
    own = tmp_path / "own" / "tokenizer.model"
    own.parent.mkdir()
    shutil.copyfile(tok_path, own)
    ckpt_path = fake_checkpoint(tmp_path / "ckpt.pt", str(own))
    folder, _ = export(ckpt_path, tmp_path / "model")
    os.remove(own)                         # the training data's tokenizer is gone: the folder has its own
    lm = SDDLM.from_pretrained(folder)
    assert lm.tokenizer.spec == "sp:" + os.path.join(os.path.abspath(folder), "tokenizer.model")
    assert lm.tokenizer.decode(lm.tokenizer.encode(TEXT)) == TEXT
    with open(os.path.join(folder, "tokenizer.model"), "ab") as f:
        f.write(b"\0")
    with pytest.raises(cli.UsageError, match="is not the tokenizer recorded"):
        load_model(folder, "cpu")
    shutil.copyfile(os.path.join(folder, "tokenizer.model"), own)   # another file at the checkpoint's tokenizer path
    with pytest.raises(cli.UsageError, match="is not the tokenizer this model was trained with"):
        export(ckpt_path, tmp_path / "again")
    assert not os.path.exists(tmp_path / "again")


def test_generate_uses_the_schedule_and_final_step_of_the_config(tmp_path, tok_path):
    ckpt_path = fake_checkpoint(tmp_path / "ckpt.pt", tok_path, loss="duo", schedule="cosine")
    folder, _ = export(ckpt_path, tmp_path / "model")
    texts = SDDLM.from_pretrained(folder).generate(3, steps=4, seq_len=16, seed=5)
    model, _ = load_checkpoint(ckpt_path)
    from data import get_tokenizer
    tok = get_tokenizer("sp:" + tok_path)

    def by_hand(schedule, final_step):
        ids = sample.generate(model, 3, 16, model.config.vocab_size, 4, alpha_schedule=schedule,
                              final_step=final_step, generator=torch.Generator().manual_seed(5), show_progress=False)
        return [tok.decode(row) for row in ids.tolist()]
    assert texts == by_hand("cosine", "greedy")
    assert texts != by_hand("loglinear", "greedy") and texts != by_hand("cosine", "ancestral")  # the test can fail


def test_api_refuses_what_the_command_line_refuses(tmp_path, tok_path):
    """Issue 44: generate(cfg_w=nan) returned garbage and a seed past 64 bits a traceback of torch's; the API's
    keywords go through the CLI's checkers (plumbing.cli.finite_float, whole), as ValueErrors naming them."""
    lm = SDDLM.from_pretrained(fake_checkpoint(tmp_path / "ckpt.pt", tok_path))
    cases = [(dict(cfg_w=math.nan, prompt="a"), "--cfg_w: expected a finite number, got nan"),
             (dict(cfg_w=math.inf, prompt="a"), "--cfg_w: expected a finite number, got inf"),
             (dict(top_p=math.nan), "--top_p must be in"), (dict(t_end=math.nan), "--t_end must be in"),
             (dict(steps=math.nan), "--steps must be an integer >= 1, got nan"),
             (dict(steps=2.5), "--steps must be an integer >= 1"), (dict(seed=2 ** 64), r"seed must be an integer in"),
             (dict(seed=-1), r"seed must be an integer in \[0, 2\^60\), got -1")]
    for kwargs, words in cases:
        with pytest.raises(ValueError, match=words):
            lm.generate(1, **{"steps": 2, "seq_len": 8, **kwargs})
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\^60\), got 18446744073709551616"):
        lm.score(["a b"], seed=2 ** 64)
    assert len(lm.generate(1, steps=2, seq_len=8, cfg_w=1.5, prompt="a", seed=2 ** 60 - 1)) == 1


@pytest.mark.numerics
def test_score_is_exact_nll_for_ar_and_the_nelbo_for_diffusion(tmp_path, tok_path):
    ar = SDDLM.from_pretrained(fake_checkpoint(tmp_path / "ar.pt", tok_path, loss="ar", causal=True))
    ids = torch.tensor([ar.tokenizer.encode(TEXT)])
    with torch.no_grad():
        log_p = torch.log_softmax(ar.model(ids).double(), -1)[0, :-1].gather(-1, ids[0, 1:, None])
    [r] = ar.score([TEXT])
    # the same float32 logits; a float32 log-softmax of V logits errs by <= (V + 13) u + 2 u |lse| (|lse| <= 10)
    V, u = ar.model.config.vocab_size, unit_roundoff(torch.float32)
    assert r["tokens"] == ids.shape[1] and r["nll"] == pytest.approx(-log_p.mean().item(), abs=(V + 33) * u)

    lm = SDDLM.from_pretrained(export(fake_checkpoint(tmp_path / "d.pt", tok_path), tmp_path / "m")[0])
    [r] = lm.score(TEXT, mc_draws=8, seed=3)
    # the same draws by hand: two rounds of 4 stratified times (metrics.sequence_draws: the text is sequence 0),
    # x_t from Eq. (discrete_marginal), Eq. (usdm) in float64 on the same float32 logits, each time weighted as drawn
    from metrics import sequence_draws
    x0, K = ids.expand(4, -1), lm.model.config.vocab_size
    rounds, tols = [], []
    for rnd in range(2):
        t, w, noise_u, noise = sequence_draws(3, 0, rnd, 4, ids.shape[1], K)
        alpha_t, dalpha_t = (a[:, None] for a in diffusion.log_linear_schedule(t.float()))
        xt = torch.where(noise_u < alpha_t, x0, noise)
        with torch.no_grad():
            logits = lm.model(xt, diffusion.sigma_from_alpha(alpha_t[:, 0])).double()
        nelbo = losses.usdm_nelbo_loss(logits, x0, xt, alpha_t.double(), dalpha_t.double()).sum(1)
        rounds.append(float((w * nelbo).sum()) / ids.shape[1])
        # the code's float32 NELBO errs by <= 2 (3K + 10) u of its terms' sizes (usdm_sizes), weighted alike
        sizes = usdm_sizes(logits, x0, xt, alpha_t.double(), dalpha_t.double()).sum(1)
        tols.append(2 * (3 * K + 10) * u * float((w * sizes).sum()) / ids.shape[1])
    assert r["nll"] == pytest.approx(sum(rounds) / 2, abs=sum(tols) / 2) and r["tokens"] == ids.shape[1]
    assert r["nll_se"] == pytest.approx(abs(rounds[0] - rounds[1]) / 2, abs=sum(tols) / 2)   # two rounds: |a - b| / 2
    assert abs(rounds[0] - rounds[1]) > 10 * sum(tols)
    assert r["ppl_se"] == pytest.approx(r["ppl"] * r["nll_se"], rel=4 * u)      # one float64 product, rounded
    # its 95% interval: Student's t on the rounds' 1 degree of freedom, 12.706205 (tan(0.475 pi)), not 1.96
    assert (r["ppl_lo"], r["ppl_hi"]) == pytest.approx((math.exp(r["nll"] - 12.706205 * r["nll_se"]),
                                                        math.exp(r["nll"] + 12.706205 * r["nll_se"])), rel=1e-6)


def fake_hub(monkeypatch, root):
    """huggingface_hub as a stand-in that records what would be uploaded and serves it back (no network)."""
    import fnmatch
    import shutil
    hub, calls = {}, []

    class HfApi:
        def __init__(self, token=None):
            self.token = token

        def create_repo(self, repo_id, private=False, exist_ok=False):
            calls.append(("create_repo", repo_id, private, exist_ok))

        def upload_folder(self, folder_path, repo_id, commit_message="", allow_patterns=None):
            files = sorted(f for f in os.listdir(folder_path) if any(fnmatch.fnmatch(f, p) for p in allow_patterns))
            calls.append(("upload_folder", repo_id, files))
            hub[repo_id] = os.path.join(str(root), repo_id.replace("/", "--"))
            os.makedirs(hub[repo_id])
            for f in files:
                shutil.copyfile(os.path.join(folder_path, f), os.path.join(hub[repo_id], f))
            return "commit"
    monkeypatch.setitem(sys.modules, "huggingface_hub",
                        SimpleNamespace(HfApi=HfApi, snapshot_download=lambda repo_id, revision=None, allow_patterns=None:
                                        hub[repo_id]))
    return hub, calls


def test_push_to_hub_uploads_and_from_pretrained_loads_it_back(tmp_path, tok_path, monkeypatch):
    folder, _ = export(fake_checkpoint(tmp_path / "ckpt.pt", tok_path), tmp_path / "model")
    open(os.path.join(folder, "notes.txt"), "w").write("not part of the model")
    hub, calls = fake_hub(monkeypatch, tmp_path / "hub")
    assert pretrained.push_to_hub(folder, "me/tiny", private=True) == "commit"
    assert calls == [("create_repo", "me/tiny", True, True),
                     ("upload_folder", "me/tiny", ["README.md", "config.json", "model.safetensors", "tokenizer.model"])]
    lm = SDDLM.from_pretrained(folder)
    assert SDDLM.from_pretrained("me/tiny").generate(2, steps=3, seq_len=12) == lm.generate(2, steps=3, seq_len=12)
    lm.push_to_hub("me/again")                             # from a loaded model: save_pretrained, then upload
    assert calls[-1] == ("upload_folder", "me/again", ["README.md", "config.json", "model.safetensors",
                                                       "tokenizer.model"])
    assert 'SDDLM.from_pretrained("me/again")' in open(os.path.join(hub["me/again"], "README.md")).read()
    assert SDDLM.from_pretrained("me/again").score(TEXT, seed=1) == lm.score(TEXT, seed=1)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)      # not installed
    with pytest.raises(ValueError, match="needs huggingface_hub"):
        pretrained.push_to_hub(folder, "me/tiny")
    with pytest.raises(ValueError, match="needs huggingface_hub"):
        SDDLM.from_pretrained("me/elsewhere")


def test_export_command_errors_are_one_line(tmp_path, tok_path, capsys):
    ckpt_path = fake_checkpoint(tmp_path / "ckpt.pt", tok_path)
    (tmp_path / "run").mkdir()
    for argv, words in [(["--ckpt", str(tmp_path / "missing.pt")], "checkpoint not found"),
                        (["--ckpt", ckpt_path, "--weights", "half"], "--weights must be ema or raw"),
                        (["--ckpt", str(tmp_path / "run")], "is a folder but not a model folder"),
                        (["--ckpt", ckpt_path, "--out", ckpt_path], "is the input --ckpt")]:
        with pytest.raises(SystemExit) as e:
            cli.run_cli(lambda: pretrained.main(argv), ValueError)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and words in err[0], (argv, err)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    live = f"model.sddlm-tmp-{socket.gethostname()}-{os.getppid()}-0a1b2c3d"
    for left in (f"model.sddlm-tmp-{socket.gethostname()}-{dead.stdout.strip()}-0a1b2c3d", live):
        os.makedirs(tmp_path / left / "x")                       # a killed export's leftovers; a live writer's folder
    assert pretrained.main(["--ckpt", ckpt_path]) == 0           # default: model/ beside the checkpoint
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "model", live, "run"]
    assert "wrote " + str(tmp_path / "model") in capsys.readouterr().out
    assert is_model_folder(tmp_path / "model")


@pytest.mark.slow
def test_train_writes_a_model_folder_that_every_script_reads(tmp_path):
    """A real train.py run: out_dir/model next to a full-state ckpt.pt (read with weights_only=True), and
    sample.py, eval_ppl.py and the lm-eval model give the same results from the folder as from the checkpoint."""
    import eval_ppl
    import train
    from test_train import TINY
    from conftest import write_corpus
    write_corpus(tmp_path / "corpus.txt")
    out = tmp_path / "out"
    assert train.main(TINY + ["--dataset", str(tmp_path / "corpus.txt"), "--data_dir", str(tmp_path / "data"),
                              "--out_dir", str(out), "--max_iters", "4", "--eval_interval", "4"]) == 0
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert {"optimizer", "rng", "data_state", "ema"} <= set(ckpt)
    assert sorted(os.listdir(out / "model")) == ["README.md", "config.json", "model.safetensors", "tokenizer.model"]
    card = (out / "model" / "README.md").read_text()
    last_val = [json.loads(line) for line in open(out / "log.jsonl") if "val_nelbo" in line][-1]
    assert (f"{last_val['val_nelbo']:.4f} ± {last_val['val_nelbo_se']:.4f} nats/token" in card
            and f"at step {last_val['step']}" in card)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    texts = [subprocess.run([sys.executable, "sample.py", "--ckpt", str(c), "--num_samples", "2", "--steps", "3",
                             "--out", str(tmp_path / f"s{i}.jsonl")], cwd=HERE, env=env, capture_output=True,
                            text=True) for i, c in enumerate((out / "model", out / "ckpt.pt"))]
    assert all(p.returncode == 0 for p in texts), texts[0].stderr[-2000:]
    assert texts[0].stdout == texts[1].stdout and "--- sample 1 ---" in texts[0].stdout
    nelbo = [eval_ppl.run_nelbo(SimpleNamespace(data_dir="", split="val", batch_size=4, max_batches=0, seed=0,
                                                mc_draws=1, rounds=2, rel_se=0.0, max_rounds=2, t_min=1e-3,
                                                ckpt=str(c)),
                                *load_model(str(c), "cpu"), "cpu", None)
             for c in (out / "model", out / "ckpt.pt")]
    assert nelbo[0] == nelbo[1]
    lm_eval_sddlm = pytest.importorskip("downstream.lm_eval_sddlm")
    scores = [lm_eval_sddlm.SDDLMHarness(ckpt=str(c), mc_draws=2, device="cpu").scorer.loglikelihood(
        [("the cat", " sees the dog")]) for c in (out / "model", out / "ckpt.pt")]
    assert scores[0] == scores[1]


def export_py(*argv):
    """python hub/pretrained.py ARGV, the real script -> (exit code, stdout, stderr lines)."""
    p = subprocess.run([sys.executable, "hub/pretrained.py", *map(str, argv)], cwd=HERE, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    return p.returncode, p.stdout, p.stderr.strip().splitlines()


def files_of(folder):
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


def test_an_export_never_deletes_or_overwrites_a_users_file(tmp_path, tok_path):
    """Issue 30: --out DIR and save_pretrained(DIR) replaced the whole DIR. A folder of the user's is refused (one
    line, nothing touched); over a model folder only our files are replaced, a user's file and README.md kept."""
    ckpt_path = fake_checkpoint(tmp_path / "ckpt.pt", tok_path)
    thesis = tmp_path / "thesis"
    thesis.mkdir()
    (thesis / "thesis.tex").write_text("\\documentclass{article} my thesis")
    code, _, err = export_py("--ckpt", ckpt_path, "--out", thesis)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --out ") and "thesis.tex" in err[0], err
    assert files_of(thesis) == {"thesis.tex": b"\\documentclass{article} my thesis"}
    lm = SDDLM.from_pretrained(ckpt_path)
    with pytest.raises(cli.UsageError, match="not an sddlm model folder"):
        lm.save_pretrained(thesis)
    assert files_of(thesis) == {"thesis.tex": b"\\documentclass{article} my thesis"}
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "thesis"]          # no temp folder left either

    # over a model folder of ours: our files replaced (raw weights now), the user's own files kept byte for byte
    model = tmp_path / "model"
    assert export_py("--ckpt", ckpt_path, "--out", model)[0] == 0
    (model / "thesis.tex").write_text("mine")
    first = files_of(model)
    code, out, err = export_py("--ckpt", ckpt_path, "--out", model, "--weights", "raw")
    assert code == 0 and err == [], err
    again = files_of(model)
    assert set(again) == set(first) == {"README.md", "config.json", "model.safetensors", "thesis.tex",
                                        "tokenizer.model"}
    assert again["thesis.tex"] == b"mine" and again["model.safetensors"] != first["model.safetensors"]
    assert json.loads(again["config.json"])["weights"] == "raw" and b"live (not the EMA)" in again["README.md"]
    assert torch.equal(logits_of(load_model(str(model), "cpu", use_ema=False)[0]),
                       logits_of(load_checkpoint(ckpt_path, use_ema=False)[0]))
    # a README.md the user wrote is theirs: kept, said once on stderr; save_pretrained keeps it too
    (model / "README.md").write_text("# my notes on this model\n")
    code, _, err = export_py("--ckpt", ckpt_path, "--out", model)
    assert code == 0 and len(err) == 1 and "README.md is not a model card of ours: kept" in err[0], err
    lm.save_pretrained(model)
    assert (model / "README.md").read_text() == "# my notes on this model\n"
    assert (model / "thesis.tex").read_text() == "mine"
    assert json.loads((model / "config.json").read_text())["weights"] == "ema"


def test_config_is_flat_with_model_type_and_old_folders_load(tmp_path, tok_path):
    """config.json as the hub's: "model_type": "sddlm" and the model's fields at the top; a folder of the first
    format (fields nested under "model_config") reads as before, and the real script re-exports it to the new one."""
    ckpt_path = fake_checkpoint(tmp_path / "ckpt.pt", tok_path, loss="duo", schedule="cosine")
    folder, _ = export(ckpt_path, tmp_path / "model")
    config = json.load(open(os.path.join(folder, "config.json")))
    saved = torch.load(ckpt_path, weights_only=True)
    assert config["model_type"] == "sddlm" and "model_config" not in config
    assert {k: config[k] for k in saved["model_config"]} == saved["model_config"]
    # the first format, as main 283effe wrote it
    old = tmp_path / "old"
    os.makedirs(old)
    for name in ("model.safetensors", "tokenizer.model"):
        open(old / name, "wb").write(open(os.path.join(folder, name), "rb").read())
    nested = {k: v for k, v in config.items() if k not in saved["model_config"] and k != "model_type"}
    json.dump({**nested, "format": "sddlm-model-1", "model_config": saved["model_config"]},
              open(old / "config.json", "w"))
    model_old, info = load_model(str(old), "cpu")
    assert torch.equal(logits_of(model_old), logits_of(load_checkpoint(ckpt_path, use_ema=True)[0]))
    assert info["train_config"]["noise_schedule"] == "cosine" and info["step"] == 7
    code, _, err = export_py("--ckpt", old, "--out", tmp_path / "new")
    assert code == 0, err
    new = json.load(open(tmp_path / "new" / "config.json"))
    assert new["model_type"] == "sddlm" and new["format"] == "sddlm-model-2" and new["n_layer"] == 2
    assert torch.equal(logits_of(load_model(str(tmp_path / "new"), "cpu")[0]), logits_of(model_old))


def card_header(text):
    """The YAML metadata block at the top of a model card -> {key: value or list of values}."""
    lines = text.split("\n")
    assert lines[0] == "---"
    end = lines.index("---", 1)
    out, key = {}, None
    for line in lines[1:end]:
        if line.startswith("- "):
            out[key].append(line[2:])
        else:
            key, _, value = line.partition(":")
            out[key] = value.strip() or []
    return out, "\n".join(lines[end + 1:])


def test_every_folder_has_a_card_with_header_run_and_validation(tmp_path, tok_path):
    run = tmp_path / "run"
    run.mkdir()
    ckpt_path = fake_checkpoint(run / "ckpt.pt", tok_path, loss="sddlm_v1", schedule="cosine")
    ckpt = torch.load(ckpt_path, weights_only=True)
    ckpt["train_config"].update(dataset="lm1b", block_size=32)
    torch.save(ckpt, ckpt_path)
    # the run's log: evaluations at steps 4 and 7 (the checkpoint's step) and a later one that is not this model's
    records = [{"step": 4, "val_nelbo": 6.5, "val_ppl": 665.1}, {"step": 7, "val_nelbo": 6.125, "val_ppl": 457.1},
               {"step": 9, "val_nelbo": 6.0, "val_ppl": 403.4}]
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 8, "val_ne')
    code, out, err = export_py("--ckpt", ckpt_path)
    assert code == 0, err
    card = (run / "model" / "README.md").read_text()
    header, body = card_header(card)
    assert header["library_name"] == "sddlm" and header["license"] == "mit"
    assert {"sddlm", "diffusion-language-model", "arxiv:2510.22926"} <= set(header["tags"])
    for words in ("| objective | `sddlm_v1` |", "| noise schedule | `cosine` |", "| training steps | 7 |",
                  "| data | lm1b, sequences of 32 tokens |", "vocabulary 300", sha256(tok_path)[:16],
                  "6.1250 nats/token (NELBO, an upper bound on the NLL), PPL 457.10, at step 7",
                  "from hub.pretrained import SDDLM", f'lm = SDDLM.from_pretrained("{run / "model"}")',
                  "print(lm.generate(2)[0]", "Simple Denoising Diffusion Language Models", "arXiv:2510.22926"):
        assert words in body, words
    config = json.load(open(run / "model" / "config.json"))
    assert config["validation"] == {"step": 7, "nelbo": 6.125, "ppl": 457.1}
    # a folder exported again from the folder keeps what the run measured; without a log nothing is invented
    SDDLM.from_pretrained(run / "model").save_pretrained(tmp_path / "copy")
    assert "PPL 457.10, at step 7" in (tmp_path / "copy" / "README.md").read_text()
    (run / "log.jsonl").unlink()
    export(ckpt_path, tmp_path / "nolog")
    assert "validation | not recorded" in (tmp_path / "nolog" / "README.md").read_text()
    assert "validation" not in json.load(open(tmp_path / "nolog" / "config.json"))


def test_the_card_reports_the_evaluated_weights_validation(tmp_path, tok_path):
    """Issue 36: the demo (no EMA) got "validation | not recorded" although its log.jsonl has the step-900
    evaluation: a run without EMA evaluates its live weights, which are then the weights exported. The card gives
    the NELBO and PPL with their Monte-Carlo standard errors and the PPL's 95% interval as the log recorded them;
    a run WITH EMA exported with its live weights (--weights raw) has no evaluation of those: not recorded."""
    run = tmp_path / "run"
    run.mkdir()
    ckpt = torch.load(fake_checkpoint(run / "ckpt.pt", tok_path), weights_only=True)
    ckpt["ema"], ckpt["n_ema"] = None, 0                       # the demo: --ema 0
    torch.save(ckpt, run / "ckpt.pt")
    record = {"step": 7, "val_loss": 2.65, "val_loss_se": 0.01, "val_nelbo": 5.2023, "val_nelbo_se": 0.0171,
              "val_ppl": 181.69, "val_ppl_se": 3.11, "val_ppl_lo": 175.7, "val_ppl_hi": 187.9, "val_tokens": 10240,
              "val_draws": 16}
    (run / "log.jsonl").write_text(json.dumps({"step": 5, "loss": 2.9}) + "\n" + json.dumps(record) + "\n")
    folder, used = export(run / "ckpt.pt", tmp_path / "live")
    card = (tmp_path / "live" / "README.md").read_text()
    assert used == "raw" and ("| validation | 5.2023 ± 0.0171 nats/token (NELBO, an upper bound on the NLL), PPL "
                              "181.69 ± 3.11 (95% interval 175.70–187.90), at step 7 (live weights") in card, card
    assert json.load(open(tmp_path / "live" / "config.json"))["validation"] == {
        "step": 7, "nelbo": 5.2023, "ppl": 181.69, "nelbo_se": 0.0171, "ppl_se": 3.11, "ppl_lo": 175.7,
        "ppl_hi": 187.9}
    with_ema = tmp_path / "ema"
    with_ema.mkdir()
    fake_checkpoint(with_ema / "ckpt.pt", tok_path)
    (with_ema / "log.jsonl").write_text(json.dumps(record) + "\n")
    export(with_ema / "ckpt.pt", tmp_path / "raw", weights="raw")
    assert "| validation | not recorded for these weights" in (tmp_path / "raw" / "README.md").read_text()
    export(with_ema / "ckpt.pt", tmp_path / "emaw")
    assert "± 0.0171 nats/token" in (tmp_path / "emaw" / "README.md").read_text()


def test_lm_eval_takes_pretrained_as_its_name_for_the_model(tmp_path, tok_path):
    """--model_args pretrained=out/model, as lm-eval names a model for every other backend, through lm-eval's own
    argument parsing (create_from_arg_string): the same model as ckpt=; both at once naming two models is refused."""
    pytest.importorskip("lm_eval", reason="lm-eval is optional (pip install lm-eval) and not installed here")
    from lm_eval.api.registry import get_model
    from downstream import lm_eval_sddlm  # noqa: F401  (importing it registers "sddlm")
    from downstream.scoring import EvalError
    ckpt_path = fake_checkpoint(tmp_path / "ckpt.pt", tok_path)
    folder, _ = export(ckpt_path, tmp_path / "model")
    cls = get_model("sddlm")
    extra = {"batch_size": 2, "device": "cpu"}
    by_name = cls.create_from_arg_string(f"pretrained={folder},mc_draws=2,seed=3", extra)
    by_ckpt = cls.create_from_arg_string(f"ckpt={ckpt_path},mc_draws=2,seed=3", extra)
    pair = [("the cat", " sees the dog")]
    assert by_name.scorer.loglikelihood(pair) == by_ckpt.scorer.loglikelihood(pair)
    assert torch.equal(logits_of(by_name.scorer.model), logits_of(load_checkpoint(ckpt_path, use_ema=True)[0]))
    with pytest.raises(EvalError, match="name two models"):
        cls.create_from_arg_string(f"pretrained={folder},ckpt={ckpt_path}", extra)


@pytest.mark.slow
def test_lm_eval_with_pretrained_scores_as_with_ckpt(tmp_path, tok_path):
    """python -m downstream.lm_eval_sddlm --model_args pretrained=FOLDER (refused before: 'unknown sddlm model
    argument(s) pretrained') logs the same responses on a local task as ckpt=CHECKPOINT."""
    pytest.importorskip("lm_eval", reason="lm-eval is optional (pip install lm-eval) and not installed here")
    import glob
    ckpt_path = fake_checkpoint(tmp_path / "ckpt.pt", tok_path)
    folder, _ = export(ckpt_path, tmp_path / "model")
    (tmp_path / "facts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in
                                                  ("the cat sees the dog", "the bird likes the fish")))
    (tmp_path / "facts.yaml").write_text(
        f"task: facts\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'facts.jsonl'}\n"
        f"test_split: test\noutput_type: loglikelihood\n"
        "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\ndoc_to_target: \"{{' ' + text.split(' ')[-1]}}\"\n"
        "metric_list:\n  - metric: perplexity\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    responses = []
    for i, model in enumerate((f"pretrained={folder}", f"ckpt={ckpt_path}")):
        p = subprocess.run([sys.executable, "-m", "downstream.lm_eval_sddlm", "--model", "sddlm", "--model_args",
                            f"{model},mc_draws=2,seed=3", "--tasks", "facts", "--include_path", str(tmp_path),
                            "--device", "cpu", "--batch_size", "2", "--output_path", str(tmp_path / f"out{i}"),
                            "--log_samples"], cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        path, = glob.glob(str(tmp_path / f"out{i}" / "**" / "samples_facts_*.jsonl"), recursive=True)
        responses.append([json.loads(line)["resps"] for line in open(path)])
    assert responses[0] == responses[1] and len(responses[0]) == 2


@pytest.mark.slow
@pytest.mark.skipif(not unshare_available(), reason="needs unshare (a user namespace) to mount a small tmpfs")
def test_a_full_disk_in_export_is_one_line_and_writes_nothing(run_ar, tmp_path):
    """hub/pretrained.py --out (a new folder, and over an earlier model folder) and SDDLM.save_pretrained on a
    disk without room for the weights: one line (an OSError for the API), nothing half-written, the earlier
    folder and a user's file as they were."""
    mnt, model = tmp_path / "mnt", os.path.join(run_ar.out, "model")
    mnt.mkdir()
    room = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model)) + 300_000
    export = f"{sys.executable} {os.path.join(HERE, 'hub', 'pretrained.py')} --ckpt {run_ar.ckpt} --out"
    api = (f"{sys.executable} -c 'from hub.pretrained import SDDLM; "
           f"SDDLM.from_pretrained(\"{model}\").save_pretrained(\"{mnt / 'api'}\")'")
    script = (f"mount -t tmpfs -o size={room // 1024}k tmpfs {mnt} && cp -r {model} {mnt / 'old'} && "
              f"echo 'my thesis' > {mnt / 'thesis.tex'} && md5sum {mnt / 'old'}/* {mnt / 'thesis.tex'} > {tmp_path}/a"
              f" && {export} {mnt / 'new'} 2> {tmp_path}/new.err; echo rc=$?; "
              f"{export} {mnt / 'old'} 2> {tmp_path}/old.err; echo rc=$?; "
              f"{api} 2> {tmp_path}/api.err; echo rc=$?; "
              f"md5sum {mnt / 'old'}/* {mnt / 'thesis.tex'} > {tmp_path}/b; ls -A {mnt}")
    p = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                       capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=300)
    assert p.stdout.splitlines() == ["rc=2", "rc=2", "rc=1", "old", "thesis.tex"], (p.stdout, p.stderr)
    for name, kept in (("new", "nothing was written"), ("old", f"the previous {mnt / 'old'} is kept")):
        err = SimpleNamespace(returncode=2, stderr=(tmp_path / f"{name}.err").read_text())
        line = one_error(err)
        assert line.startswith(f"error: could not write {mnt / name} (") and "No space left" in line and kept in line
    api_err = (tmp_path / "api.err").read_text()      # the Python API raises one OSError, its message one line
    assert api_err.splitlines()[-1].startswith(f"OSError: [Errno 28] could not write {mnt / 'api'} (")
    assert (tmp_path / "a").read_text() == (tmp_path / "b").read_text()
