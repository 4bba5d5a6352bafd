"""Nothing lost, nothing silent, part III (issue 30), through the real scripts: a user's files in a data folder
prepared again, data of another tokenizer of the same size, an edited meta.json or train.bin, non-finite float
flags, the default data folder as the run's folder, text that is no Unicode, an empty sample, a full disk at the
model export, a named pipe as the corpus, model folders for eval_downstream.py, and the exit codes of a stop
signal while a script exits. Each fault is ONE 'error:' line (progress bars aside), no traceback, exit code 2
(130 for a signal), and what was already written is unchanged (md5 of every file before and after). Script cases
run in batches (tests/test_faults.py's runner)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

import prepare
import train
from test_faults import ENV, HERE, RUNNER, case, md5s, run_batches
from test_faults3 import _unshare_available, check
from test_train import TINY, _corpus


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A corpus, its prepared data, a 4-step diffusion run (with its model folder), a 4-step AR run (a Gen PPL
    judge), and a corpus prepared with a tokenizer of the same size but other pieces."""
    root = tmp_path_factory.mktemp("faults4")
    _corpus(root / "corpus.txt")
    text = (root / "corpus.txt").read_text()
    (root / "other.txt").write_text(text.replace("the ", "a ").replace("cat", "lion").replace("dog", "wolf"))
    b = SimpleNamespace(root=root, corpus=str(root / "corpus.txt"), data_dir=str(root / "data"),
                        out=str(root / "run"), ar=str(root / "ar"), other=str(root / "other_data"))
    b.train = TINY + ["--dataset", b.corpus, "--data_dir", b.data_dir]
    short = ["--max_iters", "4", "--eval_interval", "4"]
    assert train.main(b.train + ["--out_dir", b.out, *short]) == 0
    assert train.main(b.train + ["--out_dir", b.ar, "--loss", "ar", *short]) == 0
    prepare.prepare_dataset(str(root / "other.txt"), "sp_train:320", b.other, 32, progress=False)
    b.ckpt = os.path.join(b.out, "ckpt.pt")
    return b


