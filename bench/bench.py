"""
Benchmark train.py's training step for every objective, and the ancestral sampler against bare forwards.

    python bench/bench.py                                          # tiny preset, L=128, B=8, CPU float32
    python bench/bench.py --preset tiny --vocab_size 50258         # the vocabulary cost of the NELBO
    python bench/bench.py --preset small --block_size 1024 --batch_size 32 --device cuda --compile 1   # paper Fig. (time)
    python bench/bench.py --json 1                                 # one JSON object instead of markdown
    python bench/bench.py --head fused_recompute                   # the steps with the fused head recomputing logits

Method. One process, random tokens (no dataset). The step is train.py's: loss_terms (corrupt x0, forward,
per-token loss) under the run's autocast, token mean, backward, grad clip, AdamW, EMA, with the preset's
training recipe (TRAIN_PRESETS: lr, dropout, clip, EMA) and the curriculum off. All diffusion losses share
one model (same architecture, same FLOPs); 'ar' has its causal twin. Steps are interleaved round-robin over
the losses, `warmup` rounds are dropped, and each loss reports the median of `repeats` rounds, so drifting
clocks and neighbours on shared machines hit every loss alike. On a shared CPU, --threads 1 avoids OpenMP
oversubscription (10x slowdowns with 2 threads on 2 busy cores).

Columns:
  step ms      median wall time of one step (CUDA synchronised before and after)
  tokens/s     B * L / step time
  MFU          model FLOPs per step / step time / peak FLOP/s. The peak is MEASURED: the best rate of a large
               square matmul in the compute dtype (bf16 under autocast, else float32), timed at start and
               again every round (a neighbour busy at start-up cannot inflate MFU). Model FLOPs:
                 FLOPs/step = 6 N T + 12 n_layer L d T + 6 d V T,   T = B L tokens,
               N = the weight matrices the blocks apply to every token (attention qkv/proj, MLP; not the
               embedding, the output layer, or the per-sequence sigma MLP and adaLN), 12 n_layer L d T the
               attention scores and values (full L x L, also for 'ar'), 6 d V T the output layer. The loss
               itself counts 0: what the NELBO spends over (B, L, V) shows up as lower MFU.
  peak MiB     CUDA only: torch.cuda.max_memory_allocated over one step, reset per loss (weights, gradients,
               AdamW and EMA state included). 'n/a' on CPU: no allocator statistics to read there.
  step MiB     the most memory the step's own tensors (activations, logits, loss temporaries, gradients)
               hold at once above what was allocated before it. CUDA: peak MiB - memory_allocated at the
               step's start; CPU: one extra profiled step per loss, from the allocation events of
               torch.profiler(profile_memory=True) (it prints two USDT lines per loss on stderr).
  act MiB      any device: bytes of the tensors autograd saves for backward (saved_tensors_hooks on an eager
               forward + loss, storages counted once, parameters excluded; autocast's bf16 weight copies
               are included). The device-independent part of the memory that the loss changes.
  x duo        ratio to the 'duo' row (Duo's NELBO computed as Duo does, usdm_nelbo_loss); 'duo_lean' is the
               same NELBO computed in chunks of rows (usdm_nelbo_loss_lean)
Rows: the objectives of diffusion.OBJECTIVES (--losses), then '<loss>+curriculum' (--curriculum): the same step
with Duo's curriculum on (Gaussian latent, top-k soft input), and its step time over the plain one. A row or
a measurement that does not fit in memory prints n/a and the table still comes out, with what did not fit.
Sampler: sample.generate (ancestral: float64 per-token mixture weights, two-stage Gumbel-max on block
log-sum-exps, final ancestral step) vs no-grad forwards of the same model at the same batch: overhead = generate
time / (its forwards x forward time) - 1. The last table puts the curriculum's and the sampler's costs over the
bare computation side by side, both from this one run.
The same for the Psi sampler (kappa = 0.9: every step draws the predictor-corrector mixture), timed in the
same rounds, and its time per step over the ancestral sampler's.
Fused head (--head_chunks): the output layer fused with sddlm_v1 (kernels/fused_head.py) on the model's B L
rows cut into that many chunks, forward + backward, with each chunk's logits kept for backward or recomputed
there: median time, and the FLOPs torch's counter sees over the formula's 2 N d V_pad of one output-layer product
(N = B L rows; kept: 3 products, recomputed: 4).
"""
import os, sys  # noqa: E401  (run as a file, python FOLDER/SCRIPT.py: the repository root goes on the path)
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing import cli  # first: a stop signal while the imports below load is one line, exit 130
cli.stop_at_once(__name__)

