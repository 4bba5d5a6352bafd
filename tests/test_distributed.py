"""plumbing/distributed.py: the launch environment checked as a whole before any work; a rank waiting for the
others says whom it waits for and stops on a signal or its timeout; each rank's slice of the global draws, the
--compile default, and the DDP and torch.compile wrap after the memory probe (graphs split at DDP's buckets);
two torchrun "nodes" on loopback train exactly as two processes of one node, nodes with different data fail
together in one line; on_each_node; --threads and its default (idle cores)."""
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import data
import plumbing.distributed
import train
from conftest import (ENV, HERE, TOY, assert_adam_moments_close, case, check_last, reduction_tol, run_batches,
                      write_corpus)
from model import ModelConfig
from plumbing import cli, distributed, memory
from plumbing.cli import UsageError
from plumbing.distributed import (Env, check_threads, compiles, cpu_threads, idle_cores, on_each_node, rank_slice,
                                  usable_cores, wrap_model)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("env, words", [
    ({}, None), ({"WORLD_SIZE": "1"}, None), ({"LOCAL_RANK": "0"}, None),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}, None),
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a whole number"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK and MASTER_ADDR and MASTER_PORT are not set"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR and MASTER_PORT are not set"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE must be >= 1"),
    ({"RANK": "1"}, "RANK=1 is not below WORLD_SIZE=1"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not a port"),
    ({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
      "MASTER_PORT": "1"}, "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     "LOCAL_WORLD_SIZE=3 is not in 1..WORLD_SIZE=2"),
])
def test_the_launch_environment_is_checked_as_a_whole(env, words):
    if words is None:
        distributed.launch_env(env)
    else:
        with pytest.raises(distributed.LaunchError, match=words):
            distributed.launch_env(env)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the cores and the memory")
def test_bad_environments_threads_and_sizes_refused_at_start(tmp_path):
    """Each of these ran until the machine gave up (or crashed) before: now one line in a few seconds, before any
    data are prepared or any model allocated, naming the variable, the flag or the field; nothing is created."""
    t = tmp_path
    run = lambda name: ["--out_dir", t / name, "--max_iters", "1"]
    ddp = {"WORLD_SIZE": "2", "RANK": "0"}
    cases = [
        case("train.py", *run("a"), cwd=t, env={"WORLD_SIZE": "2", "RANK": "0"},
             expect="WORLD_SIZE=2 but MASTER_ADDR and MASTER_PORT are not set"),
        case("train.py", *run("b"), cwd=t, env={"WORLD_SIZE": "2"}, expect="WORLD_SIZE=2 but RANK and MASTER_ADDR"),
        case("train.py", *run("c"), cwd=t, env={"WORLD_SIZE": "abc"}, expect="WORLD_SIZE='abc' is not a whole number"),
        case("train.py", *run("d"), cwd=t, env={**ddp, "MASTER_ADDR": "x", "MASTER_PORT": "1", "LOCAL_RANK": "5"},
             expect="contradictory: LOCAL_RANK=5 is not below LOCAL_WORLD_SIZE=2"),
        case("distillation/distill.py", "--init", t / "none.pt", *run("e"), cwd=t, env={"WORLD_SIZE": "abc"},
             expect="WORLD_SIZE='abc' is not a whole number"),
        case("distillation/distill.py", "--init", t / "none.pt", *run("f"), cwd=t, env={"WORLD_SIZE": "2"},
             expect="WORLD_SIZE=2 but RANK and MASTER_ADDR"),
        # a MASTER_ADDR that does not resolve is named (rank 0 used to blame the port after 5 s); a rank other than 0
        # that gives up waiting says so itself (it used to exit 2 without a line: rank 0 speaks for all, but is gone)
        *[case(script, *extra, *run(f"addr{rank}"), cwd=t, env={**ddp, "RANK": rank, "MASTER_ADDR":
                                                                "no.such.host.invalid", "MASTER_PORT": "29511"},
               expect=f"rank {rank}: MASTER_ADDR=no.such.host.invalid does not resolve to an address")
          for rank in ("0", "1") for script, extra in (("train.py", []),
                                                        ("distillation/distill.py", ["--init", t / "none.pt"]))],
        case("train.py", *run("alone"), "--dist_timeout", "1", cwd=t,
             env={**ddp, "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
             expect="rank 1: rank 0's store did not answer within --dist_timeout 1 s at 127.0.0.1:"),
        case("train.py", *run("g"), "--threads", "1000000", cwd=t, expect="--threads 1000000 asks for more threads"),
        case("train.py", *run("h"), cwd=t, env={"OMP_NUM_THREADS": "1000000"},
             expect="OMP_NUM_THREADS=1000000 asks for more threads"),
        case("bench/bench.py", "--threads", "1000000", cwd=t, expect="--threads 1000000 asks for more threads"),
        case("bench/bench.py", "--repeats", "1", cwd=t, env={"OMP_NUM_THREADS": "1000000"},
             expect="OMP_NUM_THREADS=1000000 asks for more threads"),
        case("train.py", *run("i"), "--n_layer", "1000000000", cwd=t, expect="--n_layer 1000000000: training"),
        case("train.py", *run("j"), "--n_embd", "2000000", "--n_head", "2", cwd=t, expect="--n_embd 2000000: training"),
    ]
    check_last(run_batches(cases))
    assert sorted(os.listdir(t)) == []          # no data folder prepared, no out_dir made


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals and /proc")
def test_a_waiting_rank_names_whom_stops_on_signal_or_timeout(tmp_path):
    """WORLD_SIZE=2 with rank 1 never started: rank 0 says it waits for rank 1, a SIGTERM ends it with 130 at once
    (it used to sit in one C++ call, deaf to signals), and --dist_timeout ends it with 2 and the rank that never
    came."""
    procs = {}
    for name, extra in (("signal", []), ("timeout", ["--dist_timeout", "3"])):
        env = {**ENV, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "TQDM_DISABLE": "1"}
        procs[name] = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), "--out_dir",
                                        str(tmp_path / name), "--max_iters", "1", *extra], cwd=tmp_path, env=env,
                                       stderr=subprocess.PIPE, text=True)
    p = procs["signal"]
    first = p.stderr.readline()                 # the wait starts with its line (after the imports)
    assert "rank 0: waiting for rank 1 of 2 to join at 127.0.0.1:" in first, first
    p.send_signal(signal.SIGTERM)
    start = time.monotonic()
    rest = p.communicate(timeout=30)[1]
    assert p.returncode == 130 and time.monotonic() - start < 5, (p.returncode, rest)
    assert rest.strip().splitlines()[-1] == "error: interrupted by SIGTERM" and "Traceback" not in rest, rest
    q = procs["timeout"]
    err = q.communicate(timeout=60)[1]
    assert q.returncode == 2 and "Traceback" not in err, (q.returncode, err)
    assert err.strip().splitlines()[-1].startswith(
        "error: rank 0: rank 1 of 2 did not join within --dist_timeout 3 s at 127.0.0.1:"), err
    assert not (tmp_path / "signal").exists() and not (tmp_path / "timeout").exists()


