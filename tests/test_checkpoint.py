"""plumbing/checkpoint.py: what a checkpoint carries and how a reader loads it."""
import os
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from model import ModelConfig, build_model

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