import datetime
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

import diffusion
import losses
from kernels.fused_head import HEADS, Head
from plumbing.cli import OutOfMemory, UsageError, autocast_for, is_out_of_memory, oom_summary, parse_flags, resolve_device, resolve_dtype, run_cli
from model import PRESETS, build_model
from diffusion import OBJECTIVES, loss_terms, token_mean
from plumbing.distributed import Env
from train import TRAIN_PRESETS, Run, TrainConfig, make_optimizer, model_config_for, train_step

ALL_LOSSES = ",".join(OBJECTIVES)
MFU_FORMULA = "6*N*T + 12*n_layer*L*d*T + 6*d*V*T (T = B*L tokens; N = per-token block weight matrices)"
@dataclass
class BenchConfig:
    preset: str = "tiny"            # model size and training recipe, as train.py --preset
    block_size: int = 0             # sequence length L (0 = the preset's)
    batch_size: int = 8             # sequences per step
    vocab_size: int = 0             # 0 = the preset's (e.g. 50258 on tiny shows the vocabulary cost)
    n_layer: int = 0                # Transformer blocks (0 = the preset's)
    n_head: int = 0                 # attention heads (0 = the preset's)
    n_embd: int = 0                 # hidden width (0 = the preset's)
    device: str = "auto"            # auto | cpu | cuda
    dtype: str = "auto"             # auto (bf16 autocast on GPU, float32 on CPU) | float32 | bfloat16
    compile: bool = False           # torch.compile the model (warm-up rounds absorb the compilation)
    repeats: int = 5                # timed rounds; each loss reports the median
    warmup: int = 2                 # rounds run first and dropped
    losses: str = ALL_LOSSES        # comma-separated objectives, as train.py --loss
    curriculum: str = "sddlm"       # this loss again with Duo's curriculum on: the row 'sddlm+curriculum' ('' = none)
    vocab_multiple: int = 0         # pad the output layer to a multiple of this; 0 = the preset's
    sample_steps: int = 16          # reverse steps of the sampler benchmark (0 = skip it)
    threads: int = 0                # CPU threads for torch (0 = torch's default); 1 is steadier on a shared CPU
    head: str = "auto"              # the steps' output layer, as train.py --head: auto | plain | fused | fused_recompute
    head_chunks: int = 8            # the fused head's rows in this many chunks: kept vs recomputed logits (0 = skip)
    seed: int = 1                   # seeds the weights and the random tokens, times and noise of every row
    json: bool = False              # print one JSON object instead of the markdown tables


def parse_args(argv=None):
    cfg = parse_flags(BenchConfig, argv, __doc__.strip().split("\n")[0], presets={name: {} for name in PRESETS})
    names = [s for s in cfg.losses.replace(" ", "").split(",") if s]
    bad = [s for s in names if s not in OBJECTIVES]
    if not names or bad:
        raise UsageError(f"unknown --losses {','.join(bad) or cfg.losses!r}; choose from {', '.join(OBJECTIVES)}")
    if cfg.curriculum and (cfg.curriculum not in OBJECTIVES or cfg.curriculum == "ar"):
        raise UsageError(f"--curriculum must be a diffusion loss of {', '.join(OBJECTIVES)} (not ar) or '', "
                         f"got {cfg.curriculum!r}")
    if (cfg.repeats < 1 or cfg.warmup < 0 or cfg.batch_size < 1 or cfg.sample_steps < 0 or cfg.threads < 0
            or cfg.head_chunks < 0):
        raise UsageError("--repeats and --batch_size must be >= 1, --warmup, --sample_steps, --threads, "
                         "--head_chunks >= 0")
    if cfg.head not in HEADS:
        raise UsageError(f"unknown --head {cfg.head!r}; choose from {', '.join(HEADS)}")
    if cfg.block_size and cfg.block_size < 2:
        raise UsageError("--block_size must be >= 2")
    resolve_dtype(cfg.dtype, resolve_device(cfg.device))
    cfg.losses = ",".join(names)
    return cfg


