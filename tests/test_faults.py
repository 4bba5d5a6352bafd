"""Bad input and OS faults through the real scripts: each is ONE 'error:' line on stderr and exit code 2 (or the
correct behaviour), and what was already written is unchanged (md5 of every file before and after).

The script cases run in batches: one child Python per batch executes each case as `python SCRIPT ARGS` would
(runpy, run_name="__main__", so through the script's own run_cli), sparing a torch import per case. Signals,
kills and concurrent preparations use one real process each."""
import errno
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from plumbing import cli
from plumbing import files
from plumbing import runlog
import data
import prepare
import train
from test_train import TINY, _corpus

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": HERE}

RUNNER = r"""
import contextlib, io, json, os, runpy, sys, traceback
results = []
for case in json.load(sys.stdin):
    os.chdir(case["cwd"])
    sys.argv = [case["script"], *case["argv"]]
    saved = dict(os.environ)
    os.environ.update(case.get("env") or {})
    err, out, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            runpy.run_path(os.path.join(os.environ["PYTHONPATH"], case["script"]), run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = "traceback"
    os.environ.clear()
    os.environ.update(saved)
    results.append(dict(case, code=code, stderr=err.getvalue(), stdout=out.getvalue()))
json.dump(results, sys.__stdout__)
"""


def run_batches(*batches):
    """Each batch (a list of dicts: script, argv, cwd, expect) in its own child process, the batches side by
    side -> the cases with code, stderr and stdout."""
    procs = [subprocess.Popen([sys.executable, "-c", RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV, cwd=HERE) for _ in batches]
    for p, batch in zip(procs, batches):
        p.stdin.write(json.dumps([{k: str(v) if k == "cwd" else v for k, v in c.items()} for c in batch]))
        p.stdin.close()
    results = []
    for p in procs:
        out, err = p.stdout.read(), p.stderr.read()
        assert p.wait(timeout=600) == 0, err[-3000:]
        results += json.loads(out)
    return results


def case(script, *argv, cwd, expect, env=None):
    """expect: words of the one error line (exit code 2), or ("ok", words in stdout) for exit code 0. env: variables
    set for this case only."""
    return dict(script=script, argv=[str(a) for a in argv], cwd=str(cwd), expect=expect, env=env or {})


def check(results):
    """Every case failed as one 'error:' line with its words and exit code 2 (or succeeded as expected)."""
    wrong = []
    for r in results:
        if isinstance(r["expect"], list):       # ("ok", words): success
            if r["code"] != 0 or r["expect"][1] not in r["stdout"]:
                wrong.append(r)
            continue
        lines = r["stderr"].strip().splitlines()
        if r["code"] != 2 or len(lines) != 1 or not lines[0].startswith("error: ") or r["expect"] not in lines[0]:
            wrong.append(r)
    assert not wrong, "\n\n".join(f"{r['script']} {' '.join(r['argv'])}\n  expected {r['expect']!r}, got code "
                                  f"{r['code']}, stderr:\n{r['stderr'][-1500:]}" for r in wrong)


def md5s(folder):
    """{relative path: md5} of every file under folder ({} when it does not exist)."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), folder)] = hashlib.md5(fh.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A corpus, its prepared data and a 4-step run (ckpt.pt, log.jsonl, config.json)."""
    root = tmp_path_factory.mktemp("faults")
    _corpus(root / "corpus.txt")
    b = SimpleNamespace(root=root, corpus=str(root / "corpus.txt"), data_dir=str(root / "data"), out=str(root / "run"))
    b.train = TINY + ["--dataset", b.corpus, "--data_dir", b.data_dir]
    assert train.main(b.train + ["--out_dir", b.out, "--max_iters", "4", "--eval_interval", "4"]) == 0
    b.ckpt = os.path.join(b.out, "ckpt.pt")
    return b


# -----------------------------------------------------------------------------------------------
# fast: the shared plumbing

def test_flag_abbreviations_are_refused():
    with pytest.raises(cli.UsageError, match="unrecognized arguments: --max_iter"):
        cli.parse_flags(train.TrainConfig, ["--max_iter", "5"])
    assert cli.parse_flags(train.TrainConfig, ["--max_iters", "5"]).max_iters == 5


def test_run_cli_turns_os_faults_and_ctrl_c_into_one_line(capsys):
    def full():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "out/log.jsonl")

    def ctrl_c():
        raise KeyboardInterrupt
    for main, code, line in [(full, 2, "error: No space left on device: out/log.jsonl"),
                             (ctrl_c, 130, "error: interrupted")]:
        with pytest.raises(SystemExit) as e:
            cli.run_cli(main)
        assert e.value.code == code and capsys.readouterr().err.splitlines() == [line]


