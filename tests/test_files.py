"""plumbing/files.py through the scripts that write: temp names, output paths."""
import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import (ENV, HERE, RUNNER, case, check_last, check_one_line, copy_data, md5s, run_batches,
                      write_corpus)
import data
from distillation import distill
from hub import pretrained
from plumbing import cli, files
from plumbing.cli import UsageError
import prepare
from test_train import TINY
import train


def test_cleanup_removes_dead_writers_temps_not_users_files(tmp_path, monkeypatch):
    """A killed writer's temp files and folders (<path>.sddlm-tmp-<host>-<pid>-<8 hex>, pid dead) go at the next
    start of prepare.py, train.py and hub/pretrained.py; a user's model.old2024 or ckpt.pt.tmp2024 stays."""
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "c.txt")
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


@pytest.fixture(scope="module")
def dcd(run4):
    """A 2-step distillation/distill.py run of the shared run's checkpoint."""
    out = str(run4.root / "dcd")
    assert distill.main(["--init", run4.ckpt, "--out_dir", out, "--max_iters", "2", "--batch_size", "8",
                         "--eval_iters", "2", "--num_samples", "0", "--log_interval", "1", "--round_iters", "3",
                         "--T", "16", "--warmup_iters", "1", "--eval_interval", "2", "--ckpt_interval", "2"]) == 0
    return out


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


@pytest.mark.slow
def test_bad_files_and_paths_are_one_line_and_leave_nothing(run4, tmp_path):
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
    ck = torch.load(run4.ckpt, weights_only=False)
    torch.save({**ck, "meta": {**ck["meta"], "tokenizer": f"sp:{t / 'bad.model'}", "tokenizer_file": None},
                "tokenizer_model": None}, t / "bad_tokenizer.pt")     # a checkpoint without its copy: the file is read
    torch.save({**ck, "model_config": {**ck["model_config"], "foo": 1}}, t / "unknown_key.pt")
    edited = t / "edited.txt"
    shutil.copy(run4.corpus, edited)
    prepared = t / "prepared"
    prepare.prepare_dataset(str(edited), "sp:" + data.load_meta(run4.data_dir)["tokenizer"][3:], str(prepared), 32,
                         progress=False)
    with open(edited, "a") as f:
        f.write("\nan edit after preparation.\n")
    for d in ("w1", "w2", "w3", "w4", "w5"):      # fresh working folders: what a failure leaves is visible
        (t / d).mkdir()
    before = md5s(run4.data_dir), md5s(run4.out), md5s(prepared)
    tr = TINY + ["--max_iters", "2"]
    cases = [
        case("train.py", *run4.train, "--out_dir", t / "afile", cwd=t, expect="--out_dir"),
        case("train.py", *run4.train, "--out_dir", t / "afile" / "sub", cwd=t, expect="afile is a file, not a folder"),
        case("train.py", *TINY, "--dataset", run4.corpus, "--data_dir", t / "afile", "--out_dir", t / "o1", cwd=t,
             expect="afile is a file, not a folder"),
        case("train.py", *tr, "--dataset", run4.corpus, "--tokenizer", f"sp:{t / 'bad.model'}", "--out_dir", t / "o2",
             cwd=t / "w1", expect="bad.model is not a SentencePiece model"),
        case("train.py", *tr, "--dataset", t / "latin1.txt", "--out_dir", t / "o3", cwd=t / "w2",
             expect="latin1.txt: not UTF-8 text (byte 0xe7 at offset 18)"),
        case("prepare.py", "--dataset", t / "binary.txt", cwd=t / "w3", expect="binary.txt: a binary file, not text (NUL "
             "byte at offset 0)"),
        case("prepare.py", "--dataset", run4.corpus, "--tokenizer", "sp_train:320", "--block_size", "100000",
             cwd=t / "w4", expect="gives no sequence of block_size 100000"),
        case("prepare.py", "--dataset", edited, "--tokenizer", "sp:" + data.load_meta(run4.data_dir)["tokenizer"][3:],
             "--block_size", "32", "--data_dir", prepared, cwd=t / "w5", expect="different corpus content"),
        case("sample.py", "--ckpt", run4.ckpt, "--out", t / "folder", "--steps", "100000", cwd=t,
             expect="--out " + str(t / "folder") + " is a folder"),
        case("eval_ppl.py", "--metric", "genppl", "--samples", t / "truncated.jsonl", "--judge", "nope.pt", cwd=t,
             expect="truncated.jsonl:2: not a JSON line"),
        case("eval_ppl.py", "--ckpt", run4.ckpt, "--metric", "zeroshot", "--dataset", t / "latin1.txt", cwd=t,
             expect="latin1.txt: not UTF-8 text"),
        case("eval_ppl.py", "--ckpt", run4.ckpt, "--out", t / "folder", cwd=t, expect="is a folder"),
        case("eval_ppl.py", "--ckpt", t / "bad_tokenizer.pt", "--metric", "zeroshot", "--dataset", run4.corpus,
             cwd=t, expect="bad.model is not a SentencePiece model"),
        case("sample.py", "--ckpt", t / "unknown_key.pt", "--out", "", cwd=t,
             expect="its model_config has keys this model.py does not know: foo"),
        case("downstream/eval_downstream.py", "--ckpt", run4.ckpt, "--jsonl", t / "gold_true.jsonl", cwd=t,
             expect="gold_true.jsonl:1: expected"),
        case("downstream/eval_downstream.py", "--ckpt", run4.ckpt, "--jsonl", t / "empty_choice.jsonl", cwd=t,
             expect="empty_choice.jsonl:1: expected"),
        case("downstream/eval_downstream.py", "--ckpt", run4.ckpt, "--jsonl", t / "latin1.jsonl", cwd=t,
             expect="latin1.jsonl: not UTF-8 text (byte 0xe9 at offset 13)"),
    ]
    check_one_line(run_batches(cases[:8], cases[8:]))
    assert (md5s(run4.data_dir), md5s(run4.out), md5s(prepared)) == before
    for d in ("w1", "w2", "w3", "w4", "w5"):      # no data/ folder, no temp folder, no lock
        assert os.listdir(t / d) == [], d
    assert not any((t / o).exists() for o in ("o1", "o2", "o3")) and (t / "afile").read_text() == "x"
    assert os.listdir(t / "folder") == []


