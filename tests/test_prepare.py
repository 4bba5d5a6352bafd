"""prepare.py's folders as train.py reads them, and train.py's own preparation (--text_field, --num_proc,
--verify)."""
import json
import os
import random
import shutil
import subprocess
import sys
import time

import pytest

import data
import prepare
import train
from conftest import ENV, HERE, copy_data, md5s, one_error, unshare_available, write_corpus
from data import DataError
from test_train import TINY

TRAIN = TINY + ["--max_iters", "1", "--eval_interval", "1000"]


def test_train_reads_any_prepared_folder_and_its_moved_copy(tmp_path, monkeypatch):
    """A folder prepare.py wrote with flags train.py lacks (--val_fraction, --insert_eos) trains; --init finds the
    data's tokenizer by content, in the folder where it is now (moved, or named by another path); a flag given
    against the folder is still refused, naming it."""
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "c.txt")
    assert prepare.main(["--dataset", "c.txt", "--tokenizer", "sp_train:320", "--block_size", "32", "--data_dir",
                         "d", "--val_fraction", "0.1", "--insert_eos", "0"]) == 0
    assert train.main(TRAIN + ["--dataset", "c.txt", "--data_dir", "d", "--out_dir", "run"]) == 0
    assert train.main(TRAIN + ["--init", "run/ckpt.pt", "--data_dir", "d", "--out_dir", "ft", "--dataset",
                               "c.txt", "--tokenizer", "sp:d/tokenizer.model"]) == 0
    os.rename("d", "moved")
    assert train.main(["--init", "run/ckpt.pt", "--data_dir", "moved", "--out_dir", "ft2", "--max_iters", "1",
                       "--batch_size", "8", "--num_samples", "0", "--eval_iters", "1"]) == 0
    with pytest.raises(DataError, match=r"moved was prepared with a different block_size=32 \(asked 64\)"):
        train.main(TRAIN + ["--block_size", "64", "--data_dir", "moved", "--out_dir", "r64"])


def test_wrap_0_says_the_share_of_tokens_it_drops(tmp_path):
    """Issue 44: --wrap 0 cut each document to block_size - 2 tokens and dropped most of a corpus without a word;
    a note on stderr says how many (the count is the documents' tokens past block_size - 2, from meta.json)."""
    write_corpus(tmp_path / "corpus.txt")
    p = subprocess.run([sys.executable, os.path.join(HERE, "prepare.py"), "--dataset", tmp_path / "corpus.txt",
                        "--tokenizer", "sp_train:300", "--data_dir", tmp_path / "data", "--wrap", "0", "--block_size",
                        "16"], capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert p.returncode == 0, p.stderr
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    dropped, tokens = meta["train_dropped_tokens"], meta["train_tokens"]
    assert dropped > tokens / 2          # 5 sentences a document, 14 tokens kept of each
    assert (f"note: --wrap 0 keeps a document's first 14 tokens: {dropped:,} of the train split's {tokens:,} tokens "
            f"({dropped / tokens:.1%}) are dropped; --wrap 1 keeps them all") in p.stderr


@pytest.mark.slow
def test_two_preparations_at_once_make_one_correct_folder(run4, tmp_path):
    """Two prepare.py runs on the same new dataset, started while a third party holds the folder's lock, so they
    certainly overlap: both succeed, one folder, its checksums verify, tokens equal a single preparation."""
    import fcntl
    corpus = tmp_path / "new.txt"
    shutil.copy(run4.corpus, corpus)
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


def test_long_names_give_valid_folder_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ("c" * 236 + ".txt")).write_text("one document.\n\nanother one.\n")
    folder = os.path.basename(prepare.prepared_dir("c" * 236 + ".txt", "sp_train:320", 32))
    assert len(folder.encode()) <= 100 and folder.startswith("c" * 55 + "~") and folder.endswith("-sp_train320-32-" +
                                                                                                  folder[-12:])
    assert prepare._short("short") == "short"
    cut = prepare._short("é" * 100)                 # cut on a character boundary, within 64 bytes
    assert len(cut.encode()) <= 64 and cut.startswith("é" * 27) and cut != prepare._short("é" * 101)