# -----------------------------------------------------------------------------------------------
# the training step: train.py's own (train.train_step on a Run without a data loader, one process)

def train_config_for(cfg, loss, curriculum=False):
    """The TrainConfig train.py would run for this preset and loss, at the benchmark's shapes, with Duo's
    curriculum on for every step (curriculum=True) or off."""
    model = PRESETS[cfg.preset]
    return TrainConfig(**{**TRAIN_PRESETS.get(cfg.preset, {}), "preset": cfg.preset, "loss": loss,
                          "block_size": cfg.block_size or model["block_size"], "batch_size": cfg.batch_size,
                          "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
                          "vocab_multiple": cfg.vocab_multiple, "curriculum_iters": 10 ** 9 if curriculum else 0,
                          "seed": cfg.seed, "compile": cfg.compile, "head": cfg.head})


def cpu_step_peak_bytes(fn):
    """Most bytes that tensors allocated inside fn() hold at once, from the profiler's CPU allocation events
    (frees of tensors made before fn are not seen, so this can only overstate by what fn frees early)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak


def saved_activation_bytes(fn, params):
    """Bytes of the storages autograd saves for backward while fn() builds its graph (parameters excluded)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(x):
        s = x.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn()
    del out
    return sum(seen.values())


# -----------------------------------------------------------------------------------------------
# FLOPs and the device's peak

def model_flops_per_step(model, batch_size, block_size):
    """6 N T + 12 n_layer L d T + 6 d V T (see the module docstring)."""
    c = model.config
    n = sum(p.numel() for name, p in model.blocks.named_parameters() if p.dim() == 2 and "adaLN" not in name)
    T, L, d = batch_size * block_size, block_size, c.n_embd
    return 6 * n * T + 12 * c.n_layer * L * d * T + 6 * d * c.vocab_size * T


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PEAK_MATMUL_N = {"cuda": 8192, "cpu": 1024}


def measure_peak_flops(device, dtype, seconds=1.0):
    """Best FLOP/s of an n x n @ n x n matmul in `dtype` (n = PEAK_MATMUL_N) over ~`seconds` (>= 1 timing)."""
    n = PEAK_MATMUL_N[device.type]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
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


def fits(measure, what, failures):
    """measure() -> its value, or None when it runs out of memory; failures[what] then says what did not fit.
    Gradients and cached blocks are released, so the next measurement starts clean."""
    try:
        return measure()
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
        failures[what] = oom_summary(e)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return None


