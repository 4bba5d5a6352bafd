"""
Train a uniform-state diffusion LM (or the AR baseline) with any of the objectives in losses.py.

    python train.py                                   # tiny preset on the built-in corpus, 2 CPU cores, minutes
    python train.py --loss sddlm_v1 --max_iters 2000
    torchrun --nproc_per_node=8 train.py --loss sddlm_v1   # the paper's recipe: --preset small, OpenWebText
    python train.py --out_dir out --resume 1          # continue exactly where a run stopped

Every field of TrainConfig is a CLI flag; --preset applies a dict of overrides first (TRAIN_PRESETS),
explicit flags win. Without --preset, a torchrun launch on CUDA trains the paper's recipe (FLAGSHIP_PRESET);
`python train.py` on one process trains the tiny offline demo. The run's full config is printed at start and
saved next to the checkpoint. On CUDA, fit_micro_batch checks at start that the micro-batch fits.
One training step (paper Algorithm 1): x0 ~ data, t ~ stratified U[1e-3, 1], xt ~ q_t(. | x0)
(or Duo's Gaussian curriculum), loss = per-token objective, token mean, AdamW, EMA.

The file reads top to bottom: the config; the objective (OBJECTIVES, corrupt, loss_terms); the parts of a run
(setup_distributed, prepare_data, open_out_dir, build_run, fit_micro_batch, train_step, evaluate, save /
restore); main.
"""
import json
import math
import os
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import diffusion
import losses
from cli import (OutOfMemory, UsageError, append_jsonl, autocast_for, check_writable, oom_summary, os_error_line,
                 parse_flags, remove_stale_temps, resolve_device, resolve_dtype, run_cli, save_atomic, write_json)
from data import BatchLoader, DataError, eval_batches, get_tokenizer, load_meta, prepare_dataset, prepared_dir
from eval_ppl import nelbo_ppl
from model import PRESETS, ModelConfig, build_model
from pretrained import export


@dataclass
class TrainConfig:
    preset: str = "tiny"             # tiny | owt (= small) | lm1b | medium | large (model + recipe), TRAIN_PRESETS
    loss: str = "sddlm"              # a key of OBJECTIVES: sddlm | sddlm_v1 | sddlm_v2 | naive | duo | duo_lean | ar
    eps: float = losses.EPS          # epsilon of SDDLM-V1/V2 in log(p + eps)
    # data
    dataset: str = "pydoc"           # pydoc (built in) | path to .txt file/folder | HF name (openwebtext, lm1b, ...)
    tokenizer: str = "sp_train:2048"  # gpt2 | sp:/path/tokenizer.model | hf:NAME | sp_train:VOCAB (train on corpus)
    data_dir: str = ""               # prepared memmaps; "" = data.prepared_dir(dataset, tokenizer, L, wrap)
    block_size: int = 128            # sequence length L
    vocab_size: int = 0              # model K; 0 = the tokenizer's (a larger K leaves unused output rows)
    vocab_multiple: int = 0          # pad the output layer to a multiple of this (masked rows); 0 = the model preset's
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
    auto_accum: bool = True          # CUDA: if the micro-batch does not fit, raise grad_accum until it does (0: stop)
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
    eval_iters: int = 8              # validation batches per evaluation, split over ranks; 0 = the whole split
    log_interval: int = 10
    ckpt_interval: int = 250
    keep_every: int = 0              # N > 0: also keep out_dir/ckpt_<step>.pt (weights + EMA, for evaluation) every N steps
    # sample quality during training (paper Figs. ppl_curve_lm1b, entropy_curve_lm1b): every gen_interval steps
    # and at the end, Gen PPL and entropy of gen_num_samples EMA samples -> log.jsonl. 0 = off
    gen_interval: int = 0
    gen_num_samples: int = 64        # split over ranks: rank r draws its share with seed gen_seed + r, every time
    gen_steps: int = 1000            # reverse steps of the ancestral sampler (final step ancestral)
    gen_seed: int = 0
    judge: str = "gpt2-large"        # the Gen PPL judge: a HF causal LM (needs transformers) | an AR ckpt.pt of this repo
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
# The paper's two small-model experiments: the Appendix hyperparameter table (AdamW 3e-4, linear decay, warm-up
# 2500, betas (0.9, 0.999), no weight decay, batch 512, 1M steps, EMA 0.9999) on Duo's data and curriculum, with
# the Gen PPL / entropy curves of its figures (GPT-2 Large judge, 1000 sampling steps) and kept checkpoints.
# `small` is the same OWT recipe without the judge (it needs transformers and the network).
PAPER_CURVES = dict(gen_interval=5000, gen_num_samples=64, gen_steps=1000, judge="gpt2-large", keep_every=100_000)
TRAIN_PRESETS["owt"] = {**TRAIN_PRESETS["small"], **PAPER_CURVES}
TRAIN_PRESETS["lm1b"] = {**TRAIN_PRESETS["small"], **PAPER_CURVES, "dataset": "lm1b",
                         "tokenizer": "hf:bert-base-uncased", "block_size": 128, "wrap": False,
                         "gamma_min": -3.5, "gamma_max": -1.75}
TRAIN_PRESETS.update({name: TRAIN_PRESETS["large"] for name in PRESETS if name.startswith("llama_")})  # SMDM ladder


class ConfigError(UsageError):
    """A bad flag or an incompatible run: reported as one line, exit code 2."""


# -----------------------------------------------------------------------------------------------
# config

def parse_config(argv=None):
    return parse_flags(TrainConfig, argv, __doc__.split("\n\n")[0], presets=TRAIN_PRESETS)


FLAGSHIP_PRESET = "small"
FLAGSHIP_NOTE = ("torchrun on CUDA without --preset: training the paper's recipe, --preset small (DiT-small, "
                 "OpenWebText, GPT-2 BPE, L = 1024, global batch 512, Duo's curriculum for 500K steps); "
                 "--preset tiny gives the offline demo")