@pytest.mark.slow
@pytest.mark.skipif(not unshare_available(), reason="needs unshare (a user namespace) to mount a small tmpfs")
def test_a_full_disk_names_the_folder_and_the_flag(run_tok, tmp_path):
    """A real full disk: a 24 KiB tmpfs in a private mount namespace, holding the data folder."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    args = " ".join([sys.executable, os.path.join(HERE, "train.py"), *TINY, "--dataset", run_tok.corpus,
                     "--data_dir", str(mnt / "data"), "--out_dir", str(tmp_path / "out"), "--max_iters", "2"])
    p = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                        f"mount -t tmpfs -o size=24k tmpfs {mnt} && {args}; echo rc=$?; ls -A {mnt}"],
                       capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=300)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: No space left on device while preparing {mnt / 'data'}; free space there or choose "
                      f"another --data_dir"], p.stderr[-2000:]
    assert p.stdout.splitlines()[-1] == "rc=2"        # and the tmpfs was left empty: no temp folder, no lock
    assert not (tmp_path / "out").exists()


def test_preparing_a_folder_again_keeps_the_users_files(run_ar, tmp_path):
    data = copy_data(run_ar, tmp_path / "data", lambda m: m.pop("sha256"))     # unverifiable: prepared again
    (data / "thesis.tex").write_text("my thesis")
    (data / "notes").mkdir()
    (data / "notes" / "a.txt").write_text("my notes")
    p = subprocess.run([sys.executable, os.path.join(HERE, "prepare.py"), "--dataset", run_ar.corpus, "--tokenizer",
                        "sp_train:320", "--block_size", "32", "--data_dir", data], capture_output=True, text=True,
                       env=ENV, cwd=tmp_path, timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert (data / "thesis.tex").read_text() == "my thesis" and (data / "notes" / "a.txt").read_text() == "my notes"
    assert "sha256" in json.loads((data / "meta.json").read_text())          # and the folder is whole again
    assert md5s(data)["train.bin"] == md5s(run_ar.data_dir)["train.bin"]
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


def test_train_prepares_with_text_field_num_proc_and_verify(tmp_path, monkeypatch):
    """train.py's own preparation: --text_field reads another field of a .jsonl; --num_proc 2 writes the bytes of
    prepare.py's one-process run; --verify hashes the files again at start and catches an edit that kept the
    size and the time."""
    import prepare
    import train
    corpus = tmp_path / "corpus.jsonl"
    rng = random.Random(0)
    docs = [" ".join(rng.choice(["the cat", "a dog", "sees", "likes", "."]) for _ in range(40)) for _ in range(60)]
    corpus.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    args = ["--dataset", str(corpus), "--text_field", "body", "--tokenizer", "sp_train:300", "--block_size", "32",
            "--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--batch_size", "4", "--max_iters", "1",
            "--eval_iters", "1", "--num_samples", "0", "--threads", "1", "--device", "cpu"]
    monkeypatch.chdir(tmp_path)
    passed, real = [], prepare.prepare_dataset
    monkeypatch.setattr(prepare, "prepare_dataset", lambda *a, **k: passed.append(k) or real(*a, **k))
    assert train.main(args + ["--num_proc", "2", "--out_dir", "o1"]) == 0
    assert (passed[0]["num_proc"], passed[0]["text_field"], passed[0]["verify"]) == (2, "body", False)
    monkeypatch.setattr(prepare, "prepare_dataset", real)
    (ours,) = os.listdir(tmp_path / "data")
    ref = prepare.prepare_dataset(str(corpus), "sp_train:300", str(tmp_path / "ref"), 32, num_proc=1,
                                  text_field="body", progress=False)
    for name in ("train.bin", "val.bin", "meta.json"):
        if name == "meta.json":          # the same record, but for where the folder is and when files were seen
            meta = lambda folder: {k: v for k, v in json.loads((folder / name).read_text()).items()
                                   if k not in ("stat", "tokenizer")}
            assert meta(tmp_path / "data" / ours) == meta(tmp_path / "ref")
        else:
            assert (tmp_path / "data" / ours / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
    with pytest.raises(data.DataError, match="no text field 'nope'; .*body"):
        train.main(args + ["--text_field", "nope", "--out_dir", "o2"])
    train_bin = tmp_path / "data" / ours / "train.bin"
    st = os.stat(train_bin)
    raw = bytearray(train_bin.read_bytes())
    raw[0] ^= 1
    train_bin.write_bytes(bytes(raw))
    os.utime(train_bin, ns=(st.st_atime_ns, st.st_mtime_ns))            # same size, same time: O(1) check passes
    assert train.main(args + ["--out_dir", "o3"]) == 0
    with pytest.raises(data.DataError, match="does not match the sha256"):
        train.main(args + ["--verify", "1", "--out_dir", "o4"])