def bench_training(cfg, device, dtype):
    """Interleaved timing of every row, and the matmul peak re-measured every round (the best is kept,
    so a busy neighbour at start-up cannot inflate MFU). A row or measurement that runs out of memory is left
    out (n/a) and the rest still run. -> (results per row, runs, L, peak FLOP/s, failures {what: why}).
    runs: {row: (its TrainConfig, a train.Run)}; the diffusion rows share one model and optimizer."""
    names, failures = row_names(cfg), {}
    L, B, env = None, cfg.batch_size, Env(device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    models, runs = {}, {}
    for name in names:
        tcfg = train_config_for(cfg, name.removesuffix(CURRICULUM), curriculum=name.endswith(CURRICULUM))
        L = tcfg.block_size
        mcfg = model_config_for(tcfg, cfg.vocab_size or PRESETS[cfg.preset]["vocab_size"])
        key = json.dumps(asdict(mcfg), sort_keys=True)
        if key not in models:
            def build():
                torch.manual_seed(cfg.seed)
                raw = build_model(mcfg).to(device).train()
                return (raw, torch.compile(raw) if cfg.compile else raw, *make_optimizer(raw, tcfg, device))
            models[key] = fits(build, f"{name} model", failures)
        if models[key] is not None:
            runs[name] = (tcfg, Run(*models[key], loader=None, gen_shared=gen, gen_local=gen))
    times = {name: [] for name in runs}
    peaks = {name: 0 for name in runs}         # CUDA: max_memory_allocated, and its excess over the step's start
    step_peaks = {name: 0 for name in runs}
    peak_flops = measure_peak_flops(device, dtype)
    for round_ in range(cfg.warmup + cfg.repeats):
        peak_flops = max(peak_flops, measure_peak_flops(device, dtype, seconds=0.2))
        for name, (tcfg, run) in runs.items():
            if times[name] is None:
                continue
            x0 = torch.randint(0, run.raw_model.config.vocab_size, (B, L), device=device, generator=gen)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)

            def step():
                synchronize(device)
                t0 = time.perf_counter()
                loss = train_step(run, tcfg, env, x0)
                synchronize(device)
                return time.perf_counter() - t0, loss.item()
            timed = fits(step, f"{name} step", failures)
            if timed is None:
                times[name] = None
                run.optimizer.zero_grad(set_to_none=True)
                continue
            dt, loss = timed
            if not math.isfinite(loss):
                raise FloatingPointError(f"bench: non-finite {name} loss at round {round_}")
            if round_ >= cfg.warmup:
                times[name].append(dt)
                if device.type == "cuda":
                    peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device))
                    step_peaks[name] = max(step_peaks[name], peaks[name] - before)
    results = {}
    for name in names:
        if name not in runs or times[name] is None:
            results[name] = dict(step_ms=None, step_ms_all=[], tokens_per_s=None, model_flops=None,
                                 peak_mem_bytes=None, step_mem_bytes=None, act_bytes=None)
            continue
        tcfg, run = runs[name]
        x0 = torch.randint(0, run.raw_model.config.vocab_size, (B, L), device=device, generator=gen)
        t = diffusion.sample_t(B, gen, device=device)

        def forward_and_loss():
            with autocast_for(device, dtype):
                return token_mean(loss_terms(run.raw_model, tcfg, x0, t, 0, gen)[0], None)

        act = fits(lambda: saved_activation_bytes(forward_and_loss, list(run.raw_model.parameters())),
                   f"{name} act", failures)
        if device.type == "cpu":
            step_peaks[name] = cpu_step_peak_bytes(lambda: train_step(run, tcfg, env, x0))
        step = statistics.median(times[name])
        flops = model_flops_per_step(run.raw_model, B, L)
        results[name] = dict(step_ms=1e3 * step, step_ms_all=[1e3 * s for s in times[name]],
                             tokens_per_s=B * L / step, model_flops=flops,
                             peak_mem_bytes=peaks[name] if device.type == "cuda" else None,
                             step_mem_bytes=step_peaks[name], act_bytes=act)
    ratio = lambda r, ref, k: r[k] / ref[k] if ref is not None and r[k] and ref[k] else None
    for name, r in results.items():
        ref = results.get("duo")
        r["step_vs_duo"] = ratio(r, ref, "step_ms")
        r["peak_vs_duo"] = ratio(r, ref, "peak_mem_bytes")
        r["step_mem_vs_duo"] = ratio(r, ref, "step_mem_bytes")
        r["act_vs_duo"] = ratio(r, ref, "act_bytes")
        r["step_vs_sddlm"] = ratio(r, results.get("sddlm"), "step_ms")
        r["step_vs_plain"] = ratio(r, results.get(name.removesuffix(CURRICULUM)), "step_ms")
    return results, runs, L, peak_flops, failures


