"""
Train a uniform-state diffusion LM (or the AR baseline) with any of the objectives in losses.py.

    python train.py                                   # tiny preset on the built-in corpus, 2 CPU cores, minutes
    python train.py --loss sddlm_v1 --max_iters 2000
    torchrun --nproc_per_node=8 train.py --preset small --loss sddlm_v1 --dataset openwebtext
    python train.py --out_dir out --resume 1          # continue exactly where a run stopped

Every field of TrainConfig is a CLI flag; --preset applies a dict of overrides first (TRAIN_PRESETS),
explicit flags win. The run's full config is printed at start and saved next to the checkpoint.
One training step (paper Algorithm 1): x0 ~ data, t ~ stratified U[1e-3, 1], xt ~ q_t(. | x0)
(or Duo's Gaussian curriculum), loss = per-token objective, token mean, AdamW, EMA.
"""
import json
import math
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, asdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import diffusion
import losses
from data import BatchLoader, DataError, eval_batches, get_tokenizer, load_meta, prepare_dataset
from model import PRESETS, ModelConfig, build_model
from sample import UsageError, parse_flags, run_cli


@dataclass
class TrainConfig:
    preset: str = "tiny"             # tiny | small | medium | large (model + recipe), see TRAIN_PRESETS
    loss: str = "sddlm"              # sddlm | sddlm_v1 | sddlm_v2 | naive | duo | ar
    eps: float = losses.EPS          # epsilon of SDDLM-V1/V2 in log(p + eps)
    # data
    dataset: str = "pydoc"           # pydoc (built in) | path to .txt file/folder | HF name (openwebtext, lm1b, ...)
    tokenizer: str = "sp_train:2048"  # gpt2 | sp:/path/tokenizer.model | hf:NAME | sp_train:VOCAB (train on corpus)
    data_dir: str = ""               # prepared memmaps; default data/<dataset>-<tokenizer>-<block_size>
    block_size: int = 128            # sequence length L
    vocab_size: int = 0              # model K; 0 = the tokenizer's (a larger K leaves unused output rows)
    wrap: bool = True                # OWT-style packing (True) or LM1B-style per-sentence padding (False)
    # model (0 = take from the model preset)
    n_layer: int = 0
    n_head: int = 0
    n_embd: int = 0
    dropout: float = 0.0
    # optimisation
    max_iters: int = 1000
    batch_size: int = 32             # GLOBAL batch in sequences (all ranks x accumulation steps)
    grad_accum: int = 1
    lr: float = 1e-3
    lr_schedule: str = "linear"      # constant | linear | cosine (after warm-up)
    min_lr: float = 0.0
    warmup_iters: int = 100
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ema: float = 0.999               # EMA decay (0 = off); Duo warms it up as min(ema, (1+n)/(10+n))
    noise_schedule: str = "loglinear"
    # Duo's Gaussian-guided curriculum (0 steps = off)
    curriculum_iters: int = 0
    gamma_min: float = -3.55
    gamma_max: float = -1.85
    log10_tau_start: float = -3.0
    log10_tau_end: float = -3.0
    # evaluation, logging, checkpoints
    eval_interval: int = 250
    eval_iters: int = 8
    log_interval: int = 10
    ckpt_interval: int = 250
    num_samples: int = 4             # printed at the end of training
    sample_steps: int = 128
    out_dir: str = "out"
    resume: bool = False
    # system
    seed: int = 1
    device: str = "auto"             # auto | cpu | cuda
    dtype: str = "auto"              # auto (bf16 autocast on GPU, float32 on CPU) | float32 | bfloat16
    compile: bool = False