def copy_data(b, folder, edit_meta=None):
    """A copy of the base data folder (times kept); edit_meta(meta dict) changes its meta.json."""
    shutil.copytree(b.data_dir, folder, copy_function=shutil.copy2)
    if edit_meta is not None:
        meta = json.loads((folder / "meta.json").read_text())
        edit_meta(meta)
        (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def one_error(p, code=2):
    """p (a CompletedProcess) ended with `code` and stderr's last line is its one 'error: ' line -> that line."""
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert p.returncode == code and len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in p.stderr, \
        (p.returncode, p.stderr[-2000:])
    return errors[0]


# -----------------------------------------------------------------------------------------------
# the scripts, in batches

@pytest.mark.slow
def test_bad_numbers_other_tokenizers_and_edited_data_are_refused_at_start(base, tmp_path):
    t = tmp_path
    up = copy_data(base, t / "meta_up", lambda m: m.update(vocab_size=m["vocab_size"] + 80))
    down = copy_data(base, t / "meta_down", lambda m: m.update(vocab_size=m["vocab_size"] - 20))
    before = md5s(base.root)
    run = lambda name: ["--out_dir", t / name, "--max_iters", "4", "--eval_interval", "4"]
    cases = [
        # every float flag, every script: nan, inf and -inf are no values (plumbing/cli.finite_float)
        case("train.py", *base.train, *run("lr"), "--lr", "nan", cwd=t, expect="--lr: expected a finite number"),
        case("train.py", *base.train, *run("gm"), "--gamma_min=-inf", cwd=t,
             expect="--gamma_min: expected a finite number, got '-inf'"),
        case("sample.py", "--ckpt", base.ckpt, "--prompt", "the cat", "--cfg_w", "nan", "--out", t / "s.jsonl",
             cwd=t, expect="--cfg_w: expected a finite number, got 'nan'"),
        case("sample.py", "--ckpt", base.ckpt, "--top_p", "inf", cwd=t, expect="--top_p: expected a finite number"),
        case("eval_ppl.py", "--ckpt", base.ckpt, "--t_min", "nan", cwd=t, expect="--t_min: expected a finite number"),
        case("prepare.py", "--dataset", base.corpus, "--val_fraction", "inf", cwd=t,
             expect="--val_fraction: expected a finite number"),
        # data of another tokenizer of the same size: its NELBO would be a number about other text
        case("eval_ppl.py", "--ckpt", base.ckpt, "--data_dir", base.other, "--max_batches", "1", cwd=t,
             expect=f"{base.other} was prepared with another tokenizer"),
        case("eval_ppl.py", "--ckpt", os.path.join(base.out, "model"), "--data_dir", base.other, "--max_batches",
             "1", cwd=t, expect=f"{base.other} was prepared with another tokenizer"),
        # meta.json's vocab_size edited, upward and downward: refused before any training or evaluation
        case("train.py", *TINY, "--dataset", base.corpus, "--data_dir", up, *run("up"), cwd=t,
             expect="does not describe its tokenizer"),
        case("train.py", *TINY, "--dataset", base.corpus, "--data_dir", down, *run("down"), cwd=t,
             expect="vocab_size 300, its tokenizer's 320"),
        case("eval_ppl.py", "--ckpt", base.ckpt, "--data_dir", up, cwd=t, expect="vocab_size 400, its tokenizer's 320"),
        # a model larger than its tokenizer: its samples would hold ids no tokenizer decodes
        case("train.py", *base.train, *run("big"), "--vocab_size", "400", cwd=t,
             expect="--vocab_size 400 is above the tokenizer's vocabulary 320"),
    ]
    results = run_batches(cases[:6], cases[6:])
    check(results)
    assert md5s(base.root) == before
    for name in ("lr", "gm", "up", "down", "big"):
        assert not (t / name).exists(), name
    assert not (t / "s.jsonl").exists()


@pytest.mark.slow
def test_the_default_data_folder_as_out_dir_and_a_changed_train_bin_are_refused_and_leave_nothing(base, tmp_path):
    t = tmp_path
    default = prepare.prepared_dir(base.corpus, "sp_train:320", 32)          # relative to the case's cwd: t
    shutil.copytree(base.data_dir, t / default, copy_function=shutil.copy2)     # prepared, as train.py would
    bad = copy_data(base, t / "bad_ids")
    path, stat = bad / "train.bin", os.stat(bad / "train.bin")
    ids = np.memmap(path, dtype=np.uint16, mode="r+")
    ids[len(ids) // 2] = 9999                                     # past K = 320, size and time kept
    ids.flush()
    del ids
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    mine = t / "mine"                                             # a user's folder, with a config.json and a model
    (mine / "model").mkdir(parents=True)
    (mine / "config.json").write_text("my own settings")
    (mine / "model" / "weights.bin").write_text("my own model")
    before = md5s(t / default), md5s(bad), md5s(mine)
    cases = [case("train.py", *TINY, "--dataset", base.corpus, "--out_dir", default, "--max_iters", "4", cwd=t,
                  expect="lies inside the input folder --data_dir"),
             case("train.py", *base.train, "--out_dir", mine, "--max_iters", "4", cwd=t,
                  expect=f"{mine / 'config.json'} exists and a new run would replace it"),
             case("train.py", *TINY, "--dataset", base.corpus, "--data_dir", bad, "--out_dir", t / "bad_run",
                  "--max_iters", "200", "--eval_interval", "1000", cwd=t, expect="holds token id 9999")]
    check(run_batches(cases))
    assert (md5s(t / default), md5s(bad), md5s(mine)) == before    # no checkpoint written into the data
    assert not (t / "bad_run").exists()                            # nor config.json or log.jsonl left behind


@pytest.mark.slow
def test_text_that_is_no_unicode_and_empty_samples_are_one_line(base, tmp_path):
    t = tmp_path
    (t / "lone.jsonl").write_text('{"text": "a fine first record"}\n{"text": "bad \\ud800 one"}\n'
                                  '{"text": "a fine last record"}\n')
    (t / "empty.jsonl").write_text('{"ids": [5, 6, 7, 8], "text": "x"}\n{"ids": [], "text": ""}\n')
    before = md5s(base.root)
    cases = [case("prepare.py", "--dataset", t / "lone.jsonl", "--tokenizer", tok, "--block_size", "32",
                  "--data_dir", t / f"d{i}", cwd=t, expect="lone.jsonl record 2: field 'text' is not Unicode text")
             for i, tok in enumerate(["gpt2", "sp_train:64"])]
    cases += [case("eval_ppl.py", "--metric", "genppl", "--samples", t / "empty.jsonl", "--judge", base.ar, cwd=t,
                   expect="empty.jsonl:2: an empty sample")]
    check(run_batches(cases))
    assert not (t / "d0").exists() and not (t / "d1").exists() and md5s(base.root) == before
    # a --prompt that is not UTF-8 (bytes on the command line): one line, not a TypeError
    p = subprocess.run([sys.executable.encode(), os.path.join(HERE, "sample.py").encode(), b"--ckpt",
                        base.ckpt.encode(), b"--prompt", b"\xff\xfe the", b"--num_samples", b"1", b"--steps", b"2"],
                       capture_output=True, text=True, env=ENV, cwd=t, timeout=300)
    assert "is not Unicode text" in one_error(p)


@pytest.mark.slow
def test_eval_downstream_takes_a_model_folder(base, tmp_path):
    (tmp_path / "mc.jsonl").write_text('{"context": "the cat", "choices": [" sees", " likes"], "gold": 0}\n')
    for ckpt in (os.path.join(base.out, "model"), base.ckpt):
        p = subprocess.run([sys.executable, os.path.join(HERE, "downstream", "eval_downstream.py"), "--ckpt", ckpt,
                            "--jsonl", tmp_path / "mc.jsonl", "--mc_draws", "2", "--out", tmp_path / "r.json"],
                           capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=300)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert json.loads((tmp_path / "r.json").read_text())["results"][0]["n"] == 1
        os.remove(tmp_path / "r.json")
        os.remove(tmp_path / "r.md")


# -----------------------------------------------------------------------------------------------
# preparation: a user's files, a named pipe

def test_preparing_a_folder_again_keeps_the_users_files(base, tmp_path):
    data = copy_data(base, tmp_path / "data", lambda m: m.pop("sha256"))     # unverifiable: prepared again
    (data / "thesis.tex").write_text("my thesis")
    (data / "notes").mkdir()
    (data / "notes" / "a.txt").write_text("my notes")
    p = subprocess.run([sys.executable, os.path.join(HERE, "prepare.py"), "--dataset", base.corpus, "--tokenizer",
                        "sp_train:320", "--block_size", "32", "--data_dir", data], capture_output=True, text=True,
                       env=ENV, cwd=tmp_path, timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert (data / "thesis.tex").read_text() == "my thesis" and (data / "notes" / "a.txt").read_text() == "my notes"
    assert "sha256" in json.loads((data / "meta.json").read_text())          # and the folder is whole again
    assert md5s(data)["train.bin"] == md5s(base.data_dir)["train.bin"]
    assert sorted(os.listdir(tmp_path)) == ["data"]                           # no temp folder, no lock left


@pytest.mark.slow
def test_a_named_pipe_as_the_corpus_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "pipe.txt")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.txt").write_text("one document.\n\nanother one.\n")
    os.mkfifo(tmp_path / "folder" / "b.txt")
    for corpus in ("pipe.txt", "folder"):
        writer = subprocess.Popen(["sh", "-c", f"echo 'some text' > {tmp_path / 'pipe.txt'}"]) \
            if corpus == "pipe.txt" else None                 # a writer, as `--dataset <(cat x)` would have
        t0 = time.time()
        p = subprocess.run([sys.executable, os.path.join(HERE, "prepare.py"), "--dataset", corpus, "--tokenizer",
                            "sp_train:64", "--data_dir", "d"], capture_output=True, text=True, env=ENV,
                           cwd=tmp_path, timeout=120)
        assert "is not a regular file or folder" in one_error(p) and time.time() - t0 < 60
        if writer is not None:
            writer.kill()
            writer.wait()
        assert not (tmp_path / "d").exists()


# -----------------------------------------------------------------------------------------------
# exit codes

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


def test_a_signal_while_a_script_exits_is_never_a_kill_by_the_signal(tmp_path):
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
def test_a_second_stop_signal_during_the_stop_exits_130(base, tmp_path):
    from test_faults2 import catches, start, wait_until
    codes = []
    for gap in (0.0, 0.05, 0.3):
        out = tmp_path / f"run{gap}"
        p, stdout, err = start("train.py", *base.train, "--out_dir", out, "--max_iters", "100000", "--log_interval",
                               "1", "--eval_interval", "100000", "--ckpt_interval", "100000", cwd=tmp_path,
                               name=out.name)
        wait_until(lambda: (out / "log.jsonl").exists() or p.poll() is not None, what="training")
        p.send_signal(signal.SIGTERM)
        time.sleep(gap)
        p.send_signal(signal.SIGTERM)
        codes.append(p.wait(timeout=120))
        assert "Traceback" not in err.read_text() and (out / "ckpt.pt").exists()
    assert codes == [130, 130, 130]


# -----------------------------------------------------------------------------------------------
# a full disk at the end-of-run model export

@pytest.mark.slow
@pytest.mark.skipif(not _unshare_available(), reason="needs unshare (a user namespace) to mount a small tmpfs")
def test_a_disk_that_fills_during_the_model_export_is_one_line_and_keeps_the_checkpoint(base, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    room = os.path.getsize(base.ckpt) + 300_000           # the checkpoint fits, its model folder does not
    args = " ".join([sys.executable, os.path.join(HERE, "train.py"), *TINY, "--dataset", base.corpus, "--data_dir",
                     base.data_dir, "--out_dir", str(mnt / "run"), "--max_iters", "4", "--eval_interval", "4"])
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


# -----------------------------------------------------------------------------------------------
# the rest of issue 30: hub/pretrained.py on a full disk, float lists, a resumed run's model folder, named pipes

@pytest.mark.slow
@pytest.mark.skipif(not _unshare_available(), reason="needs unshare (a user namespace) to mount a small tmpfs")
def test_a_full_disk_during_pretrained_export_is_one_line_and_writes_nothing(base, tmp_path):
    """hub/pretrained.py --out (a new folder, and over an earlier model folder) and SDDLM.save_pretrained on a
    disk without room for the weights: one line (an OSError for the API), nothing half-written, the earlier
    folder and a user's file as they were."""
    mnt, model = tmp_path / "mnt", os.path.join(base.out, "model")
    mnt.mkdir()
    room = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model)) + 300_000
    export = f"{sys.executable} {os.path.join(HERE, 'hub', 'pretrained.py')} --ckpt {base.ckpt} --out"
    api = (f"{sys.executable} -c 'from hub.pretrained import SDDLM; "
           f"SDDLM.from_pretrained(\"{model}\").save_pretrained(\"{mnt / 'api'}\")'")
    script = (f"mount -t tmpfs -o size={room // 1024}k tmpfs {mnt} && cp -r {model} {mnt / 'old'} && "
              f"echo 'my thesis' > {mnt / 'thesis.tex'} && md5sum {mnt / 'old'}/* {mnt / 'thesis.tex'} > {tmp_path}/a"
              f" && {export} {mnt / 'new'} 2> {tmp_path}/new.err; echo rc=$?; "
              f"{export} {mnt / 'old'} 2> {tmp_path}/old.err; echo rc=$?; "
              f"{api} 2> {tmp_path}/api.err; echo rc=$?; "
              f"md5sum {mnt / 'old'}/* {mnt / 'thesis.tex'} > {tmp_path}/b; ls -A {mnt}")
    p = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                       capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=300)
    assert p.stdout.splitlines() == ["rc=2", "rc=2", "rc=1", "old", "thesis.tex"], (p.stdout, p.stderr)
    for name, kept in (("new", "nothing was written"), ("old", f"the previous {mnt / 'old'} is kept")):
        err = SimpleNamespace(returncode=2, stderr=(tmp_path / f"{name}.err").read_text())
        line = one_error(err)
        assert line.startswith(f"error: could not write {mnt / name} (") and "No space left" in line and kept in line
    api_err = (tmp_path / "api.err").read_text()      # the Python API raises one OSError, its message one line
    assert api_err.splitlines()[-1].startswith(f"OSError: [Errno 28] could not write {mnt / 'api'} (")
    assert (tmp_path / "a").read_text() == (tmp_path / "b").read_text()


