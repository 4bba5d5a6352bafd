"""plumbing/checkpoint.py and trained/checkpoint.py: what a checkpoint carries, how a reader loads it, what a resume
reads."""
import os
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

import train
from model import ModelConfig, build_model
from test_faults import case, check, md5s, run_batches
from test_train import TINY, _corpus

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
    _corpus(tmp_path / "corpus.txt")
    run = TINY + ["--dataset", tmp_path / "corpus.txt", "--data_dir", tmp_path / "data", "--out_dir", tmp_path / "run"]
    run = [str(a) for a in run]
    assert train.main(run + ["--max_iters", "2", "--eval_interval", "2"]) == 0
    ckpt = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    torch.save({**ckpt, "scheduler": {"last_epoch": 2}}, tmp_path / "run" / "ckpt.pt")
    before = md5s(tmp_path / "run")
    check(run_batches([case("train.py", *run, "--max_iters", "4", "--resume", "1", cwd=tmp_path,
                            expect="ckpt.pt: it holds scheduler, which this version of sddlm does not know")]))
    assert md5s(tmp_path / "run") == before