# Appendix Table (hyperparameters) for small/medium; SMDM's 1.1B recipe for large; tiny = CPU demo.
TRAIN_PRESETS = {
    "tiny": {},
    "small": dict(dataset="openwebtext", tokenizer="gpt2", block_size=1024, max_iters=1_000_000, batch_size=512,
                  lr=3e-4, lr_schedule="linear", warmup_iters=2500, beta2=0.999, weight_decay=0.0, ema=0.9999,
                  dropout=0.1,
                  curriculum_iters=500_000, gamma_min=-3.55, gamma_max=-1.85, eval_interval=5000,
                  ckpt_interval=500, eval_iters=50, sample_steps=1024),
    "large": dict(dataset="slimpajama", tokenizer="sp:tokenizer.model", block_size=2048, max_iters=250_000,
                  batch_size=256, lr=2e-4, lr_schedule="linear", warmup_iters=2500, beta2=0.95, weight_decay=0.1,
                  ema=0.9999, eval_interval=5000, ckpt_interval=1000, eval_iters=50, sample_steps=1024),
}
TRAIN_PRESETS["medium"] = TRAIN_PRESETS["small"]
TRAIN_PRESETS.update({name: TRAIN_PRESETS["large"] for name in PRESETS if name.startswith("llama_")})  # SMDM ladder


class ConfigError(UsageError):
    """A bad flag or an incompatible run: reported as one line, exit code 2."""


# -----------------------------------------------------------------------------------------------
# config <-> command line

def parse_config(argv=None):
    return parse_flags(TrainConfig, argv, __doc__.split("\n\n")[0], presets=TRAIN_PRESETS)


def validate(cfg, world_size):
    if cfg.loss not in losses.LOSSES:
        raise ConfigError(f"unknown --loss {cfg.loss!r}; choose from {', '.join(losses.LOSSES)}")
    if cfg.preset not in PRESETS:
        raise ConfigError(f"--preset {cfg.preset!r} has no model preset; choose from tiny, small, medium, large")
    if cfg.lr_schedule not in ("constant", "linear", "cosine"):
        raise ConfigError(f"unknown --lr_schedule {cfg.lr_schedule!r}; choose from constant, linear, cosine")
    if cfg.noise_schedule not in diffusion.SCHEDULES:
        raise ConfigError(f"unknown --noise_schedule {cfg.noise_schedule!r}; choose from {', '.join(diffusion.SCHEDULES)}")
    if cfg.max_iters < 1 or cfg.batch_size < 1 or cfg.grad_accum < 1 or cfg.block_size < 2:
        raise ConfigError("--max_iters, --batch_size, --grad_accum must be >= 1 and --block_size >= 2")
    if cfg.batch_size % (world_size * cfg.grad_accum):
        raise ConfigError(f"--batch_size {cfg.batch_size} is not divisible by {world_size} ranks x "
                          f"--grad_accum {cfg.grad_accum}")
    if cfg.loss == "ar" and cfg.curriculum_iters:
        raise ConfigError("--curriculum_iters applies to diffusion losses, not --loss ar")
    if not 0 <= cfg.ema < 1:
        raise ConfigError("--ema must be in [0, 1)")


def model_config_for(cfg, vocab_size):
    if cfg.vocab_size and cfg.vocab_size < vocab_size:
        raise ConfigError(f"--vocab_size {cfg.vocab_size} is smaller than the tokenizer's vocabulary {vocab_size}")
    vocab_size = cfg.vocab_size or vocab_size
    base = dict(PRESETS[cfg.preset])
    base.update({k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd") if getattr(cfg, k)})
    base.update(vocab_size=vocab_size, block_size=cfg.block_size, dropout=cfg.dropout)
    if cfg.loss == "ar":   # the AR baseline: causal attention, no time input
        base.update(causal=True, time_cond=False)
    return ModelConfig(**base)


def lr_at(it, cfg):
    """Linear warm-up, then constant, linear decay to min_lr, or cosine to min_lr at max_iters."""
    if it < cfg.warmup_iters:
        return cfg.lr * (it + 1) / cfg.warmup_iters
    if cfg.lr_schedule == "constant":
        return cfg.lr
    frac = min(1.0, (it - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters))
    if cfg.lr_schedule == "linear":
        return cfg.lr + frac * (cfg.min_lr - cfg.lr)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * frac)) * (cfg.lr - cfg.min_lr)


# -----------------------------------------------------------------------------------------------
# one objective evaluation: corrupt x0, run the model, per-token losses

