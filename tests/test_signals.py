"""plumbing/signals.py and cli's stop handling: every stop signal, at any moment of a script (its imports, its
work, its exit), ends it with one line and exit 130, a run's checkpoint saved and nothing half-written left."""
import ast
import glob
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import ENV, HERE, md5s, one_error, start, wait_until
import data
from plumbing import cli
from plumbing.cli import STOP_SIGNALS
from plumbing.lock import LOCK
from plumbing.signals import stop_signals
from test_train import TINY
import train


def stop(p):
    """SIGSTOP p and wait until the kernel has stopped it (state T in /proc/PID/stat): the signal takes effect
    asynchronously, after a system call in progress (a rename, say) completes."""
    p.send_signal(signal.SIGSTOP)

    def state():
        with open(f"/proc/{p.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    wait_until(lambda: state() == "T", timeout=30, what=f"process {p.pid} to stop")


def catches(pid, sig):
    """True once process pid has a Python handler for sig (cli.run_cli installed them: start-up proper)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (sig - 1) & 1)


def big_corpus(path, mb):
    rng = random.Random(1)
    words = "the a cat dog bird fish tree house sees likes finds eats under over near far small big".split()
    with open(path, "w") as f:
        for _ in range(mb * 2 ** 20 // 6000):
            f.write("\n".join(" ".join(rng.choices(words, k=12)) + " ." for _ in range(100)) + "\n\n")
    return str(path)


SCRIPTS = sorted(os.path.relpath(f, HERE) for f in glob.glob(os.path.join(HERE, "*.py")) + glob.glob(
    os.path.join(HERE, "*", "*.py")) if "run_cli(" in open(f).read() and os.path.relpath(f, HERE).split(os.sep)[0]
    not in ("plumbing", "tests", "tools"))


def catches_now(pid, sig):
    """Whether process pid has a handler for sig (Linux: the SigCgt mask in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)


LATE = r"""
import os, signal, sys
from plumbing import cli
cli.stop_at_once("__main__")

class Late:                                           # freed by the interpreter's shutdown, after the exit handlers
    def __del__(self, kill=os.kill, pid=os.getpid(), sig=signal.SIGTERM):
        kill(pid, sig)
late = Late()
if sys.argv[1] == "import":                           # the imports before run_cli (torch's) run out of memory
    raise RuntimeError("std::bad_alloc")

def main():
    if sys.argv[1] == "atexit":                       # a signal while the exit handlers run
        import atexit
        atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))
    if sys.argv[1] == "memory":
        raise MemoryError
    print("done")
    return 0
cli.run_cli(main)
"""


@pytest.mark.slow
def test_signal_during_the_final_evaluation_saves_and_exits_130(run4, tmp_path, monkeypatch):
    args = run4.train + ["--max_iters", "6", "--eval_interval", "3"]
    assert train.main(args + ["--out_dir", str(tmp_path / "ref")]) == 0
    real = train.evaluate

    def slow_final_evaluation(run, cfg, data_dir, env):
        if run.it < cfg.max_iters:
            return real(run, cfg, data_dir, env)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)                    # the evaluation would go on; the signal must end it
        raise AssertionError("not interrupted")
    monkeypatch.setattr(train, "evaluate", slow_final_evaluation)
    t0 = time.time()
    assert train.main(args + ["--out_dir", str(tmp_path / "run")]) == 130 and time.time() - t0 < 30
    ref, ck = (torch.load(tmp_path / d / "ckpt.pt", weights_only=False) for d in ("ref", "run"))
    assert ck["step"] == 6
    for k in ref["model"]:                # the checkpoint the uninterrupted run saves, EMA swapped back
        assert torch.equal(ck["model"][k], ref["model"][k]) and torch.equal(ck["ema"][k], ref["ema"][k]), k