def test_an_output_that_resolves_to_an_input_is_refused(tmp_path):
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


def test_dead_writers_temps_are_removed_and_live_ones_kept(tmp_path):
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    live, host = os.getppid(), socket.gethostname()
    stale = [f"ckpt.pt.sddlm-tmp-{host}-{dead}-0a1b2c3d", f"model.sddlm-tmp-{host}-{dead}-00000000"]
    kept = ["ckpt.pt", f"ckpt.pt.sddlm-tmp-{host}-{live}-0a1b2c3d", f"model.sddlm-tmp-{host}-{os.getpid()}-abcdef01",
            f"data.sddlm-tmp-other-{dead}-0a1b2c3d", f"ckpt.pt.sddlm-tmp-{host}-{dead}-xyz", f"ckpt.pt.tmp{dead}",
            f"model.old{dead}", f"data.tmp-{host}-{dead}-x1y2", "model", "data"]
    for name in stale + kept:
        (tmp_path / name).mkdir() if name.startswith(("model", "data")) else (tmp_path / name).write_bytes(b"")
    files.remove_stale_temps(str(tmp_path / "ckpt.pt"))
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


@pytest.mark.slow
def test_input_outputs_and_other_scripts_folders_change_nothing(run4, dcd, tmp_path):
    t = tmp_path
    corpus_dir = t / "corpus"
    corpus_dir.mkdir()
    shutil.copy(run4.corpus, corpus_dir / "c.txt")
    os.symlink(run4.ckpt, t / "link.pt")
    os.link(run4.ckpt, t / "hard.pt")
    (t / "task.jsonl").write_text('{"context": "a", "choices": ["b", "c"], "gold": 0}\n')
    (t / "s.jsonl").write_text('{"sample": 0, "text": "a b", "ids": [1, 2]}\n')
    before = md5s(run4.out), md5s(dcd), md5s(corpus_dir), md5s(run4.data_dir)
    listing = sorted(os.listdir(t))
    run_out = os.path.join(run4.out, "ckpt.pt")
    cases = [
        case("eval_ppl.py", "--ckpt", run4.ckpt, "--out", run4.ckpt, cwd=t, expect="is the input --ckpt"),
        case("eval_ppl.py", "--ckpt", t / "link.pt", "--out", t / "hard.pt", cwd=t, expect="is the input --ckpt"),
        case("downstream/eval_downstream.py", "--ckpt", run4.ckpt, "--jsonl", t / "task.jsonl", "--out", run4.ckpt,
             cwd=t, expect="is the input --ckpt"),
        case("sample.py", "--ckpt", run4.ckpt, "--out", t / "link.pt", cwd=t, expect="is the input --ckpt"),
        case("eval_ppl.py", "--metric", "genppl", "--samples", t / "s.jsonl", "--save_samples", t / "s.jsonl",
             cwd=t, expect="--save_samples " + str(t / "s.jsonl") + " is the input --samples"),
        case("distillation/distill.py", "--init", run4.ckpt, "--out_dir", run4.out, cwd=t,
             expect=f"--out_dir writes {run_out}, which is the input --init"),
        case("train.py", *run4.train, "--judge", run4.ckpt, "--out_dir", run4.out, "--resume", "1", cwd=t,
             expect=f"--out_dir writes {run_out}, which is the input --judge"),
        case("train.py", *run4.train, "--dataset", corpus_dir, "--out_dir", corpus_dir / "run", cwd=t,
             expect="lies inside the input folder --dataset"),
        case("prepare.py", "--dataset", corpus_dir, "--data_dir", corpus_dir / "prepared", cwd=t,
             expect="lies inside the input folder --dataset"),
        case("hub/pretrained.py", "--ckpt", run4.ckpt, "--out", run4.out, cwd=t,
             expect="would be written over the input --ckpt"),
        case("figures/plot.py", "--runs", run4.out, "--table", os.path.join(run4.out, "log.jsonl"), cwd=t,
             expect="is the input --runs"),
        case("train.py", *run4.train, "--out_dir", dcd, "--resume", "1", cwd=t,
             expect=f"written by distillation/distill.py; continue it with python distillation/distill.py --out_dir {dcd} --resume 1"),
        case("distillation/distill.py", "--out_dir", run4.out, "--resume", "1", cwd=t,
             expect=f"written by train.py; continue it with python train.py --out_dir {run4.out} --resume 1"),
        case("distillation/distill.py", "--init", t / "nope.pt", "--out_dir", t / "dd", cwd=t, expect="no such checkpoint"),
    ]
    check_one_line(run_batches(cases[:7], cases[7:]))
    assert (md5s(run4.out), md5s(dcd), md5s(corpus_dir), md5s(run4.data_dir)) == before
    assert sorted(os.listdir(t)) == listing            # no out_dir, data folder or lock left by a refused run


