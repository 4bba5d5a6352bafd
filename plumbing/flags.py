"""What train.py's flags may hold (and prepare.py's, which train.py shares), checked once at start-up, before out_dir
is locked or made: each bad value is one line naming the flag and the values it takes (exit code 2)."""
import math

import torch

import diffusion
from curriculum.gaussian import GAMMA_LIMIT
from diffusion import OBJECTIVES
from kernels.fused_head import HEADS
from model import PRESETS
from plumbing.cli import ConfigError, resolve_dtype
from plumbing.distributed import compiles
from plumbing.files import refuse_overwrite, run_outputs
from plumbing.tracking import require_trackers


def check_train_flags(cfg, world_size):
    """train.py's flags (train.TrainConfig) at start-up, each against the values it may take (world_size: the
    torchrun job's ranks), its data preparation's among them (check_prepare_flags), and no output of the run over
    one of its inputs -> ConfigError (UsageError) naming the flag and what it accepts. The model's shape and size
    are plumbing.run.launch_training's next check."""
    refuse_overwrite({"--out_dir": run_outputs(cfg.out_dir)}, {"--dataset": cfg.dataset, "--data_dir": cfg.data_dir,
                                                               "--tokenizer": cfg.tokenizer, "--judge": cfg.judge,
                                                               "--init": cfg.init})
    require_trackers(cfg)
    if not cfg.out_dir.strip():
        raise ConfigError("--out_dir is empty; name the folder for the checkpoint and log, e.g. --out_dir out")
    if cfg.init and cfg.resume:
        raise ConfigError("--init starts a new run from a trained model and --resume 1 continues out_dir's checkpoint "
                          "(a fine-tuning run's records its start): drop --init to resume, or --resume to start anew")
    if cfg.loss not in OBJECTIVES:
        raise ConfigError(f"unknown --loss {cfg.loss!r}; choose from {', '.join(OBJECTIVES)}")
    if cfg.preset not in PRESETS:
        raise ConfigError(f"--preset {cfg.preset!r} has no model preset; choose from tiny, small, owt, lm1b, medium, "
                          f"large")
    if cfg.head not in HEADS:
        raise ConfigError(f"unknown --head {cfg.head!r}; choose from {', '.join(HEADS)}")
    if cfg.lr_schedule not in ("constant", "linear", "cosine"):
        raise ConfigError(f"unknown --lr_schedule {cfg.lr_schedule!r}; choose from constant, linear, cosine")
    if cfg.noise_schedule not in diffusion.SCHEDULES:
        raise ConfigError(f"unknown --noise_schedule {cfg.noise_schedule!r}; choose from "
                          f"{', '.join(diffusion.SCHEDULES)}")
    if cfg.max_iters < 1 or cfg.batch_size < 1 or cfg.grad_accum < 1 or cfg.block_size < 2:
        raise ConfigError("--max_iters, --batch_size, --grad_accum must be >= 1 and --block_size >= 2")
    if cfg.batch_size % (world_size * cfg.grad_accum):
        raise ConfigError(f"--batch_size {cfg.batch_size} is not divisible by {world_size} ranks x "
                          f"--grad_accum {cfg.grad_accum}")
    if OBJECTIVES[cfg.loss].causal and cfg.curriculum_iters:
        raise ConfigError("--curriculum_iters applies to diffusion losses, not --loss ar")
    if not 0 <= cfg.ema < 1:
        raise ConfigError("--ema must be in [0, 1)")
    for name in ("eval_interval", "log_interval", "ckpt_interval", "sample_steps"):   # eval_iters: 0 = all
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name} must be >= 1, got {getattr(cfg, name)}")
    if not 0 <= cfg.curriculum_share <= 1:          # before curriculum_iters, which a share given sets
        raise ConfigError(f"--curriculum_share must be in [0, 1], got {cfg.curriculum_share}")
    for name in ("warmup_iters", "curriculum_iters", "num_samples", "vocab_size", "vocab_multiple", "n_layer", "n_head",
                 "n_embd"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name} must be >= 0, got {getattr(cfg, name)}")
    # eps >= 1 leaves log(p + eps) within log 2 of a constant: nothing to learn. The curriculum's alpha table
    # (curriculum.gaussian) is accurate for |gamma| <= GAMMA_LIMIT; tau = 10^x beyond [1e-30, 1e3) overflows its
    # softmax or makes its input uniform.
    for name, low, high, closed in [("lr", 0, math.inf, False), ("min_lr", 0, math.inf, True), ("eps", 0, 1, False),
                                    ("beta1", 0, 1, True), ("beta2", 0, 1, True), ("dropout", 0, 1, True),
                                    ("weight_decay", 0, math.inf, True), ("diverge_margin", 0, math.inf, True),
                                    ("grad_clip", 0, math.inf, True), ("gamma_min", -GAMMA_LIMIT, GAMMA_LIMIT, True),
                                    ("gamma_max", -GAMMA_LIMIT, GAMMA_LIMIT, True), ("log10_tau_start", -30, 3, True),
                                    ("log10_tau_end", -30, 3, True)]:
        v = getattr(cfg, name)
        if not (low <= v if closed else low < v) or not v < high:
            raise ConfigError(f"--{name} must be in {'[' if closed else '('}{low}, {high}), got {v}")
    if cfg.min_lr > cfg.lr:
        raise ConfigError(f"--min_lr {cfg.min_lr} is above --lr {cfg.lr}: the schedule decays from --lr to --min_lr")
    if not 0 < cfg.sample_top_p <= 1:
        raise ConfigError(f"--sample_top_p must be in (0, 1] (1 = off), got {cfg.sample_top_p}")
    if cfg.eval_iters < 0 or cfg.keep_every < 0 or cfg.gen_interval < 0:
        raise ConfigError("--eval_iters (0 = the whole split), --keep_every and --gen_interval (0 = off) must be >= 0")
    if cfg.gen_interval and (cfg.gen_num_samples < 1 or cfg.gen_steps < 1):
        raise ConfigError("--gen_interval needs --gen_num_samples >= 1 and --gen_steps >= 1")
    if cfg.curriculum_iters and not cfg.gamma_min < cfg.gamma_max:
        raise ConfigError(f"--gamma_min {cfg.gamma_min} must be below --gamma_max {cfg.gamma_max}")
    resolve_dtype(cfg.dtype, torch.device("cpu"))     # an unknown --dtype fails here, before any work
    compiles(cfg.compile, cfg.preset, torch.device("cpu"))   # --compile: auto, 1 or 0
    check_prepare_flags(cfg.num_proc)


def check_prepare_flags(num_proc, val_fraction=0.05):
    """prepare.py's and train.py's preparation flags, before any work."""
    if num_proc < 0:                        # more than the cores is capped when preparing (worker_count)
        raise ConfigError(f"--num_proc must be >= 0 (0 = the usable cores), got {num_proc}")
    if not 0 < val_fraction < 1:
        raise ConfigError(f"--val_fraction must be between 0 and 1 (a share of the characters), got {val_fraction}")
