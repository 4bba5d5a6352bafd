"""The training loop's plumbing: each rank's slice of the global draws, the --compile default, the model DDP and
torch.compile wrap after the memory probe (graphs split at DDP's buckets, gradients as bucket views), batches on
the run's device, and the memory the probe leaves free. CPU only: CUDA is stood in for where it is named."""
import functools
import os

import pytest
import torch
import torch.distributed as dist

import data
import validation
import prepare
import train
from model import ModelConfig
from plumbing import cli, distributed, memory
from plumbing.distributed import Env, compiles, rank_slice, wrap_model
from conftest import assert_adam_moments_close, reduction_tol


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

TOY = ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)


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


# -----------------------------------------------------------------------------
# batches on the run's device

@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    d = tmp_path_factory.mktemp("loop")
    (d / "c.txt").write_text("\n\n".join(f"the cat {i} sees the dog {i % 7} ." * 3 for i in range(300)))
    return prepare.prepare_dataset(str(d / "c.txt"), "gpt2", str(d / "data"), 16, progress=False, num_proc=1)


def test_the_run_loads_its_batches_onto_its_device(prepared, monkeypatch):
    """train.py's loader is built with the run's device: on CUDA data._to_tensors pins each batch and copies it
    without blocking the host (which runs ahead, loading the next batch while the GPU computes). Stood in for on
    the CPU: the pinned, non-blocking route gives the same batches, in the same order, as the plain one."""
    seen = {}
    monkeypatch.setattr(train, "BatchLoader", lambda *a, **kw: seen.update(kw))
    env = Env(torch.device("cpu"))
    train.build_run(train.TrainConfig(batch_size=4, block_size=16), TOY, env, prepared)
    assert seen["device"] == env.device
    monkeypatch.undo()

    copies = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and torch.device(args[0]).type == "cuda":       # the copy to the GPU, stood in for
            copies.append((getattr(self, "is_pinned_stand_in", False), kwargs.get("non_blocking")))
            return self
        return real_to(self, *args, **kwargs)

    def pin_memory(self):
        self.is_pinned_stand_in = True
        return self
    plain = data.BatchLoader(prepared, "train", 4, seed=3)
    on_gpu = data.BatchLoader(prepared, "train", 4, seed=3, device=torch.device("cuda"))
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    for _ in range(2 * plain.steps_per_epoch + 1):                   # over two epoch boundaries
        (a, mask_a), (b, mask_b) = plain.next_batch(), on_gpu.next_batch()
        assert torch.equal(a, b) and mask_a is None and mask_b is None
    assert copies == [(True, True)] * (2 * plain.steps_per_epoch + 1)


def test_evaluation_runs_the_compiled_model(prepared, one_thread):
    """Evaluation calls run.eval_model (train.py sets it to the compiled raw model when the run compiles) with the EMA
    weights swapped in, and scores what the plain model scores."""
    cfg = train.TrainConfig(batch_size=8, block_size=16, eval_iters=2, ema=0.5)
    meta = data.load_meta(prepared)
    mcfg = ModelConfig(vocab_size=meta["vocab_size"], block_size=16, n_layer=1, n_head=2, n_embd=32)
    env = Env(torch.device("cpu"))
    run = train.build_run(cfg, mcfg, env)
    for e in run.ema:
        e.add_(0.01)
    eager = validation.evaluate(run, cfg, prepared, env)
    calls = []

    class Spy(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model, self.config = model, model.config

        def forward(self, *args, **kwargs):
            calls.append(self.model.training)
            return self.model(*args, **kwargs)
    run.eval_model = Spy(run.raw_model)
    assert torch.equal(validation.evaluate(run, cfg, prepared, env), eager)
    assert calls and not any(calls)                                   # eval mode, every call


# -----------------------------------------------------------------------------
# the memory the probe leaves free

def test_the_probe_leaves_room_for_cuda_context_nccl_fragments():
    """The probe accepts a measured peak up to usable_bytes: the device less 2 GiB (CUDA context, library
    workspaces, NCCL's buffers: outside torch's allocator) less 8% of it (fragmentation, steps the probe does not
    take). The old bar, 0.97 of the device, left 2.4 GiB of an 80 GiB H100."""
    gib = 2 ** 30
    for total_gib in (16, 24, 40, 80, 141):
        total = total_gib * gib
        usable = memory.usable_bytes(total)
        assert usable == int(total * 0.92) - 2 * gib
        assert total - usable >= 2 * gib + 0.08 * total - 1
    assert memory.usable_bytes(80 * gib) / gib == pytest.approx(71.6, rel=1e-9)   # int() drops < 1 byte of 72 GiB
    assert memory.usable_bytes(80 * gib) < 0.97 * 80 * gib - 5 * gib   # 5 GiB more room than the old bar


def test_expandable_segments_set_before_cuda_unless_user_chose(monkeypatch):
    assert memory.cuda_allocator_env({}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert memory.cuda_allocator_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == {}
    assert memory.cuda_allocator_env({"PYTORCH_ALLOC_CONF": ""}) == {}
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # setup_distributed sets TF32 on CUDA: put it back by hand (monkeypatch cannot undo these properties in pytest 9.2)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    threads = torch.get_num_threads()
    try:
        _setup_on_a_stand_in_cuda(monkeypatch)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        torch.set_num_threads(threads)


def _setup_on_a_stand_in_cuda(monkeypatch):
    distributed.setup_distributed(train.TrainConfig(device="cpu", threads=1))
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ                 # the CPU: nothing to set
    at_first_cuda_call = []
    monkeypatch.setattr(distributed, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: at_first_cuda_call.append(
        os.environ.get("PYTORCH_CUDA_ALLOC_CONF")))
    env = distributed.setup_distributed(train.TrainConfig())
    assert env.device == torch.device("cuda", 0) and at_first_cuda_call == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    distributed.setup_distributed(train.TrainConfig())
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"   # the user's own is kept
