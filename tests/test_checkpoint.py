"""plumbing/checkpoint.py and trained/checkpoint.py: what a checkpoint carries, how a reader loads it, what a resume
reads."""
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch


import train
from model import ModelConfig, build_model
from test_train import TINY
from conftest import ENV, HERE, case, check_one_line, md5s, one_error, run_batches, write_corpus
from plumbing import cli
from plumbing.checkpoint import refuse_other_script






TEXT = "The os module provides a portable way of using operating system dependent functionality.\n\nNew lines stay."


@pytest.fixture
def saved(tmp_path):
    """A checkpoint written by checkpoint_state (train.py's save path) of a model trained with a SentencePiece
    tokenizer that lives in the data folder, the way train.py's `sp_train:N` leaves it."""
    from data import get_tokenizer, train_sentencepiece
    from plumbing.checkpoint import checkpoint_state
    from train import TrainConfig
    data = tmp_path / "data"
    data.mkdir()
    tok = get_tokenizer("sp:" + train_sentencepiece([TEXT] * 3 + ["a tree finds a house .\n"] * 20,
                                                    str(data / "tokenizer"), 300))
    mc = ModelConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16, cond_dim=8)
    run = SimpleNamespace(raw_model=build_model(mc), ema=None, it=3, n_ema=0)
    meta = dict(tokenizer=tok.spec, tokenizer_sha256=tok.fingerprint, vocab_size=tok.vocab_size, bos_id=tok.bos_id,
                eos_id=tok.eos_id, pad_id=tok.pad_id)
    state = checkpoint_state(run, TrainConfig(), mc, meta)
    torch.save(state, tmp_path / "ckpt.pt")
    return tmp_path / "ckpt.pt", tok, data


def test_ckpt_decodes_with_its_own_tokenizer_once_data_moves(saved, tmp_path):
    """sample.py --ckpt out/ckpt.pt once data/ was moved wrote ids only: the checkpoint now carries its
    SentencePiece model, so its readers (load_tokenizer: sample.py, eval_ppl.py, SDDLM) and an export to a model
    folder decode as the original file does, with the recorded content hash."""
    from hub.pretrained import SDDLM
    from trained.checkpoint import load_model, load_tokenizer
    from trained.export import export
    path, tok, data = saved
    ids = tok.encode(TEXT)
    os.rename(data, tmp_path / "moved")
    model, ckpt = load_model(str(path), "cpu")
    again, why = load_tokenizer(ckpt, str(path))
    assert why is None and again.decode(ids) == TEXT and again.encode(TEXT) == ids
    assert again.fingerprint == ckpt["meta"]["tokenizer_sha256"]
    assert SDDLM.from_pretrained(str(path)).tokenizer.decode(ids) == TEXT
    folder, _ = export(str(path), str(tmp_path / "model"))
    assert SDDLM.from_pretrained(folder).tokenizer.decode(ids) == TEXT


def test_a_resume_refuses_keys_it_would_drop(tmp_path):
    """Issue 44: keys a checkpoint holds that this version does not know (a later version's) were dropped from the
    checkpoints a resume writes, without a word: refused in one line, nothing changed."""
    write_corpus(tmp_path / "corpus.txt")
    run = TINY + ["--dataset", tmp_path / "corpus.txt", "--data_dir", tmp_path / "data", "--out_dir", tmp_path / "run"]
    run = [str(a) for a in run]
    assert train.main(run + ["--max_iters", "2", "--eval_interval", "2"]) == 0
    ckpt = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    torch.save({**ckpt, "scheduler": {"last_epoch": 2}}, tmp_path / "run" / "ckpt.pt")
    before = md5s(tmp_path / "run")
    check_one_line(run_batches([case("train.py", *run, "--max_iters", "4", "--resume", "1", cwd=tmp_path,
                                     expect="ckpt.pt: it holds scheduler, which this version of sddlm does not know")]))
    assert md5s(tmp_path / "run") == before