def test_failed_writes_keep_the_previous_file_and_leave_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    torch.save({"step": 1, "model_config": {}}, path)     # a checkpoint of ours: replaced, or kept on a failure
    before = path.read_bytes()

    def torch_on_a_full_disk(tmp):   # what torch.save says when the disk fills
        with open(tmp, "wb") as f:
            f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")
    with pytest.raises(OSError, match=r"could not write .*ckpt.pt \(PytorchStreamWriter failed writing file data/0"
                                      r".* GiB free there\); the previous .*ckpt.pt is kept"):
        files.save_atomic(str(path), torch_on_a_full_disk)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["ckpt.pt"]

    log = tmp_path / "log.jsonl"
    files.append_jsonl(str(log), [{"step": 1}])
    real_write = os.write

    def half_then_full(fd, b):
        real_write(fd, b[:len(b) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(cli.os, "write", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        files.append_jsonl(str(log), [{"step": 2, "loss": 1.0}])
    assert log.read_text() == '{"step": 1}\n'                         # no torn line left


def test_output_paths_are_checked_before_the_work(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    (tmp_path / "folder").mkdir()
    files.check_writable(str(tmp_path / "new" / "deeper" / "samples.jsonl"), "--out")   # made when written
    files.check_writable(str(tmp_path / "new_dir"), "--out_dir", folder=True)
    for path, folder, words in [(tmp_path / "folder", False, "is a folder"), (tmp_path / "file", True, "is a file"),
                                (tmp_path / "file" / "x.jsonl", False, "is a file, not a folder"),
                                (tmp_path / "file" / "sub", True, "is a file, not a folder")]:
        with pytest.raises(cli.UsageError, match=words):
            files.check_writable(str(path), "--out", folder=folder)
    monkeypatch.setattr(cli.os, "access", lambda path, mode: False)   # as a non-root user on a read-only folder
    with pytest.raises(cli.UsageError, match="is not writable"):
        files.check_writable(str(tmp_path / "folder" / "s.jsonl"), "--out")


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


# -----------------------------------------------------------------------------------------------
# slow: the scripts themselves

@pytest.mark.slow
def test_bad_flags_fail_at_start_and_create_nothing(base, tmp_path):
    before = md5s(base.data_dir)
    out = tmp_path / "out"
    flags = [(["--eval_interval", "0"], "--eval_interval must be >= 1"),
             (["--log_interval", "0"], "--log_interval must be >= 1"),
             (["--ckpt_interval", "0"], "--ckpt_interval must be >= 1"),
             (["--eval_iters", "-1"], "--eval_iters (0 = the whole split)"),
             (["--eps", "-1"], "--eps must be in (0, 1)"),
             (["--lr", "nan"], "--lr: expected a finite number, got 'nan'"),
             (["--lr", "-1"], "--lr must be in (0, inf)"),
             (["--lr", "inf"], "--lr: expected a finite number, got 'inf'"),
             (["--beta1", "1.5"], "--beta1 must be in [0, 1)"),
             (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
             (["--n_head", "3"], "n_embd=64 must split into n_head=3"),
             (["--dtype", "float16"], "--dtype must be auto, float32 or bfloat16"),
             (["--device", "tpu"], "--device must be auto, cpu or cuda"),
             (["--max_iter", "5"], "unrecognized arguments: --max_iter")]
    if not torch.cuda.is_available():
        flags.append((["--device", "cuda"], "no CUDA device is available"))
    cases = [case("train.py", *base.train, "--out_dir", out, *args, cwd=tmp_path, expect=words)
             for args, words in flags]
    cases += [case("prepare.py", "--dataset", base.corpus, "--block", "16", cwd=tmp_path, expect="unrecognized"),
              case("sample.py", "--ckpt", base.ckpt, "--num_sample", "2", cwd=tmp_path, expect="unrecognized"),
              *[case("eval_ppl.py", "--ckpt", base.ckpt, "--t_min", t_min, cwd=tmp_path,
                     expect="--t_min must be in (0, 1)") for t_min in ("0", "2")],
              case("eval_ppl.py", "--ckpt", base.ckpt, "--max_batches", "-1", cwd=tmp_path,
                   expect="--max_batches must be >= 0")]
    check(run_batches(cases[:10], cases[10:]))
    assert not out.exists() and md5s(base.data_dir) == before and os.listdir(tmp_path) == []


@pytest.mark.slow
def test_refused_resumes_change_nothing_in_out_dir(base, tmp_path):
    ck = torch.load(base.ckpt, weights_only=False)

    def run_dir(name, edit=None, files=("ckpt.pt", "log.jsonl", "config.json")):
        d = tmp_path / name
        d.mkdir()
        for f in files:
            (shutil.copytree if f == "model" else shutil.copy)(os.path.join(base.out, f), d / f)
        if edit is not None:
            edit(d / "ckpt.pt")
        return d

    def edited(change):
        def edit(path):
            c = {k: (dict(v) if isinstance(v, dict) else v) for k, v in ck.items()}
            c["meta"]["data_key"] = dict(c["meta"]["data_key"])
            change(c)
            torch.save(c, path)
        return edit
    dirs = {
        "below": (run_dir("below"), ["--resume", "1", "--max_iters", "2"], "below the checkpoint's step 4"),
        # a finished run, its model folder included (a resume of one whose export failed writes it: test_faults4)
        "noop": (run_dir("noop", files=("ckpt.pt", "log.jsonl", "config.json", "model")),
                 ["--resume", "1", "--max_iters", "4"], ["ok", "already at step 4"]),
        # a pickle's protocol byte of 129: torch warns before it fails, and the report stays one line
        "corrupt": (run_dir("corrupt", lambda p: p.write_bytes(b"\x80\x81" + os.urandom(1998))), ["--resume", "1"],
                    "not a readable checkpoint (not a torch checkpoint, or a damaged one"),
        "foreign": (run_dir("foreign", lambda p: torch.save({"weights": torch.zeros(2)}, p)), ["--resume", "1"],
                    "not a train.py checkpoint (missing model, optimizer"),
        "unknown": (run_dir("unknown", edited(lambda c: c.__setitem__("model_config",
                                                                      {**c["model_config"], "foo": 1}))),
                    ["--resume", "1"], "its model_config has keys this model.py does not know: foo"),
        "tokenizer": (run_dir("tokenizer", edited(lambda c: c["meta"].__setitem__("tokenizer_sha256", "0" * 64))),
                      ["--resume", "1"], "the tokenizer's content differs"),
        "data": (run_dir("data", edited(lambda c: c["meta"]["data_key"].__setitem__("corpus", "0" * 64))),
                 ["--resume", "1"], "the training data differ from the checkpoint's (corpus changed)"),
        "fresh_over_ckpt": (run_dir("fresh_over_ckpt"), [], "exists; pass --resume 1"),
        "fresh_over_log": (run_dir("fresh_over_log", files=("log.jsonl", "config.json")), [],
                           "holds the log of an earlier run"),
    }
    before = {name: md5s(d) for name, (d, _, _) in dirs.items()}
    data_before = md5s(base.data_dir)
    cases = [case("train.py", *base.train, "--out_dir", d, "--max_iters", "8", *args, cwd=tmp_path, expect=words)
             for d, args, words in dirs.values()]
    check(run_batches(cases[:5], cases[5:]))
    assert {name: md5s(d) for name, (d, _, _) in dirs.items()} == before    # config.json included
    assert md5s(base.data_dir) == data_before


@pytest.mark.slow
def test_bad_files_and_paths_are_one_line_and_leave_nothing(base, tmp_path):
    t = tmp_path
    (t / "afile").write_text("x")
    (t / "folder").mkdir()
    (t / "latin1.txt").write_bytes("une phrase en français.\n\nune autre.\n".encode("latin-1"))
    (t / "binary.txt").write_bytes(bytes(range(256)) * 8)
    (t / "bad.model").write_bytes(os.urandom(500))
    (t / "truncated.jsonl").write_text('{"sample": 0, "text": "a b", "ids": [1, 2]}\n{"sample": 1, "te')
    (t / "gold_true.jsonl").write_text('{"context": "a", "choices": ["b", "c"], "gold": true}\n')
    (t / "empty_choice.jsonl").write_text('{"context": "a", "choices": ["b", ""], "gold": 0}\n')
    (t / "latin1.jsonl").write_bytes('{"context": "é", "choices": ["b", "c"], "gold": 0}\n'.encode("latin-1"))
    ck = torch.load(base.ckpt, weights_only=False)
    torch.save({**ck, "meta": {**ck["meta"], "tokenizer": f"sp:{t / 'bad.model'}", "tokenizer_file": None},
                "tokenizer_model": None}, t / "bad_tokenizer.pt")     # a checkpoint without its copy: the file is read
    torch.save({**ck, "model_config": {**ck["model_config"], "foo": 1}}, t / "unknown_key.pt")
    edited = t / "edited.txt"
    shutil.copy(base.corpus, edited)
    prepared = t / "prepared"
    prepare.prepare_dataset(str(edited), "sp:" + data.load_meta(base.data_dir)["tokenizer"][3:], str(prepared), 32,
                         progress=False)
    with open(edited, "a") as f:
        f.write("\nan edit after preparation.\n")
    for d in ("w1", "w2", "w3", "w4", "w5"):      # fresh working folders: what a failure leaves is visible
        (t / d).mkdir()
    before = md5s(base.data_dir), md5s(base.out), md5s(prepared)
    tr = TINY + ["--max_iters", "2"]
    cases = [
        case("train.py", *base.train, "--out_dir", t / "afile", cwd=t, expect="--out_dir"),
        case("train.py", *base.train, "--out_dir", t / "afile" / "sub", cwd=t, expect="afile is a file, not a folder"),
        case("train.py", *TINY, "--dataset", base.corpus, "--data_dir", t / "afile", "--out_dir", t / "o1", cwd=t,
             expect="afile is a file, not a folder"),
        case("train.py", *tr, "--dataset", base.corpus, "--tokenizer", f"sp:{t / 'bad.model'}", "--out_dir", t / "o2",
             cwd=t / "w1", expect="bad.model is not a SentencePiece model"),
        case("train.py", *tr, "--dataset", t / "latin1.txt", "--out_dir", t / "o3", cwd=t / "w2",
             expect="latin1.txt: not UTF-8 text (byte 0xe7 at offset 18)"),
        case("prepare.py", "--dataset", t / "binary.txt", cwd=t / "w3", expect="binary.txt: a binary file, not text (NUL "
             "byte at offset 0)"),
        case("prepare.py", "--dataset", base.corpus, "--tokenizer", "sp_train:320", "--block_size", "100000",
             cwd=t / "w4", expect="gives no sequence of block_size 100000"),
        case("prepare.py", "--dataset", edited, "--tokenizer", "sp:" + data.load_meta(base.data_dir)["tokenizer"][3:],
             "--block_size", "32", "--data_dir", prepared, cwd=t / "w5", expect="different corpus content"),
        case("sample.py", "--ckpt", base.ckpt, "--out", t / "folder", "--steps", "100000", cwd=t,
             expect="--out " + str(t / "folder") + " is a folder"),
        case("eval_ppl.py", "--metric", "genppl", "--samples", t / "truncated.jsonl", "--judge", "nope.pt", cwd=t,
             expect="truncated.jsonl:2: not a JSON line"),
        case("eval_ppl.py", "--ckpt", base.ckpt, "--metric", "zeroshot", "--dataset", t / "latin1.txt", cwd=t,
             expect="latin1.txt: not UTF-8 text"),
        case("eval_ppl.py", "--ckpt", base.ckpt, "--out", t / "folder", cwd=t, expect="is a folder"),
        case("eval_ppl.py", "--ckpt", t / "bad_tokenizer.pt", "--metric", "zeroshot", "--dataset", base.corpus,
             cwd=t, expect="bad.model is not a SentencePiece model"),
        case("sample.py", "--ckpt", t / "unknown_key.pt", "--out", "", cwd=t,
             expect="its model_config has keys this model.py does not know: foo"),
        case("downstream/eval_downstream.py", "--ckpt", base.ckpt, "--jsonl", t / "gold_true.jsonl", cwd=t,
             expect="gold_true.jsonl:1: expected"),
        case("downstream/eval_downstream.py", "--ckpt", base.ckpt, "--jsonl", t / "empty_choice.jsonl", cwd=t,
             expect="empty_choice.jsonl:1: expected"),
        case("downstream/eval_downstream.py", "--ckpt", base.ckpt, "--jsonl", t / "latin1.jsonl", cwd=t,
             expect="latin1.jsonl: not UTF-8 text (byte 0xe9 at offset 13)"),
    ]
    check(run_batches(cases[:8], cases[8:]))
    assert (md5s(base.data_dir), md5s(base.out), md5s(prepared)) == before
    for d in ("w1", "w2", "w3", "w4", "w5"):      # no data/ folder, no temp folder, no lock
        assert os.listdir(t / d) == [], d
    assert not any((t / o).exists() for o in ("o1", "o2", "o3")) and (t / "afile").read_text() == "x"
    assert os.listdir(t / "folder") == []


@pytest.mark.slow
def test_two_preparations_at_once_make_one_correct_folder(base, tmp_path):
    """Two prepare.py runs on the same new dataset, started while a third party holds the folder's lock, so they
    certainly overlap: both succeed, one folder, its checksums verify, tokens equal a single preparation."""
    import fcntl
    corpus = tmp_path / "new.txt"
    shutil.copy(base.corpus, corpus)
    args = ["--dataset", str(corpus), "--tokenizer", "sp_train:320", "--block_size", "32"]
    folder = prepare.prepared_dir(str(corpus), "sp_train:320", 32)
    (tmp_path / "data").mkdir()
    held = os.open(tmp_path / (folder + ".lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    errs = [tmp_path / f"err{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "prepare.py"), *args], cwd=tmp_path, env=ENV,
                              stdout=subprocess.DEVNULL, stderr=open(err, "w")) for err in errs]
    deadline = time.time() + 120
    while time.time() < deadline and not all("waiting for another process" in err.read_text() for err in errs):
        time.sleep(0.1)
    fcntl.flock(held, fcntl.LOCK_UN)                  # both wait: now one prepares, the other waits for it
    os.close(held)
    assert [p.wait(timeout=300) for p in procs] == [0, 0], [err.read_text() for err in errs]
    out = tmp_path / folder
    meta = data.load_meta(str(out))
    data.verify_prepared(str(out), meta)
    single = prepare.prepare_dataset(str(corpus), "sp_train:320", str(tmp_path / "single"), 32, progress=False)
    single_meta = data.load_meta(single)
    for k in ("train_tokens", "train_sequences", "val_tokens", "val_sequences", "sha256"):
        assert meta[k] == single_meta[k], k
    assert os.listdir(tmp_path / "data") == [os.path.basename(folder)]    # no temp folder, no lock


@pytest.mark.slow
def test_sigkill_then_resume_gives_a_log_that_matches_the_checkpoint(base, tmp_path):
    out = tmp_path / "run"
    args = base.train + ["--out_dir", str(out), "--max_iters", "100000", "--ckpt_interval", "4", "--log_interval",
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
    assert train.main(base.train + ["--out_dir", str(out), "--max_iters", str(saved + 6), "--ckpt_interval", "4",
                                    "--log_interval", "1", "--eval_interval", "100000", "--resume", "1"]) == 0
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, saved + 7))     # each step once, none lost
    assert [r["step"] for r in rows if "val_loss" in r] == [saved + 6]
    assert sorted(os.listdir(out)) == ["ckpt.pt", "config.json", "log.jsonl", "model"]


@pytest.mark.slow
def test_signal_during_the_final_evaluation_saves_and_exits_130(base, tmp_path, monkeypatch):
    args = base.train + ["--max_iters", "6", "--eval_interval", "3"]
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
def test_signal_during_end_of_training_sampling_exits_130_promptly(base, tmp_path):
    out = tmp_path / "run"
    args = base.train + ["--out_dir", str(out), "--max_iters", "3", "--eval_interval", "3", "--num_samples", "2",
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


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_is_one_line_and_keeps_the_last_one(base, tmp_path, monkeypatch, capsys):
    real, saves = torch.save, []

    def disk_fills_at_the_second_save(obj, f, *args, **kwargs):
        saves.append(f)
        if len(saves) == 2:
            with open(f, "wb") as fh:
                fh.write(b"partial")
            raise RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing "
                               "file data/0: file write failed")
        return real(obj, f, *args, **kwargs)
    monkeypatch.setattr(torch, "save", disk_fills_at_the_second_save)
    args = base.train + ["--out_dir", str(tmp_path), "--max_iters", "8", "--ckpt_interval", "4", "--eval_interval",
                         "100"]
    with pytest.raises(SystemExit) as e:
        cli.run_cli(lambda: train.main(args))
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: could not write") and \
        err[0].endswith("ckpt.pt is kept"), err               # on a line of its own, after the progress bar
    assert torch.load(tmp_path / "ckpt.pt", weights_only=False)["step"] == 4
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "config.json", "log.jsonl"]     # no temp file left
