"""
Benchmark train.py's training step for every objective, and the ancestral sampler against bare forwards.

    python bench/bench.py                                          # tiny preset, L=128, B=4, CPU float32: ~1 min
    python bench/bench.py --preset tiny --vocab_size 50258         # the vocabulary cost of the NELBO
    python bench/bench.py --preset small --block_size 1024 --batch_size 32 --device cuda --compile 1
                                                                   # paper Fig. (time)
    python bench/bench.py --json 1                                 # one JSON object instead of markdown
    python bench/bench.py --head fused_recompute                   # the steps with the fused head recomputing logits
    python bench/bench.py --losses sddlm_v1 --profile 1            # where a step, the sampler spend their time

The method (train.py's own step, interleaved rounds, medians), every column and table, the flags that give
RESULTS.md's earlier tables: docs/testing.md.
"""
import os, sys  # noqa: E401  (run as a file, python FOLDER/SCRIPT.py: the repository root goes on the path)
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing import cli  # first: a stop signal while the imports below load is one line, exit 130
cli.stop_at_once(__name__)

import datetime
import gc
import itertools
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm

import curriculum.gaussian as curriculum
import diffusion
import losses
from kernels.fused_head import HEADS, Head
from plumbing.cli import (OutOfMemory, UsageError, autocast_for, is_out_of_memory, oom_summary, parse_flags,
                          resolve_device, resolve_dtype, run_cli)
from model import PRESETS, build_model
from diffusion import OBJECTIVES, loss_terms, token_mean
from plumbing.distributed import Env, check_threads, omp_threads
from plumbing.memory import check_training_memory, cuda_allocator_env
from plumbing.run import Run
from sample import Psi, check_sample_size, generate, generate_long, long_windows
from train import TRAIN_PRESETS, TrainConfig, make_optimizer, model_config_for, train_step

ALL_LOSSES = ",".join(OBJECTIVES)
MFU_FORMULA = "6*N*T + 12*n_layer*L*d*T + 6*d*V*T (T = B*L tokens; N = per-token block weight matrices)"
@dataclass
class BenchConfig:
    preset: str = "tiny"            # model size and training recipe, as train.py --preset
    block_size: int = 0             # sequence length L (0 = the preset's)
    batch_size: int = 4             # sequences per step
    vocab_size: int = 0             # 0 = the preset's (e.g. 50258 on tiny shows the vocabulary cost)
    n_layer: int = 0                # Transformer blocks (0 = the preset's)
    n_head: int = 0                 # attention heads (0 = the preset's)
    n_embd: int = 0                 # hidden width (0 = the preset's)
    device: str = "auto"            # auto | cpu | cuda
    dtype: str = "auto"             # auto (bf16 autocast on GPU, float32 on CPU) | float32 | bfloat16
    compile: bool = False           # torch.compile the model (warm-up rounds absorb the compilation)
    repeats: int = 3                # timed rounds; each loss reports the median
    warmup: int = 1                 # rounds run first and dropped (with --compile: they compile)
    losses: str = ALL_LOSSES        # comma-separated objectives, as train.py --loss
    curriculum: str = "sddlm"       # this loss again with Duo's curriculum on: the row 'sddlm+curriculum' ('' = none)
    vocab_multiple: int = 0         # pad the output layer to a multiple of this; 0 = the preset's
    sample_steps: int = 4           # reverse steps of the sampler benchmark (0 = skip it)
    threads: int = 1                # CPU threads for torch (0 = torch's default, every core: 10x slower on busy ones)
    head: str = "auto"              # the steps' output layer, as train.py --head: auto | plain | fused
                                    # | fused_recompute
    head_chunks: int = 4            # the fused head's rows in this many chunks: kept vs recomputed logits (0 = skip)
    long_blocks: int = 2            # long generation: samples of this many blocks at strides L, L/2, L/4 (0 = skip)
    profile: bool = False           # also profile one more step of each row (torch.profiler): its ops by self time
    seed: int = 1                   # seeds the weights and the random tokens, times and noise of every row
    json: bool = False              # print one JSON object instead of the markdown tables