@pytest.mark.slow
def test_refused_resumes_change_nothing_in_out_dir(run4, tmp_path):
    ck = torch.load(run4.ckpt, weights_only=False)

    def run_dir(name, edit=None, files=("ckpt.pt", "log.jsonl", "config.json")):
        d = tmp_path / name
        d.mkdir()
        for f in files:
            (shutil.copytree if f == "model" else shutil.copy)(os.path.join(run4.out, f), d / f)
        if edit is not None:
            edit(d / "ckpt.pt")
        return d

    def edited(change):
        def edit(path):
            c = {k: (dict(v) if isinstance(v, dict) else v) for k, v in ck.items()}
            c["meta"]["data_key"] = dict(c["meta"]["data_key"])
            change(c)
            torch.save(c, path)
        return edit
    dirs = {
        "below": (run_dir("below"), ["--resume", "1", "--max_iters", "2"], "below the checkpoint's step 4"),
        # a finished run, its model folder included (a resume of one whose export failed writes it: test_export.py)
        "noop": (run_dir("noop", files=("ckpt.pt", "log.jsonl", "config.json", "model")),
                 ["--resume", "1", "--max_iters", "4"], ["ok", "already at step 4"]),
        # a pickle's protocol byte of 129: torch warns before it fails, and the report stays one line
        "corrupt": (run_dir("corrupt", lambda p: p.write_bytes(b"\x80\x81" + os.urandom(1998))), ["--resume", "1"],
                    "not a readable checkpoint (not a torch checkpoint, or a damaged one"),
        "foreign": (run_dir("foreign", lambda p: torch.save({"weights": torch.zeros(2)}, p)), ["--resume", "1"],
                    "not a train.py checkpoint (missing model, optimizer"),
        "unknown": (run_dir("unknown", edited(lambda c: c.__setitem__("model_config",
                                                                      {**c["model_config"], "foo": 1}))),
                    ["--resume", "1"], "its model_config has keys this model.py does not know: foo"),
        "tokenizer": (run_dir("tokenizer", edited(lambda c: c["meta"].__setitem__("tokenizer_sha256", "0" * 64))),
                      ["--resume", "1"], "the tokenizer's content differs"),
        "data": (run_dir("data", edited(lambda c: c["meta"]["data_key"].__setitem__("corpus", "0" * 64))),
                 ["--resume", "1"], "the training data differ from the checkpoint's (corpus changed)"),
        "fresh_over_ckpt": (run_dir("fresh_over_ckpt"), [], "exists; pass --resume 1"),
        "fresh_over_log": (run_dir("fresh_over_log", files=("log.jsonl", "config.json")), [],
                           "holds the log of an earlier run"),
    }
    before = {name: md5s(d) for name, (d, _, _) in dirs.items()}
    data_before = md5s(run4.data_dir)
    cases = [case("train.py", *run4.train, "--out_dir", d, "--max_iters", "8", *args, cwd=tmp_path, expect=words)
             for d, args, words in dirs.values()]
    check_one_line(run_batches(cases[:5], cases[5:]))
    assert {name: md5s(d) for name, (d, _, _) in dirs.items()} == before    # config.json included
    assert md5s(run4.data_dir) == data_before


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(run4, tmp_path, monkeypatch, capsys):
    real, saves = torch.save, []

    def disk_fills_at_the_second_save(obj, f, *args, **kwargs):
        saves.append(f)
        if len(saves) == 2:
            with open(f, "wb") as fh:
                fh.write(b"partial")
            raise RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing "
                               "file data/0: file write failed")
        return real(obj, f, *args, **kwargs)
    monkeypatch.setattr(torch, "save", disk_fills_at_the_second_save)
    args = run4.train + ["--out_dir", str(tmp_path), "--max_iters", "8", "--ckpt_interval", "4", "--eval_interval",
                         "100"]
    with pytest.raises(SystemExit) as e:
        cli.run_cli(lambda: train.main(args))
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: could not write") and \
        err[0].endswith("ckpt.pt is kept"), err               # on a line of its own, after the progress bar
    assert torch.load(tmp_path / "ckpt.pt", weights_only=False)["step"] == 4
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "config.json", "log.jsonl"]     # no temp file left


def test_resume_refuses_the_other_scripts_folder():
    trained = {"model": {}, "train_config": {}, "optimizer": {}}
    distilled = {**trained, "distill_config": {}, "teacher": {}}
    refuse_other_script(trained, "run", "train.py")
    refuse_other_script(distilled, "dcd", "distillation/distill.py")
    refuse_other_script({"weights": 1}, "x", "train.py")        # foreign: its own message comes later
    with pytest.raises(cli.ConfigError, match="written by distillation/distill.py; continue it with python "
                                              "distillation/distill.py --out_dir dcd --resume 1"):
        refuse_other_script(distilled, "dcd", "train.py")
    with pytest.raises(cli.ConfigError, match="written by train.py; continue it with python train.py --out_dir run "
                                              "--resume 1, or distil it into a new folder"):
        refuse_other_script(trained, "run", "distillation/distill.py")


@pytest.mark.slow
def test_a_resume_refuses_a_users_model_folder_before_training(run_ar, tmp_path):
    """--resume 1 into an out_dir whose model/ holds a user's file: refused at start (was: trained to the end,
    then refused the export), the checkpoint and the user's file unchanged."""
    out = tmp_path / "run"
    shutil.copytree(run_ar.out, out, copy_function=shutil.copy2)
    shutil.rmtree(out / "model")
    (out / "model").mkdir()
    (out / "model" / "notes.txt").write_text("my notes")
    before = md5s(out)
    p = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *run_ar.train, "--out_dir", out, "--resume",
                        "1", "--max_iters", "8", "--eval_interval", "4"], capture_output=True, text=True, env=ENV,
                       cwd=tmp_path, timeout=300)
    line = one_error(p)
    assert f"--out_dir {out}: its model folder {out / 'model'} already holds files" in line and "notes.txt" in line
    assert md5s(out) == before
