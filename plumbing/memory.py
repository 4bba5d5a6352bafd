"""Memory: sizes checked against the machine before anything is allocated, naming the flag or config field at
fault; and on CUDA the micro-batch probe before training (fit_micro_batch), the margin it leaves for what torch's
allocator does not count, and the allocator's settings."""
import os
import resource
from contextlib import suppress
from types import SimpleNamespace

import torch
import torch.distributed as dist

from plumbing.cli import OutOfMemory, UsageError, resolve_device

# What a micro-batch's measured peak does not show, and what the probe therefore leaves free (why these sizes:
# docs/training.md, "The step")
OUTSIDE_ALLOCATOR = 2 * 2 ** 30       # bytes: CUDA context, library workspaces, NCCL buffers
FRAGMENTATION = 0.08                  # share of the device: fragmentation and the steps the probe does not take


def usable_bytes(total):
    """The largest measured peak (bytes) a micro-batch may reach on a device of `total` bytes: the total less
    OUTSIDE_ALLOCATOR and FRAGMENTATION x total (80 GiB -> 71.6 GiB; 141 GiB -> 127.7 GiB)."""
    return int(total * (1 - FRAGMENTATION)) - OUTSIDE_ALLOCATOR


# -----------------------------------------------------------------------------------------------
# sizes against the machine, before anything is allocated