def draw_noise(batch, length, vocab_size, generator, device):
    """The random draws of one step for a whole (global) batch: keep-uniforms, replacement tokens and
    SDDLM-V1 negatives, each (batch, length). Drawn from a generator shared by all ranks and sliced per rank,
    so a DDP run corrupts every sequence exactly as a single-process run at the same global batch."""
    return (torch.rand(batch, length, generator=generator, device=device),
            torch.randint(0, vocab_size, (batch, length), generator=generator, device=device),
            torch.randint(0, vocab_size, (batch, length), generator=generator, device=device))


def loss_terms(model, cfg, x0, t, it, generator, draws=None):
    """Per-token training loss (B, L) for clean x0 (B, L) at times t (B,), and (logits, xt, alpha_t, dalpha_t)
    for the NELBO. draws: this micro-batch's slice of draw_noise (else drawn from generator). During Duo's
    curriculum the input is the tempered softmax of a Gaussian latent (per-rank generator) and xt its argmax."""
    V = model_vocab(model)
    if draws is None:
        draws = draw_noise(x0.shape[0], x0.shape[1], V, generator, x0.device)
    if cfg.loss == "ar":
        return losses.ar_loss(model(x0), x0), None
    if it < cfg.curriculum_iters:
        tau = diffusion.tau_schedule(it, cfg.log10_tau_start, cfg.log10_tau_end, 0, cfg.curriculum_iters)
        xt, net_in, alpha_t, dalpha_t = diffusion.curriculum_sample(
            x0, t, V, cfg.gamma_min, cfg.gamma_max, tau, generator)
    else:
        alpha_t, dalpha_t = diffusion.SCHEDULES[cfg.noise_schedule](t)
        alpha_t, dalpha_t = alpha_t.unsqueeze(-1), dalpha_t.unsqueeze(-1)
        xt = net_in = diffusion.sample_xt(x0, alpha_t, V, draws=draws[:2])
    logits = model(net_in, diffusion.sigma_from_alpha(alpha_t.squeeze(-1)))
    if cfg.loss == "duo":
        return losses.usdm_nelbo_loss(logits, x0, xt, alpha_t, dalpha_t), None
    if cfg.loss == "sddlm_v1":
        loss = losses.sddlm_v1_loss(logits, x0, xt, neg=draws[2], eps=cfg.eps)
    elif cfg.loss == "sddlm_v2":
        loss = losses.sddlm_v2_loss(logits, x0, xt, eps=cfg.eps)
    elif cfg.loss == "sddlm":
        loss = losses.sddlm_loss(logits, x0, xt)
    else:
        loss = losses.naive_denoising_loss(logits, x0)
    return loss, (logits, xt, alpha_t, dalpha_t)


def model_vocab(model):
    return (model.module if isinstance(model, DDP) else model).config.vocab_size


def token_mean(per_token, mask):
    if mask is None:
        return per_token.mean()
    return (per_token * mask).sum() / mask.sum().clamp_min(1)


@torch.no_grad()
def evaluate(model, cfg, data_dir, device, autocast, batch_size):
    """Validation loss of the training objective and NELBO perplexity (usdm_nelbo_loss, log-linear
    schedule, one draw per sequence, t stratified within each batch), identical draws at every eval."""
    model.eval()
    gen = torch.Generator(device=device).manual_seed(1234)
    tot, tot_nelbo, n = 0.0, 0.0, 0.0
    for x0, mask in eval_batches(data_dir, "val", batch_size, cfg.eval_iters):
        x0 = x0.to(device)
        mask = None if mask is None else mask.to(device)
        t = diffusion.sample_t(x0.shape[0], gen, device=device)
        with autocast:
            loss, extra = loss_terms(model, cfg, x0, t, cfg.curriculum_iters, gen)  # curriculum off in eval
            if cfg.loss == "ar":
                nelbo = loss
                mask = None if mask is None else mask[:, 1:]
            elif extra is None:
                nelbo = loss
            else:
                logits, xt, alpha_t, dalpha_t = extra
                nelbo = losses.usdm_nelbo_loss(logits, x0, xt, alpha_t, dalpha_t)
        w = float(mask.sum()) if mask is not None else loss.numel()
        tot += float(token_mean(loss, mask)) * w
        tot_nelbo += float(token_mean(nelbo, mask)) * w
        n += w
    model.train()
    if n == 0:
        raise DataError(f"{data_dir}: the validation split has no sequences of length {cfg.block_size}")
    return {"val_loss": tot / n, "val_nelbo": tot_nelbo / n, "val_ppl": math.exp(min(tot_nelbo / n, 50))}