def parse_args(argv=None):
    cfg = parse_flags(BenchConfig, argv, __doc__.strip().split("\n")[0], presets={name: {} for name in PRESETS})
    names = [s for s in cfg.losses.replace(" ", "").split(",") if s]
    bad = [s for s in names if s not in OBJECTIVES]
    if not names or bad:
        raise UsageError(f"unknown --losses {','.join(bad) or cfg.losses!r}; choose from {', '.join(OBJECTIVES)}")
    if cfg.curriculum and (cfg.curriculum not in OBJECTIVES or OBJECTIVES[cfg.curriculum].causal):
        raise UsageError(f"--curriculum must be a diffusion loss of {', '.join(OBJECTIVES)} (not ar) or '', "
                         f"got {cfg.curriculum!r}")
    if (cfg.repeats < 1 or cfg.warmup < 0 or cfg.batch_size < 1 or cfg.sample_steps < 0 or cfg.threads < 0
            or cfg.head_chunks < 0 or cfg.long_blocks < 0):
        raise UsageError("--repeats and --batch_size must be >= 1, --warmup, --sample_steps, --threads, "
                         "--head_chunks, --long_blocks >= 0")
    if cfg.head not in HEADS:
        raise UsageError(f"unknown --head {cfg.head!r}; choose from {', '.join(HEADS)}")
    check_threads(cfg.threads, "--threads")          # a million threads crash torch's pool: refused here
    omp_threads()                                    # OMP_NUM_THREADS, likewise
    if cfg.block_size and cfg.block_size < 2:
        raise UsageError("--block_size must be >= 2")
    resolve_dtype(cfg.dtype, resolve_device(cfg.device))
    cfg.losses = ",".join(names)
    return cfg


# -----------------------------------------------------------------------------------------------
# the training step: train.py's own (train.train_step on a Run without a data loader, one process)

def profile_table(fn, device, rows=25):
    """torch.profiler over fn(): its ops and kernels by self time on the device (CUDA; CPU: on the CPU), as the
    profiler's own table of the first `rows`."""
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        synchronize(device)
    return prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                     row_limit=rows, max_name_column_width=70)


def cpu_step_peak_bytes(fn):
    """Most bytes that tensors allocated inside fn() hold at once, from the profiler's CPU allocation events
    (frees of tensors made before fn are not seen, so this can only overstate by what fn frees early)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    return max([0, *itertools.accumulate(nbytes for _, nbytes in events)])    # the most held at once


def saved_activation_bytes(fn, params):
    """Bytes of the storages autograd saves for backward while fn() builds its graph (parameters excluded). The
    pack hook keeps each storage, not the tensor, and gives autograd nothing back: a saved output handed back
    would hold its own grad_fn, a reference cycle through C++ that Python's gc cannot see, and the whole graph
    would outlive the measurement. The graph cannot run backward (it is not meant to)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    kept = {}           # data_ptr -> storage, held until the graph is gone: no other storage takes its address

    def pack(x):
        s = x.untyped_storage()
        if s.data_ptr() not in skip:
            kept[s.data_ptr()] = s

    def unpack(_):
        raise RuntimeError("bench: a graph built by saved_activation_bytes cannot run backward")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        fn()
    return sum(s.nbytes() for s in kept.values())


# -----------------------------------------------------------------------------------------------
# one measurement at a time: each starts from the memory the one before it started from

