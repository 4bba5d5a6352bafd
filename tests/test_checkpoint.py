"""plumbing/checkpoint.py: what a resume reads, through the real train.py."""
import torch

import train
from test_faults import case, check, md5s, run_batches
from test_train import TINY, _corpus


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