def model_numel(c):
    """Elements of model.DiffusionTransformer's tensors for config c (a ModelConfig or any object with its fields),
    counted from the shapes without building it (Python ints: no overflow, no allocation) -> (parameters with the
    output layer's padding rows, RoPE buffer elements)."""
    d, h, cd, K = c.n_embd, c.mlp_hidden or 4 * c.n_embd, c.cond_dim, c.vocab_size
    dit, tc = c.arch == "dit", c.time_cond
    padded = -(-K // c.vocab_multiple) * c.vocab_multiple
    block = 2 * d + 4 * d * d + (2 * d * h + h + d if dit else 3 * d * h) + (6 * d * (cd + 1) if tc else 0)
    params = (K * d + (256 * cd + cd * cd + 2 * cd if tc else 0) + c.n_layer * block + d
              + (2 * d * (cd + 1) if tc else 0) + padded * d + (padded if dit else 0))
    return params, 2 * c.block_size * (d // c.n_head)


def available_memory(device):
    """(bytes, where) a new allocation may take: on CUDA the device's total memory; on the CPU the least of the
    kernel's MemAvailable, the cgroup's limit less its usage (a container's or a job's) and `ulimit -v` less the
    process's address space (None where none can be read)."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"GPU memory ({props.name})"
    found = []
    with suppress(OSError, KeyError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            info = {row.split(":")[0]: int(row.split()[1]) * 1024 for row in f if row.split()[1:2]}
        found.append((info["MemAvailable"], "available RAM"))
    with suppress(OSError, StopIteration, ValueError, IndexError):
        with open("/proc/self/cgroup") as f:
            group = next(row.strip().split(":", 2)[2] for row in f if row.startswith("0::"))
        base = os.path.join("/sys/fs/cgroup", group.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f, open(os.path.join(base, "memory.current")) as g:
            limit = f.read().strip()
            if limit != "max":
                found.append((int(limit) - int(g.read()), "memory left under its cgroup's limit"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        with suppress(OSError, StopIteration, ValueError):
            with open("/proc/self/status") as f:
                size = next(int(row.split()[1]) * 1024 for row in f if row.startswith("VmSize:"))
            found.append((soft - size, "address space left under ulimit -v"))
    return min(found) if found else (None, "")


def _size(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            return f"{n:.3g} {unit}"
        n /= 1024


def check_fits(need, device, what, fix):
    """`what` (words naming the values at fault) needs at least `need` bytes on `device`: more than the memory there
    is (available_memory) -> UsageError, one line with both sizes and `fix`. For the sizes a script knows at its
    start that are not a model's: sample.py's tokens, eval_ppl.py's draws."""
    free, where = available_memory(device)
    if free is not None and need > free:
        raise UsageError(f"{what} need at least {_size(need)}, more than the {_size(max(free, 0))} of {where}; {fix}")


def _refuse_if_too_big(need, mcfg, micro, device, name, what, fix, smaller):
    """need(c) -> bytes, c: mcfg's fields and the micro-batch `micro`; above the memory there is -> UsageError naming
    the field whose reset to smaller's value saves the most."""
    c = SimpleNamespace(**vars(mcfg), micro=micro)
    total = need(c)
    free, where = available_memory(device)
    if free is None or total <= free:
        return
    savings = {field: total - need(SimpleNamespace(**{**vars(c), field: small})) for field, small in smaller.items()
               if getattr(c, field) is not None and getattr(c, field) > small}
    field = max(savings, key=savings.get) if savings else "n_layer"
    raise UsageError(f"{name(field)} {getattr(c, field)}: {what} needs at least {_size(total)} ({model_numel(c)[0]:,} "
                     f"parameters), more than the {_size(max(free, 0))} of {where}; {fix}")


# the reference sizes (--preset tiny's model, a micro-batch of one) against which the field at fault is found
SMALL = dict(n_layer=4, n_embd=128, mlp_hidden=512, cond_dim=64, vocab_size=2048, block_size=128, micro=1)


def check_model_memory(mcfg, device, name, fix="use a machine with more memory"):
    """Before a model is built (a model folder or checkpoint read anywhere): its float32 weights and RoPE tables fit
    in the memory there is, else one line naming the field at fault (name(field): "out/model/config.json: n_layer")."""
    _refuse_if_too_big(lambda c: 4 * sum(model_numel(c)), mcfg, 0, device, name, "the model", fix,
                       {k: v for k, v in SMALL.items() if k != "micro"})


def check_training_memory(mcfg, micro, ema, device, name, fix="lower it"):
    """Before a training run allocates its model: a lower bound of the bytes it takes before its first step ends, for
    a micro-batch of `micro` sequences, fits in the memory there is, else one line naming the flag at fault
    (name(field) -> "--n_layer"; "micro": the micro-batch). The bound: 16 bytes a parameter (float32 weights,
    gradients, AdamW's two moments), 4 more with the EMA, the RoPE tables, and each block's input kept for backward
    (2 bytes a value or more). The true peak is higher: a run this refuses cannot fit."""
    def need(c):
        params, buffers = model_numel(c)
        return params * (16 + 4 * bool(ema)) + 4 * buffers + 2 * c.micro * c.block_size * c.n_embd * c.n_layer
    _refuse_if_too_big(need, mcfg, micro, device, name,
                       "training (weights, gradients, AdamW's moments, EMA, one micro-batch)", fix, SMALL)


def check_run_fits(cfg, mcfg, launch, model_from=None):
    """train.py's / distillation/distill.py's start, before any data or model: check_training_memory for the run's
    micro-batch on this rank's device, the field at fault named as the run's flags set it (--n_layer, --block_size,
    the micro-batch's --batch_size / --grad_accum; a preset's own fields; model_from: where the model's fields come
    from instead, e.g. distill's "--init ckpt.pt: model_config.")."""
    micro = max(1, cfg.batch_size // (launch.world_size * cfg.grad_accum))
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", launch.local_rank)

    def name(field):
        if field == "micro":
            return (f"--batch_size {cfg.batch_size} / {launch.world_size} rank(s) / --grad_accum {cfg.grad_accum}: "
                    f"the micro-batch")
        if model_from and field != "block_size":
            return f"{model_from}{field}"
        if field in ("n_layer", "n_embd", "n_head", "block_size", "vocab_size"):
            return f"--{field}"
        return f"--preset {cfg.preset}'s {field}"
    check_training_memory(mcfg, micro, cfg.ema, device, name)


def cuda_allocator_env(environ):
    """The environment a CUDA run adds before its first allocation: PyTorch's caching allocator with expandable
    segments (blocks that grow in place instead of new fixed-size segments: less fragmentation as the micro-batch's
    activations come and go), unless the user configured the allocator (PYTORCH_CUDA_ALLOC_CONF or its newer name
    PYTORCH_ALLOC_CONF): theirs is kept. -> {name: value} to add (empty: nothing)."""
    if environ.get("PYTORCH_CUDA_ALLOC_CONF") is not None or environ.get("PYTORCH_ALLOC_CONF") is not None:
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def fit_micro_batch(run, cfg, env, compile=False, loss=None, fusable=False):
    """CUDA: make sure the micro-batch fits before training, by the probe of each kind of step (probe_steps,
    loss(model, x0, it, gen) its step), its verdict shared by all ranks; compiled, one probe serves every micro-batch
    tried (docs/training.md, "The step"). If it does not fit, --auto_accum 1 doubles --grad_accum until it does;
    --auto_accum 0 stops with one line naming the flag to set.
    With --head auto and `fusable` (an objective the fused head computes), --head fused_recompute is tried at each
    micro-batch before a smaller one. Updates cfg.grad_accum and cfg.head."""
    model = torch.compile(run.raw_model) if compile else None
    accum = first = cfg.grad_accum
    try:
        while True:
            micro = cfg.batch_size // (env.world_size * accum)
            fits = _probe_fits(run, cfg, env, micro, model, loss)
            if not fits and cfg.head == "auto" and fusable:
                cfg.head = "fused_recompute"          # the fused head's kept logits may be what does not fit
                fits = _probe_fits(run, cfg, env, micro, model, loss)
                if fits and env.master:
                    print(f"micro-batch {micro} fits in GPU memory ({_gpu_gib(env)}) with the fused head recomputing "
                          f"its logits in backward: --head fused_recompute (one more output-layer product a step)",
                          flush=True)
                cfg.head = "fused_recompute" if fits else "auto"
            if fits:
                break
            if micro == 1 or cfg.batch_size % (env.world_size * accum * 2):
                raise OutOfMemory(f"micro-batch {micro} does not fit in GPU memory ({_gpu_gib(env)}): lower "
                                  f"--block_size or the model size")
            accum *= 2
    finally:    # DDP splits its graph at its buckets (wrap_model); another micro-batch compiled its batch size dynamic
        if compile and (env.ddp or accum != first):
            torch._dynamo.reset()
    if accum == first:
        return
    first_micro = cfg.batch_size // (env.world_size * first)
    if not cfg.auto_accum:
        raise OutOfMemory(f"micro-batch {first_micro} (--batch_size {cfg.batch_size} / {env.world_size} rank(s) / "
                          f"--grad_accum {first}) does not fit in GPU memory ({_gpu_gib(env)}); micro-batch {micro} "
                          f"fits: set --grad_accum {accum}")
    if env.master:
        print(f"micro-batch {first_micro} does not fit in GPU memory ({_gpu_gib(env)}): training with --grad_accum "
              f"{accum} (micro-batch {micro}, the same global batch {cfg.batch_size})", flush=True)
    cfg.grad_accum = accum


def _gpu_gib(env):
    return f"{torch.cuda.get_device_properties(env.device).total_memory / 2 ** 30:.1f} GiB"


def _probe_fits(run, cfg, env, micro, model, loss):
    """One probe of fit_micro_batch at this micro-batch -> bool, the same on every rank: the measured peak, plus the
    optimizer's moments (not yet allocated in a fresh run), within usable_bytes of the device on every rank."""
    later = sum(2 * p.numel() * p.element_size() for p in run.raw_model.parameters()) if not run.optimizer.state else 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(env.device)
    try:
        probe_steps(run, cfg, env, micro, loss, model)
        peak = torch.cuda.max_memory_allocated(env.device) + later
        fits = peak <= usable_bytes(torch.cuda.get_device_properties(env.device).total_memory)
    except torch.OutOfMemoryError:
        fits = False
    torch.cuda.empty_cache()
    if env.ddp:
        flag = torch.tensor([float(fits)], device=env.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        fits = bool(flag.item())
    return fits


def probe_steps(run, cfg, env, micro, loss, model=None):
    """One forward + backward of each kind of step the run will take (a curriculum step while it lasts, a plain
    step after) through `model` at this micro-batch, on random tokens (loss(model, x0, it, gen) -> the step's mean
    loss): the probe's (None: run.raw_model, outside DDP: a rank that fails leaves none waiting), or the run's
    compiled model before its first step (no compilation when the curriculum ends). Weights, optimizer and torch's
    random states are left as they were; the gradients as a step leaves them (the probe's: None)."""
    its = [run.it] if run.it < cfg.curriculum_iters else []                      # a curriculum step
    if cfg.max_iters > cfg.curriculum_iters:
        its.append(max(run.it, cfg.curriculum_iters))                            # a plain step
    none = model is not run.model or not env.ddp        # the run's model under DDP: zeros in its buckets
    cuda, model = env.device.type == "cuda", run.raw_model if model is None else model
    states = torch.get_rng_state(), torch.cuda.get_rng_state(env.device) if cuda else None
    try:
        for it in its:
            gen = torch.Generator(device=env.device).manual_seed(0)
            x0 = torch.randint(0, run.raw_model.config.vocab_size, (micro, cfg.block_size), generator=gen,
                               device=env.device)
            with env.autocast(cfg.dtype):
                mean = loss(model, x0, it, gen)
            mean.backward()
            del mean
            run.optimizer.zero_grad(set_to_none=none)
    finally:
        run.optimizer.zero_grad(set_to_none=none)
        torch.set_rng_state(states[0])
        if cuda:
            torch.cuda.set_rng_state(states[1], env.device)