def allocated_bytes(device):
    """Bytes the tensors on `device` hold: torch.cuda.memory_allocated on CUDA; None on CPU (no allocator
    statistics to read there)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


class Rows:
    """Runs the benchmark's measurements (a table's row, one cell of it, a whole table) so that each starts from
    the memory the one before it started from: after each, allocated_bytes() is checked to be back where it was
    (`left` {what: bytes} records what is not; CPU: not checked). A measurement that runs out of memory gives None
    (it reads 'n/a (out of memory)'; `out_of_memory` {what: why}) and the rest still run.
    lasting: what the measurement builds is meant to stay (a model; the AdamW moments of a first step): not checked.
    end_of_table: the caches go too (not between a table's steps: handing the allocator's blocks back to the device
    and taking them again would be timed in the next step)."""

    def __init__(self, device, total=None):
        self.device, self.out_of_memory, self.left = device, {}, {}
        self.bar = tqdm(total=total, desc="bench", unit="measurement", file=sys.stderr, dynamic_ncols=True)

    def measure(self, what, fn, lasting=False, end_of_table=False):
        self.bar.set_description(what)      # the progress bar: the measurement now running, and how many are left
        before = allocated_bytes(self.device)
        value, failed = None, False
        try:
            value = fn()
        except (RuntimeError, MemoryError) as e:
            if not is_out_of_memory(e):
                raise
            self.out_of_memory[what], failed = oom_summary(e), True
        if end_of_table:        # what a table leaves to the process: compiled graphs, the curriculum's tables
            curriculum.clear_alpha_tables()
            if "torch._dynamo" in sys.modules:                  # imported: something was compiled
                torch._dynamo.reset()
        if self.device.type == "cuda":      # cuBLAS keeps a workspace per thread and stream in the allocator from
            torch._C._cuda_clearCublasWorkspaces()      # its first matmul on: back to its cache (the next takes it)
        after = allocated_bytes(self.device)
        if failed or end_of_table or (before is not None and after > before):
            gc.collect()        # reference cycles (a traceback's frames, graphs); it costs ~0.1 s, so only here
            after = allocated_bytes(self.device)
        if (failed or end_of_table) and self.device.type == "cuda":
            torch.cuda.empty_cache()
        if not lasting and before is not None and after > before:
            self.left[what] = after - before
        self.bar.update()
        return value


# -----------------------------------------------------------------------------------------------
# FLOPs and the device's peak

def model_flops_per_step(model, batch_size, block_size):
    """6 N T + 12 n_layer L d T + 6 d V T (docs/testing.md: MFU)."""
    c = model.config
    n = sum(p.numel() for name, p in model.blocks.named_parameters() if p.dim() == 2 and "adaLN" not in name)
    T, L, d = batch_size * block_size, block_size, c.n_embd
    return 6 * n * T + 12 * c.n_layer * L * d * T + 6 * d * c.vocab_size * T


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_rounds(cfg, device, fns):
    """fns {name: fn} run round-robin for cfg.warmup + cfg.repeats rounds -> {name: median seconds over the rounds
    after the warm-up}."""
    times = {name: [] for name in fns}
    for round_ in range(cfg.warmup + cfg.repeats):
        for name, fn in fns.items():
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            if round_ >= cfg.warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


PEAK_MATMUL_N = {"cuda": 8192, "cpu": 1024}


def measure_peak_flops(device, dtype, seconds=1.0):
    """Best FLOP/s of an n x n @ n x n matmul in `dtype` (n = PEAK_MATMUL_N) over ~`seconds` (>= 1 timing)."""
    n = PEAK_MATMUL_N[device.type]
    a, b = torch.randn(2, n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    best, start = 0.0, time.perf_counter()
    while best == 0.0 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        synchronize(device)
        best = max(best, 4 * 2 * n ** 3 / (time.perf_counter() - t0))
    return best


# -----------------------------------------------------------------------------------------------
# benchmarks

CURRICULUM = "+curriculum"      # a row name's suffix: the same loss with Duo's curriculum on


def row_names(cfg):
    """The table's rows: --losses, then --curriculum's loss again with the curriculum on."""
    names = cfg.losses.split(",")
    return names + ([cfg.curriculum + CURRICULUM] if cfg.curriculum else [])


def configs_for(cfg, name):
    """A row's TrainConfig (the one train.py would run for this preset and loss, at the benchmark's shapes, with
    Duo's curriculum on for every step or off) and the ModelConfig of its model."""
    tcfg = TrainConfig(**{**TRAIN_PRESETS.get(cfg.preset, {}), "preset": cfg.preset,
                          "loss": name.removesuffix(CURRICULUM),
                          "curriculum_iters": 10 ** 9 if name.endswith(CURRICULUM) else 0,
                          "block_size": cfg.block_size or PRESETS[cfg.preset]["block_size"],
                          "batch_size": cfg.batch_size, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                          "n_embd": cfg.n_embd, "vocab_multiple": cfg.vocab_multiple, "seed": cfg.seed,
                          "compile": cfg.compile, "head": cfg.head})
    mcfg = model_config_for(tcfg, cfg.vocab_size or PRESETS[cfg.preset]["vocab_size"])
    check_training_memory(mcfg, tcfg.batch_size, tcfg.ema, resolve_device(cfg.device),   # before it is allocated
                          lambda f: "--batch_size" if f == "micro" else f"--{f}"
                          if f in ("n_layer", "n_embd", "block_size", "vocab_size") else f"--preset's {f}")
    return tcfg, mcfg


def random_tokens(run, tcfg, gen):
    return torch.randint(0, run.raw_model.config.vocab_size, (tcfg.batch_size, tcfg.block_size),
                         device=gen.device, generator=gen)