@pytest.mark.slow
def test_data_folder_as_out_dir_and_changed_bins_leave_nothing(run_ar, tmp_path):
    t = tmp_path
    default = prepare.prepared_dir(run_ar.corpus, "sp_train:320", 32)          # relative to the case's cwd: t
    shutil.copytree(run_ar.data_dir, t / default, copy_function=shutil.copy2)     # prepared, as train.py would
    bad = copy_data(run_ar, t / "bad_ids")
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
    cases = [case("train.py", *TINY, "--dataset", run_ar.corpus, "--out_dir", default, "--max_iters", "4", cwd=t,
                  expect="lies inside the input folder --data_dir"),
             case("train.py", *run_ar.train, "--out_dir", mine, "--max_iters", "4", cwd=t,
                  expect=f"{mine / 'config.json'} exists and a new run would replace it"),
             case("train.py", *TINY, "--dataset", run_ar.corpus, "--data_dir", bad, "--out_dir", t / "bad_run",
                  "--max_iters", "200", "--eval_interval", "1000", cwd=t, expect="holds token id 9999")]
    check_last(run_batches(cases))
    assert (md5s(t / default), md5s(bad), md5s(mine)) == before    # no checkpoint written into the data
    assert not (t / "bad_run").exists()                            # nor config.json or log.jsonl left behind


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
    check_last(json.loads(p.stdout))
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt", "mc.jsonl", "pipe"]


