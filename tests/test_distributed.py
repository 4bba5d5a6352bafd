"""plumbing/distributed.py: the launch environment checked as a whole before any work; a rank waiting for the
others says whom it waits for and stops on a signal or its timeout; each rank's slice of the global draws, the
--compile default, and the DDP and torch.compile wrap after the memory probe (graphs split at DDP's buckets)."""
import functools
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import train
from conftest import ENV, HERE, TOY, assert_adam_moments_close, case, check_last, reduction_tol, run_batches
from model import ModelConfig
from plumbing import cli, distributed, memory
from plumbing.distributed import Env, compiles, rank_slice, wrap_model


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
    model = wrap_model(run.raw_model, env, compile=False)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel) and model.gradient_as_bucket_view
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