@pytest.mark.slow
def test_float_lists_refuse_nan_and_inf_naming_the_flag(base, tmp_path):
    t = tmp_path
    psi = ["--sampler", "psi", "--psi_profile", "loop", "--steps", "4", "--num_samples", "1"]
    cases = [case("sample.py", "--ckpt", base.ckpt, *psi, "--psi_fracs", "nan,0.5,0.5", "--out", t / "s.jsonl",
                  cwd=t, expect="--psi_fracs: expected a finite number, got 'nan' in 'nan,0.5,0.5'"),
             case("sample.py", "--ckpt", base.ckpt, *psi, "--psi_fracs", "0.5,0.5,-inf", "--out", t / "s.jsonl",
                  cwd=t, expect="--psi_fracs: expected a finite number, got '-inf'"),
             case("sample.py", "--ckpt", base.ckpt, *psi, "--psi_eta", "0.9,nan,0.9", "--out", t / "s.jsonl",
                  cwd=t, expect="--psi_eta: expected a finite number, got 'nan'"),
             case("eval_ppl.py", "--ckpt", base.ckpt, "--metric", "genppl", "--judge", base.ar, *psi,
                  "--psi_fracs", "0.5,nan,0.5", cwd=t, expect="--psi_fracs: expected a finite number, got 'nan'"),
             case("downstream/eval_downstream.py", "--ckpt", base.ckpt, "--jsonl", t / "mc.jsonl", "--cfg", "on",
                  "--cfg_w_task", "mc=nan", cwd=t, expect="--cfg_w_task: expected NAME=W (W a finite number)")]
    (t / "mc.jsonl").write_text('{"context": "the cat", "choices": [" sees", " likes"], "gold": 0}\n')
    before = md5s(base.root)
    check(run_batches(cases))
    assert not (t / "s.jsonl").exists() and md5s(base.root) == before
    # lm-eval's --model_args of eval_downstream's model: strings, or values lm-eval already made floats
    from downstream import lm_eval_adapter as adapter, scoring
    for args, flag in (({"cfg_w": float("nan")}, "cfg_w"), ({"cfg_w": "inf"}, "cfg_w"),
                       ({"top_p": "nan"}, "top_p"), ({"psi_loop_t": float("inf")}, "psi_loop_t"),
                       ({"sampler": "psi", "psi_profile": "loop", "psi_fracs": "nan/0.5/0.5"}, "psi_fracs")):
        with pytest.raises(scoring.EvalError, match=f"sddlm model argument {flag}"):
            adapter._Harness(ckpt=base.ckpt, **args)