def bench_sampler(cfg, model, raw, device, dtype, L):
    """sample.generate per reverse step (ancestral, then Psi) vs one no-grad forward of the same batch. -> dict."""
    from sample import Psi, generate
    B, V = cfg.batch_size, raw.config.vocab_size
    calls = [0]
    hook = raw.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    x = torch.randint(0, V, (B, L), device=device, generator=gen)
    sigma = torch.full((B,), 0.5, device=device)
    fwd, gen_time, psi_time, nfe = [], [], [], 0
    raw.eval()
    try:
        for round_ in range(cfg.warmup + cfg.repeats):
            synchronize(device)
            t0 = time.perf_counter()
            with torch.no_grad(), autocast_for(device, dtype):
                for _ in range(cfg.sample_steps):
                    model(x, sigma)
            synchronize(device)
            t1 = time.perf_counter()
            calls[0] = 0
            generate(model, B, L, V, cfg.sample_steps, generator=gen, device=device, dtype=dtype,
                     show_progress=False)
            synchronize(device)
            t2 = time.perf_counter()
            nfe = calls[0]
            generate(model, B, L, V, cfg.sample_steps, psi=Psi(("eta",), (0.9,)), generator=gen, device=device,
                     dtype=dtype, show_progress=False)
            synchronize(device)
            t3 = time.perf_counter()
            if round_ >= cfg.warmup:
                fwd.append((t1 - t0) / cfg.sample_steps)
                gen_time.append(t2 - t1)
                psi_time.append(t3 - t2)
    finally:
        hook.remove()
        raw.train()
    forward_s, generate_s, psi_s = statistics.median(fwd), statistics.median(gen_time), statistics.median(psi_time)
    return dict(steps=cfg.sample_steps, nfe=nfe, forward_ms=1e3 * forward_s, generate_ms=1e3 * generate_s,
                ms_per_step=1e3 * generate_s / cfg.sample_steps, overhead=generate_s / (nfe * forward_s) - 1,
                psi_ms_per_step=1e3 * psi_s / cfg.sample_steps, psi_overhead=psi_s / (nfe * forward_s) - 1,
                psi_vs_ancestral=psi_s / generate_s)


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
    times = {name: [] for name in kinds}
    for round_ in range(cfg.warmup + cfg.repeats):
        for name, keep in kinds.items():
            synchronize(device)
            t0 = time.perf_counter()
            step(keep)
            synchronize(device)
            if round_ >= cfg.warmup:
                times[name].append(time.perf_counter() - t0)
    product = 2 * B * L * d * V_pad
    out = {name: dict(ms=1e3 * statistics.median(times[name]), flops=flops[name], products=flops[name] / product)
           for name in kinds}
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


def run(cfg):
    """The whole benchmark -> one JSON-able dict."""
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dtype = resolve_dtype(cfg.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    if device.type == "cpu" and cfg.threads:
        torch.set_num_threads(cfg.threads)
    results, runs, L, peak, failures = bench_training(cfg, device, dtype)
    if not runs:
        raise OutOfMemory(f"no model of preset {cfg.preset} fits in memory ({'; '.join(failures.values())})")
    n = PEAK_MATMUL_N[device.type]
    peak_how = f"{dtype_name} {n}x{n} matmul"
    for r in results.values():
        r["mfu"] = r["model_flops"] / (r["step_ms"] / 1e3) / peak if r["step_ms"] else None
    diffusion_runs = [run for tcfg, run in runs.values() if tcfg.loss != "ar"]
    sampler = None
    if cfg.sample_steps and diffusion_runs:
        sampler = fits(lambda: bench_sampler(cfg, diffusion_runs[0].model, diffusion_runs[0].raw_model, device,
                                             dtype, L), "sampler", failures)
    any_raw = next(iter(runs.values()))[1].raw_model
    mc = any_raw.config
    head = fits(lambda: bench_head(cfg, mc, device, dtype, L), "fused head", failures) if cfg.head_chunks else None
    out = dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), device=device_name(device),
               bench_config=asdict(cfg), cuda=device.type == "cuda", dtype=dtype_name, block_size=L,
               model=dict(arch=mc.arch, n_layer=mc.n_layer, n_head=mc.n_head, n_embd=mc.n_embd,
                          vocab_size=mc.vocab_size, padded_vocab_size=mc.padded_vocab_size,
                          params=any_raw.num_params(), non_embedding_params=any_raw.num_params(non_embedding=True)),
               peak_flops=peak, peak_flops_from=peak_how, mfu_formula=MFU_FORMULA, losses=results, sampler=sampler,
               head=head, out_of_memory=failures)
    return out


