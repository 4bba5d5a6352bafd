"""Running out of memory and the launch defaults: every out-of-memory error is one line naming what did not fit and
the flag to change (exit 2, the last checkpoint kept); train.py fits the micro-batch to the GPU before training;
a torchrun launch on CUDA without --preset trains the paper's recipe; the memory the probe leaves free, and
expandable segments set before CUDA starts. CPU only: CUDA is stood in for."""
import os

import pytest
import torch

from model import ModelConfig, build_model
from plumbing import cli, distributed, memory
import plumbing.distributed
import plumbing.memory
import plumbing.run
from plumbing.cli import UsageError
from plumbing.distributed import Env
import test_train
from conftest import write_corpus
import train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    write_corpus(d / "corpus.txt")
    return str(d / "corpus.txt"), str(d / "data")


OOM = ("CUDA out of memory. Tried to allocate 12.27 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
       "1.20 GiB is free. Including non-PyTorch memory, this process has 77.98 GiB memory in use.")


def exit_and_stderr(fn, capsys):
    with pytest.raises(SystemExit) as e:
        cli.run_cli(fn, oom_hint="lower --batch_size")
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("rank", ["0", "3"])
def test_out_of_memory_is_one_line_from_the_rank_that_hit_it(rank, monkeypatch, capsys):
    """torch's CUDA error and the CPU allocator's both become one line with the size and the flag; under torchrun
    the rank that ran out says so (the others may not have), while bad flags are reported by rank 0 alone."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "4")          # a job: a RANK without one is the one process's (rank 0)

    def cuda():
        raise torch.OutOfMemoryError(OOM)

    code, err = exit_and_stderr(cuda, capsys)
    prefix = "error: " if rank == "0" else f"error: rank {rank}: "
    assert code == 2 and err == (prefix + "out of memory: CUDA out of memory (tried to allocate 12.27 GiB; "
                                 "1.20 GiB of 79.19 GiB free); lower --batch_size\n")
    code, err = exit_and_stderr(lambda: torch.empty(1 << 60, dtype=torch.uint8), capsys)
    assert code == 2 and err.startswith(prefix + "out of memory: CPU out of memory (tried to allocate ")
    assert err.count("\n") == 1

    def bad_flag():
        raise cli.UsageError("--steps must be >= 1")

    code, err = exit_and_stderr(bad_flag, capsys)
    assert code == 2 and err == ("error: --steps must be >= 1\n" if rank == "0" else "")

    def bug():
        raise RuntimeError("a real bug")

    with pytest.raises(RuntimeError, match="a real bug"):   # not every RuntimeError is a resource fault
        cli.run_cli(bug)


def test_oom_in_training_names_the_micro_batch_keeps_checkpoint(corpus, tmp_path, monkeypatch,
                                                                                   capsys):
    real = train.train_step

    def step(run_, cfg, env, x0_all, mask_all=None):
        if run_.it >= 6:
            raise torch.OutOfMemoryError(OOM)
        return real(run_, cfg, env, x0_all, mask_all)

    monkeypatch.setattr(train, "train_step", step)
    code, err = exit_and_stderr(lambda: test_train.run(["--max_iters", "20", "--ckpt_interval", "4", "--eval_interval", "1000",
                                             "--grad_accum", "2"], tmp_path, corpus), capsys)
    err = err.split("\r")[-1].splitlines()[-1]                   # after the progress bar: one line
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err
    assert err.startswith("error: out of memory at micro-batch 4 (--batch_size 8 / 1 rank(s) / --grad_accum 2): "
                          "CUDA out of memory (tried to allocate 12.27 GiB")
    assert "set --grad_accum 4 (micro-batch 2)" in err and f"the last checkpoint in {tmp_path} is kept" in err
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ckpt["step"] == 4 and all(torch.isfinite(v).all() for v in ckpt["model"].values())


def fake_cuda_fit(monkeypatch, fits_up_to):
    monkeypatch.setattr(plumbing.memory, "_probe_fits", lambda run_, cfg, env, micro, model, loss: micro <= fits_up_to)
    monkeypatch.setattr(plumbing.memory, "_gpu_gib", lambda env: "79.2 GiB")
    return Env(torch.device("cuda"), world_size=2)        # no DDP: the ranks' verdicts need no all-reduce


def test_a_micro_batch_too_large_raises_grad_accum_until_it_fits(monkeypatch, capsys):
    env = fake_cuda_fit(monkeypatch, fits_up_to=16)
    cfg = train.TrainConfig(batch_size=128, grad_accum=1)
    plumbing.memory.fit_micro_batch(None, cfg, env)
    assert cfg.grad_accum == 4                                 # 128 / 2 ranks / 4 = 16 sequences per micro-step
    assert "micro-batch 64 does not fit in GPU memory (79.2 GiB): training with --grad_accum 4 (micro-batch 16" \
        in capsys.readouterr().out
    cfg = train.TrainConfig(batch_size=128, grad_accum=2)
    plumbing.memory.fit_micro_batch(None, cfg, fake_cuda_fit(monkeypatch, fits_up_to=64))
    assert cfg.grad_accum == 2                                 # it fits: nothing changes (CPU: no probe, test_run)


def test_a_micro_batch_too_large_is_one_line_with_auto_accum_off(monkeypatch):
    env = fake_cuda_fit(monkeypatch, fits_up_to=16)
    cfg = train.TrainConfig(batch_size=128, grad_accum=1, auto_accum=False)
    with pytest.raises(cli.OutOfMemory, match=r"^micro-batch 64 \(--batch_size 128 / 2 rank\(s\) / --grad_accum 1\) "
                                              r"does not fit in GPU memory \(79.2 GiB\); micro-batch 16 fits: set "
                                              r"--grad_accum 4$"):
        plumbing.memory.fit_micro_batch(None, cfg, env)
    with pytest.raises(cli.OutOfMemory, match="micro-batch 1 does not fit in GPU memory .*--block_size"):
        plumbing.memory.fit_micro_batch(None, train.TrainConfig(batch_size=4), fake_cuda_fit(monkeypatch, fits_up_to=0))


def test_torchrun_on_cuda_without_preset_trains_papers_recipe(monkeypatch, capsys):
    """The flagship command `torchrun --nproc_per_node=8 train.py --loss sddlm_v1` runs --preset small and says so
    first; a preset given, a CPU device or a plain `python train.py` keep what was asked."""
    seen = []

    class Started(Exception):
        pass

    def started(cfg, env):                       # train's first call after the note: the run starts here
        seen.append(cfg)
        raise Started

    def main(argv):
        with pytest.raises(Started):
            train.main(argv)
        return seen[-1]
    monkeypatch.setattr(cli, "resolve_device", lambda name: torch.device("cpu" if name == "cpu" else "cuda"))
    monkeypatch.setattr(plumbing.run, "setup_distributed", lambda cfg, env: Env(torch.device("cpu")))
    monkeypatch.setattr(train, "load_gen_judge", started)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert main(["--loss", "sddlm_v1"]).preset == "tiny"                                 # python train.py
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg, out = main(["--loss", "sddlm_v1"]), capsys.readouterr().out
    assert (cfg.preset, cfg.dataset, cfg.tokenizer, cfg.block_size, cfg.batch_size) == \
        ("small", "openwebtext", "gpt2", 1024, 512) and cfg.loss == "sddlm_v1" and cfg.curriculum_iters == 500_000
    assert out.splitlines()[0] == train.FLAGSHIP_NOTE
    assert main(["--loss", "sddlm_v1", "--batch_size", "256"]).batch_size == 256
    capsys.readouterr()
    for argv in (["--preset", "tiny"], ["--preset=tiny"], ["--device", "cpu"]):
        assert main(argv).preset == "tiny", argv
    assert train.FLAGSHIP_NOTE not in capsys.readouterr().out


def test_model_numel_counts_what_the_model_allocates():
    """model_numel, from the shapes alone, against the tensors a built model holds (an independent route)."""
    for kw in [dict(n_layer=2, n_embd=64, n_head=2, vocab_size=320, block_size=32),
               dict(arch="llama", time_cond=False, n_layer=3, n_embd=64, n_head=4, vocab_size=1000, vocab_multiple=128,
                    block_size=16, mlp_hidden=100),
               dict(time_cond=False, causal=True, n_layer=1, n_embd=32, n_head=2, vocab_size=77, vocab_multiple=8,
                    block_size=8, cond_dim=16)]:
        config = ModelConfig(**kw)
        model = build_model(config)
        assert plumbing.memory.model_numel(config) == (sum(p.numel() for p in model.parameters()),
                                              sum(b.numel() for b in model.buffers()))


def test_a_folder_too_large_for_the_machine_names_its_field(tmp_path):
    """The memory check itself (a consistent folder cannot be made that large here): the field whose value costs the
    most is named, as the caller names it."""
    config = ModelConfig(n_layer=10 ** 9, n_embd=64, n_head=2, vocab_size=320, block_size=32)
    with pytest.raises(UsageError, match=r"out/model/config.json: n_layer 1000000000: the model needs at least .*"
                                         r"more than the .* of (available RAM|memory left|address space)"):
        plumbing.memory.check_model_memory(config, "cpu", lambda field: f"out/model/config.json: {field}")
    wide = ModelConfig(n_layer=2, n_embd=2 * 10 ** 6, n_head=2, vocab_size=320, block_size=32)
    with pytest.raises(UsageError, match="config.json: n_embd 2000000"):
        plumbing.memory.check_model_memory(wide, "cpu", lambda field: f"config.json: {field}")
    small = ModelConfig(n_layer=2, n_embd=64, n_head=2, vocab_size=320, block_size=32)
    plumbing.memory.check_model_memory(small, "cpu", lambda field: field)       # a small one passes


def test_compiled_probe_compiles_each_step_twice_at_most(monkeypatch):
    """--compile on CUDA (the CUDA memory query stood in for, the probe's steps run on the CPU): trying
    micro-batches 8, 4, 2 compiles each kind of step (curriculum, plain) twice at most -- at the first micro-batch,
    then once with a dynamic batch size (dynamo specializes a size of 1: micro-batch 1 would be a third) -- not once
    per try; where the first fits, the probe's graphs are the run's (none made after). Dynamo's "eager" backend:
    what is compiled, and when, dynamo's guards decide before any backend runs."""
    import functools
    import torch._dynamo.utils
    from plumbing.memory import fit_micro_batch, probe_steps
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    cfg = train.TrainConfig(batch_size=8, block_size=16, curriculum_iters=2, max_iters=4, n_layer=1, n_embd=32,
                            n_head=2, ema=0.0, head="plain")                 # one head: no fused_recompute tries
    cpu = Env(torch.device("cpu"))
    run = train.build_run(cfg, train.model_config_for(cfg, 64), cpu)
    graphs = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]

    def probe_on_cpu(fits_up_to):
        monkeypatch.setattr(plumbing.memory, "_probe_fits", lambda run_, cfg, env, micro, model, loss:
                            probe_steps(run_, cfg, cpu, micro, loss, model) or micro <= fits_up_to)
        monkeypatch.setattr(plumbing.memory, "_gpu_gib", lambda env: "79.2 GiB")
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        fit_micro_batch(run, cfg, Env(torch.device("cuda")), compile=True, loss=train.probe_loss(cfg))

    try:
        probe_on_cpu(fits_up_to=2)
        assert cfg.grad_accum == 4 and graphs() <= 4, graphs()           # 3 tries of 2 kinds: 6 compilations before
        cfg.grad_accum = 1
        probe_on_cpu(fits_up_to=8)
        assert graphs() == 2
        probe_steps(run, cfg, cpu, 8, train.probe_loss(cfg), torch.compile(run.raw_model))   # the run's first steps
        assert graphs() == 2
    finally:
        torch._dynamo.reset()


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
    distributed.setup_distributed(train.TrainConfig(device="cpu", threads=1), distributed.launch_env())
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ                 # the CPU: nothing to set
    at_first_cuda_call = []
    monkeypatch.setattr(distributed, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: at_first_cuda_call.append(
        os.environ.get("PYTORCH_CUDA_ALLOC_CONF")))
    env = distributed.setup_distributed(train.TrainConfig(), distributed.launch_env())
    assert env.device == torch.device("cuda", 0) and at_first_cuda_call == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    distributed.setup_distributed(train.TrainConfig(), distributed.launch_env())
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"   # the user's own is kept
