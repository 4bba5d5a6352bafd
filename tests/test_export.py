"""trained/export.py: the model folder written beside a checkpoint."""
import os
import subprocess
import sys

import pytest

from conftest import ENV, HERE, unshare_available
from test_train import TINY


@pytest.mark.slow
@pytest.mark.skipif(not unshare_available(), reason="needs unshare (a user namespace) to mount a small tmpfs")
def test_a_full_disk_is_one_line_and_keeps_the_checkpoint(run_ar, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    room = os.path.getsize(run_ar.ckpt) + 300_000           # the checkpoint fits, its model folder does not
    args = " ".join([sys.executable, os.path.join(HERE, "train.py"), *TINY, "--dataset", run_ar.corpus, "--data_dir",
                     run_ar.data_dir, "--out_dir", str(mnt / "run"), "--max_iters", "4", "--eval_interval", "4"])
    script = (f"mount -t tmpfs -o size={room // 1024}k tmpfs {mnt} && {args}; echo rc=$?; ls -A {mnt / 'run'}; "
              f"mount -o remount,size=20m {mnt} && {args} --resume 1; echo rc=$?; ls -A {mnt / 'run' / 'model'}")
    p = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                       capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=300)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert errors[0].startswith(f"error: could not write {mnt / 'run' / 'model'} (") and "No space left" in errors[0]
    assert "ckpt.pt is saved: free space and run the same command with --resume 1" in errors[0]
    lines = p.stdout.splitlines()
    first = lines.index("rc=2")
    assert lines[first:first + 4] == ["rc=2", "ckpt.pt", "config.json", "log.jsonl"]   # no half model folder
    assert lines[-5:] == ["rc=0", "README.md", "config.json", "model.safetensors",   # --resume 1 exports it
                          "tokenizer.model"]
