"""GPU memory: the micro-batch probe (CUDA: before training, one forward + backward of each kind of step the run
will take shows whether the micro-batch fits; if not, --grad_accum is raised or the run stops with the flag to set),
the margin it leaves for what torch's allocator does not count, and the allocator's settings."""
import torch
import torch.distributed as dist

import diffusion
from diffusion import loss_terms
from plumbing.cli import OutOfMemory, autocast_for, resolve_dtype

# What a micro-batch's measured peak (torch.cuda.max_memory_allocated) does not show, and what the probe therefore
# leaves free: a fixed part, outside torch's allocator -- the CUDA context and its kernels' modules (~0.5 GiB on an
# H100), cuBLAS / cuDNN workspaces, NCCL's communication buffers (~1 GiB at 8 ranks) -- and a share of the device
# for the caching allocator's fragmentation (reserved but unusable blocks, a few % of a long run's memory; less with
# expandable segments) and for the steps that differ from the probe's (another length of the last evaluation batch,
# the samples at the end). The probe used to accept up to 0.97 of the device: 2.4 GiB of an 80 GiB H100, less than
# the context plus NCCL alone, so a compiled 1.1B run could pass it and then run out of memory.
OUTSIDE_ALLOCATOR = 2 * 2 ** 30       # bytes: CUDA context, library workspaces, NCCL buffers
FRAGMENTATION = 0.08                  # share of the device: fragmentation and the steps the probe does not take


def usable_bytes(total):
    """The largest measured peak (bytes) a micro-batch may reach on a device of `total` bytes: the total less
    OUTSIDE_ALLOCATOR and FRAGMENTATION x total (80 GiB -> 71.6 GiB; 141 GiB -> 127.7 GiB)."""
    return int(total * (1 - FRAGMENTATION)) - OUTSIDE_ALLOCATOR


def cuda_allocator_env(environ):
    """The environment a CUDA run adds before its first allocation: PyTorch's caching allocator with expandable
    segments (blocks that grow in place instead of new fixed-size segments: less fragmentation as the micro-batch's
    activations come and go), unless the user configured the allocator (PYTORCH_CUDA_ALLOC_CONF or its newer name
    PYTORCH_ALLOC_CONF): theirs is kept. -> {name: value} to add (empty: nothing)."""
    if environ.get("PYTORCH_CUDA_ALLOC_CONF") is not None or environ.get("PYTORCH_ALLOC_CONF") is not None:
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def fit_micro_batch(run, cfg, env, compile=False):
    """CUDA: make sure the micro-batch fits before training. One forward + backward of each kind of step the run
    will take (curriculum and/or plain) at its micro-batch, on random tokens, outside DDP (compiled when the run
    compiles: probe_steps), leaving weights, optimizer and every random state as they were. The verdict is shared by
    all ranks. If it does not fit, --auto_accum 1 doubles --grad_accum (halving the micro-batch) until it does;
    --auto_accum 0 stops with one line naming the micro-batch that fits and the flag to set. With --head auto the
    fused head keeps its chunk logits for backward where they fit, and recomputes them (--head fused_recompute) where
    only that fits: tried at each micro-batch before a smaller one. Updates cfg.grad_accum and cfg.head."""
    if env.device.type != "cuda":
        return
    accum, first = cfg.grad_accum, cfg.grad_accum
    while True:
        micro = cfg.batch_size // (env.world_size * accum)
        fits = _fits_on_every_rank(run, cfg, env, micro, compile)
        if not fits and cfg.head == "auto" and not diffusion.OBJECTIVES[cfg.loss].full_logits:
            cfg.head = "fused_recompute"          # the fused head's kept logits may be what does not fit
            fits = _fits_on_every_rank(run, cfg, env, micro, compile)
            if fits and env.master:
                print(f"micro-batch {micro} fits in GPU memory ({_gpu_gib(env)}) with the fused head recomputing its "
                      f"logits in backward: --head fused_recompute (one more output-layer product a step)", flush=True)
            cfg.head = "fused_recompute" if fits else "auto"
        if fits and accum == first:
            return
        if fits:
            break
        if micro == 1 or cfg.batch_size % (env.world_size * accum * 2):
            raise OutOfMemory(f"micro-batch {micro} does not fit in GPU memory ({_gpu_gib(env)}): lower --block_size "
                              f"or the model size")
        accum *= 2
    first_micro = cfg.batch_size // (env.world_size * first)
    if not cfg.auto_accum:
        raise OutOfMemory(f"micro-batch {first_micro} (--batch_size {cfg.batch_size} / {env.world_size} rank(s) / "
                          f"--grad_accum {first}) does not fit in GPU memory ({_gpu_gib(env)}); micro-batch {micro} "
                          f"fits: set --grad_accum {accum}")
    if env.master:
        print(f"micro-batch {first_micro} does not fit in GPU memory ({_gpu_gib(env)}): training with --grad_accum "
              f"{accum} (micro-batch {micro}, the same global batch {cfg.batch_size})", flush=True)
    cfg.grad_accum = accum