@pytest.mark.slow
def test_signal_in_end_of_training_sampling_exits_130_promptly(run4, tmp_path):
    out = tmp_path / "run"
    args = run4.train + ["--out_dir", str(out), "--max_iters", "3", "--eval_interval", "3", "--num_samples", "2",
                         "--sample_steps", "1000000"]
    p = subprocess.Popen([sys.executable, "train.py", *args], cwd=HERE, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "ckpt.pt").exists():
        time.sleep(0.05)
    time.sleep(0.5)                                   # now in the sampler (a million steps)
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 130 and time.time() - t0 < 20, stderr[-2000:]
    assert "stopped by signal 15 after training; checkpoint of step 3 saved" in stdout
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == 3


def test_every_stop_signal_ends_a_script_in_one_line_and_130(capsys):
    assert {signal.Signals(s).name for s in STOP_SIGNALS} >= {"SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2",
                                                              "SIGQUIT", "SIGXCPU"}
    for sig in STOP_SIGNALS:
        left = []

        def main():
            try:
                os.kill(os.getpid(), sig)
                time.sleep(30)                # the work a signal must end
            finally:
                left.append("cleaned up")      # a `finally` on the way out runs (temp folders, locks)
        t0 = time.time()
        with pytest.raises(SystemExit) as e:
            cli.run_cli(main)
        assert e.value.code == 130 and time.time() - t0 < 10 and left == ["cleaned up"]
        assert capsys.readouterr().err.splitlines() == [f"error: interrupted by {signal.Signals(sig).name}"]
        with stop_signals() as stop:               # the training loop: a flag, the run saves at the next step
            os.kill(os.getpid(), sig)
            time.sleep(0.01)
            assert stop["signal"] == sig


def test_deferred_signals_hold_another_threads_signal_to_the_end():
    """The kernel gives a process's signal to any thread that does not block it (torch's, a pool's); Python then
    runs the handler in the main thread at once. Deferring by the main thread's mask alone let it through."""
    from plumbing.signals import deferred_signals
    old = cli.set_stop_handlers(cli._raise)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    inside = []
    try:
        with pytest.raises(cli.Interrupted) as e:
            with deferred_signals():
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})     # only the other thread can take it
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.2)
                    sum(range(10 ** 6))                                      # bytecode: where a handler would run
                    inside.append("done")
                finally:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        assert inside == ["done"] and e.value.signum == signal.SIGTERM
        with stop_signals() as flag:                # under the training loop's handler: the flag, after the block
            with deferred_signals():
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(0.05)
                assert flag["signal"] is None
            assert flag["signal"] == signal.SIGUSR1
    finally:
        stop.set()
        other.join()
        for signum, handler in old.items():
            signal.signal(signum, handler)


def test_handlers_set_outside_python_are_left_in_place():
    """signal.getsignal says None for a handler set outside Python: putting the handlers back (deferred_signals,
    stop_signals) skips it rather than failing with a TypeError."""
    before = signal.getsignal(signal.SIGTERM)
    assert cli.set_stop_handlers({signal.SIGTERM: None}) == {} and signal.getsignal(signal.SIGTERM) is before


def test_every_script_handles_stop_signals_before_its_imports():
    assert len(SCRIPTS) >= 10
    for name in SCRIPTS:
        source = open(os.path.join(HERE, name)).read()
        body = ast.parse(source).body
        body = body[1:] if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else body
        imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))
                   and not (isinstance(n, ast.Import) and [a.name for a in n.names] == ["os", "sys"])]
        first = imports[0]                                  # a folder's script puts the root on the path first
        after = body[body.index(first) + 1]
        assert ast.get_source_segment(source, first) == "from plumbing import cli", name
        assert ast.get_source_segment(source, after) == "cli.stop_at_once(__name__)", name
        assert all(n.lineno >= first.lineno for n in imports), name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
