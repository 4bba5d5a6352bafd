"""plumbing/files.py through the scripts that write: temp names, output paths."""
import os
import socket
import subprocess
import sys

from hub import pretrained
import prepare
import train
from test_train import TINY, _corpus


def test_cleanup_removes_dead_writers_temps_not_users_files(tmp_path, monkeypatch):
    """A killed writer's temp files and folders (<path>.sddlm-tmp-<host>-<pid>-<8 hex>, pid dead) go at the next
    start of prepare.py, train.py and hub/pretrained.py; a user's model.old2024 or ckpt.pt.tmp2024 stays."""
    monkeypatch.chdir(tmp_path)
    _corpus(tmp_path / "c.txt")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    mark = f".sddlm-tmp-{socket.gethostname()}-{dead}-0123abcd"
    users = [f"{p}.{s}2024" for p in ("model", "data2", "run/ckpt.pt") for s in ("old", "tmp")]
    stale = [p + mark for p in ("model", "data2", "run/ckpt.pt", "run/ckpt_4.pt")]
    for name in users + stale:
        os.makedirs(name if not name.startswith("run/") else "run", exist_ok=True)
        if name.startswith("run/"):
            (tmp_path / name).write_bytes(b"half")
        else:
            (tmp_path / name / "x").write_bytes(b"mine")
    assert prepare.main(["--dataset", "c.txt", "--tokenizer", "sp_train:320", "--block_size", "32",
                         "--data_dir", "data2"]) == 0
    assert train.main(TINY + ["--data_dir", "data2", "--dataset", "c.txt", "--out_dir", "run", "--max_iters", "1",
                              "--eval_interval", "1000"]) == 0
    assert pretrained.main(["--ckpt", "run/ckpt.pt", "--out", "model"]) == 0
    assert [n for n in users + stale if os.path.exists(n)] == users
