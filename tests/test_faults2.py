"""Faults of a hostile user and a failing machine, part II, through the real scripts: an output that is an input is
refused before any work (the input's md5 unchanged); one run per out_dir (a second one stops at once naming the
holder, a killed holder's lock is taken over); --resume refuses the other script's folder; every stop signal, at
every phase (preparation, start-up, training, evaluation, sampling), ends a script with one line and exit code
130, training saved, and no temp folder, lock or empty out_dir left behind."""
import json
import glob
import ast
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from plumbing import cli
import data
from distillation import distill
from plumbing import files
from plumbing.checkpoint import refuse_other_script
from plumbing.lock import LOCK, acquire_folder
from plumbing.cli import STOP_SIGNALS
from plumbing.signals import stop_signals
from test_train import TINY
from test_faults import ENV, HERE, base, case, check, md5s, run_batches  # noqa: F401  (base: the shared run)

QUIET = {**ENV, "TQDM_DISABLE": "1"}


def wait_until(condition, timeout=120, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


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


def start(script, *args, cwd, name, env=QUIET):
    """script in its own process, stdout and stderr to files in cwd/../name.{out,err} -> (Popen, out, err); no
    progress bars unless env says otherwise."""
    out, err = cwd.parent / f"{name}.out", cwd.parent / f"{name}.err"
    p = subprocess.Popen([sys.executable, os.path.join(HERE, script), *map(str, args)], cwd=cwd, env=env,
                         stdout=open(out, "w"), stderr=open(err, "w"))
    return p, out, err


def big_corpus(path, mb):
    rng = random.Random(1)
    words = "the a cat dog bird fish tree house sees likes finds eats under over near far small big".split()
    with open(path, "w") as f:
        for _ in range(mb * 2 ** 20 // 6000):
            f.write("\n".join(" ".join(rng.choices(words, k=12)) + " ." for _ in range(100)) + "\n\n")
    return str(path)


@pytest.fixture(scope="module")
def dcd(base):
    """A 2-step distillation/distill.py run of the shared run's checkpoint."""
    out = str(base.root / "dcd")
    assert distill.main(["--init", base.ckpt, "--out_dir", out, "--max_iters", "2", "--batch_size", "8",
                         "--eval_iters", "2", "--num_samples", "0", "--log_interval", "1", "--round_iters", "3",
                         "--T", "16", "--warmup_iters", "1", "--eval_interval", "2", "--ckpt_interval", "2"]) == 0
    return out


# -----------------------------------------------------------------------------------------------
# fast: the plumbing

def test_an_output_is_refused_when_it_is_an_input_by_resolved_path(tmp_path):
    ckpt, corpus = tmp_path / "run" / "ckpt.pt", tmp_path / "corpus"
    ckpt.parent.mkdir()
    corpus.mkdir()
    ckpt.write_bytes(b"weights")
    (corpus / "a.txt").write_text("text")
    os.symlink(ckpt, tmp_path / "link.pt")
    os.link(ckpt, tmp_path / "hard.pt")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "ckpt_40.pt").write_bytes(b"kept")
    refused = [
        ({"--out": str(ckpt)}, {"--ckpt": str(ckpt)}, "is the input --ckpt"),
        ({"--out": str(tmp_path / "hard.pt")}, {"--ckpt": str(tmp_path / "link.pt")}, "is the input --ckpt"),
        ({"--out": str(tmp_path / "run" / ".." / "run" / "ckpt.pt")}, {"--ckpt": "sp:" + str(ckpt)}, "itself"),
        ({"--out_dir": files.run_outputs(str(tmp_path / "run"))}, {"--init": str(ckpt)}, "writes"),
        ({"--out_dir": files.run_outputs(str(tmp_path / "r"))}, {"--judge": str(tmp_path / "r" / "ckpt_40.pt")},
         "ckpt_*.pt, which is the input --judge"),                 # a kept checkpoint, by the glob
        ({"--out": str(tmp_path / "run")}, {"--ckpt": str(ckpt)}, "lies inside it"),
        ({"--out_dir": files.run_outputs(str(corpus / "run"))}, {"--dataset": str(corpus)}, "inside the input folder"),
    ]
    for outputs, inputs, words in refused:
        with pytest.raises(cli.UsageError, match=words.replace("*", r"\*")):
            files.refuse_overwrite(outputs, inputs)
    allowed = [({"--out": str(tmp_path / "samples.jsonl")}, {"--ckpt": str(ckpt)}),
               ({"--out": str(ckpt)}, {"--judge": "gpt2-large", "--tokenizer": "hf:bert-base-uncased", "--x": ""}),
               ({"--out_dir": files.run_outputs(str(tmp_path / "run"))}, {"--init": "", "--data_dir": str(corpus)}),
               ({"--out": ""}, {"--ckpt": str(ckpt)})]
    for outputs, inputs in allowed:
        files.refuse_overwrite(outputs, inputs)
    assert (ckpt.read_bytes(), (corpus / "a.txt").read_text()) == (b"weights", "text")


def test_a_held_out_dir_is_refused_naming_its_holder_and_a_dead_holders_lock_is_taken_over(tmp_path):
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


def test_every_stop_signal_ends_a_script_with_one_line_and_exit_130(capsys):
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


def test_deferred_signals_hold_a_signal_another_thread_received_until_the_block_ends():
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


SCRIPTS = sorted(os.path.relpath(f, HERE) for f in glob.glob(os.path.join(HERE, "*.py")) + glob.glob(
    os.path.join(HERE, "*", "*.py")) if "run_cli(" in open(f).read() and os.path.relpath(f, HERE).split(os.sep)[0]
    not in ("plumbing", "tests", "tools"))


def _catches(pid, sig):
    """Whether process pid has a handler for sig (Linux: the SigCgt mask in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)


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
def test_a_stop_signal_while_a_script_loads_its_imports_is_one_line_and_130(script, tmp_path):
    p = subprocess.Popen([sys.executable, os.path.join(HERE, script)], cwd=tmp_path, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not _catches(p.pid, signal.SIGTERM) and time.time() - t0 < 30:   # cli.stop_at_once has run
        time.sleep(0.002)
    p.send_signal(signal.SIGTERM)                                            # torch is still loading
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.splitlines() == ["error: interrupted by SIGTERM while starting"], err
    assert os.listdir(tmp_path) == []


def test_stale_temps_of_dead_writers_are_removed_and_live_ones_kept(tmp_path):
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    live, host = os.getppid(), socket.gethostname()
    stale = [f"ckpt.pt.tmp{dead}", f"model.tmp{dead}", f"model.old{dead}", f"data.tmp-{host}-{dead}-x1y2"]
    kept = ["ckpt.pt", f"ckpt.pt.tmp{live}", f"model.old{live}", f"model.tmp{os.getpid()}",
            f"data.tmp-{host}-{live}-ab", f"data.tmp-other-{dead}-a", f"ckpt_4.pt.tmpx{dead}", "model", "data"]
    for name in stale + kept:
        (tmp_path / name).mkdir() if name.startswith(("model", "data")) else (tmp_path / name).write_bytes(b"")
    for path in ("ckpt.pt", "model", "data"):
        files.remove_stale_temps(str(tmp_path / path))
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


def test_resume_refuses_the_other_scripts_folder():
    trained = {"model": {}, "train_config": {}, "optimizer": {}}
    distilled = {**trained, "distill_config": {}, "teacher": {}}
    refuse_other_script(trained, "run", "train.py")
    refuse_other_script(distilled, "dcd", "distillation/distill.py")
    refuse_other_script({"weights": 1}, "x", "train.py")        # foreign: its own message comes later
    with pytest.raises(cli.ConfigError, match="written by distillation/distill.py; continue it with python distillation/distill.py --out_dir "
                                              "dcd --resume 1"):
        refuse_other_script(distilled, "dcd", "train.py")
    with pytest.raises(cli.ConfigError, match="written by train.py; continue it with python train.py --out_dir run "
                                              "--resume 1, or distil it into a new folder"):
        refuse_other_script(trained, "run", "distillation/distill.py")


# -----------------------------------------------------------------------------------------------
# slow: the scripts themselves

@pytest.mark.slow
def test_outputs_that_are_inputs_and_the_other_scripts_folder_are_refused_changing_nothing(base, dcd, tmp_path):
    t = tmp_path
    corpus_dir = t / "corpus"
    corpus_dir.mkdir()
    shutil.copy(base.corpus, corpus_dir / "c.txt")
    os.symlink(base.ckpt, t / "link.pt")
    os.link(base.ckpt, t / "hard.pt")
    (t / "task.jsonl").write_text('{"context": "a", "choices": ["b", "c"], "gold": 0}\n')
    (t / "s.jsonl").write_text('{"sample": 0, "text": "a b", "ids": [1, 2]}\n')
    before = md5s(base.out), md5s(dcd), md5s(corpus_dir), md5s(base.data_dir)
    listing = sorted(os.listdir(t))
    run_out = os.path.join(base.out, "ckpt.pt")
    cases = [
        case("eval_ppl.py", "--ckpt", base.ckpt, "--out", base.ckpt, cwd=t, expect="is the input --ckpt"),
        case("eval_ppl.py", "--ckpt", t / "link.pt", "--out", t / "hard.pt", cwd=t, expect="is the input --ckpt"),
        case("downstream/eval_downstream.py", "--ckpt", base.ckpt, "--jsonl", t / "task.jsonl", "--out", base.ckpt, cwd=t,
             expect="is the input --ckpt"),
        case("sample.py", "--ckpt", base.ckpt, "--out", t / "link.pt", cwd=t, expect="is the input --ckpt"),
        case("eval_ppl.py", "--metric", "genppl", "--samples", t / "s.jsonl", "--save_samples", t / "s.jsonl",
             cwd=t, expect="--save_samples " + str(t / "s.jsonl") + " is the input --samples"),
        case("distillation/distill.py", "--init", base.ckpt, "--out_dir", base.out, cwd=t,
             expect=f"--out_dir writes {run_out}, which is the input --init"),
        case("train.py", *base.train, "--judge", base.ckpt, "--out_dir", base.out, "--resume", "1", cwd=t,
             expect=f"--out_dir writes {run_out}, which is the input --judge"),
        case("train.py", *base.train, "--dataset", corpus_dir, "--out_dir", corpus_dir / "run", cwd=t,
             expect="lies inside the input folder --dataset"),
        case("prepare.py", "--dataset", corpus_dir, "--data_dir", corpus_dir / "prepared", cwd=t,
             expect="lies inside the input folder --dataset"),
        case("hub/pretrained.py", "--ckpt", base.ckpt, "--out", base.out, cwd=t,
             expect="would be written over the input --ckpt"),
        case("figures/plot.py", "--runs", base.out, "--table", os.path.join(base.out, "log.jsonl"), cwd=t,
             expect="is the input --runs"),
        case("train.py", *base.train, "--out_dir", dcd, "--resume", "1", cwd=t,
             expect=f"written by distillation/distill.py; continue it with python distillation/distill.py --out_dir {dcd} --resume 1"),
        case("distillation/distill.py", "--out_dir", base.out, "--resume", "1", cwd=t,
             expect=f"written by train.py; continue it with python train.py --out_dir {base.out} --resume 1"),
        case("distillation/distill.py", "--init", t / "nope.pt", "--out_dir", t / "dd", cwd=t, expect="no such checkpoint"),
    ]
    check(run_batches(cases[:7], cases[7:]))
    assert (md5s(base.out), md5s(dcd), md5s(corpus_dir), md5s(base.data_dir)) == before
    assert sorted(os.listdir(t)) == listing            # no out_dir, data folder or lock left by a refused run


@pytest.mark.slow
def test_a_second_run_into_a_running_out_dir_stops_at_once_and_a_dead_runs_lock_is_taken_over(base, tmp_path):
    out = tmp_path / "run"
    (tmp_path / "w").mkdir()
    a, a_out, a_err = start("train.py", *base.train, "--out_dir", out, "--max_iters", "100000", "--log_interval", "1",
                            "--ckpt_interval", "5", "--eval_interval", "100000", cwd=tmp_path / "w", name="a")
    wait_until(lambda: (out / "log.jsonl").exists() and (out / "log.jsonl").read_text().count("\n") >= 2,
               what="the first run's log")
    config = md5s(out)["config.json"]
    t0 = time.time()
    b = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *base.train, "--loss", "sddlm_v1",
                        "--out_dir", str(out), "--max_iters", "20"], cwd=tmp_path / "w", env=QUIET,
                       capture_output=True, text=True, timeout=300)
    assert b.returncode == 2 and time.time() - t0 < 60, b.stderr[-2000:]
    assert b.stderr.splitlines() == [b.stderr.strip()] and \
        f"is in use by another run (train.py" in b.stderr and f"pid {a.pid} on host {socket.gethostname()}" in b.stderr
    a.send_signal(signal.SIGTERM)
    assert a.wait(timeout=120) == 130, a_err.read_text()[-2000:]
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert md5s(out)["config.json"] == config and all(set(r) <= {"step", "t", "loss", "lr", "tokens_per_s"} for r in rows)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))            # one run's rows, each step once
    saved = torch.load(out / "ckpt.pt", weights_only=False)
    assert saved["train_config"]["loss"] == "sddlm" and saved["step"] == rows[-1]["step"]
    assert "checkpoint saved" in a_out.read_text() and sorted(os.listdir(out)) == ["ckpt.pt", "config.json",
                                                                                  "log.jsonl"]
    (out / LOCK).write_text(json.dumps({"pid": a.pid, "host": socket.gethostname(), "started": 0}))  # as a kill leaves
    resumed = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *base.train, "--out_dir", str(out),
                              "--max_iters", str(saved["step"] + 2), "--log_interval", "1", "--eval_interval", "100000",
                              "--resume", "1"], cwd=tmp_path / "w", env=QUIET, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == saved["step"] + 2 and not (out / LOCK).exists()


@pytest.mark.slow
def test_stop_signals_during_preparation_leave_no_temp_folder_lock_or_empty_folder(base, tmp_path):
    corpus = big_corpus(tmp_path / "big.txt", 4)
    tokenizer = data.load_meta(base.data_dir)["tokenizer"]
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
        return (cwd / "data").is_dir() and any(".tmp-" in n for n in os.listdir(cwd / "data"))
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
def test_stop_signals_of_schedulers_and_terminals_during_training_save_and_exit_130(base, tmp_path):
    runs = []
    for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGXCPU):     # SIGINT, SIGTERM: test_faults.py
        out = tmp_path / signal.Signals(sig).name
        runs.append((sig, out, *start("train.py", *base.train, "--out_dir", out, "--max_iters", "100000",
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
def test_a_signal_at_start_up_in_sampling_and_in_evaluation_is_one_line_and_130(base, tmp_path):
    before = md5s(base.out)
    (tmp_path / "w").mkdir()
    w = tmp_path / "w"
    train_p = start("train.py", *base.train, "--out_dir", w / "run", "--max_iters", "100000", cwd=w, name="train")
    sample_p = start("sample.py", "--ckpt", base.ckpt, "--steps", "1000000", "--out", w / "s.jsonl", cwd=w,
                     name="sample", env=ENV)                  # its bar says when sampling has begun
    eval_p = start("eval_ppl.py", "--ckpt", base.ckpt, "--mc_draws", "100000", "--out", w / "e.json", cwd=w,
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
    assert md5s(base.out) == before