def test_an_output_is_new_or_a_regular_file_sddlm_wrote(tmp_path):
    t = tmp_path
    (t / "notes.txt").write_text("my notes\n")
    (t / "res.json").write_text('{"mine": 1}\n')
    (t / "ours.json").write_text(json.dumps({files.WRITTEN_BY: files.signature("eval_ppl.py"), "x": 1}))
    (t / "ours.md").write_text(files.text_mark("figures/plot.py") + "\n| a |\n")
    (t / "ours.jsonl").write_text(json.dumps({files.WRITTEN_BY: "sddlm sample.py", "sample": 0}) + "\n{}\n")
    (t / "old_run_config.json").write_text(json.dumps({"train_config": {}, "model_config": {}, "meta": {}}))
    torch.save({"model": {}, "model_config": {}}, t / "ckpt.pt")
    torch.save({"weights": torch.zeros(2)}, t / "theirs.pt")
    os.symlink(t / "ours.json", t / "link.json")
    os.mkfifo(t / "fifo")
    for name in ("new.json", "ours.json", "ours.md", "ours.jsonl", "old_run_config.json", "ckpt.pt"):
        files.check_output(str(t / name), "--out")
    for name, words in [("notes.txt", "was not written by sddlm"), ("res.json", "was not written by sddlm"),
                        ("theirs.pt", "was not written by sddlm"), ("link.json", "is a symbolic link"),
                        ("fifo", "is a named pipe"), (".", "is a folder")]:
        with pytest.raises(UsageError, match=words):
            files.check_output(str(t / name), "--out")
    # the atomic replace itself refuses what is not a regular file of ours, whoever calls it; appending, what is not
    # a regular file
    for name in ("link.json", "fifo", "notes.txt"):
        with pytest.raises(OSError, match="refusing to"):
            files.save_atomic(str(t / name), lambda tmp: open(tmp, "w").close())
    for name in ("link.json", "fifo"):
        with pytest.raises(OSError, match="refusing to write"):
            files.append_jsonl(str(t / name), [{"a": 1}])
    assert os.path.islink(t / "link.json") and stat.S_ISFIFO(os.lstat(t / "fifo").st_mode)
    assert (t / "notes.txt").read_text() == "my notes\n" and sorted(os.listdir(t)) == sorted(
        ["notes.txt", "res.json", "ours.json", "ours.md", "ours.jsonl", "old_run_config.json", "ckpt.pt",
         "theirs.pt", "link.json", "fifo"])                                 # no temp file left behind