def optimizer_step(raw_model, optimizer, ema, cfg, n_ema):
    """Clip the gradient norm, AdamW step, zero the gradients, update the EMA weights with Duo's warm-up
    decay min(ema, (1 + n) / (10 + n)). n_ema = EMA updates so far -> n_ema + 1."""
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if ema is None:
        return n_ema
    n_ema += 1
    d = min(cfg.ema, (1 + n_ema) / (10 + n_ema))
    torch._foreach_lerp_(ema, [p.detach() for p in raw_model.parameters()], 1 - d)
    return n_ema


# -----------------------------------------------------------------------------------------------
# checkpoints

def save_checkpoint(path, state):
    """Atomic: write to a temp file, then rename, so an interrupt never leaves a half-written checkpoint."""
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def rng_state(device, gen_shared, gen_local):
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None,
            "gen_shared": gen_shared.get_state(), "gen_local": gen_local.get_state()}


def check_resume(ckpt, cfg, mcfg, path):
    saved = ckpt["model_config"]
    if saved != asdict(mcfg):
        diff = {k: (saved.get(k), v) for k, v in asdict(mcfg).items() if saved.get(k) != v}
        raise ConfigError(f"cannot resume from {path}: model differs (saved, now) {diff}")
    old = ckpt["train_config"]
    for k in ("loss", "tokenizer", "batch_size"):
        if old[k] != getattr(cfg, k):
            raise ConfigError(f"cannot resume from {path}: --{k} was {old[k]!r}, now {getattr(cfg, k)!r}")


# -----------------------------------------------------------------------------------------------