def timed_step(run, tcfg, env, gen):
    """One train_step on random tokens -> (seconds, its loss, CUDA: the step's peak bytes and their excess over
    the memory at its start; CPU: None, None)."""
    device, cuda = env.device, env.device.type == "cuda"
    x0 = random_tokens(run, tcfg, gen)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    try:
        synchronize(device)
        t0 = time.perf_counter()
        loss = train_step(run, tcfg, env, x0)
        synchronize(device)
        seconds = time.perf_counter() - t0
    finally:
        run.optimizer.zero_grad(set_to_none=True)       # a step cut short (out of memory) leaves gradients
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    return seconds, loss.item(), peak, peak - before if cuda else None


def bench_training(cfg, device, dtype, rows):
    """The training rows: every row's step timed in interleaved rounds, the matmul peak re-measured every round
    (the best is kept, so a busy neighbour at start-up cannot inflate MFU), then each row's saved activations and
    (CPU) step memory; each through `rows` (what runs out of memory reads n/a, the rest still run). The diffusion
    rows share one model and optimizer, 'ar' has its own: built before the first round, released with the table.
    The first round makes what the runs keep (AdamW moments, compiled graphs): from the second on, every step
    leaves the memory as it found it. -> (results per row, the model {config, params}, L, peak FLOP/s)."""
    names, B, env = row_names(cfg), cfg.batch_size, Env(device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    models, runs, model = {}, {}, None
    for name in names:
        tcfg, mcfg = configs_for(cfg, name)
        key = json.dumps(asdict(mcfg), sort_keys=True)
        if key not in models:
            def build():
                torch.manual_seed(cfg.seed)
                raw = build_model(mcfg).to(device).train()
                return (raw, torch.compile(raw) if cfg.compile else raw, *make_optimizer(raw, tcfg, device))
            models[key] = rows.measure(f"{name} model", build, lasting=True)
        if models[key] is not None:
            runs[name] = (tcfg, Run(*models[key], loader=None, gen_shared=gen, gen_local=gen))
            raw = models[key][0]
            model = model or dict(config=mcfg, params=raw.num_params(),
                                  non_embedding_params=raw.num_params(non_embedding=True))
    times = {name: [] for name in runs}         # None once the row ran out of memory
    peaks = dict.fromkeys(runs, 0)              # CUDA: max_memory_allocated, and its excess over the step's start
    step_peaks = dict.fromkeys(runs, 0)
    peak_flops = measure_peak_flops(device, dtype)
    for round_ in range(cfg.warmup + cfg.repeats):
        peak_flops = max(peak_flops, measure_peak_flops(device, dtype, seconds=0.2))
        for name, (tcfg, run) in runs.items():
            if times[name] is None:
                continue
            timed = rows.measure(f"{name} step", lambda: timed_step(run, tcfg, env, gen), lasting=round_ == 0)
            if timed is None:
                times[name] = None
                continue
            seconds, loss, peak, step_peak = timed
            if not math.isfinite(loss):
                raise FloatingPointError(f"bench: non-finite {name} loss at round {round_}")
            if round_ >= cfg.warmup:
                times[name].append(seconds)
                if peak is not None:
                    peaks[name], step_peaks[name] = max(peaks[name], peak), max(step_peaks[name], step_peak)
    results = {}
    for name in names:
        if name not in runs or times[name] is None:
            results[name] = dict(step_ms=None, step_ms_all=[], tokens_per_s=None, model_flops=None,
                                 peak_mem_bytes=None, step_mem_bytes=None, act_bytes=None,
                                 out_of_memory=["model" if name not in runs else "step"])
            continue
        tcfg, run = runs[name]

        def forward_and_loss():
            x0, t = random_tokens(run, tcfg, gen), diffusion.sample_t(B, gen, device=device)
            with autocast_for(device, dtype):
                return token_mean(loss_terms(run.raw_model, tcfg, x0, t, 0, gen)[0], None)

        def profiled_step():
            x0 = random_tokens(run, tcfg, gen)
            return cpu_step_peak_bytes(lambda: train_step(run, tcfg, env, x0))

        act = rows.measure(f"{name} act", lambda: saved_activation_bytes(forward_and_loss,
                                                                           list(run.raw_model.parameters())))
        if device.type == "cpu":
            step_peaks[name] = rows.measure(f"{name} step MiB", profiled_step)
        profiled = rows.measure(f"{name} profile", lambda: profile_table(
            lambda: train_step(run, tcfg, env, random_tokens(run, tcfg, gen)), device)) if cfg.profile else None
        step = statistics.median(times[name])
        flops = model_flops_per_step(run.raw_model, B, tcfg.block_size)
        results[name] = dict(step_ms=1e3 * step, step_ms_all=[1e3 * s for s in times[name]],
                             tokens_per_s=B * tcfg.block_size / step, model_flops=flops,
                             peak_mem_bytes=peaks[name] if device.type == "cuda" else None,
                             step_mem_bytes=step_peaks[name], act_bytes=act, profile=profiled,
                             out_of_memory=[what for what, value in (("act", act), ("step MiB", step_peaks[name]))
                                            if value is None])
    ratio = lambda r, ref, k: r[k] / ref[k] if ref is not None and r[k] and ref[k] else None
    for name, r in results.items():
        r.update({f"{what}_vs_duo": ratio(r, results.get("duo"), k) for what, k in (
            ("step", "step_ms"), ("peak", "peak_mem_bytes"), ("step_mem", "step_mem_bytes"), ("act", "act_bytes"))},
                 step_vs_sddlm=ratio(r, results.get("sddlm"), "step_ms"),
                 step_vs_plain=ratio(r, results.get(name.removesuffix(CURRICULUM)), "step_ms"))
    return results, model, configs_for(cfg, names[0])[0].block_size, peak_flops


def sampler_model(cfg, mcfg, device):
    """A model of the sampler tables' own (mcfg; compiled with --compile) -> (the model, the one to call)."""
    torch.manual_seed(cfg.seed)
    raw = build_model(mcfg).to(device).eval()
    return raw, torch.compile(raw) if cfg.compile else raw


def bench_sampler(cfg, mcfg, device, dtype, L):
    """sample.generate per reverse step (ancestral, then Psi) vs one no-grad forward of the same batch, on a model
    of its own, in interleaved rounds. -> dict."""
    raw, model = sampler_model(cfg, mcfg, device)
    B, V, steps = cfg.batch_size, raw.config.vocab_size, cfg.sample_steps
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    x = torch.randint(0, V, (B, L), device=device, generator=gen)
    sigma = torch.full((B,), 0.5, device=device)
    sample = lambda **psi: generate(model, B, L, V, steps, generator=gen, device=device, dtype=dtype,
                                    show_progress=False, **psi)
    calls, nfe = [], [0]
    hook = raw.register_forward_hook(lambda *_: calls.append(1))

    def forwards():
        with torch.no_grad(), autocast_for(device, dtype):
            for _ in range(steps):
                model(x, sigma)

    def ancestral():                    # its forwards counted: the sampler's NFE
        calls.clear()
        sample()
        nfe[0] = len(calls)
    try:
        t = timed_rounds(cfg, device, dict(forward=forwards, ancestral=ancestral,
                                           psi=lambda: sample(psi=Psi(("eta",), (0.9,)))))
        profiled = profile_table(sample, device) if cfg.profile else None
    finally:
        hook.remove()
    forward_s, generate_s, psi_s, nfe = t["forward"] / steps, t["ancestral"], t["psi"], nfe[0]
    return dict(steps=steps, nfe=nfe, forward_ms=1e3 * forward_s, generate_ms=1e3 * generate_s, profile=profiled,
                ms_per_step=1e3 * generate_s / steps, overhead=generate_s / (nfe * forward_s) - 1,
                psi_ms_per_step=1e3 * psi_s / steps, psi_overhead=psi_s / (nfe * forward_s) - 1,
                psi_vs_ancestral=psi_s / generate_s)


def bench_long(cfg, mcfg, device, dtype, L):
    """sample.generate_long to long_blocks x L tokens at strides L, L/2, L/4 vs one block of sample.generate, on a
    model of its own: median time per generated token, interleaved rounds. -> dict."""
    raw, model = sampler_model(cfg, mcfg, device)
    B, V, n = cfg.batch_size, raw.config.vocab_size, cfg.long_blocks * L
    strides = sorted({L, max(1, L // 2), max(1, L // 4)}, reverse=True)
    kw = dict(generator=torch.Generator(device=device).manual_seed(cfg.seed), device=device, dtype=dtype,
              show_progress=False)
    fns = {0: lambda: generate(model, B, L, V, cfg.sample_steps, **kw)}     # 0: one block of the one-block sampler
    fns.update({s: lambda s=s: generate_long(model, B, n, V, cfg.sample_steps, block_size=L, stride=s, **kw)
                for s in strides})
    times = timed_rounds(cfg, device, fns)
    block_ms = 1e3 * times[0] / L
    windows = {s: len(long_windows(0, n, L, s)) for s in strides}
    rows = [dict(stride=s, windows=windows[s], ms_per_token=1e3 * times[s] / n, vs_block=times[s] * L / (n * times[0]),
                 predicted=windows[s] * L / n) for s in strides]
    return dict(seq_len=n, steps=cfg.sample_steps, block_ms_per_token=block_ms, rows=rows)


def bench_head(cfg, mc, device, dtype, L):
    """The fused output layer + sddlm_v1 on B L rows in cfg.head_chunks chunks, forward + backward, with the chunk
    logits kept or recomputed: median ms (interleaved rounds) and torch-counted FLOPs. -> dict."""
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    B, d, V, V_pad = cfg.batch_size, mc.n_embd, mc.vocab_size, mc.padded_vocab_size
    rand = lambda *shape: torch.randn(*shape, device=device, generator=gen).to(dtype).requires_grad_(True)
    hidden, weight = rand(B, L, d), rand(V_pad, d)
    x0, xt, neg = (torch.randint(0, V, (B, L), device=device, generator=gen) for _ in range(3))
    chunk_elems = -(-B * L // cfg.head_chunks) * V_pad
    kinds = {"kept": True, "recomputed": False}

    def step(keep):
        head = Head(hidden, weight, None, V, keep_logits=keep, chunk_elems=chunk_elems)
        losses.sddlm_v1_loss(head, x0, xt, neg=neg).sum().backward()
        hidden.grad = weight.grad = None

    flops = {}
    for name, keep in kinds.items():
        with FlopCounterMode(display=False) as counter:
            step(keep)
        flops[name] = counter.get_total_flops()
    times = timed_rounds(cfg, device, {name: lambda keep=keep: step(keep) for name, keep in kinds.items()})
    product = 2 * B * L * d * V_pad
    out = {name: dict(ms=1e3 * times[name], flops=flops[name], products=flops[name] / product) for name in kinds}
    return dict(rows=B * L, d=d, padded_vocab_size=V_pad, chunks=-(-B * L // (chunk_elems // V_pad)),
                product_flops=product, kept_vs_recomputed=out["kept"]["ms"] / out["recomputed"]["ms"], **out)


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return f"CPU {model} ({os.cpu_count()} cores, torch {torch.get_num_threads()} threads)".replace("  ", " ")


def run(cfg, show=lambda out, table: None):
    """The whole benchmark -> one JSON-able dict, each table measured through one Rows; show(out, table) as each
    table ("losses", "sampler", "head", "long") finishes."""
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        os.environ.update(cuda_allocator_env(os.environ))      # train.py's allocator, before the first allocation
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dtype = resolve_dtype(cfg.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    if device.type == "cpu" and cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.sample_steps and cfg.long_blocks:        # the long samples' length, at the start (not after the rows)
        L = configs_for(cfg, row_names(cfg)[0])[1].block_size
        check_sample_size(cfg.batch_size, cfg.long_blocks * L, device, ("--batch_size", "--long_blocks x L"))
    names = row_names(cfg)
    diffusion_rows = [name for name in names if not OBJECTIVES[name.removesuffix(CURRICULUM)].causal]
    sampling, long = bool(cfg.sample_steps and diffusion_rows), bool(cfg.sample_steps and cfg.long_blocks)
    models = len({OBJECTIVES[name.removesuffix(CURRICULUM)].causal for name in names})   # diffusion rows share one
    total = models + len(names) * (cfg.warmup + cfg.repeats + 1 + cfg.profile + (device.type == "cpu")) + 1 \
        + sampling + bool(cfg.head_chunks) + (sampling and long)
    rows, baseline = Rows(device, total), allocated_bytes(device)
    training = rows.measure("training rows", lambda: bench_training(cfg, device, dtype, rows), end_of_table=True)
    results, model, L, peak = training or (None, None, None, None)
    if model is None:
        raise OutOfMemory(f"no model of preset {cfg.preset} fits in memory ({'; '.join(rows.out_of_memory.values())})")
    n = PEAK_MATMUL_N[device.type]
    for r in results.values():
        r["mfu"] = r["model_flops"] / (r["step_ms"] / 1e3) / peak if r["step_ms"] else None
    mc = model["config"]
    out = dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), device=device_name(device),
               bench_config=asdict(cfg), cuda=device.type == "cuda", dtype=dtype_name, block_size=L,
               model=dict(arch=mc.arch, n_layer=mc.n_layer, n_head=mc.n_head, n_embd=mc.n_embd,
                          vocab_size=mc.vocab_size, padded_vocab_size=mc.padded_vocab_size, params=model["params"],
                          non_embedding_params=model["non_embedding_params"]),
               peak_flops=peak, peak_flops_from=f"{dtype_name} {n}x{n} matmul", mfu_formula=MFU_FORMULA,
               losses=results, sampler=None, head=None, long=None, out_of_memory=rows.out_of_memory,
               memory_baseline=baseline, memory_left=rows.left)
    show(out, "losses")
    mcfg = configs_for(cfg, (diffusion_rows or names)[0])[1]
    for table, wanted, what, fn in (
            ("sampler", sampling, "sampler", lambda: bench_sampler(cfg, mcfg, device, dtype, L)),
            ("head", cfg.head_chunks, "fused head", lambda: bench_head(cfg, mc, device, dtype, L)),
            ("long", sampling and long, "long generation", lambda: bench_long(cfg, mcfg, device, dtype, L))):
        if wanted:
            out[table] = rows.measure(what, fn, end_of_table=True)
            show(out, table)
    rows.bar.close()
    return out


# -----------------------------------------------------------------------------------------------
# output

def fmt(x, spec, none="n/a"):
    return none if x is None else format(x, spec)


def markdown(out, parts=("losses", "sampler", "head", "long", "footer")):
    """The tables of `parts` (each table as it finishes: main), "footer" the lines that follow them all."""
    m, cfg = out["model"], out["bench_config"]
    padded = m.get("padded_vocab_size", m["vocab_size"])
    padded = f" (output layer {padded})" if padded != m["vocab_size"] else ""
    lines = [] if "losses" not in parts else [
        f"### bench/bench.py: preset {cfg['preset']} ({m['arch']}, {m['n_layer']} layers, d={m['n_embd']}, "
        f"V={m['vocab_size']}{padded}, {m['params'] / 1e6:.2f}M params), L={out['block_size']}, B={cfg['batch_size']}, "
        f"{out['dtype']}{', compiled' if cfg['compile'] else ', eager'}",
        f"{out['device']}; {out['date']}; median of {cfg['repeats']} interleaved rounds after {cfg['warmup']} "
        f"warm-up rounds",
        f"MFU = model FLOPs / step time / peak; FLOPs/step = {out['mfu_formula']}; "
        f"peak {out['peak_flops'] / 1e9:,.1f} GFLOP/s (measured: best {out['peak_flops_from']}, every round)",
        "",
        "| loss | step ms | tokens/s | MFU | peak MiB | step MiB | act MiB | time x duo | peak x duo "
        "| step MiB x duo | act x duo |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    mib = lambda b: None if b is None else b / 2 ** 20
    pct = lambda x: None if x is None else 100 * x
    lost = "n/a (out of memory)"
    for name, r in out["losses"].items() if "losses" in parts else ():
        na = lambda *what: lost if set(what) & set(r.get("out_of_memory", ())) else "n/a"
        lines.append(f"| {name} | {fmt(r['step_ms'], '.1f', na('model', 'step'))} | {fmt(r['tokens_per_s'], ',.0f')} "
                     f"| {fmt(pct(r['mfu']), '.1f')}{'%' if r['mfu'] is not None else ''} "
                     f"| {fmt(mib(r['peak_mem_bytes']), ',.0f')} "
                     f"| {fmt(mib(r['step_mem_bytes']), ',.1f', na('step MiB'))} "
                     f"| {fmt(mib(r['act_bytes']), ',.1f', na('act'))} | {fmt(r['step_vs_duo'], '.2f')} "
                     f"| {fmt(r['peak_vs_duo'], '.2f')} | {fmt(r['step_mem_vs_duo'], '.2f')} "
                     f"| {fmt(r['act_vs_duo'], '.2f')} |")
    oom = out.get("out_of_memory") or {}
    s, h, g = out["sampler"], out.get("head"), out.get("long")
    if "sampler" in parts and (s is not None or "sampler" in oom):
        lines += ["", "| sampler | steps | NFE | ms / step | forward ms | overhead |", "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| sample.generate | {lost} | n/a | n/a | n/a | n/a |"] if s is None else [
            f"| sample.generate (ancestral) | {s['steps']} | {s['nfe']} | {s['ms_per_step']:.1f} "
            f"| {s['forward_ms']:.1f} | {100 * s['overhead']:+.1f}% |",
            f"| sample.generate (psi, kappa = 0.9) | {s['steps']} | {s['nfe']} | {s['psi_ms_per_step']:.1f} "
            f"| {s['forward_ms']:.1f} | {100 * s['psi_overhead']:+.1f}% |",
            "", f"Psi step / ancestral step: {s['psi_vs_ancestral']:.3f}"]
    if "head" in parts and (h is not None or "fused head" in oom):
        shape = "" if h is None else \
            f" {h['rows']} rows x d={h['d']} x V_pad={h['padded_vocab_size']}, {h['chunks']} chunks,"
        lines += ["", f"| fused head + sddlm_v1,{shape} fwd + bwd | ms | GFLOP (counted) | output-layer products |",
                  "|---|---:|---:|---:|"]
        lines += [f"| kept and recomputed logits | {lost} | n/a | n/a |"] if h is None else [
            *(f"| {name} logits | {h[name]['ms']:.1f} | {h[name]['flops'] / 1e9:.3f} | {h[name]['products']:.2f} |"
              for name in ("kept", "recomputed")),
            "", f"kept / recomputed time: {h['kept_vs_recomputed']:.3f} (one product = 2 N d V_pad = "
                f"{h['product_flops'] / 1e9:.3f} GFLOP)"]
    if "long" in parts and (g is not None or "long generation" in oom):
        title = "long generation" if g is None else \
            f"long generation, {g['seq_len']} tokens, {g['steps']} steps a window"
        lines += ["", f"| {title} | stride | windows | ms / token | x one block | windows x L / n |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| sample.generate_long | {lost} | n/a | n/a | n/a | n/a |"] if g is None else [
            f"| sample.generate, one block | - | 1 | {g['block_ms_per_token']:.2f} | 1.000 | 1.000 |",
            *(f"| sample.generate_long | {r['stride']} | {r['windows']} | {r['ms_per_token']:.2f} "
              f"| {r['vs_block']:.3f} | {r['predicted']:.3f} |" for r in g["rows"])]
    if "footer" not in parts:
        return "\n".join(lines)
    costs = [(f"{name} step / {name.removesuffix(CURRICULUM)} step", fmt(r["step_vs_plain"], ".3f"))
             for name, r in out["losses"].items() if name.endswith(CURRICULUM)]
    if s is not None:
        costs.append(("sampler time / its forwards' time", f"{1 + s['overhead']:.3f} ({100 * s['overhead']:+.1f}%)"))
    if costs:       # the two costs over the bare computation, from the same run (same machine load)
        lines += ["", "| cost over the bare computation, this run | ratio |", "|---|---:|"]
        lines += [f"| {what} | {ratio} |" for what, ratio in costs]
    for name, r in [*((f"{name} step", r) for name, r in out["losses"].items()),
                    (f"sample.generate ({s and s['steps']} steps)", s or {})]:
        if r.get("profile"):
            lines += ["", f"One more {name} under torch.profiler, after the timed rounds:", "", "```",
                      r["profile"].strip("\n"), "```"]
    if oom:
        lines += ["", "n/a from running out of memory: " + "; ".join(f"{what}: {why}" for what, why in oom.items())]
    if out.get("memory_left"):
        lines += ["", "memory NOT released (later rows ran with less): " + "; ".join(
            f"{what} left {b / 2 ** 20:,.1f} MiB ({b:,} bytes) allocated" for what, b in out["memory_left"].items())]
    elif out.get("memory_baseline") is not None:
        lines += ["", "memory: every table, and every row after the first round, ended with memory_allocated where it "
                      f"started ({out['memory_baseline'] / 2 ** 20:,.1f} MiB before the first table)"]
    return "\n".join(lines)


def main(argv=None):
    cfg = parse_args(argv)
    out = run(cfg, show=lambda out, table: cfg.json or tqdm.write(markdown(out, (table,)), sys.stdout))  # above the bar
    print(json.dumps(out, indent=1) if cfg.json else markdown(out, ("footer",)))
    return 0


if __name__ == "__main__":
    run_cli(main, FloatingPointError, oom_hint="lower --batch_size")