@pytest.mark.parametrize("script", ["train.py", "sample.py", "prepare.py"])
def test_a_signal_during_imports_is_one_line_and_130(script, tmp_path):
    p = subprocess.Popen([sys.executable, os.path.join(HERE, script)], cwd=tmp_path, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not catches_now(p.pid, signal.SIGTERM) and time.time() - t0 < 30:   # cli.stop_at_once has run
        time.sleep(0.002)
    p.send_signal(signal.SIGTERM)                                            # torch is still loading
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.splitlines() == ["error: interrupted by SIGTERM while starting"], err
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_signals_in_preparation_leave_no_temp_lock_or_folder(run4, tmp_path):
    corpus = big_corpus(tmp_path / "big.txt", 4)
    tokenizer = data.load_meta(run4.data_dir)["tokenizer"]
    runs = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):   # all of them: the fast tests
        cwd = tmp_path / signal.Signals(sig).name
        cwd.mkdir()
        args = ["--dataset", corpus, "--tokenizer", tokenizer, "--block_size", "32",
                "--num_proc", "2" if sig == signal.SIGTERM else "1"]
        runs.append((sig, cwd, *start("prepare.py", *args, cwd=cwd, name=cwd.name)))
    cwd = tmp_path / "train"                   # train.py's own preparation, with its out_dir made at start
    cwd.mkdir()
    runs.append((signal.SIGTERM, cwd, *start("train.py", *TINY, "--dataset", corpus, "--tokenizer", tokenizer,
                                             "--out_dir", cwd / "run", cwd=cwd, name="train")))
    def preparing(cwd):
        return (cwd / "data").is_dir() and any(".sddlm-tmp-" in n for n in os.listdir(cwd / "data"))
    waiting = list(runs)

    def signal_those_preparing():           # each as soon as its temp folder appears
        for run in list(waiting):
            sig, cwd, p, _, err = run
            if preparing(cwd):
                stop(p)                        # held still: certainly inside the preparation
                assert preparing(cwd), cwd.name
                p.send_signal(sig)
                p.send_signal(signal.SIGCONT)
                waiting.remove(run)
            else:
                assert p.poll() is None, (cwd.name, err.read_text()[-2000:])
        return not waiting
    wait_until(signal_those_preparing, what="the temp folders")
    for sig, cwd, p, _, err in runs:
        assert p.wait(timeout=120) == 130, (cwd.name, err.read_text()[-2000:])
        assert err.read_text().splitlines() == [f"error: interrupted by {signal.Signals(sig).name}"], cwd.name
        left = sorted(os.path.relpath(os.path.join(r, f), cwd) for r, ds, fs in os.walk(cwd) for f in ds + fs)
        assert left == [], (cwd.name, left)                # no data/, temp folder, lock or out_dir


@pytest.mark.slow
def test_scheduler_and_terminal_signals_in_training_save_and_130(run4, tmp_path):
    runs = []
    for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGXCPU):     # SIGINT, SIGTERM: the tests above
        out = tmp_path / signal.Signals(sig).name
        runs.append((sig, out, *start("train.py", *run4.train, "--out_dir", out, "--max_iters", "100000",
                                      "--log_interval", "1", "--ckpt_interval", "1000", "--eval_interval", "100000",
                                      cwd=tmp_path, name=out.name)))
    for sig, out, p, _, err in runs:
        wait_until(lambda: (out / "log.jsonl").exists() or p.poll() is not None, what=f"{out.name}'s training")
        p.send_signal(sig)
    for sig, out, p, stdout, err in runs:
        assert p.wait(timeout=120) == 130, (out.name, err.read_text()[-2000:])
        steps = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
        step = torch.load(out / "ckpt.pt", weights_only=False)["step"]
        assert step == steps[-1] and f"stopped by signal {int(sig)} at step {step}; checkpoint saved" in \
            stdout.read_text(), out.name
        assert not (out / LOCK).exists() and "Traceback" not in err.read_text()


