"""plumbing/runlog.py: the progress bar (one frame per log update, showing that update's step and mean loss), and
the log a resume keeps: the lines up to its checkpoint."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import ENV, HERE
from plumbing import runlog
from plumbing.runlog import Log
import train


def test_progress_bar_draws_each_update_once_with_its_own_loss(tmp_path, capsys):
    cfg = SimpleNamespace(out_dir=str(tmp_path), batch_size=4, block_size=16, loss="sddlm", max_iters=30,
                          resume=False)
    updates = [(10, 30.0), (20, 20.0), (30, 10.0)]          # (step, loss summed over the 10 steps since the last)
    with Log(cfg, SimpleNamespace(master=True), 0) as log:
        for step, loss_sum in updates:
            time.sleep(0.15)             # past tqdm's mininterval (0.1 s): a step-count update would draw by itself
            log.progress(step, loss_sum, 1e-3)
    frames = [f for f in re.split(r"[\r\n]", capsys.readouterr().err) if "loss=" in f]
    shown = [(int(re.search(r"(\d+)/30", f).group(1)), float(re.search(r"loss=([0-9.]+)", f).group(1)))
             for f in frames]
    expected = [(10, 3.0), (20, 2.0), (30, 1.0)]
    # the first three frames are the three updates; closing the bar may draw the last one again, nothing else
    assert shown[:3] == expected and set(shown[3:]) <= {expected[-1]}, shown


def test_bars_honour_tqdm_disable_even_where_a_script_asks(monkeypatch, capsys):
    """Scripts pass `disable=` to tqdm, which would override tqdm's own TQDM_DISABLE switch (the one a batch job
    sets to keep bars out of its log); cli.bar_hidden restores it. A real bar: sample.generate's."""
    import torch

    import sample

    def model(x, sigma):                                     # uniform logits: the sampler's law is not the point
        return torch.zeros(*x.shape, 11)

    def bar_text(env):
        if env is None:
            monkeypatch.delenv("TQDM_DISABLE", raising=False)
        else:
            monkeypatch.setenv("TQDM_DISABLE", env)
        sample.generate(model, 2, 8, 11, 3, show_progress=True, generator=torch.Generator().manual_seed(0))
        return capsys.readouterr().err

    assert "sampling (3 steps)" in bar_text(None) and "sampling (3 steps)" in bar_text("0")
    assert bar_text("1") == "" and bar_text("True") == ""


def test_an_evaluation_prints_each_estimate_with_se_and_interval():
    """The console line of an evaluation: every estimate with "± its SE" and its 95% interval beside it, the SE and
    interval keys not repeated as metrics of their own; values without an SE as they are."""
    from plumbing.runlog import metrics_line
    line = metrics_line({"val_loss": 2.65, "val_loss_se": 0.0123, "val_nelbo": 5.2023, "val_nelbo_se": 0.0171,
                         "val_ppl": 181.69, "val_ppl_se": 3.11, "val_ppl_lo": 175.7, "val_ppl_hi": 187.9,
                         "val_tokens": 10240, "dt": 0.25})
    assert line == ("val_loss 2.6500 ± 0.0123, val_nelbo 5.2023 ± 0.0171, val_ppl 181.6900 ± 3.1100 (95% "
                    "175.70–187.90), val_tokens 10240, dt 0.2500")


def test_resume_keeps_a_log_line_that_is_not_utf8(tmp_path, monkeypatch):
    """train.py --resume 1 over a log.jsonl with a line that is not UTF-8 (a user's note, an editor's encoding):
    the line is kept byte for byte, like any line that is not JSON, and the run continues."""
    import train
    from test_train import TINY
    from conftest import write_corpus
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "c.txt")
    args = TINY + ["--dataset", "c.txt", "--out_dir", "run", "--log_interval", "1", "--eval_interval", "1000"]
    assert train.main(args + ["--max_iters", "2"]) == 0
    first, *rest = (tmp_path / "run" / "log.jsonl").read_bytes().splitlines(keepends=True)
    (tmp_path / "run" / "log.jsonl").write_bytes(b"".join([first, b'{"note": "caf\xe9"}\n', *rest]))
    assert train.main(args + ["--max_iters", "3", "--resume", "1"]) == 0
    lines = (tmp_path / "run" / "log.jsonl").read_bytes().splitlines()
    assert lines[1] == b'{"note": "caf\xe9"}' and b'"step": 3' in lines[-1]


def test_a_resumed_log_keeps_the_lines_up_to_the_checkpoint(tmp_path):
    log = tmp_path / "log.jsonl"
    rows = [{"step": 5, "loss": 1.0}, {"note": "no step"}, {"step": 10, "loss": 0.9}, {"step": 10, "val_loss": 1.1},
            {"step": 15, "loss": 0.8}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 16, "lo')   # torn by a kill
    runlog.truncate_log(str(log), 10)
    assert [json.loads(line) for line in log.read_text().splitlines()] == rows[:4]
    before = log.read_bytes()
    runlog.truncate_log(str(log), 10)
    assert log.read_bytes() == before


@pytest.mark.slow
def test_sigkill_then_resume_gives_the_checkpoints_log(run4, tmp_path):
    out = tmp_path / "run"
    args = run4.train + ["--out_dir", str(out), "--max_iters", "100000", "--ckpt_interval", "4", "--log_interval",
                         "1", "--eval_interval", "100000"]
    p = subprocess.Popen([sys.executable, "train.py", *args], cwd=HERE, env=ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)

    def logged():
        lines = (out / "log.jsonl").read_text().splitlines() if (out / "log.jsonl").exists() else []
        return [json.loads(line)["step"] for line in lines]
    deadline, steps, saved = time.time() + 120, [], 0
    while time.time() < deadline:       # kill it when the log runs past its last checkpoint (frozen to look)
        time.sleep(0.1)
        if len(logged()) >= 10:
            p.send_signal(signal.SIGSTOP)
            steps, saved = logged(), torch.load(out / "ckpt.pt", weights_only=False)["step"]
            if steps[-1] > saved:
                break
            p.send_signal(signal.SIGCONT)
    p.kill()
    p.wait()
    assert saved >= 8 and steps[-1] > saved
    (out / f"ckpt.pt.sddlm-tmp-{socket.gethostname()}-{p.pid}-0a1b2c3d").write_bytes(b"half")   # cut by the kill
    assert train.main(run4.train + ["--out_dir", str(out), "--max_iters", str(saved + 6), "--ckpt_interval", "4",
                                    "--log_interval", "1", "--eval_interval", "100000", "--resume", "1"]) == 0
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, saved + 7))     # each step once, none lost
    assert [r["step"] for r in rows if "val_loss" in r] == [saved + 6]
    assert sorted(os.listdir(out)) == ["ckpt.pt", "config.json", "log.jsonl", "model"]