def _fits_on_every_rank(run, cfg, env, micro, compile):
    fits = _probe_fits(run, cfg, env, micro, compile)
    if env.ddp:
        flag = torch.tensor([float(fits)], device=env.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        fits = bool(flag.item())
    return fits


def _gpu_gib(env):
    return f"{torch.cuda.get_device_properties(env.device).total_memory / 2 ** 30:.1f} GiB"


def _probe_fits(run, cfg, env, micro, compile):
    """One probe of fit_micro_batch at this micro-batch -> bool: the measured peak, plus the optimizer's moments
    (not yet allocated in a fresh run), within usable_bytes of the device."""
    states = torch.get_rng_state(), torch.cuda.get_rng_state(env.device)
    later = sum(2 * p.numel() * p.element_size() for p in run.raw_model.parameters()) if not run.optimizer.state else 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(env.device)
    try:
        probe_steps(run, cfg, env, micro, compile)
        peak = torch.cuda.max_memory_allocated(env.device) + later
        fits = peak <= usable_bytes(torch.cuda.get_device_properties(env.device).total_memory)
    except torch.OutOfMemoryError:
        fits = False
    torch.set_rng_state(states[0])
    torch.cuda.set_rng_state(states[1], env.device)
    torch.cuda.empty_cache()
    return fits


def probe_steps(run, cfg, env, micro, compile=False):
    """One forward + backward of each kind of step the run will take (a curriculum step while it lasts, a plain
    step after) at this micro-batch, on random tokens, on run.raw_model outside DDP (no DDP hooks: a rank that
    fails leaves none waiting), compiled when the run compiles, so the peak is the compiled step's. Its graphs are
    dropped after (torch._dynamo.reset): the training model is compiled later inside DDP (distributed.wrap_model),
    and a graph cached here would be reused there whole, never split at DDP's gradient buckets. The gradients are
    set back to None."""
    its = [run.it] if run.it < cfg.curriculum_iters else []                      # a curriculum step
    if cfg.max_iters > cfg.curriculum_iters:
        its.append(max(run.it, cfg.curriculum_iters))                            # a plain step
    model = torch.compile(run.raw_model) if compile else run.raw_model
    try:
        for it in its:
            gen = torch.Generator(device=env.device).manual_seed(0)
            x0 = torch.randint(0, run.raw_model.config.vocab_size, (micro, cfg.block_size), generator=gen,
                               device=env.device)
            t = diffusion.sample_t(micro, gen, device=env.device)
            with autocast_for(env.device, resolve_dtype(cfg.dtype, env.device)):
                loss = loss_terms(model, cfg, x0, t, it, gen)[0].mean()
            loss.backward()
            del loss
            run.optimizer.zero_grad(set_to_none=True)
    finally:
        run.optimizer.zero_grad(set_to_none=True)
        if compile:
            torch._dynamo.reset()
