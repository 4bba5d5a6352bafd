"""Several nodes and CPU threads: two torchrun "nodes" on loopback, each with its own working directory and data
folder, train exactly as two processes of one node; nodes with different data fail together in one line;
--threads and its default; train.py's own preparation takes prepare.py's --text_field, --num_proc, --verify."""
import json
import os
import random
import socket
import subprocess
import sys

import pytest
import torch

import data
import plumbing.distributed
from plumbing.cli import UsageError
from plumbing.distributed import Env, cpu_threads, idle_cores, on_each_node, usable_cores

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
TINY = ["--n_layer", "2", "--n_embd", "64", "--n_head", "2", "--block_size", "32", "--batch_size", "8",
        "--warmup_iters", "5", "--num_samples", "0", "--eval_iters", "2", "--log_interval", "2",
        "--tokenizer", "sp_train:320", "--dataset", "corpus.txt", "--max_iters", "4", "--eval_interval", "1000",
        "--device", "cpu", "--threads", "1", "--loss", "sddlm_v1", "--lr_schedule", "constant",
        "--curriculum_iters", "0"]


def write_corpus(path, seed=0):
    rng = random.Random(seed)
    nouns, verbs = ["cat", "dog", "bird", "fish", "tree", "house"], ["sees", "likes", "finds", "eats"]
    lines = [f"the {rng.choice(nouns)} {rng.choice(verbs)} the {rng.choice(nouns)} ." for _ in range(1500)]
    path.write_text("\n".join(" ".join(lines[i:i + 5]) + "\n" for i in range(0, len(lines), 5)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(cwd, launch, args=TINY):
    """A torchrun process in its own working directory (a node's disk): train.py given by its absolute path."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launch, os.path.join(HERE, "train.py"),
                             *args], cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def two_nodes(tmp_path, corpora=(0, 0)):
    """Two loopback nodes (--nnodes 2 --nproc_per_node 1, c10d rendezvous at 127.0.0.1), node folders a/ and b/,
    each with its own copy of the corpus -> (folders, finished processes)."""
    nodes = [tmp_path / "a", tmp_path / "b"]
    port = free_port()
    for node, seed in zip(nodes, corpora):
        node.mkdir()
        write_corpus(node / "corpus.txt", seed)
    launch = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
              f"127.0.0.1:{port}", "--rdzv_id", "loopback"]
    procs = [torchrun(node, launch) for node in nodes]
    for p in procs:
        p.out, p.err = p.communicate(timeout=240)
    return nodes, procs


def last(log_path, key):
    with open(log_path) as f:
        return [r[key] for r in map(json.loads, f) if key in r][-1]


@pytest.mark.slow
def test_two_loopback_nodes_train_as_two_processes_of_one_node(tmp_path):
    nodes, procs = two_nodes(tmp_path)
    for p in procs:
        assert p.returncode == 0, p.err[-3000:]
    # each node prepared its own folder (no shared storage), with the same content key in its name
    folders = [os.listdir(node / "data") for node in nodes]
    assert folders[0] == folders[1] and len(folders[0]) == 1, folders
    metas = [data.load_meta(str(node / "data" / folders[0][0])) for node in nodes]
    assert metas[0]["sha256"] == metas[1]["sha256"] and folders[0][0].endswith(data.key_digest(metas[0]["data_key"]))
    # rank 0 (on whichever node the rendezvous made first) wrote the run; its first lines name the shape
    writer = [node for node in nodes if (node / "out" / "ckpt.pt").exists()]
    assert len(writer) == 1
    said = "".join(p.out for p in procs)
    assert "2 nodes x 1 process, cpu, 1 torch thread per process (--threads)" in said, said

    one = tmp_path / "one"
    one.mkdir()
    write_corpus(one / "corpus.txt")
    p = torchrun(one, ["--standalone", "--nproc_per_node", "2"])
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, err[-3000:]
    assert "1 node x 2 processes" in out, out
    # the same arithmetic in the same order: the weights, the loss and the evaluation are equal to the bit
    a = torch.load(writer[0] / "out" / "ckpt.pt", weights_only=False)
    b = torch.load(one / "out" / "ckpt.pt", weights_only=False)
    assert a["step"] == b["step"] == 4
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for key in ("loss", "val_ppl", "val_tokens"):
        assert last(writer[0] / "out" / "log.jsonl", key) == last(one / "out" / "log.jsonl", key), key


@pytest.mark.slow
def test_nodes_with_different_data_fail_together_in_one_line(tmp_path):
    nodes, procs = two_nodes(tmp_path, corpora=(0, 1))
    assert all(p.returncode != 0 for p in procs)
    errors = [line for p in procs for line in p.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the nodes hold different prepared data" in errors[0], errors
    assert "Traceback (most recent call last):\n  File \"" + os.path.join(HERE, "train.py") not in \
        "".join(p.err for p in procs)
    assert not any((node / "out" / "ckpt.pt").exists() for node in nodes)


def test_other_data_keys_or_bytes_are_one_line_naming_both_nodes():
    same = ("/n0/data/x", "abc", {"train.bin": "1"})
    data.same_data_on_every_node({0: same, 1: ("/n1/data/x", "abc", {"train.bin": "1"})})   # other paths: fine
    with pytest.raises(data.DataError, match=r"node 0 has data key abc \(/n0/data/x\), node 1 has def"):
        data.same_data_on_every_node({1: ("/n1/d", "def", {}), 0: same})
    with pytest.raises(data.DataError, match="share the data key abc but not their bytes"):
        data.same_data_on_every_node({0: same, 1: ("/n1/d", "abc", {"train.bin": "2"})})


def test_on_each_node_in_one_process_is_the_work_and_its_error():
    first = Env(torch.device("cpu"))
    assert on_each_node(first, lambda: "d") == ("d", {0: "d"})
    with pytest.raises(data.DataError, match="^bad$"):
        on_each_node(first, lambda: (_ for _ in ()).throw(data.DataError("bad")), data.DataError)


def test_threads_flag_then_omp_num_threads_then_idle_cores(monkeypatch):
    assert usable_cores() == sorted(os.sched_getaffinity(0))
    monkeypatch.setattr(plumbing.distributed, "usable_cores", lambda: list(range(8)))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(5, 1) == (5, "--threads")
    assert cpu_threads(0, 1) == (3, "OMP_NUM_THREADS")
    for threads, omp, words in [(9, "3", "--threads 9 asks for more threads than the 8 usable cores"),
                                (0, "9", "OMP_NUM_THREADS=9 asks for more threads than the 8 usable cores"),
                                (0, "abc", "OMP_NUM_THREADS='abc' is not a number of threads")]:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
        with pytest.raises(UsageError, match=words):
            cpu_threads(threads, 1)
    monkeypatch.delenv("OMP_NUM_THREADS")
    for idle, local, threads in [(8.0, 1, 8), (7.6, 2, 4), (2.4, 1, 2), (0.2, 1, 1), (0.0, 4, 1), (None, 2, 4),
                                 (None, 16, 1)]:
        monkeypatch.setattr(plumbing.distributed, "idle_cores", lambda cores, idle=idle: idle)
        assert cpu_threads(0, local)[0] == threads, (idle, local)
    monkeypatch.setattr(plumbing.distributed, "idle_cores", lambda cores: 2.4)
    assert cpu_threads(0, 1) == (2, "8 usable cores, 2.4 idle at start, 1 per node")


def test_idle_cores_counts_a_busy_core_as_busy():
    """A core kept busy by another process while idle_cores watches is not counted idle (the kernel's counters)."""
    import multiprocessing
    cores = usable_cores()
    ctx = multiprocessing.get_context("spawn")
    spinning = ctx.Event()
    busy = ctx.Process(target=_spin, args=(cores[0], 3.0, spinning))
    busy.start()
    try:
        assert spinning.wait(60)                            # the child has started spinning (spawn takes seconds)
        idle = idle_cores(cores[:1], seconds=0.5)
    finally:
        busy.join()
    assert idle is not None and idle < 0.5


def _spin(core, seconds, spinning):
    import time
    os.sched_setaffinity(0, {core})
    spinning.set()
    end = time.time() + seconds
    while time.time() < end:
        pass


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
