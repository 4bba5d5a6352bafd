"""plumbing/files.py through the scripts that write: temp names, output paths."""
import os
import socket
import subprocess
import sys

import pytest

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


def test_outputs_through_dangling_links_are_named(tmp_path, monkeypatch, capsys):
    """An output that is, or lies under, a link to nothing: one line naming the link and its target, exit 2,
    nothing written (a folder output may create the target; a file output is never written through a link)."""
    import sample
    from plumbing.cli import run_cli
    monkeypatch.chdir(tmp_path)
    for link, target in (("run", "gone"), ("up", "gone2"), ("out", "gone3"), ("s.jsonl", "gone4")):
        os.symlink(target, link)
    for script, argv, words in [
            (train, ["--out_dir", "run"], "--out_dir run: {t}/run is a link to {t}/gone, which does not exist; remove "
                                          "the link or create {t}/gone"),
            (prepare, ["--data_dir", "up/data"], "--data_dir up/data: {t}/up is a link to {t}/gone2, which"),
            (pretrained, ["--ckpt", "x.pt", "--out", "out"], "--out out: {t}/out is a link to {t}/gone3, which"),
            (sample, ["--ckpt", "x.pt", "--out", "s.jsonl"], "--out s.jsonl: {t}/s.jsonl is a link to {t}/gone4, "
                                                             "which does not exist; remove the link\n")]:
        with pytest.raises(SystemExit) as e:
            run_cli(lambda: script.main(argv), ValueError)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: " + words.format(t=tmp_path)) and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["out", "run", "s.jsonl", "up"]
