"""What a training script's flags may hold, checked once at start-up, before out_dir is locked or made. Each bad
value is one line naming the flag and the values it takes (exit code 2)."""
import math

import torch

from plumbing.cli import ConfigError, resolve_dtype
from plumbing.distributed import compiles
from plumbing.files import refuse_overwrite, run_outputs
from plumbing.tracking import require_trackers

# (field, low, high, low included): the optimisation's ranges, every run's
OPTIM_RANGES = [("lr", 0, math.inf, False), ("min_lr", 0, math.inf, True), ("beta1", 0, 1, True),
                ("beta2", 0, 1, True), ("weight_decay", 0, math.inf, True), ("diverge_margin", 0, math.inf, True),
                ("grad_clip", 0, math.inf, True)]


def check_run_flags(cfg, world_size, inputs, choices, ranges=()):
    """A training run's flags (train.OptimConfig's fields and the script's own) -> ConfigError naming the flag and
    what it accepts. inputs: {flag: path}, which no output may overwrite; choices: {field: the names it takes};
    ranges: the script's (field, low, high, low included), beside OPTIM_RANGES."""
    refuse_overwrite({"--out_dir": run_outputs(cfg.out_dir)}, inputs)
    require_trackers(cfg)
    if not cfg.out_dir.strip():
        raise ConfigError("--out_dir is empty; name the folder for the checkpoint and log, e.g. --out_dir out")
    for name, allowed in {"lr_schedule": ("constant", "linear", "cosine"), **choices}.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"unknown --{name} {getattr(cfg, name)!r}; choose from {', '.join(allowed)}")
    for name in ("max_iters", "batch_size", "grad_accum", "eval_interval", "log_interval", "ckpt_interval",
                 "sample_steps"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.batch_size % (world_size * cfg.grad_accum):
        raise ConfigError(f"--batch_size {cfg.batch_size} is not divisible by {world_size} ranks x "
                          f"--grad_accum {cfg.grad_accum}")
    if not 0 <= cfg.ema < 1:
        raise ConfigError("--ema must be in [0, 1)")
    for name in ("warmup_iters", "num_samples"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name} must be >= 0, got {getattr(cfg, name)}")
    if cfg.eval_iters < 0:
        raise ConfigError(f"--eval_iters (0 = the whole split) must be >= 0, got {cfg.eval_iters}")
    for name, low, high, closed in [*OPTIM_RANGES, *ranges]:
        v = getattr(cfg, name)
        if not (low <= v if closed else low < v) or not v < high:
            raise ConfigError(f"--{name} must be in {'[' if closed else '('}{low}, {high}), got {v}")
    if cfg.min_lr > cfg.lr:
        raise ConfigError(f"--min_lr {cfg.min_lr} is above --lr {cfg.lr}: the schedule decays from --lr to --min_lr")
    if not 0 < cfg.sample_top_p <= 1:
        raise ConfigError(f"--sample_top_p must be in (0, 1] (1 = off), got {cfg.sample_top_p}")
    resolve_dtype(cfg.dtype, torch.device("cpu"))     # an unknown --dtype fails here, before any work
    compiles(cfg.compile, cfg.preset, torch.device("cpu"))   # --compile: auto, 1 or 0


def check_train_flags(cfg, world_size, choices, ranges):
    """train.py's flags (train.TrainConfig) at start-up: every run's (with train.py's choices and ranges), its data
    preparation's and its own -> ConfigError naming the flag and what it accepts. The model's shape and size are
    train.check_start's next check."""
    inputs = {"--dataset": cfg.dataset, "--data_dir": cfg.data_dir, "--tokenizer": cfg.tokenizer, "--judge": cfg.judge,
              "--init": cfg.init}
    check_run_flags(cfg, world_size, inputs, choices, ranges)
    if cfg.init and cfg.resume:
        raise ConfigError("--init starts a new run from a trained model and --resume 1 continues out_dir's checkpoint "
                          "(a fine-tuning run's records its start): drop --init to resume, or --resume to start anew")
    if cfg.block_size < 2:
        raise ConfigError(f"--block_size must be >= 2, got {cfg.block_size}")
    if not 0 <= cfg.curriculum_share <= 1:          # before curriculum_iters, which a share given sets
        raise ConfigError(f"--curriculum_share must be in [0, 1], got {cfg.curriculum_share}")
    for name in ("curriculum_iters", "vocab_size", "vocab_multiple", "n_layer", "n_head", "n_embd", "keep_every",
                 "gen_interval"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name} must be >= 0, got {getattr(cfg, name)}")
    if cfg.gen_interval and (cfg.gen_num_samples < 1 or cfg.gen_steps < 1):
        raise ConfigError("--gen_interval needs --gen_num_samples >= 1 and --gen_steps >= 1")
    if cfg.curriculum_iters and not cfg.gamma_min < cfg.gamma_max:
        raise ConfigError(f"--gamma_min {cfg.gamma_min} must be below --gamma_max {cfg.gamma_max}")
    check_prepare_flags(cfg.num_proc)


def check_prepare_flags(num_proc, val_fraction=0.05):
    """prepare.py's and train.py's preparation flags, before any work."""
    if num_proc < 0:                        # more than the cores is capped when preparing (worker_count)
        raise ConfigError(f"--num_proc must be >= 0 (0 = the usable cores), got {num_proc}")
    if not 0 < val_fraction < 1:
        raise ConfigError(f"--val_fraction must be between 0 and 1 (a share of the characters), got {val_fraction}")
