"""The micro-batch memory probe (CUDA): before training, one forward + backward of each kind of step the run will
take shows whether the micro-batch fits; if not, --grad_accum is raised (or the run stops with the flag to set)."""
import torch
import torch.distributed as dist

import diffusion
from plumbing.cli import autocast_for, resolve_dtype
from diffusion import loss_terms
from plumbing.cli import OutOfMemory


def fit_micro_batch(run, cfg, env):
    """CUDA: make sure the micro-batch fits before training. One forward + backward of each kind of step the run
    will take (curriculum and/or plain) at its micro-batch, on random tokens, outside DDP, leaving weights,
    optimizer and every random state as they were. The verdict is shared by all ranks. If it does not fit,
    --auto_accum 1 doubles --grad_accum (halving the micro-batch) until it does; --auto_accum 0 stops with one
    line naming the micro-batch that fits and the flag to set. With --head auto the fused head keeps its chunk
    logits for backward where they fit, and recomputes them (--head fused_recompute) where only that fits: tried at
    each micro-batch before a smaller one. Updates cfg.grad_accum and cfg.head."""
    if env.device.type != "cuda":
        return
    accum, first = cfg.grad_accum, cfg.grad_accum
    while True:
        micro = cfg.batch_size // (env.world_size * accum)
        fits = _fits_on_every_rank(run, cfg, env, micro)
        if not fits and cfg.head == "auto" and cfg.loss not in diffusion.FULL_LOGITS:
            cfg.head = "fused_recompute"          # the fused head's kept logits may be what does not fit
            fits = _fits_on_every_rank(run, cfg, env, micro)
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


def _fits_on_every_rank(run, cfg, env, micro):
    fits = _probe_fits(run, cfg, env, micro)
    if env.ddp:
        flag = torch.tensor([float(fits)], device=env.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        fits = bool(flag.item())
    return fits


def _gpu_gib(env):
    return f"{torch.cuda.get_device_properties(env.device).total_memory / 2 ** 30:.1f} GiB"


def _probe_fits(run, cfg, env, micro):
    """One probe of fit_micro_batch at this micro-batch -> bool. The optimizer's moments, not yet allocated in
    a fresh run, are added to the measured peak."""
    states = torch.get_rng_state(), torch.cuda.get_rng_state(env.device)
    later = sum(2 * p.numel() * p.element_size() for p in run.raw_model.parameters()) if not run.optimizer.state else 0
    its = [run.it] if run.it < cfg.curriculum_iters else []                      # a curriculum step
    if cfg.max_iters > cfg.curriculum_iters:
        its.append(max(run.it, cfg.curriculum_iters))                            # a plain step
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(env.device)
    try:
        for it in its:
            _probe_step(run, cfg, env, micro, it)
        peak = torch.cuda.max_memory_allocated(env.device) + later
        fits = peak < 0.97 * torch.cuda.get_device_properties(env.device).total_memory
    except torch.OutOfMemoryError:
        fits = False
    run.optimizer.zero_grad(set_to_none=True)
    torch.set_rng_state(states[0])
    torch.cuda.set_rng_state(states[1], env.device)
    torch.cuda.empty_cache()
    return fits


def _probe_step(run, cfg, env, micro, it):
    model = run.model.module if env.ddp else run.model       # no DDP hooks: a rank that fails leaves none waiting
    gen = torch.Generator(device=env.device).manual_seed(0)
    x0 = torch.randint(0, run.raw_model.config.vocab_size, (micro, cfg.block_size), generator=gen, device=env.device)
    t = diffusion.sample_t(micro, gen, device=env.device)
    with autocast_for(env.device, resolve_dtype(cfg.dtype, env.device)):
        loss = loss_terms(model, cfg, x0, t, it, gen)[0].mean()
    loss.backward()
    run.optimizer.zero_grad(set_to_none=True)