def main(argv=None):
    cfg = parse_config(argv)
    ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank, world_size, local_rank = 0, 1, 0
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    if ddp:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        dist.init_process_group(backend="nccl" if cfg.device == "cuda" else "gloo")
    validate(cfg, world_size)
    master = rank == 0
    if cfg.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        device = torch.device("cpu")
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext())

    # data: prepared once (by rank 0) into token memmaps
    # absolute, so a checkpoint finds its data and tokenizer from any working directory
    data_dir = cfg.data_dir = os.path.abspath(cfg.data_dir or os.path.join(
        "data", f"{os.path.basename(cfg.dataset.rstrip('/'))}-{cfg.tokenizer.replace(':', '').replace('/', '_')}"
        f"-{cfg.block_size}"))
    error = None
    if master:
        try:
            prepare_dataset(cfg.dataset, cfg.tokenizer, data_dir, block_size=cfg.block_size, wrap=cfg.wrap)
        except DataError as e:
            error = str(e)
    if ddp:    # every rank learns rank 0's verdict and fails with the same one line, instead of hanging
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise DataError(error)
    meta = load_meta(data_dir)
    vocab_size = meta["vocab_size"]
    mcfg = model_config_for(cfg, vocab_size)

    os.makedirs(cfg.out_dir, exist_ok=True)
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    ckpt = None
    if cfg.resume:
        if not os.path.exists(ckpt_path):
            raise ConfigError(f"--resume: no checkpoint at {ckpt_path}")
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        check_resume(ckpt, cfg, mcfg, ckpt_path)
    elif os.path.exists(ckpt_path):
        raise ConfigError(f"{ckpt_path} exists; pass --resume 1 to continue it or choose another --out_dir")

    torch.manual_seed(cfg.seed + rank)
    raw_model = build_model(mcfg).to(device)
    ema = [p.detach().clone() for p in raw_model.parameters()] if cfg.ema else None
    decay, no_decay = [], []
    for p in raw_model.parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")
    micro = cfg.batch_size // (world_size * cfg.grad_accum)
    loader = BatchLoader(data_dir, "train", micro * cfg.grad_accum, rank=rank, world_size=world_size, seed=cfg.seed)
    gen_shared = torch.Generator(device=device).manual_seed(cfg.seed)                   # identical on every rank
    gen_local = torch.Generator(device=device).manual_seed(cfg.seed + 7919 * (rank + 1))  # curriculum noise
    it, n_ema = 0, 0
    if ckpt is not None:
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if ema is not None and ckpt.get("ema") is not None:
            for e, v in zip(ema, ckpt["ema"].values()):
                e.copy_(v)
        it, n_ema = ckpt["step"], ckpt.get("n_ema", ckpt["step"])
        loader.load_state_dict(ckpt["data_state"][rank] if isinstance(ckpt["data_state"], list)
                               else ckpt["data_state"])
        r = ckpt["rng"][rank] if isinstance(ckpt["rng"], list) else ckpt["rng"]
        torch.set_rng_state(r["torch"])
        if r["cuda"] is not None and device.type == "cuda":
            torch.cuda.set_rng_state(r["cuda"])
        gen_shared.set_state(r["gen_shared"])
        gen_local.set_state(r["gen_local"])
    model = torch.compile(raw_model) if cfg.compile else raw_model
    if ddp:
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)

    if master:
        print(json.dumps({"train_config": asdict(cfg), "model_config": asdict(mcfg)}, indent=1))
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump({"train_config": asdict(cfg), "model_config": asdict(mcfg), "meta": meta}, f, indent=1)
        print(f"model: {raw_model.num_params() / 1e6:.2f}M parameters "
              f"({raw_model.num_params(non_embedding=True) / 1e6:.2f}M non-embedding); "
              f"world {world_size} x micro-batch {micro} x accum {cfg.grad_accum} = {cfg.batch_size} sequences/step")

    def ema_state():
        if ema is None:
            return None
        return {k: e.detach().clone() for (k, _), e in zip(raw_model.named_parameters(), ema)}

    def gather(obj):
        if not ddp:
            return obj
        out = [None] * world_size
        dist.all_gather_object(out, obj)
        return out

    def checkpoint():
        states = gather(loader.state_dict()), gather(rng_state(device, gen_shared, gen_local))
        if master:
            save_checkpoint(ckpt_path, {
                "model": raw_model.state_dict(), "ema": ema_state(), "optimizer": optimizer.state_dict(),
                "model_config": asdict(mcfg), "train_config": asdict(cfg), "meta": meta, "step": it,
                "n_ema": n_ema, "data_state": states[0], "rng": states[1]})

    def swap_ema():
        """Exchange live and EMA weights (evaluate/sample with EMA, then swap back)."""
        if ema is not None:
            for p, e in zip(raw_model.parameters(), ema):
                tmp = p.detach().clone()
                p.data.copy_(e)
                e.copy_(tmp)

    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum

    old_handlers = signal.signal(signal.SIGINT, on_signal), signal.signal(signal.SIGTERM, on_signal)

    log_path = os.path.join(cfg.out_dir, "log.jsonl")
    bad = torch.zeros((), device=device, dtype=torch.bool)     # non-finite loss seen since the last check
    tokens_per_step = cfg.batch_size * cfg.block_size
    pbar = None
    if master:
        from tqdm import tqdm
        pbar = tqdm(total=cfg.max_iters, initial=it, desc=f"train {cfg.loss}", dynamic_ncols=True)
    t_last, it_last = time.time(), it
    loss_acc = torch.zeros((), device=device)
    while it < cfg.max_iters:
        lr = lr_at(it, cfg)
        for g in optimizer.param_groups:
            g["lr"] = lr
        t_global = diffusion.sample_t(cfg.batch_size, gen_shared, device=device)
        draws_global = draw_noise(cfg.batch_size, cfg.block_size, mcfg.vocab_size, gen_shared, device)
        x0_all, mask_all = loader.next_batch()
        for micro_step in range(cfg.grad_accum):
            x0 = x0_all[micro_step * micro:(micro_step + 1) * micro].to(device, non_blocking=True)
            mask = None if mask_all is None else mask_all[micro_step * micro:(micro_step + 1) * micro].to(device)
            t, *draws = (diffusion.rank_slice(v, rank, world_size, micro_step, cfg.grad_accum)
                         for v in (t_global, *draws_global))
            sync = nullcontext() if (not ddp or micro_step == cfg.grad_accum - 1) else model.no_sync()
            with sync:
                with autocast:
                    per_token, _ = loss_terms(model, cfg, x0, t, it, gen_local, draws)
                    m = None if mask is None else (mask[:, 1:] if cfg.loss == "ar" else mask)
                    loss = token_mean(per_token, m) / cfg.grad_accum
                loss.backward()
            loss_acc += loss.detach()
            bad |= ~torch.isfinite(loss.detach())
        n_ema = optimizer_step(raw_model, optimizer, ema, cfg, n_ema)
        it += 1

        last = it == cfg.max_iters
        save = it % cfg.ckpt_interval == 0 or last
        # the only host syncs; under DDP every rank takes this branch at the same steps (collectives inside)
        stopping = False
        if it % cfg.log_interval == 0 or save or (not ddp and stop["signal"] is not None):
            stopping = stop["signal"] is not None
            if ddp:
                dist.all_reduce(loss_acc)
                loss_acc /= world_size
                flags = torch.tensor([float(bad), float(stopping)], device=device)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
                bad.fill_(bool(flags[0]))
                stopping = bool(flags[1])                        # any rank signalled: all stop together
            if bool(bad):   # checked before any checkpoint is written, so the last one on disk is good
                raise FloatingPointError(f"non-finite loss by step {it} (lr {lr:.2e}); the last good checkpoint "
                                         f"{ckpt_path} is kept. Lower --lr or check the data.")
            steps_done = it - it_last
            mean_loss = loss_acc.item() / max(1, steps_done)
            loss_acc.zero_()
            dt = time.time() - t_last
            t_last, it_last = time.time(), it
            if master:
                pbar.update(steps_done)
                pbar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.1e}", tok_s=f"{tokens_per_step * steps_done / dt:,.0f}")
                with open(log_path, "a") as f:
                    f.write(json.dumps({"step": it, "loss": mean_loss, "lr": lr,
                                        "tokens_per_s": tokens_per_step * steps_done / dt}) + "\n")
        if it % cfg.eval_interval == 0 or last:
            swap_ema()
            metrics = evaluate(model if not ddp else raw_model, cfg, data_dir, device, autocast, micro)
            swap_ema()
            if master:
                pbar.write(f"step {it}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
                with open(log_path, "a") as f:
                    f.write(json.dumps({"step": it, **metrics}) + "\n")
            t_last = time.time()    # keep evaluation out of the tokens/s figure
        if save or stopping:
            checkpoint()
        if stopping:
            if master:
                pbar.close()
                print(f"stopped by signal {stop['signal'] or signal.SIGTERM} at step {it}; checkpoint saved to "
                      f"{ckpt_path} (continue with --resume 1)")
            if ddp:
                dist.destroy_process_group()
            signal.signal(signal.SIGINT, old_handlers[0]), signal.signal(signal.SIGTERM, old_handlers[1])
            return 130
    if master:
        pbar.close()
        if cfg.num_samples > 0:
            print_samples(raw_model, cfg, meta, device, swap_ema)
    if ddp:
        dist.destroy_process_group()
    signal.signal(signal.SIGINT, old_handlers[0]), signal.signal(signal.SIGTERM, old_handlers[1])
    return 0


def print_samples(raw_model, cfg, meta, device, swap_ema):
    """A few samples from the EMA weights with the ancestral sampler, so a newcomer sees text."""
    from sample import generate, generate_ar
    tok = get_tokenizer(meta["tokenizer"])
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    swap_ema()
    raw_model.eval()
    if cfg.loss == "ar":
        ids = generate_ar(raw_model, cfg.num_samples, cfg.block_size, bos_id=tok.bos_id, generator=gen)
    else:
        ids = generate(raw_model, cfg.num_samples, cfg.block_size, raw_model.config.vocab_size, cfg.sample_steps,
                       alpha_schedule=cfg.noise_schedule, generator=gen, device=device)
    swap_ema()
    for i, row in enumerate(ids.tolist()):
        print(f"--- sample {i} ({cfg.sample_steps} steps) ---\n{tok.decode(row)}")


if __name__ == "__main__":
    run_cli(main, DataError, FloatingPointError, FileNotFoundError)
