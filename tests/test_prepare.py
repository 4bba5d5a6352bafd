"""prepare.py's folders as train.py reads them."""
import os

import pytest

from data import DataError
import prepare
import train
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