def flagship_launch(argv, cfg):
    """True for a torchrun launch on CUDA without --preset: train.py then runs the paper's recipe."""
    given = any(a == "--preset" or a.startswith("--preset=") for a in argv)
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    return not given and torchrun and resolve_device(cfg.device).type == "cuda"


def validate(cfg, world_size):
    if cfg.loss not in OBJECTIVES:
        raise ConfigError(f"unknown --loss {cfg.loss!r}; choose from {', '.join(OBJECTIVES)}")
    if cfg.preset not in PRESETS:
        raise ConfigError(f"--preset {cfg.preset!r} has no model preset; choose from tiny, small, owt, lm1b, medium, large")
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
    for name in ("eval_interval", "log_interval", "ckpt_interval", "sample_steps"):   # eval_iters: 0 = all
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("warmup_iters", "curriculum_iters", "num_samples", "vocab_size", "vocab_multiple", "n_layer", "n_head",
                 "n_embd"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name} must be >= 0, got {getattr(cfg, name)}")
    for name, low, high, closed in [("lr", 0, math.inf, False), ("min_lr", 0, math.inf, True),
                                    ("eps", 0, math.inf, False), ("beta1", 0, 1, True), ("beta2", 0, 1, True),
                                    ("dropout", 0, 1, True), ("weight_decay", 0, math.inf, True),
                                    ("grad_clip", 0, math.inf, True)]:
        v = getattr(cfg, name)
        if not (low <= v if closed else low < v) or not v < high:
            raise ConfigError(f"--{name} must be in {'[' if closed else '('}{low}, {high}), got {v}")
    if cfg.curriculum_iters and not cfg.gamma_min < cfg.gamma_max:
        raise ConfigError(f"--gamma_min {cfg.gamma_min} must be below --gamma_max {cfg.gamma_max}")
    resolve_dtype(cfg.dtype, torch.device("cpu"))     # an unknown --dtype fails here, before any work
    model_config_for(cfg, 2)                          # an impossible model (e.g. n_embd % n_head) too