@pytest.mark.slow
def test_outputs_replace_only_what_sddlm_wrote(run_ema, tmp_path):
    """A user's --out, a companion .md never named, links, pipes and device nodes are refused before any work; what
    sddlm wrote is replaced (eval_ppl.py run twice into one --out)."""
    t = tmp_path
    (t / "notes.txt").write_text("my notes\n")
    (t / "res.json").write_text('{"mine": 1}\n')
    (t / "only_md").mkdir()
    (t / "only_md" / "res.md").write_text("my table\n")
    (t / "table.md").write_text("my table\n")
    (t / "mc.jsonl").write_text(json.dumps({"context": "the cat", "choices": [" sees", " eats"], "gold": 0}) + "\n")
    os.symlink(t / "notes.txt", t / "link.jsonl")
    os.mkfifo(t / "fifo.jsonl")
    shutil.copytree(run_ema.model, t / "linked_model")
    os.remove(t / "linked_model" / "model.safetensors")
    os.symlink(run_ema.model / "model.safetensors", t / "linked_model" / "model.safetensors")
    devices = []
    try:                                         # as root a device node's own rename is the danger (/dev/null)
        os.mknod(t / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        devices = ["null"]
    except (PermissionError, OSError):
        pass
    before = md5s(run_ema.root)
    ppl = ["eval_ppl.py", "--ckpt", run_ema.ckpt, "--max_batches", "1", "--mc_draws", "1"]
    evals = ",".join(os.path.join(HERE, "figures", "tiny", "evals", f) for f in
                     sorted(os.listdir(os.path.join(HERE, "figures", "tiny", "evals"))))
    ds = ["downstream/eval_downstream.py", "--ckpt", run_ema.ckpt, "--jsonl", t / "mc.jsonl", "--mc_draws", "1"]
    cases = [
        case(*ppl, "--out", t / "notes.txt", cwd=t, expect=f"--out {t}/notes.txt exists and was not written by sddlm"),
        case(*ds, "--out", t / "res.json", cwd=t, expect=f"--out {t}/res.json exists and was not written by sddlm"),
        case(*ds, "--out", t / "only_md" / "res.json", cwd=t,
             expect=f"--out {t}/only_md/res.md exists and was not written by sddlm"),
        case("sample.py", "--ckpt", run_ema.ckpt, "--num_samples", "1", "--steps", "2", "--out", t / "link.jsonl",
             cwd=t, expect="link.jsonl is a symbolic link"),
        case("sample.py", "--ckpt", run_ema.ckpt, "--num_samples", "1", "--steps", "2", "--out", t / "fifo.jsonl",
             cwd=t, expect="fifo.jsonl is a named pipe, not a regular file"),          # (it used to wait for a reader)
        case("figures/plot.py", "--evals", evals, "--table", t / "table.md", "--overwrite", "1", "--out_dir",
             t / "plots", cwd=t, expect=f"--table {t}/table.md exists and was not written by sddlm"),
        case("hub/pretrained.py", "--ckpt", run_ema.ckpt, "--out", t / "linked_model", cwd=t,
             expect="its model.safetensors is a symbolic link, not a file sddlm wrote"),
        *[case(*ppl, "--out", t / d, cwd=t, expect=f"--out {t}/{d} is a character device") for d in devices],
        *[case(*ds, "--out", t / d, cwd=t, expect=f"--out {t}/{d} is a character device") for d in devices],
        case(*ppl, "--out", t / "ours.json", cwd=t, expect=["ok", '"metric": "nelbo"']),     # new: written
    ]
    again = [case(*ppl, "--out", t / "ours.json", cwd=t, expect=["ok", '"metric": "nelbo"'])]   # ours: replaced
    check_last(run_batches(cases) + run_batches(again))
    assert md5s(run_ema.root) == before
    assert (t / "notes.txt").read_text() == "my notes\n" and (t / "res.json").read_text() == '{"mine": 1}\n'
    assert (t / "only_md" / "res.md").read_text() == "my table\n" and (t / "table.md").read_text() == "my table\n"
    assert os.path.islink(t / "link.jsonl") and stat.S_ISFIFO(os.lstat(t / "fifo.jsonl").st_mode)
    assert os.path.islink(t / "linked_model" / "model.safetensors")
    assert all(stat.S_ISCHR(os.lstat(t / d).st_mode) for d in devices)
    assert json.loads((t / "ours.json").read_text())[files.WRITTEN_BY] == "sddlm eval_ppl.py"
    assert not (t / "only_md" / "res.json").exists() and not (t / "plots").exists()


def test_an_output_replaces_only_its_own_scripts_earlier_output(tmp_path):
    """sddlm's files are not all alike: eval_ppl.py --out run/ckpt.pt replaced a trained checkpoint with a 1 KB JSON
    (exit code 0), and a run's config.json or sample.py's samples alike. writer_of names the script by content."""
    t = tmp_path
    (t / "ppl.json").write_text(json.dumps({files.WRITTEN_BY: files.signature("eval_ppl.py"), "x": 1}))
    (t / "table.md").write_text(files.text_mark("downstream/eval_downstream.py") + "\n| a |\n")
    (t / "run_config.json").write_text(json.dumps({"train_config": {}, "model_config": {}, "meta": {}}))
    (t / "samples.jsonl").write_text(json.dumps({"sample": 0, "ids": [1], "settings": {}}) + "\n")
    torch.save({"model": {}, "model_config": {}}, t / "ckpt.pt")
    assert [files.writer_of(str(t / n)) for n in ("ppl.json", "table.md", "run_config.json", "samples.jsonl",
                                                   "ckpt.pt")] == \
        ["sddlm eval_ppl.py", "sddlm downstream/eval_downstream.py", "sddlm train.py", "sddlm sample.py",
         "sddlm checkpoint"]
    files.check_output(str(t / "ppl.json"), "--out", script="eval_ppl.py")          # its own: replaced
    files.check_output(str(t / "table.md"), "--out", script="downstream/eval_downstream.py")
    for name, script, words in [("ckpt.pt", "eval_ppl.py", "is a checkpoint, not an earlier output of eval_ppl.py"),
                                ("run_config.json", "eval_ppl.py", "is written by train.py, not an earlier output"),
                                ("samples.jsonl", "eval_ppl.py", "is written by sample.py"),
                                ("ppl.json", "downstream/eval_downstream.py", "is written by eval_ppl.py"),
                                ("table.md", "figures/plot.py", "is written by downstream/eval_downstream.py")]:
        with pytest.raises(UsageError, match=words):
            files.check_output(str(t / name), "--out", script=script)
