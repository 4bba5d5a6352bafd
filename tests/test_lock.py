"""plumbing/lock.py: one run per out_dir and one preparation per data folder at a time; a dead holder's lock is
taken over, a live one named; a lock file is never written through."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import HERE, QUIET, md5s, start, wait_until
from plumbing import cli, files
from plumbing.cli import UsageError
from plumbing.lock import LOCK, acquire_folder


def test_a_held_folder_names_its_holder_a_dead_ones_is_taken(tmp_path):
    out = tmp_path / "new" / "run"
    lock = acquire_folder(str(out))
    record = json.loads((out / LOCK).read_text())
    assert (record["pid"], record["host"]) == (os.getpid(), socket.gethostname())
    with pytest.raises(cli.UsageError, match=rf"in use by another run \(.*pid {os.getpid()} on host "
                                             rf"{socket.gethostname()}, since"):
        acquire_folder(str(out))          # a second open file: flock refuses it even in the same process
    lock.release()
    assert not (tmp_path / "new").exists()          # it wrote nothing: no folder left behind
    out.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / LOCK).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(), "started": 0}))
    lock = acquire_folder(str(out))                 # a killed run's lock file: no flock holds it
    assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()
    (out / "ckpt.pt").write_bytes(b"x")
    lock.release()
    assert sorted(os.listdir(out)) == ["ckpt.pt"]    # a folder the run wrote into stays, its lock goes


def test_without_flock_the_recorded_pid_and_host_decide(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_flock(fd, op):                  # a file system without locks (some network mounts)
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(fcntl, "flock", no_flock)
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    host = socket.gethostname()
    for record, held in [({"pid": os.getppid(), "host": host}, True), ({"pid": dead, "host": "elsewhere"}, True),
                         ({"pid": dead, "host": host}, False), ({"pid": "garbled"}, False), ({}, False)]:
        out = tmp_path / str(len(os.listdir(tmp_path)))
        out.mkdir()
        (out / LOCK).write_text(json.dumps(record))
        if held:
            with pytest.raises(cli.UsageError, match=f"pid {record['pid']} on host {record['host']}"):
                acquire_folder(str(out))
            assert json.loads((out / LOCK).read_text()) == record
        else:
            acquire_folder(str(out)).release()
            assert os.listdir(out) == []


@pytest.mark.slow
def test_a_second_run_stops_at_once_a_dead_runs_lock_is_taken(run4, tmp_path):
    out = tmp_path / "run"
    (tmp_path / "w").mkdir()
    a, a_out, a_err = start("train.py", *run4.train, "--out_dir", out, "--max_iters", "100000", "--log_interval", "1",
                            "--ckpt_interval", "5", "--eval_interval", "100000", cwd=tmp_path / "w", name="a")
    wait_until(lambda: (out / "log.jsonl").exists() and (out / "log.jsonl").read_text().count("\n") >= 2,
               what="the first run's log")
    config = md5s(out)["config.json"]
    t0 = time.time()
    b = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *run4.train, "--loss", "sddlm_v1",
                        "--out_dir", str(out), "--max_iters", "20"], cwd=tmp_path / "w", env=QUIET,
                       capture_output=True, text=True, timeout=300)
    assert b.returncode == 2 and time.time() - t0 < 60, b.stderr[-2000:]
    assert b.stderr.splitlines() == [b.stderr.strip()] and \
        f"is in use by another run (train.py" in b.stderr and f"pid {a.pid} on host {socket.gethostname()}" in b.stderr
    a.send_signal(signal.SIGTERM)
    assert a.wait(timeout=120) == 130, a_err.read_text()[-2000:]
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert md5s(out)["config.json"] == config
    assert all(set(r) <= {"step", "t", "loss", "lr", "tokens_per_s"} for r in rows)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))            # one run's rows, each step once
    saved = torch.load(out / "ckpt.pt", weights_only=False)
    assert saved["train_config"]["loss"] == "sddlm" and saved["step"] == rows[-1]["step"]
    assert "checkpoint saved" in a_out.read_text() and sorted(os.listdir(out)) == ["ckpt.pt", "config.json",
                                                                                  "log.jsonl"]
    (out / LOCK).write_text(json.dumps({"pid": a.pid, "host": socket.gethostname(), "started": 0}))  # as a kill leaves
    resumed = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *run4.train, "--out_dir", str(out),
                              "--max_iters", str(saved["step"] + 2), "--log_interval", "1", "--eval_interval", "100000",
                              "--resume", "1"], cwd=tmp_path / "w", env=QUIET, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == saved["step"] + 2 and not (out / LOCK).exists()


def test_locks_never_write_through_nor_replace_a_users_file(tmp_path):
    """out_dir/.lock (train.py, distill.py) and a data folder's <data_dir>.lock (prepare.py) are opened only when
    they are absent or a lock of ours (empty, or a record naming a pid and a host); a link to elsewhere, a user's
    file, a pipe or a folder is refused in one line naming it, and left as it was."""
    from plumbing import lock
    t = tmp_path
    (t / "theirs.txt").write_text("my notes\n")
    for name, make, words in [("link", lambda p: os.symlink(t / "theirs.txt", p), "is a symbolic link"),
                              ("mine", lambda p: p.write_text("my lock notes\n"),
                               "is a file that is not an sddlm lock"),
                              ("pipe", lambda p: os.mkfifo(p), "is a named pipe"),
                              ("dir", lambda p: p.mkdir(), "is a folder")]:
        (t / name).mkdir()
        make(t / name / ".lock")
        with pytest.raises(UsageError, match=f"--out_dir {t / name}: {t / name}/.lock {words}"):
            lock.acquire_folder(str(t / name))
        assert files.kind_of(str(t / name / ".lock")) == files.kind_of(str(t / name / ".lock"))   # still there
        assert os.path.lexists(t / name / ".lock")
    assert (t / "theirs.txt").read_text() == "my notes\n" and (t / "mine" / ".lock").read_text() == "my lock notes\n"
    for name, content in (("empty", ""), ("killed", '{"pid": 999999999, "host": "h", "started": 0}\n')):
        (t / name).mkdir()
        (t / name / ".lock").write_text(content)         # a killed run's lock (or one killed before writing): taken
        held = lock.acquire_folder(str(t / name))
        assert json.loads((t / name / ".lock").read_text())["pid"] == os.getpid()
        held.release()
