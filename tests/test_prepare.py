"""prepare.py's folders as train.py reads them."""
import json
import os
import subprocess
import sys

import pytest

import prepare
import train
from data import DataError
from test_train import TINY, _corpus

TRAIN = TINY + ["--max_iters", "1", "--eval_interval", "1000"]


def test_train_reads_any_prepared_folder_and_its_moved_copy(tmp_path, monkeypatch):
    """A folder prepare.py wrote with flags train.py lacks (--val_fraction, --insert_eos) trains; --init finds the
    data's tokenizer by content, in the folder where it is now (moved, or named by another path); a flag given
    against the folder is still refused, naming it."""
    monkeypatch.chdir(tmp_path)
    _corpus(tmp_path / "c.txt")
    assert prepare.main(["--dataset", "c.txt", "--tokenizer", "sp_train:320", "--block_size", "32", "--data_dir",
                         "d", "--val_fraction", "0.1", "--insert_eos", "0"]) == 0
    assert train.main(TRAIN + ["--dataset", "c.txt", "--data_dir", "d", "--out_dir", "run"]) == 0
    assert train.main(TRAIN + ["--init", "run/ckpt.pt", "--data_dir", "d", "--out_dir", "ft", "--dataset",
                               "c.txt", "--tokenizer", "sp:d/tokenizer.model"]) == 0
    os.rename("d", "moved")
    assert train.main(["--init", "run/ckpt.pt", "--data_dir", "moved", "--out_dir", "ft2", "--max_iters", "1",
                       "--batch_size", "8", "--num_samples", "0", "--eval_iters", "1"]) == 0
    with pytest.raises(DataError, match=r"moved was prepared with a different block_size=32 \(asked 64\)"):
        train.main(TRAIN + ["--block_size", "64", "--data_dir", "moved", "--out_dir", "r64"])


HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root


def test_wrap_0_says_the_share_of_tokens_it_drops(tmp_path):
    """Issue 44: --wrap 0 cut each document to block_size - 2 tokens and dropped most of a corpus without a word;
    a note on stderr says how many (the count is the documents' tokens past block_size - 2, from meta.json)."""
    _corpus(tmp_path / "corpus.txt")
    p = subprocess.run([sys.executable, os.path.join(HERE, "prepare.py"), "--dataset", tmp_path / "corpus.txt",
                        "--tokenizer", "sp_train:300", "--data_dir", tmp_path / "data", "--wrap", "0", "--block_size",
                        "16"], capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert p.returncode == 0, p.stderr
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    dropped, tokens = meta["train_dropped_tokens"], meta["train_tokens"]
    assert dropped > tokens / 2          # 5 sentences a document, 14 tokens kept of each
    assert (f"note: --wrap 0 keeps a document's first 14 tokens: {dropped:,} of the train split's {tokens:,} tokens "
            f"({dropped / tokens:.1%}) are dropped; --wrap 1 keeps them all") in p.stderr