def test_rank_slices_reassemble_the_global_time_vector():
    world, accum, n = 4, 2, 64
    t = torch.rand(n, generator=torch.Generator().manual_seed(0))
    parts = [rank_slice(t, r, world, m, accum) for r in range(world) for m in range(accum)]
    assert all(p.numel() == n // (world * accum) for p in parts)
    assert torch.equal(torch.cat(parts), t)


# -----------------------------------------------------------------------------
# --compile auto

def test_compile_auto_compiles_only_the_papers_presets_on_cuda():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    papers = ["small", "owt", "lm1b", "medium", "large"] + [p for p in train.TRAIN_PRESETS if p.startswith("llama_")]
    assert train.TrainConfig().compile == "auto" and train.parse_config([]).compile == "auto"
    for preset in papers:
        assert compiles("auto", preset, cuda) is True, preset
        assert compiles("auto", preset, cpu) is False, preset
    assert compiles("auto", "tiny", cuda) is False                  # the CPU demo stays eager, on any device
    for off in ("0", "false", "no", False):                         # --compile 0 wins over the preset
        assert compiles(off, "small", cuda) is False
    assert compiles(train.parse_config(["--preset", "small", "--compile", "0"]).compile, "small", cuda) is False
    assert compiles(train.parse_config(["--compile", "1"]).compile, "tiny", cpu) is True
    with pytest.raises(cli.UsageError, match=r"^--compile must be auto, 1 or 0, got 'sometimes'$"):
        train.main(["--compile", "sometimes"])


# -----------------------------------------------------------------------------
# the probe, then DDP, then torch.compile

@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of one rank in this process: DDP for real, with no other process."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield Env(torch.device("cpu"), ddp=True, world_size=1)
    dist.destroy_process_group()


@pytest.fixture
def graphs(monkeypatch):
    """torch.compile with a backend that records each graph it is given and runs it as traced (no C++ compiler)."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    yield seen
    torch._dynamo.reset()


def cached_graphs(model):
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    return len(_debug_get_cache_entry_list(type(model).forward.__code__))


def probe_on_cpu(monkeypatch, run, cfg, env):
    """The micro-batch probe at --compile 1 whose CUDA memory query is stood in for (it fits)."""
    monkeypatch.setattr(memory, "_probe_fits", lambda run_, cfg, env, micro, model, loss:
                        memory.probe_steps(run_, cfg, env, micro, loss, model) or True)
    memory.fit_micro_batch(run, cfg, env, compile=True, loss=train.probe_loss(cfg))


def test_the_probe_leaves_no_graph_and_ddp_keeps_its_buckets(one_rank_group, graphs, one_thread, monkeypatch):
    """The memory probe compiles the model outside DDP (its peak is the compiled step's), then drops the graph: the
    training model, compiled inside DDP afterwards, must not reuse a graph that was never split at DDP's buckets
    (the old probe left one: the cache held it, and DDP's forward ran it whole). DDP is built with
    gradient_as_bucket_view, its gradients zeros from the start, so every step accumulates in the buckets."""
    env = one_rank_group
    cfg = train.TrainConfig(batch_size=4, block_size=16, ema=0, warmup_iters=0)
    run = train.build_run(cfg, TOY, env)
    probe_on_cpu(monkeypatch, run, cfg, env)
    assert len(graphs) == 1 and cached_graphs(run.raw_model) == 0
    assert all(p.grad is None for p in run.raw_model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)           # torch 2.13 warns at broadcast_buffers=False
        model = wrap_model(run.raw_model, env, compile=False)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel) and model.gradient_as_bucket_view
    assert not model.will_sync_module_buffers()                     # the RoPE tables: no broadcast at each forward
    assert all(p.grad is not None and not p.grad.any() for p in run.raw_model.parameters())
    assert model.config is run.raw_model.config                     # diffusion.loss_terms reads it through DDP


@pytest.mark.numerics
@pytest.mark.slow
def test_compiled_ddp_splits_at_buckets_and_equals_one_process(one_rank_group, graphs, one_thread, monkeypatch):
    """TorchDynamo's DDPOptimizer splits the graph compiled inside DDP at the gradient buckets (here 1 MiB each:
    several graphs for a 1.6M-parameter model), so each bucket's all-reduce overlaps the rest of the backward; with
    the probe's graph left in the cache no new graph is compiled at all. And the compiled DDP steps equal eager
    steps of one process: their losses, and their gradients through AdamW's moments at a learning rate that moves
    no weight (conftest.assert_adam_moments_close)."""
    env = one_rank_group
    cfg = train.TrainConfig(batch_size=4, block_size=16, ema=0.9, warmup_iters=0, grad_accum=2, lr=1e-30,
                            grad_clip=0.0)
    mcfg = ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=128)
    one = Env(torch.device("cpu"))
    run, ref = train.build_run(cfg, mcfg, env), train.build_run(cfg, mcfg, one)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():         # the zero-initialised output and adaLN layers perturbed: every weight has a gradient
        for p, q in zip(run.raw_model.parameters(), ref.raw_model.parameters()):
            noise = 0.05 * torch.randn(p.shape, generator=g)
            p.add_(noise), q.add_(noise)
    probe_on_cpu(monkeypatch, run, cfg, env)
    run.model = wrap_model(run.raw_model, env, compile=True)
    run.model._orig_mod.bucket_bytes_cap = dist._DEFAULT_FIRST_BUCKET_BYTES
    before = len(graphs)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x0 = torch.randint(0, 64, (4, 16), generator=gen)
        # a mean of 64 positive token losses, each a 64-term log-sum-exp: float32, relative to the loss itself
        torch.testing.assert_close(train.train_step(run, cfg, env, x0), train.train_step(ref, cfg, one, x0),
                                   rtol=reduction_tol(64 + 64 + 13, torch.float32), atol=0)
    assert len(graphs) - before > 1
    assert_adam_moments_close(run.optimizer.state_dict(), ref.optimizer.state_dict(), n_terms=4 * 16)


TINY = ["--n_layer", "2", "--n_embd", "64", "--n_head", "2", "--block_size", "32", "--batch_size", "8",
        "--warmup_iters", "5", "--num_samples", "0", "--eval_iters", "2", "--log_interval", "2",
        "--tokenizer", "sp_train:320", "--dataset", "corpus.txt", "--max_iters", "4", "--eval_interval", "1000",
        "--device", "cpu", "--threads", "1", "--loss", "sddlm_v1", "--lr_schedule", "constant",
        "--curriculum_iters", "0"]


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
        write_corpus(node / "corpus.txt", 1500, seed)
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
    write_corpus(one / "corpus.txt", 1500)
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
    with pytest.raises(UsageError, match="--threads 9 asks for more threads than the 8 usable cores"):
        check_threads(9, "--threads")           # plumbing.run.launch's check: cpu_threads takes --threads as given
    for omp, words in [("9", "OMP_NUM_THREADS=9 asks for more threads than the 8 usable cores"),
                       ("abc", "OMP_NUM_THREADS='abc' is not a number of threads")]:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
        with pytest.raises(UsageError, match=words):
            cpu_threads(0, 1)
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