def model_config_for(cfg, vocab_size):
    if cfg.vocab_size and cfg.vocab_size < vocab_size:
        raise ConfigError(f"--vocab_size {cfg.vocab_size} is smaller than the tokenizer's vocabulary {vocab_size}")
    vocab_size = cfg.vocab_size or vocab_size
    base = dict(PRESETS[cfg.preset])
    base.update({k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd") if getattr(cfg, k)})
    base.update(vocab_size=vocab_size, block_size=cfg.block_size, dropout=cfg.dropout)
    if cfg.vocab_multiple:
        base.update(vocab_multiple=cfg.vocab_multiple)
    if cfg.loss == "ar":   # the AR baseline: causal attention, no time input
        base.update(causal=True, time_cond=False)
    try:
        return ModelConfig(**base)
    except ValueError as e:
        raise ConfigError(f"--n_layer/--n_head/--n_embd: {e}") from None


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
# the objective: corrupt x0, run the model, per-token losses

@dataclass
class Corrupted:
    """One corrupted batch: clean x0, noisy xt (B, L), the network input (xt, or the curriculum's soft
    (B, L, K) input), SDDLM-V1's negatives (B, L), alpha_t and its time derivative (B, 1)."""
    x0: torch.Tensor
    xt: torch.Tensor
    net_in: torch.Tensor
    neg: torch.Tensor
    alpha_t: torch.Tensor
    dalpha_t: torch.Tensor


# --loss -> per-token loss (B, L) of the model's output and the corrupted batch c: the one place a loss is chosen.
# The output is a losses.Head (the last hidden state and the output layer: the loss computes the logits chunk by
# chunk and never holds all of them), except for the objectives in FULL_LOGITS, which get the (B, L, V) logits.
OBJECTIVES = {
    "sddlm": lambda out, c, eps: losses.sddlm_loss(out, c.x0, c.xt),
    "sddlm_v1": lambda out, c, eps: losses.sddlm_v1_loss(out, c.x0, c.xt, neg=c.neg, eps=eps),
    "sddlm_v2": lambda out, c, eps: losses.sddlm_v2_loss(out, c.x0, c.xt, eps=eps),
    "naive": lambda out, c, eps: losses.naive_denoising_loss(out, c.x0),
    "duo": lambda out, c, eps: losses.usdm_nelbo_loss(out, c.x0, c.xt, c.alpha_t, c.dalpha_t),
    "duo_lean": lambda out, c, eps: losses.usdm_nelbo_loss_lean(out, c.x0, c.xt, c.alpha_t, c.dalpha_t),
    "ar": lambda out, c, eps: losses.ar_loss(out, c.x0),
}
FULL_LOGITS = {"duo"}   # Duo's NELBO computed as Duo does (the reference); duo_lean is the same, memory-lean


def draw_noise(batch, length, vocab_size, generator, device):
    """The random draws of one step for a whole (global) batch: keep-uniforms, replacement tokens and
    SDDLM-V1 negatives, each (batch, length). Drawn from a generator shared by all ranks and sliced per rank,
    so a DDP run corrupts every sequence exactly as a single-process run at the same global batch."""
    return (torch.rand(batch, length, generator=generator, device=device),
            torch.randint(0, vocab_size, (batch, length), generator=generator, device=device),
            torch.randint(0, vocab_size, (batch, length), generator=generator, device=device))


def corrupt(cfg, x0, t, it, vocab_size, generator, draws):
    """x0 (B, L) at times t (B,) -> Corrupted. draws: this micro-batch's slice of draw_noise. During Duo's
    curriculum (it < curriculum_iters) the input is the tempered softmax of a Gaussian latent (drawn from
    `generator`, per rank) and xt its argmax; afterwards Eq. (discrete_marginal) under cfg.noise_schedule."""
    if it < cfg.curriculum_iters:
        tau = diffusion.tau_schedule(it, cfg.log10_tau_start, cfg.log10_tau_end, 0, cfg.curriculum_iters)
        xt, net_in, alpha_t, dalpha_t = diffusion.curriculum_sample(
            x0, t, vocab_size, cfg.gamma_min, cfg.gamma_max, tau, generator)
    else:
        alpha_t, dalpha_t = diffusion.SCHEDULES[cfg.noise_schedule](t)
        alpha_t, dalpha_t = alpha_t.unsqueeze(-1), dalpha_t.unsqueeze(-1)
        xt = net_in = diffusion.sample_xt(x0, alpha_t, vocab_size, draws=draws[:2])
    return Corrupted(x0, xt, net_in, draws[2], alpha_t, dalpha_t)


def loss_terms(model, cfg, x0, t, it, generator, draws=None):
    """Per-token training loss (B, L) (B, L - 1 for 'ar') of clean x0 (B, L) at times t (B,), and the model's
    output (the logits (B, L, V), or a losses.Head, see OBJECTIVES). draws: this micro-batch's slice of
    draw_noise (else drawn from generator)."""
    V = unwrap(model).config.vocab_size
    if draws is None:
        draws = draw_noise(x0.shape[0], x0.shape[1], V, generator, x0.device)
    head = cfg.loss not in FULL_LOGITS
    if cfg.loss == "ar":
        c = Corrupted(x0, x0, x0, draws[2], None, None)
        out = model(x0, return_head=head)
    else:
        c = corrupt(cfg, x0, t, it, V, generator, draws)
        out = model(c.net_in, diffusion.sigma_from_alpha(c.alpha_t.squeeze(-1)), return_head=head)
    return OBJECTIVES[cfg.loss](out, c, cfg.eps), out


def unwrap(model):
    """The DiffusionTransformer inside a DDP and/or torch.compile wrapper."""
    model = model.module if isinstance(model, DDP) else model
    return getattr(model, "_orig_mod", model)


def token_mean(per_token, mask):
    if mask is None:
        return per_token.mean()
    return (per_token * mask).sum() / mask.sum().clamp_min(1)


# -----------------------------------------------------------------------------------------------
# the parts of a run

@dataclass
class Env:
    """Where this process runs: device and its place in a torchrun job."""
    device: torch.device
    ddp: bool = False
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def master(self):
        return self.rank == 0


def setup_distributed(cfg):
    """torchrun's environment -> Env (process group joined, CUDA device chosen), or a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(cfg.device)
    env = Env(device, ddp=world_size > 1, world_size=world_size)
    if env.ddp:
        env.rank, env.local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
        env.device = torch.device("cuda", env.local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return env


def prepare_data(cfg, env):
    """Tokenize the corpus once (rank 0) into token memmaps -> (absolute data_dir, meta). Under torchrun every
    rank learns rank 0's verdict and fails with the same one line, instead of hanging at a barrier."""
    data_dir = error = None
    if env.master:
        try:
            data_dir = os.path.abspath(cfg.data_dir or prepared_dir(cfg.dataset, cfg.tokenizer, cfg.block_size,
                                                                    cfg.wrap))
            prepare_dataset(cfg.dataset, cfg.tokenizer, data_dir, block_size=cfg.block_size, wrap=cfg.wrap)
        except DataError as e:
            error = str(e)
        except OSError as e:
            error = os_error_line(e)
    if env.ddp:
        box = [error, data_dir]
        dist.broadcast_object_list(box, src=0)
        error, data_dir = box
    if error:
        raise DataError(error)
    return data_dir, load_meta(data_dir)


def load_resume_checkpoint(cfg):
    """What train.py and distill.py share at start: out_dir writable and cleared of a killed save's temp file;
    a fresh run (cfg.resume false) refused where a checkpoint or an earlier run's log.jsonl exists -> None;
    a resume -> the checkpoint out_dir/ckpt.pt as read by torch.load (one line if missing or unreadable)."""
    check_writable(cfg.out_dir, "--out_dir", folder=True)
    os.makedirs(cfg.out_dir, exist_ok=True)
    path = os.path.join(cfg.out_dir, "ckpt.pt")
    remove_stale_temps(path)              # a save killed half-way (SIGKILL) leaves its temp file
    if not cfg.resume:
        if os.path.exists(path):
            raise ConfigError(f"{path} exists; pass --resume 1 to continue it or choose another --out_dir")
        if os.path.exists(os.path.join(cfg.out_dir, "log.jsonl")):
            raise ConfigError(f"{os.path.join(cfg.out_dir, 'log.jsonl')} holds the log of an earlier run that left no "
                              f"checkpoint; delete it or choose another --out_dir")
        return None
    if not os.path.exists(path):
        raise ConfigError(f"--resume: no checkpoint at {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"cannot resume from {path}: not a readable checkpoint ({type(e).__name__}: {first})"
                          ) from None


def open_out_dir(cfg, mcfg, meta=None):
    """The checkpoint to resume (None for a fresh run). A fresh run never overwrites an existing checkpoint nor
    mixes its log with an earlier run's; a resume must match the saved model, objective, batch, tokenizer (by
    content) and data (meta: this run's prepared data), and reach beyond the saved step. A refused run changes
    nothing in out_dir."""
    ckpt = load_resume_checkpoint(cfg)
    if ckpt is None:
        return None
    path = os.path.join(cfg.out_dir, "ckpt.pt")
    missing = [k for k in RESUME_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ConfigError(f"cannot resume from {path}: not a train.py checkpoint (missing {', '.join(missing)})")
    unknown = sorted(set(ckpt["model_config"]) - set(asdict(mcfg)))
    if unknown:
        raise ConfigError(f"cannot resume from {path}: its model_config has keys this model.py does not know: "
                          f"{', '.join(unknown)}")
    try:
        saved = asdict(ModelConfig(**ckpt["model_config"]))   # fields added since it was saved take their defaults
    except (TypeError, ValueError) as e:
        raise ConfigError(f"cannot resume from {path}: its model_config is invalid ({e})") from None
    if saved != asdict(mcfg):
        diff = {k: (saved.get(k), v) for k, v in asdict(mcfg).items() if saved.get(k) != v}
        raise ConfigError(f"cannot resume from {path}: model differs (saved, now) {diff}")
    old_meta = ckpt.get("meta") or {}
    by_content = meta is not None and old_meta.get("tokenizer_sha256") and meta.get("tokenizer_sha256")
    for k in ("loss", "batch_size") + (() if by_content else ("tokenizer",)):
        if ckpt["train_config"].get(k) != getattr(cfg, k):
            raise ConfigError(f"cannot resume from {path}: --{k} was {ckpt['train_config'].get(k)!r}, now "
                              f"{getattr(cfg, k)!r}")
    if by_content and old_meta["tokenizer_sha256"] != meta["tokenizer_sha256"]:
        raise ConfigError(f"cannot resume from {path}: the tokenizer's content differs from the checkpoint's (sha256 "
                          f"{old_meta['tokenizer_sha256'][:12]}..., now {meta['tokenizer_sha256'][:12]}...)")
    if meta is not None and old_meta.get("data_key") and old_meta["data_key"] != meta.get("data_key"):
        diff = [k for k, v in old_meta["data_key"].items() if (meta.get("data_key") or {}).get(k) != v]
        raise ConfigError(f"cannot resume from {path}: the training data differ from the checkpoint's "
                          f"({', '.join(diff)} changed); restore them or start a new run in another --out_dir")
    if cfg.max_iters < ckpt["step"]:
        raise ConfigError(f"--max_iters {cfg.max_iters} is below the checkpoint's step {ckpt['step']}; nothing to "
                          f"resume (raise --max_iters)")
    return ckpt


# what open_out_dir requires of a checkpoint it resumes (save writes them)
RESUME_KEYS = ("model", "optimizer", "model_config", "train_config", "step", "data_state", "rng")


@dataclass
class Run:
    """The state a training run carries from step to step (and saves in its checkpoint)."""
    raw_model: torch.nn.Module           # the DiffusionTransformer itself
    model: torch.nn.Module               # what the step calls: raw_model, compiled and/or DDP-wrapped
    optimizer: torch.optim.Optimizer
    ema: list                            # EMA copies of raw_model.parameters(), or None
    loader: BatchLoader                  # None in bench.py (random tokens)
    gen_shared: torch.Generator          # identical on every rank: times and corruption noise
    gen_local: torch.Generator           # per rank: the curriculum's Gaussian latent
    it: int = 0                          # optimizer steps done
    n_ema: int = 0                       # EMA updates done


def make_optimizer(raw_model, cfg, device):
    """AdamW (weight decay on matrices only) and the EMA copy of the weights (None when cfg.ema == 0)."""
    decay = [p for p in raw_model.parameters() if p.dim() >= 2]
    no_decay = [p for p in raw_model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")
    ema = [p.detach().clone() for p in raw_model.parameters()] if cfg.ema else None
    return optimizer, ema


def build_run(cfg, mcfg, env, data_dir=None):
    """Model (seeded per rank), optimizer, EMA, loader over data_dir (None: no loader) and generators."""
    torch.manual_seed(cfg.seed + env.rank)
    raw_model = build_model(mcfg).to(env.device)
    optimizer, ema = make_optimizer(raw_model, cfg, env.device)
    model = torch.compile(raw_model) if cfg.compile else raw_model
    if env.ddp:
        model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None,
                    broadcast_buffers=False)   # the only buffers are the RoPE tables, identical on every rank
    loader = None
    if data_dir is not None:
        micro = cfg.batch_size // (env.world_size * cfg.grad_accum)
        loader = BatchLoader(data_dir, "train", micro * cfg.grad_accum, rank=env.rank, world_size=env.world_size,
                             seed=cfg.seed)
    return Run(raw_model, model, optimizer, ema, loader,
               gen_shared=torch.Generator(device=env.device).manual_seed(cfg.seed),
               gen_local=torch.Generator(device=env.device).manual_seed(cfg.seed + 7919 * (env.rank + 1)))


def fit_micro_batch(run, cfg, env):
    """CUDA: make sure the micro-batch fits before training. One forward + backward of each kind of step the run
    will take (curriculum and/or plain) at its micro-batch, on random tokens, outside DDP, leaving weights,
    optimizer and every random state as they were. The verdict is shared by all ranks. If it does not fit,
    --auto_accum 1 doubles --grad_accum (halving the micro-batch) until it does; --auto_accum 0 stops with one
    line naming the micro-batch that fits and the flag to set. Updates cfg.grad_accum."""
    if env.device.type != "cuda":
        return
    accum, first = cfg.grad_accum, cfg.grad_accum
    while True:
        micro = cfg.batch_size // (env.world_size * accum)
        fits = _probe_fits(run, cfg, env, micro)
        if env.ddp:
            flag = torch.tensor([float(fits)], device=env.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            fits = bool(flag.item())
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


def train_step(run, cfg, env, x0_all, mask_all=None):
    """One optimizer step on this rank's part of a global batch x0_all (B_rank, L): times and noise for the
    global batch from gen_shared, then accumulate_step. -> the step's mean loss (a detached 0-dim tensor)."""
    t_global = diffusion.sample_t(cfg.batch_size, run.gen_shared, device=env.device)
    draws_global = draw_noise(cfg.batch_size, x0_all.shape[1], run.raw_model.config.vocab_size, run.gen_shared,
                              env.device)

    def per_token_loss(x0, mask, t, *draws):
        per_token, _ = loss_terms(run.model, cfg, x0, t, run.it, run.gen_local, draws)
        return per_token, None if mask is None else (mask[:, 1:] if cfg.loss == "ar" else mask)
    return accumulate_step(run, cfg, env, x0_all, mask_all, (t_global, *draws_global), per_token_loss)


def accumulate_step(run, cfg, env, x0_all, mask_all, draws_global, per_token_loss):
    """The optimizer step shared by train.py and distill.py: learning rate of step run.it; per micro-batch, this
    rank's slice of every global draw (diffusion.rank_slice, so a DDP run equals one process), forward under
    autocast via per_token_loss(x0, mask, *draws) -> (per-token loss, token weights or None), token mean and
    backward (DDP syncs gradients on the last micro-batch only); then optimizer_step. -> the step's mean loss
    (a detached 0-dim tensor: no host sync here)."""
    lr = lr_at(run.it, cfg)
    for g in run.optimizer.param_groups:
        g["lr"] = lr
    micro = x0_all.shape[0] // cfg.grad_accum
    total = torch.zeros((), device=env.device)
    for m in range(cfg.grad_accum):
        x0 = x0_all[m * micro:(m + 1) * micro].to(env.device, non_blocking=True)
        mask = None if mask_all is None else mask_all[m * micro:(m + 1) * micro].to(env.device)
        draws = [diffusion.rank_slice(v, env.rank, env.world_size, m, cfg.grad_accum) for v in draws_global]
        sync = nullcontext() if (not env.ddp or m == cfg.grad_accum - 1) else run.model.no_sync()
        with sync:
            with autocast_for(env.device, resolve_dtype(cfg.dtype, env.device)):
                per_token, weight = per_token_loss(x0, mask, *draws)
                loss = token_mean(per_token, weight) / cfg.grad_accum
            loss.backward()
        total += loss.detach()
    run.n_ema = optimizer_step(run.raw_model, run.optimizer, run.ema, cfg, run.n_ema)
    run.it += 1
    return total


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


@contextmanager
def ema_weights(run):
    """Evaluate or sample with the EMA weights: swap them into the model, and back on exit. A signal that
    interrupts evaluation or sampling waits for a swap to finish, so the weights are never left half-swapped."""
    def swap():
        if run.ema is not None:
            for p, e in zip(run.raw_model.parameters(), run.ema):
                tmp = p.detach().clone()
                p.data.copy_(e)
                e.copy_(tmp)
    swapped = False
    try:
        with deferred_signals():
            swap()
            swapped = True
        yield run.raw_model
    finally:
        if swapped:
            with deferred_signals():
                swap()


@torch.no_grad()
def evaluate(run, cfg, data_dir, env):
    """EMA weights on the first eval_iters validation batches (0: the whole split), batch i on rank
    i % world_size: the training objective's loss (curriculum off), and the NELBO perplexity of
    eval_ppl.nelbo_ppl (one draw per sequence, t stratified per batch, log-linear schedule; exact PPL for 'ar'),
    both with the same draws at every evaluation (seeded per rank), so runs are comparable. -> this rank's
    float64 sums (objective, its tokens, NELBO, its tokens); the caller adds them over ranks (val_metrics)."""
    micro = cfg.batch_size // (env.world_size * cfg.grad_accum)
    dtype = resolve_dtype(cfg.dtype, env.device)
    batches = lambda: eval_batches(data_dir, "val", micro, cfg.eval_iters or None, rank=env.rank,
                                   world_size=env.world_size, device=env.device)
    sums = torch.zeros(4, dtype=torch.float64)     # objective sum, its tokens, NELBO sum, its tokens
    with ema_weights(run) as model:
        model.eval()
        gen = torch.Generator(device=env.device).manual_seed(1234 + env.rank)
        for x0, mask in batches():
            t = diffusion.sample_t(x0.shape[0], gen, device=env.device)
            with autocast_for(env.device, dtype):
                per_token, _ = loss_terms(model, cfg, x0, t, cfg.curriculum_iters, gen)
            weight = None if mask is None else (mask[:, 1:] if cfg.loss == "ar" else mask)
            n = float(weight.sum()) if weight is not None else per_token.numel()
            sums[0] += float(token_mean(per_token, weight)) * n
            sums[1] += n
        if sums[1] > 0:      # a rank past the last batch contributes nothing
            nelbo = nelbo_ppl(model, batches(), model.config.vocab_size,
                              generator=torch.Generator(device=env.device).manual_seed(1234 + env.rank),
                              device=env.device, dtype=dtype, show_progress=False)
            sums[2:] = torch.tensor([nelbo["nll"] * nelbo["tokens"], nelbo["tokens"]], dtype=torch.float64)
        model.train()
    return sums


def val_metrics(sums, cfg, data_dir):
    """evaluate's sums, added over ranks -> the log.jsonl record."""
    if sums[1] == 0 or sums[3] == 0:
        raise DataError(f"{data_dir}: the validation split has no sequences of length {cfg.block_size}")
    nll = float(sums[2] / sums[3])
    return {"val_loss": float(sums[0] / sums[1]), "val_nelbo": nll, "val_ppl": math.exp(min(nll, 50)),
            "val_tokens": int(sums[3])}


def reduced_unless_stopped(stop, env, n, work):
    """Work a stop signal abandons (interruptible): work() -> this rank's float64 sums (n,), then ONE all-reduce of
    [interrupted, sums] that every rank joins, so a signal on any rank abandons the work on all of them and no
    collective is left waiting. -> the sums added over ranks, or None when any rank was interrupted."""
    sums, interrupted = torch.zeros(n, dtype=torch.float64), False
    try:
        with interruptible(stop):
            sums = work()
    except Interrupted:
        interrupted = True
    if env.ddp:
        both = torch.cat([torch.tensor([float(interrupted)], dtype=torch.float64), sums]).to(env.device)
        dist.all_reduce(both)
        interrupted, sums = bool(both[0] > 0), both[1:].cpu()
    return None if interrupted else sums


def check_experiment_flags(cfg):
    """The flags of kept checkpoints, full-split validation and sample quality during training."""
    if cfg.eval_iters < 0 or cfg.keep_every < 0 or cfg.gen_interval < 0:
        raise ConfigError("--eval_iters (0 = the whole split), --keep_every and --gen_interval (0 = off) must be >= 0")
    if cfg.gen_interval and (cfg.gen_num_samples < 1 or cfg.gen_steps < 1):
        raise ConfigError("--gen_interval needs --gen_num_samples >= 1 and --gen_steps >= 1")


def load_gen_judge(cfg, env):
    """The judge of sample_quality, or None when --gen_interval is 0. Loaded on every rank before the data are
    prepared, so a missing judge fails at once (eval_ppl.load_judge never substitutes another)."""
    if not cfg.gen_interval:
        return None
    from eval_ppl import load_judge
    return load_judge(cfg.judge, env.device)


@torch.no_grad()
def sample_quality(run, cfg, env, judge, tok):
    """Gen PPL and entropy of gen_num_samples samples from the EMA weights (paper Figs. ppl_curve_lm1b and
    entropy_curve_lm1b): the ancestral sampler with gen_steps steps and an ancestral final step (the AR baseline:
    its own sampler). Rank r draws samples r, r + W, ... with a generator seeded gen_seed + r, the same draws at
    every call, so a curve follows the model and not the sampling noise; each rank scores its share with the
    judge (eval_ppl.score_samples). -> this rank's float64 sums (NLL, scored tokens, entropy, samples); added over
    ranks (gen_metrics), they pool all samples exactly as one process would."""
    from eval_ppl import score_samples
    from sample import generate, generate_ar
    n = len(range(env.rank, cfg.gen_num_samples, env.world_size))
    gen = torch.Generator(device=env.device).manual_seed(cfg.gen_seed + env.rank)
    micro = cfg.batch_size // (env.world_size * cfg.grad_accum)
    dtype = resolve_dtype(cfg.dtype, env.device)
    sums = torch.zeros(4, dtype=torch.float64)      # NLL sum, scored tokens, entropy sum, samples
    if n:
        ids = []
        with ema_weights(run) as model:
            model.eval()
            for b in range(0, n, micro):
                m = min(micro, n - b)
                if cfg.loss == "ar":
                    ids += generate_ar(model, m, cfg.block_size, bos_id=tok.bos_id, generator=gen, device=env.device,
                                       dtype=dtype, show_progress=False).tolist()
                else:
                    ids += generate(model, m, cfg.block_size, model.config.vocab_size, cfg.gen_steps,
                                    alpha_schedule=cfg.noise_schedule, final_step="ancestral", generator=gen,
                                    device=env.device, dtype=dtype, show_progress=False).tolist()
            model.train()
        r = score_samples(ids, [tok.decode(row) for row in ids], tok, judge, micro, env.device, label=cfg.out_dir,
                          steps=cfg.gen_steps, show_progress=False)
        sums = torch.tensor([r["nll"] * r["tokens"], r["tokens"], r["entropy"] * n, n], dtype=torch.float64)
    return sums


def gen_metrics(sums, cfg, judge):
    """sample_quality's sums, added over ranks -> the log.jsonl record, naming the judge and sampler settings."""
    nll = float(sums[0] / sums[1])
    return {"gen_ppl": math.exp(min(nll, 700.0)), "gen_nll": nll, "gen_entropy": float(sums[2] / sums[3]),
            "gen_samples": int(sums[3]), "gen_steps": None if cfg.loss == "ar" else cfg.gen_steps,
            "gen_sampler": "ar" if cfg.loss == "ar" else "ancestral, final step ancestral",
            "gen_seed": cfg.gen_seed, "gen_judge": judge.name}


def keep_checkpoint(run, cfg, mcfg, meta):
    """out_dir/ckpt_<step>.pt, written atomically: the weights, EMA weights, configs and step of this moment
    (no optimizer or RNG state: for eval_ppl.py / sample.py, not for --resume), so that any curve over
    training can be recomputed after the run."""
    ema = None if run.ema is None else {k: e.detach().clone()
                                        for (k, _), e in zip(run.raw_model.named_parameters(), run.ema)}
    state = {"model": run.raw_model.state_dict(), "ema": ema, "model_config": asdict(mcfg),
             "train_config": asdict(cfg), "meta": meta, "step": run.it, "n_ema": run.n_ema}
    save_atomic(os.path.join(cfg.out_dir, f"ckpt_{run.it}.pt"), lambda tmp: torch.save(state, tmp))


def save(run, cfg, mcfg, meta, env, extra=None):
    """Write out_dir/ckpt.pt atomically: weights, EMA, optimizer, configs, step, and every rank's data
    position and RNG states (gathered to rank 0), so --resume 1 continues bit-identically. extra: more
    top-level entries (distill.py records its settings and teacher there), added last."""
    rng = {"torch": torch.get_rng_state(), "gen_shared": run.gen_shared.get_state(),
           "gen_local": run.gen_local.get_state(),
           "cuda": torch.cuda.get_rng_state() if env.device.type == "cuda" else None}
    states = [run.loader.state_dict(), rng]
    if env.ddp:
        gathered = []
        for obj in states:
            out = [None] * env.world_size
            dist.all_gather_object(out, obj)
            gathered.append(out)
        states = gathered
    if not env.master:
        return
    ema = None if run.ema is None else {k: e.detach().clone()
                                        for (k, _), e in zip(run.raw_model.named_parameters(), run.ema)}
    state = {"model": run.raw_model.state_dict(), "ema": ema, "optimizer": run.optimizer.state_dict(),
             "model_config": asdict(mcfg), "train_config": asdict(cfg), "meta": meta, "step": run.it,
             "n_ema": run.n_ema, "data_state": states[0], "rng": states[1], **(extra or {})}
    save_atomic(os.path.join(cfg.out_dir, "ckpt.pt"), lambda tmp: torch.save(state, tmp))


def restore(run, ckpt, env):
    """Load a checkpoint written by save into the run (this rank's data position and RNG states). A checkpoint
    whose state does not load -> ConfigError (one line)."""
    try:
        _restore(run, ckpt, env)
    except DataError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"cannot resume: the checkpoint's state does not load ({type(e).__name__}: {first})"
                          ) from None


def _restore(run, ckpt, env):
    run.raw_model.load_state_dict(ckpt["model"])
    run.optimizer.load_state_dict(ckpt["optimizer"])
    if run.ema is not None and ckpt.get("ema") is not None:
        for e, v in zip(run.ema, ckpt["ema"].values()):
            e.copy_(v)
    run.it, run.n_ema = ckpt["step"], ckpt.get("n_ema", ckpt["step"])
    per_rank = lambda v: v[env.rank] if isinstance(v, list) else v
    run.loader.load_state_dict(per_rank(ckpt["data_state"]))
    r = per_rank(ckpt["rng"])
    torch.set_rng_state(r["torch"])
    if r["cuda"] is not None and env.device.type == "cuda":
        torch.cuda.set_rng_state(r["cuda"])
    run.gen_shared.set_state(r["gen_shared"])
    run.gen_local.set_state(r["gen_local"])


@contextmanager
def deferred_signals():
    """SIGINT / SIGTERM wait until the block is done (delivered, and handled, right after it)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Interrupted(KeyboardInterrupt):
    """A stop signal inside `interruptible`: evaluation or sampling ends at once."""


@contextmanager
def stop_signals():
    """SIGINT / SIGTERM set a flag (the loop saves and exits at the next step) instead of killing the process;
    inside `interruptible(stop)` they raise Interrupted at once."""
    stop = {"signal": None, "raise": False}

    def handler(signum, frame):
        stop["signal"] = signum
        if stop["raise"]:
            raise Interrupted(signum)
    old = signal.signal(signal.SIGINT, handler), signal.signal(signal.SIGTERM, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, old[0]), signal.signal(signal.SIGTERM, old[1])


@contextmanager
def interruptible(stop):
    """Work that a stop signal abandons (evaluation, sampling), rather than finishing it first: raises
    Interrupted on a signal received before or during it."""
    try:
        stop["raise"] = True
        if stop["signal"] is not None:
            raise Interrupted(stop["signal"])
        yield
    finally:
        stop["raise"] = False


def any_rank(env, flag):
    """True on every rank when `flag` is true on any (a collective: every rank must call it)."""
    if not env.ddp:
        return bool(flag)
    t = torch.tensor(float(flag), device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def agree(env, loss_sum, bad, stopping):
    """The only host sync of the loop: under DDP every rank reaches it at the same steps, averages the loss
    and learns whether ANY rank saw a non-finite loss or a signal. -> (loss_sum, bad, stopping) as Python values."""
    if env.ddp:
        dist.all_reduce(loss_sum)
        loss_sum /= env.world_size
        flags = torch.tensor([float(bad), float(stopping)], device=env.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad, stopping = flags[0], flags[1]
    return loss_sum.item(), bool(bad), bool(stopping)


# -----------------------------------------------------------------------------------------------

def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_config(argv)
    flagship = flagship_launch(argv, cfg)
    if flagship:
        cfg = parse_config(["--preset", FLAGSHIP_PRESET, *argv])

    def work(env):
        if flagship and env.master:
            print(FLAGSHIP_NOTE, flush=True)
        return train(cfg, env)
    return run_distributed(cfg, work)


def run_distributed(cfg, work):
    """work(env) in this process's place of a torchrun job (setup_distributed), the process group torn down
    after it. Out of memory -> one line naming the micro-batch and the flag that halves it; the checkpoint on
    disk is kept. Shared by train.py and distill.py."""
    env = setup_distributed(cfg)
    try:
        return work(env)
    except torch.OutOfMemoryError as e:
        micro = cfg.batch_size // (env.world_size * cfg.grad_accum)
        fix = (f"set --grad_accum {2 * cfg.grad_accum} (micro-batch {micro // 2})" if micro > 1 and
               cfg.batch_size % (2 * env.world_size * cfg.grad_accum) == 0 else
               "lower --batch_size, --block_size or the model size")
        raise OutOfMemory(f"out of memory at micro-batch {micro} (--batch_size {cfg.batch_size} / {env.world_size} "
                          f"rank(s) / --grad_accum {cfg.grad_accum}): {oom_summary(e)}; {fix}; the last checkpoint "
                          f"in {cfg.out_dir} is kept") from None
    finally:
        if env.ddp and dist.is_initialized():
            dist.destroy_process_group()


def train(cfg, env):
    validate(cfg, env.world_size)
    check_experiment_flags(cfg)
    judge = load_gen_judge(cfg, env)
    data_dir, meta = prepare_data(cfg, env)
    cfg.data_dir = data_dir              # absolute: a checkpoint finds its data from any working directory
    mcfg = model_config_for(cfg, meta["vocab_size"])
    ckpt = open_out_dir(cfg, mcfg, meta)
    if ckpt is not None and ckpt["step"] == cfg.max_iters:   # nothing written, config.json untouched
        if env.master:
            print(f"{os.path.join(cfg.out_dir, 'ckpt.pt')} is already at step {cfg.max_iters} = --max_iters; nothing "
                  f"to do (raise --max_iters to train on)")
        return 0
    run = build_run(cfg, mcfg, env, data_dir)
    if ckpt is not None:
        restore(run, ckpt, env)
    fit_micro_batch(run, cfg, env)
    quality = None if judge is None else (judge, get_tokenizer(meta["tokenizer"]))
    log = Log(cfg, env, run.it)
    if env.master:
        print(json.dumps({"train_config": asdict(cfg), "model_config": asdict(mcfg)}, indent=1))
        write_json(os.path.join(cfg.out_dir, "config.json"),
                   {"train_config": asdict(cfg), "model_config": asdict(mcfg), "meta": meta})
        print(f"model: {run.raw_model.num_params() / 1e6:.2f}M parameters "
              f"({run.raw_model.num_params(non_embedding=True) / 1e6:.2f}M non-embedding); world {env.world_size} x "
              f"micro-batch {cfg.batch_size // (env.world_size * cfg.grad_accum)} x accum {cfg.grad_accum} = "
              f"{cfg.batch_size} sequences/step")
    bad = torch.zeros((), device=env.device, dtype=torch.bool)   # a non-finite loss since the last check
    loss_sum = torch.zeros((), device=env.device)
    with stop_signals() as stop, log:
        while run.it < cfg.max_iters:
            loss = train_step(run, cfg, env, *run.loader.next_batch())
            loss_sum += loss
            bad |= ~torch.isfinite(loss)
            last, save_now = run.it == cfg.max_iters, run.it % cfg.ckpt_interval == 0
            stopping = False
            if run.it % cfg.log_interval == 0 or save_now or last or (not env.ddp and stop["signal"] is not None):
                mean, is_bad, stopping = agree(env, loss_sum, bad, stop["signal"] is not None)
                if is_bad:   # checked before any checkpoint is written, so the last one on disk is good
                    raise FloatingPointError(f"non-finite loss by step {run.it} (lr {lr_at(run.it - 1, cfg):.2e}); "
                                             f"the last good checkpoint in {cfg.out_dir} is kept. Lower --lr or "
                                             f"check the data.")
                log.progress(run.it, mean, lr_at(run.it - 1, cfg))
                loss_sum.zero_()
            if (run.it % cfg.eval_interval == 0 or last) and not stopping:
                sums = reduced_unless_stopped(stop, env, 4, lambda: evaluate(run, cfg, data_dir, env))
                if sums is not None:
                    log.metrics(run.it, val_metrics(sums, cfg, data_dir))
                stopping = any_rank(env, stop["signal"] is not None)
            if quality is not None and (run.it % cfg.gen_interval == 0 or last) and not stopping:
                sums = reduced_unless_stopped(stop, env, 4, lambda: sample_quality(run, cfg, env, *quality))
                if sums is not None:
                    log.metrics(run.it, gen_metrics(sums, cfg, quality[0]))
                stopping = any_rank(env, stop["signal"] is not None)
            if save_now or last or stopping:
                save(run, cfg, mcfg, meta, env)
            if cfg.keep_every and run.it % cfg.keep_every == 0 and env.master:
                keep_checkpoint(run, cfg, mcfg, meta)
            if stopping:
                log.close(f"stopped by signal {stop['signal'] or signal.SIGTERM} at step {run.it}; checkpoint saved "
                          f"to {os.path.join(cfg.out_dir, 'ckpt.pt')} "
                          + ("(training finished)" if last else "(continue with --resume 1)"))
                return 130
        log.close()
        if env.master:                                 # the shareable model: out_dir/model (pretrained.py)
            export(os.path.join(cfg.out_dir, "ckpt.pt"), os.path.join(cfg.out_dir, "model"))
        try:
            with interruptible(stop):                  # also a signal during the final save
                if env.master and cfg.num_samples > 0:
                    print_samples(run, cfg, meta, env)
        except Interrupted:
            if env.master:
                print(f"stopped by signal {stop['signal']} after training; checkpoint of step {run.it} saved to "
                      f"{os.path.join(cfg.out_dir, 'ckpt.pt')}")
            return 130
    return 0


class Log:
    """Rank 0's progress bar and out_dir/log.jsonl: training loss and tokens/s at log steps, validation metrics."""

    def __init__(self, cfg, env, step):
        self.path, self.master = os.path.join(cfg.out_dir, "log.jsonl"), env.master
        self.tokens_per_step, self.loss_name = cfg.batch_size * cfg.block_size, cfg.loss
        self.t_last, self.step_last = time.time(), step
        self.pbar = None
        if self.master:
            if cfg.resume:
                truncate_log(self.path, step)
            from tqdm import tqdm
            self.pbar = tqdm(total=cfg.max_iters, initial=step, desc=f"train {cfg.loss}", dynamic_ncols=True)

    def _write(self, record):
        append_jsonl(self.path, [record])

    def progress(self, step, loss_sum, lr):
        steps, dt = step - self.step_last, time.time() - self.t_last
        self.t_last, self.step_last = time.time(), step
        if self.master:
            tok_s = self.tokens_per_step * steps / dt
            self.pbar.update(steps)
            self.pbar.set_postfix(loss=f"{loss_sum / max(1, steps):.4f}", lr=f"{lr:.1e}", tok_s=f"{tok_s:,.0f}")
            self._write({"step": step, "loss": loss_sum / max(1, steps), "lr": lr, "tokens_per_s": tok_s})

    def metrics(self, step, metrics):
        if self.master:
            self.pbar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                         for k, v in metrics.items()))
            self._write({"step": step, **metrics})
        self.t_last = time.time()    # keep evaluation out of the tokens/s figure

    def close(self, message=None):
        if self.master:
            self.pbar.close()
            if message:
                print(message)

    def __enter__(self):
        return self

    def __exit__(self, *exc):   # an error ends the bar's line, so its one-line message starts a line of its own
        if self.master:
            self.pbar.close()


def truncate_log(path, step):
    """Keep the lines of log.jsonl up to `step`, the checkpoint's: a resumed run logs the later steps again.
    A torn last line (a kill mid-write) goes too; lines that are not JSON elsewhere are kept as they are."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    keep = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            if i < len(lines) - 1:
                keep.append(line)
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int) or record["step"] <= step:
            keep.append(line if line.endswith("\n") else line + "\n")
    if keep != lines:
        def write(tmp):
            with open(tmp, "w") as f:
                f.writelines(keep)
        save_atomic(path, write)


def print_samples(run, cfg, meta, env):
    """A few samples from the EMA weights with the ancestral sampler, so a newcomer sees text."""
    from sample import generate, generate_ar
    tok = get_tokenizer(meta["tokenizer"])
    gen = torch.Generator(device=env.device).manual_seed(cfg.seed)
    with ema_weights(run) as model:
        model.eval()
        if cfg.loss == "ar":
            ids = generate_ar(model, cfg.num_samples, cfg.block_size, bos_id=tok.bos_id, generator=gen)
        else:
            ids = generate(model, cfg.num_samples, cfg.block_size, model.config.vocab_size, cfg.sample_steps,
                           alpha_schedule=cfg.noise_schedule, generator=gen, device=env.device)
        model.train()
    for i, row in enumerate(ids.tolist()):
        print(f"--- sample {i} ({cfg.sample_steps} steps) ---\n{tok.decode(row)}")


if __name__ == "__main__":
    run_cli(main, DataError, FloatingPointError, FileNotFoundError,
            oom_hint="lower the micro-batch: raise --grad_accum (or lower --batch_size)")