@pytest.mark.slow
def test_a_signal_at_start_up_of_sample_and_eval_is_one_line_130(run4, tmp_path):
    before = md5s(run4.out)
    (tmp_path / "w").mkdir()
    w = tmp_path / "w"
    train_p = start("train.py", *run4.train, "--out_dir", w / "run", "--max_iters", "100000", cwd=w, name="train")
    sample_p = start("sample.py", "--ckpt", run4.ckpt, "--steps", "1000000", "--out", w / "s.jsonl", cwd=w,
                     name="sample", env=ENV)                  # its bar says when sampling has begun
    eval_p = start("eval_ppl.py", "--ckpt", run4.ckpt, "--mc_draws", "100000", "--out", w / "e.json", cwd=w,
                   name="eval", env=ENV)
    wait_until(lambda: catches(train_p[0].pid, signal.SIGTERM) or train_p[0].poll() is not None, what="start-up")
    train_p[0].send_signal(signal.SIGTERM)        # handlers installed: while its imports load, or later in start-up
    wait_until(lambda: "sampling" in sample_p[2].read_text() or sample_p[0].poll() is not None, what="sampling")
    time.sleep(0.5)
    sample_p[0].send_signal(signal.SIGTERM)
    wait_until(lambda: "nelbo" in eval_p[2].read_text() or eval_p[0].poll() is not None, what="evaluation")
    eval_p[0].send_signal(signal.SIGUSR1)
    for name, (p, out, err), sig in [("sample", sample_p, "SIGTERM"), ("eval", eval_p, "SIGUSR1")]:
        assert p.wait(timeout=120) == 130, err.read_text()[-2000:]
        assert err.read_text().splitlines()[-1] == f"error: interrupted by {sig}", name
        assert "Traceback" not in err.read_text()
    p, out, err = train_p
    assert p.wait(timeout=120) == 130, err.read_text()[-2000:]
    if (w / "run" / "ckpt.pt").exists():          # the signal came after the loop began: saved, resumable
        assert "checkpoint saved" in out.read_text()
    else:
        assert err.read_text().splitlines() in (["error: interrupted by SIGTERM"],
                                                ["error: interrupted by SIGTERM while starting"])
        assert not (w / "run").exists() or sorted(os.listdir(w / "run")) == ["config.json"]
    assert not (w / "run" / LOCK).exists() and not (w / "s.jsonl").exists() and not (w / "e.json").exists()
    assert md5s(run4.out) == before


def test_a_signal_while_a_script_exits_never_kills_it(tmp_path):
    (tmp_path / "late.py").write_text(LATE)
    run = lambda how: subprocess.run([sys.executable, "late.py", how], capture_output=True, text=True, env=ENV,
                                     cwd=tmp_path, timeout=120)
    p = run("shutdown")               # SIGTERM during the interpreter's shutdown: was 143, killed by the signal
    assert p.returncode == 0 and p.stdout == "done\n" and p.stderr == "", (p.returncode, p.stderr)
    p = run("atexit")                 # during the exit handlers: 130 and one line (was 130 with no word)
    assert one_error(p, 130) == "error: interrupted by SIGTERM while exiting"
    p = run("memory")                 # Python's own MemoryError is the out-of-memory line, as torch's
    assert one_error(p).startswith("error: out of memory: CPU out of memory (Python's MemoryError)")
    p = run("import")                 # what torch's import raises under `ulimit -v` (measured: 600 MB)
    assert one_error(p).startswith("error: out of memory while starting: CPU out of memory (std::bad_alloc)")


@pytest.mark.slow
def test_a_second_stop_signal_during_the_stop_exits_130(run_ar, tmp_path):
    codes = []
    for gap in (0.0, 0.05, 0.3):
        out = tmp_path / f"run{gap}"
        p, stdout, err = start("train.py", *run_ar.train, "--out_dir", out, "--max_iters", "100000", "--log_interval",
                               "1", "--eval_interval", "100000", "--ckpt_interval", "100000", cwd=tmp_path,
                               name=out.name)
        wait_until(lambda: (out / "log.jsonl").exists() or p.poll() is not None, what="training")
        p.send_signal(signal.SIGTERM)
        time.sleep(gap)
        p.send_signal(signal.SIGTERM)
        codes.append(p.wait(timeout=120))
        assert "Traceback" not in err.read_text() and (out / "ckpt.pt").exists()
    assert codes == [130, 130, 130]