# -----------------------------------------------------------------------------------------------
# output

def fmt(x, spec, none="n/a"):
    return none if x is None else format(x, spec)


def markdown(out):
    m, cfg = out["model"], out["bench_config"]
    padded = f" (output layer {m['padded_vocab_size']})" if m.get("padded_vocab_size", m["vocab_size"]) != m["vocab_size"] else ""
    lines = [
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
    for name, r in out["losses"].items():
        lines.append(f"| {name} | {fmt(r['step_ms'], '.1f')} | {fmt(r['tokens_per_s'], ',.0f')} "
                     f"| {fmt(pct(r['mfu']), '.1f')}{'%' if r['mfu'] is not None else ''} "
                     f"| {fmt(mib(r['peak_mem_bytes']), ',.0f')} | {fmt(mib(r['step_mem_bytes']), ',.1f')} "
                     f"| {fmt(mib(r['act_bytes']), ',.1f')} | {fmt(r['step_vs_duo'], '.2f')} | {fmt(r['peak_vs_duo'], '.2f')} "
                     f"| {fmt(r['step_mem_vs_duo'], '.2f')} | {fmt(r['act_vs_duo'], '.2f')} |")
    s = out["sampler"]
    if s is not None:
        lines += ["", "| sampler | steps | NFE | ms / step | forward ms | overhead |", "|---|---:|---:|---:|---:|---:|",
                  f"| sample.generate (ancestral) | {s['steps']} | {s['nfe']} | {s['ms_per_step']:.1f} "
                  f"| {s['forward_ms']:.1f} | {100 * s['overhead']:+.1f}% |",
                  f"| sample.generate (psi, kappa = 0.9) | {s['steps']} | {s['nfe']} | {s['psi_ms_per_step']:.1f} "
                  f"| {s['forward_ms']:.1f} | {100 * s['psi_overhead']:+.1f}% |",
                  "", f"Psi step / ancestral step: {s['psi_vs_ancestral']:.3f}"]
    h = out.get("head")
    if h is not None:
        lines += ["", f"| fused head + sddlm_v1, {h['rows']} rows x d={h['d']} x V_pad={h['padded_vocab_size']}, "
                      f"{h['chunks']} chunks, fwd + bwd | ms | GFLOP (counted) | output-layer products |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {name} logits | {h[name]['ms']:.1f} | {h[name]['flops'] / 1e9:.3f} | {h[name]['products']:.2f} |"
                  for name in ("kept", "recomputed")]
        lines += ["", f"kept / recomputed time: {h['kept_vs_recomputed']:.3f} (one product = 2 N d V_pad = "
                      f"{h['product_flops'] / 1e9:.3f} GFLOP)"]
    costs = [(f"{name} step / {name.removesuffix(CURRICULUM)} step", fmt(r["step_vs_plain"], ".3f"))
             for name, r in out["losses"].items() if name.endswith(CURRICULUM)]
    if s is not None:
        costs.append(("sampler time / its forwards' time", f"{1 + s['overhead']:.3f} ({100 * s['overhead']:+.1f}%)"))
    if costs:       # the two costs over the bare computation, from the same run (same machine load)
        lines += ["", "| cost over the bare computation, this run | ratio |", "|---|---:|"]
        lines += [f"| {what} | {ratio} |" for what, ratio in costs]
    if out.get("out_of_memory"):
        lines += ["", "n/a from running out of memory: "
                  + "; ".join(f"{what}: {why}" for what, why in out["out_of_memory"].items())]
    return "\n".join(lines)


def main(argv=None):
    cfg = parse_args(argv)
    out = run(cfg)
    print(json.dumps(out, indent=1) if cfg.json else markdown(out))
    return 0


if __name__ == "__main__":
    run_cli(main, FloatingPointError, oom_hint="lower --batch_size")