@pytest.mark.slow
def test_a_resume_refuses_a_users_model_folder_before_training(base, tmp_path):
    """--resume 1 into an out_dir whose model/ holds a user's file: refused at start (was: trained to the end,
    then refused the export), the checkpoint and the user's file unchanged."""
    out = tmp_path / "run"
    shutil.copytree(base.out, out, copy_function=shutil.copy2)
    shutil.rmtree(out / "model")
    (out / "model").mkdir()
    (out / "model" / "notes.txt").write_text("my notes")
    before = md5s(out)
    p = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *base.train, "--out_dir", out, "--resume",
                        "1", "--max_iters", "8", "--eval_interval", "4"], capture_output=True, text=True, env=ENV,
                       cwd=tmp_path, timeout=300)
    line = one_error(p)
    assert f"--out_dir {out}: its model folder {out / 'model'} already holds files" in line and "notes.txt" in line
    assert md5s(out) == before


def test_named_pipes_as_inputs_say_what_they_are_and_never_wait(tmp_path):
    """A named pipe as --ckpt, --tokenizer sp:PATH, --samples, --jsonl, --judge: one line saying it is a named pipe
    (was: 'not found'), without opening it (no writer: an open would wait forever)."""
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "corpus.txt").write_text("the cat sees the dog .\n" * 50)
    (tmp_path / "mc.jsonl").write_text('{"context": "the cat", "choices": [" sees", " likes"], "gold": 0}\n')
    said = "pipe is a named pipe, not a regular file; save it to a file first"
    cases = [case("sample.py", "--ckpt", "pipe", cwd=tmp_path, expect=f"the checkpoint {said}"),
             case("hub/pretrained.py", "--ckpt", "pipe", "--out", "m", cwd=tmp_path, expect=f"the checkpoint {said}"),
             case("eval_ppl.py", "--metric", "genppl", "--samples", "pipe", "--judge", "pipe", cwd=tmp_path,
                  expect=f"--samples {said}"),
             case("eval_ppl.py", "--metric", "genppl", "--ckpt", "m.pt", "--judge", "pipe", cwd=tmp_path,
                  expect=f"--judge {said}"),
             case("downstream/eval_downstream.py", "--ckpt", "pipe", "--jsonl", "mc.jsonl", cwd=tmp_path,
                  expect=f"--ckpt {said}"),
             case("downstream/eval_downstream.py", "--ckpt", "corpus.txt", "--jsonl", "pipe", cwd=tmp_path,
                  expect=f"--jsonl {said}"),
             case("prepare.py", "--dataset", "corpus.txt", "--tokenizer", "sp:pipe", "--data_dir", "d", cwd=tmp_path,
                  expect=f"the SentencePiece model {said}"),
             case("train.py", "--dataset", "corpus.txt", "--tokenizer", "sp:pipe", "--out_dir", "r", cwd=tmp_path,
                  expect=f"the SentencePiece model {said}")]
    p = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(cases), capture_output=True, text=True,
                       env=ENV, cwd=HERE, timeout=240)      # a read of the pipe would wait: the timeout fails it
    assert p.returncode == 0, p.stderr[-3000:]
    check(json.loads(p.stdout))
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt", "mc.jsonl", "pipe"]
