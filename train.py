"""
Train a uniform-state diffusion LM (or the AR baseline) with any of the objectives in losses.py.

    python train.py                                   # tiny preset on the built-in corpus, 2 CPU cores, minutes
    python train.py --loss sddlm_v1 --max_iters 2000
    torchrun --nproc_per_node=8 train.py --loss sddlm_v1   # the paper's recipe: --preset small, OpenWebText
    python train.py --out_dir out --resume 1          # continue exactly where a run stopped

Every field of TrainConfig is a CLI flag (`--help` describes them: the comment on each field's line); --preset
applies a dict of overrides first (TRAIN_PRESETS), explicit flags win. Without --preset, a torchrun launch on CUDA
trains the paper's recipe (FLAGSHIP_PRESET); `python train.py` on one process trains the tiny offline demo. A short
summary is printed at start, the full config saved next to the checkpoint (config.json). On CUDA, plumbing.memory.fit_micro_batch checks at start that the micro-batch fits.
One training step (paper Algorithm 1, objective.py): x0 ~ data, t ~ stratified U[1e-3, 1], xt ~ q_t(. | x0)
(or Duo's Gaussian curriculum), loss = per-token objective, token mean, AdamW, EMA.
The file reads top to bottom: the config; the step; evaluation; the run and its loop (guarded_loop, shared
with distillation/distill.py), where ranks, signals, checkpoints, the memory probe and the log are one call each (plumbing/).
"""
from plumbing import cli  # first: a stop signal while the imports below load is one line, exit 130
cli.stop_at_once(__name__)

import math
import os
import signal
import sys
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import diffusion
import losses
from plumbing.cli import ConfigError, autocast_for, parse_flags, resolve_device, resolve_dtype, run_cli
from data import BatchLoader, DataError, get_tokenizer
from eval_ppl import evaluate, gen_metrics, load_gen_judge, sample_quality, val_metrics
from model import PRESETS, ModelConfig, build_model
from kernels.fused_head import HEADS
from diffusion import (FULL_LOGITS, OBJECTIVES, Corrupted, corrupt, draw_noise, loss_terms,  # noqa: F401
                       token_mean, unwrap)
from plumbing.checkpoint import (RESUME_KEYS, check_resume, ema_weights,  # noqa: F401
                                 keep_checkpoint, load_resume_checkpoint, open_out_dir, restore, save)
from plumbing.distributed import (Env, agree, any_rank, on_rank0, run_distributed,  # noqa: F401
                                  setup_distributed)
from plumbing.files import refuse_overwrite, run_outputs, write_json
from plumbing.memory import fit_micro_batch
from plumbing.runlog import Log, finish_lines, kept, start_lines, truncate_log  # noqa: F401
from hub.pretrained import export
from plumbing.tracking import require_trackers
from plumbing.signals import Interrupted, interruptible, reduced_unless_stopped, stop_signals
from plumbing.integrity import DivergenceRule
from prepare import check_settings, prepare_for_run


@dataclass
class OptimConfig:
    """The optimisation, evaluation and system fields train.py and distillation/distill.py share (same flags, same meaning;
    distillation/distill.py changes some defaults)."""
    # optimisation
    max_iters: int = 1000            # optimizer steps of the whole run (a resumed run trains up to this step)
    batch_size: int = 32             # GLOBAL batch in sequences (all ranks x accumulation steps)
    grad_accum: int = 1              # micro-batches per optimizer step (micro-batch = batch_size / (ranks x this))
    lr: float = 1e-3                 # peak AdamW learning rate, reached after warmup_iters
    lr_schedule: str = "linear"      # constant | linear | cosine (after warm-up)
    min_lr: float = 0.0              # the learning rate that linear / cosine decay reaches at max_iters
    warmup_iters: int = 100          # steps of linear warm-up from lr / warmup_iters to lr
    beta1: float = 0.9               # AdamW beta1
    beta2: float = 0.999             # AdamW beta2
    weight_decay: float = 0.0        # AdamW weight decay of the matrices and embeddings (not of biases and norms)
    grad_clip: float = 1.0           # clip the global gradient norm to this (0 = off)
    ema: float = 0.999               # EMA decay (0 = off); Duo warms it up as min(ema, (1+n)/(10+n))
    diverge_margin: float = 0.0      # nats/token a logged loss may rise above its recent median (0 = log V)
    # evaluation, logging, checkpoints
    eval_interval: int = 250         # validation loss and NELBO PPL (EMA weights) every N steps and at the end
    eval_iters: int = 8              # validation batches of --batch_size sequences (same for any world size); 0 = all
    log_interval: int = 10           # training loss, lr and tokens/s every N steps (progress bar, log.jsonl)
    ckpt_interval: int = 250         # write out_dir/ckpt.pt every N steps (and at the end, and on Ctrl-C)
    num_samples: int = 4             # samples printed at the end of the run (EMA weights; 0 = none)
    sample_steps: int = 128          # reverse steps of the samples printed at the end
    out_dir: str = "out"             # the run's folder: ckpt.pt, config.json, log.jsonl, model/
    resume: bool = False             # continue out_dir/ckpt.pt exactly where it stopped (same data, RNG, optimizer)
    # runtime
    seed: int = 1                    # seeds the data order, every noise draw and (train.py) the initial weights
    device: str = "auto"             # auto | cpu | cuda
    dtype: str = "auto"              # auto (bf16 autocast on GPU, float32 on CPU) | float32 | bfloat16
    compile: bool = False            # torch.compile the model (slower start, faster steps on GPU)
    threads: int = 0                 # CPU: torch threads per process; 0 = $OMP_NUM_THREADS or idle cores / local procs
    wandb: bool = False              # log.jsonl's scalars, the config and the samples to wandb too (pip install wandb)
    wandb_project: str = "sddlm"     # the wandb project; the run is named after out_dir, its id kept in out_dir
    tensorboard: bool = False        # log.jsonl's scalars to out_dir/tensorboard too (pip install tensorboard)


@dataclass
class TrainConfig(OptimConfig):
    # preset and objective
    preset: str = "tiny"             # tiny | owt (= small) | lm1b | medium | large (model + recipe), TRAIN_PRESETS
    loss: str = "sddlm"              # a key of OBJECTIVES: sddlm | sddlm_v1 | sddlm_v2 | naive | duo | duo_lean | ar
    eps: float = losses.EPS          # epsilon of SDDLM-V1/V2 in log(p + eps)
    head: str = "auto"               # auto (fused on CUDA) | plain (logits) | fused | fused_recompute: kernels/fused_head.py
    # data
    dataset: str = "pydoc"           # pydoc (built in) | path to .txt file/folder | HF name (openwebtext, lm1b, ...)
    tokenizer: str = "sp_train:2048"  # gpt2 | sp:/path/tokenizer.model | hf:NAME | sp_train:VOCAB (train on corpus)
    data_dir: str = ""               # prepared memmaps; "" = prepare.prepared_dir(dataset, tokenizer, L, wrap)
    block_size: int = 128            # sequence length L
    vocab_size: int = 0              # model K; 0 = the tokenizer's (a larger K leaves unused output rows)
    vocab_multiple: int = 0          # pad the output layer to a multiple of this (masked rows); 0 = the model preset's
    wrap: bool = True                # OWT-style packing (True) or LM1B-style per-sentence padding (False)
    text_field: str = "text"         # the text of a record (.jsonl, .parquet, Arrow, hf:REPO), as prepare.py
    num_proc: int = 0                # processes tokenizing the corpus; 0 = the usable cores (same bytes for any)
    verify: bool = False             # hash every file of the prepared data at start (else size and time only)
    # model
    # 0 = the model preset's (model.PRESETS[preset])
    n_layer: int = 0                 # Transformer blocks
    n_head: int = 0                  # attention heads (n_embd must be divisible by it)
    n_embd: int = 0                  # hidden width
    dropout: float = 0.0             # dropout in the blocks during training (the paper's DiT-small: 0.1)
    # runtime
    auto_accum: bool = True          # CUDA: if the micro-batch does not fit, raise grad_accum until it does (0: stop)
    # diffusion
    noise_schedule: str = "loglinear"  # alpha_t of the forward process: loglinear (1 - (1 - 1e-3) t) | cosine
    # Duo's Gaussian-guided curriculum
    # the first curriculum_iters steps corrupt through a Gaussian latent (diffusion.curriculum_sample); 0 steps = off
    curriculum_iters: int = 0        # steps of curriculum at the start of training (the paper's recipe: 500K)
    gamma_min: float = -3.55         # the Gaussian log-SNR gamma_t = gamma_min + t (gamma_max - gamma_min): at t = 0
    gamma_max: float = -1.85         # ... and at t = 1
    log10_tau_start: float = -3.0    # log10 of the softmax temperature tau of the soft input at the first step
    log10_tau_end: float = -3.0      # ... at the last curriculum step (log-linear in between)
    # evaluation, logging, checkpoints
    keep_every: int = 0              # N > 0: also keep out_dir/ckpt_<step>.pt (weights + EMA, for evaluation) every N steps
    # sample quality during training
    # paper Figs. ppl_curve_lm1b, entropy_curve_lm1b: every gen_interval steps and at the end, Gen PPL and entropy
    # of gen_num_samples EMA samples -> log.jsonl
    gen_interval: int = 0            # steps between two measurements of sample quality (0 = off)
    gen_num_samples: int = 64        # in 8 groups seeded by group (eval_ppl.sample_groups): the same for any world size
    gen_steps: int = 1000            # reverse steps of the ancestral sampler (final step ancestral)
    gen_seed: int = 0                # the samples' seed, the same at every measurement (curves compare like with like)
    judge: str = "gpt2-large"        # the Gen PPL judge: a HF causal LM (needs transformers) | an AR ckpt.pt of this repo


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


# -----------------------------------------------------------------------------------------------
# config

def parse_config(argv=None):
    return parse_flags(TrainConfig, argv, __doc__.split("\n\n")[0], presets=TRAIN_PRESETS,
                       preset_note=lambda name: f"its model (model.PRESETS; --n_layer etc. of 0 take these): "
                                                f"{', '.join(f'{k}={v}' for k, v in PRESETS.get(name, {}).items())}")


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
    require_trackers(cfg)
    if not cfg.out_dir.strip():
        raise ConfigError("--out_dir is empty; name the folder for the checkpoint and log, e.g. --out_dir out")
    if cfg.loss not in OBJECTIVES:
        raise ConfigError(f"unknown --loss {cfg.loss!r}; choose from {', '.join(OBJECTIVES)}")
    if cfg.preset not in PRESETS:
        raise ConfigError(f"--preset {cfg.preset!r} has no model preset; choose from tiny, small, owt, lm1b, medium, large")
    if cfg.head not in HEADS:
        raise ConfigError(f"unknown --head {cfg.head!r}; choose from {', '.join(HEADS)}")
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
                                    ("diverge_margin", 0, math.inf, True),
                                    ("grad_clip", 0, math.inf, True)]:
        v = getattr(cfg, name)
        if not (low <= v if closed else low < v) or not v < high:
            raise ConfigError(f"--{name} must be in {'[' if closed else '('}{low}, {high}), got {v}")
    if cfg.eval_iters < 0 or cfg.keep_every < 0 or cfg.gen_interval < 0:
        raise ConfigError("--eval_iters (0 = the whole split), --keep_every and --gen_interval (0 = off) must be >= 0")
    if cfg.gen_interval and (cfg.gen_num_samples < 1 or cfg.gen_steps < 1):
        raise ConfigError("--gen_interval needs --gen_num_samples >= 1 and --gen_steps >= 1")
    if cfg.curriculum_iters and not cfg.gamma_min < cfg.gamma_max:
        raise ConfigError(f"--gamma_min {cfg.gamma_min} must be below --gamma_max {cfg.gamma_max}")
    check_settings(cfg.num_proc)                      # the data preparation's own flags
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
# the parts of a run

@dataclass
class Run:
    """The state a training run carries from step to step (and saves in its checkpoint)."""
    raw_model: torch.nn.Module           # the DiffusionTransformer itself
    model: torch.nn.Module               # what the step calls: raw_model, compiled and/or DDP-wrapped
    optimizer: torch.optim.Optimizer
    ema: list                            # EMA copies of raw_model.parameters(), or None
    loader: BatchLoader                  # None in bench/bench.py (random tokens)
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


# -----------------------------------------------------------------------------------------------
# the step: one optimizer step on a global batch

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
    """The optimizer step shared by train.py and distillation/distill.py: learning rate of step run.it; per micro-batch, this
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


# -----------------------------------------------------------------------------------------------
# the run

def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_config(argv)
    flagship = flagship_launch(argv, cfg)
    if flagship:
        cfg = parse_config(["--preset", FLAGSHIP_PRESET, *argv])
    refuse_overwrite({"--out_dir": run_outputs(cfg.out_dir)}, {"--dataset": cfg.dataset, "--data_dir": cfg.data_dir,
                                                               "--tokenizer": cfg.tokenizer, "--judge": cfg.judge})
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))    # once, before out_dir is locked or made

    def work(env):
        if flagship and env.master:
            print(FLAGSHIP_NOTE, flush=True)
        return train(cfg, env)
    return run_distributed(cfg, work)


def train(cfg, env):
    judge = load_gen_judge(cfg, env)
    data_dir, meta = prepare_for_run(cfg, env)   # prepare.py: once per node, agreed on by content
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
    if env.master:                       # a few lines before the progress bar starts; the rest is in config.json
        write_json(os.path.join(cfg.out_dir, "config.json"),
                   {"train_config": asdict(cfg), "model_config": asdict(mcfg), "meta": meta})
        print(start_lines(cfg, run.raw_model, env))
    log = Log(cfg, env, run.it, config={"train_config": asdict(cfg), "model_config": asdict(mcfg), "meta": meta})
    evals = [(cfg.eval_interval, lambda: evaluate(run, cfg, data_dir, env),
              lambda sums: val_metrics(sums, cfg, data_dir))]
    if quality is not None:
        evals.append((cfg.gen_interval, lambda: sample_quality(run, cfg, env, *quality),
                      lambda sums: gen_metrics(sums, cfg, quality[0])))

    def keep():
        if cfg.keep_every and run.it % cfg.keep_every == 0 and env.master:
            keep_checkpoint(run, cfg, mcfg, meta)
    return guarded_loop(run, cfg, env, log, lambda *batch: train_step(run, cfg, env, *batch), evals,
                        save=lambda: save(run, cfg, mcfg, meta, env), keep=keep,
                        samples=lambda: log.samples(run.it, print_samples(run, cfg, meta, env)), what="training",
                        nonfinite=lambda it, why: f"{why} by step {it} (lr {lr_at(it - 1, cfg):.2e}); {kept(cfg)}. "
                                                  f"Lower --lr or check the data.")


def guarded_loop(run, cfg, env, log, step, evals, save, samples, what, nonfinite, keep=None):
    """The loop of train.py and distillation/distill.py: step(*batch) until max_iters; the loss is checked and logged every
    log_interval steps (one host sync shared by the ranks, agree); each of evals (interval, work, metrics) runs at
    its interval and at the end; a checkpoint every ckpt_interval steps, at the end and on a stop signal (SIGINT /
    SIGTERM save and exit 130, --resume 1 continues); then samples(). nonfinite(step, why) -> the message of a
    non-finite or diverged loss (plumbing.integrity.DivergenceRule), raised before any checkpoint of those weights
    is written, so the last one on disk is sound. -> exit code."""
    bad = torch.zeros((), device=env.device, dtype=torch.bool)   # a non-finite loss since the last check
    loss_sum = torch.zeros((), device=env.device)
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    rule, first = DivergenceRule(cfg.diverge_margin, math.log(run.raw_model.config.vocab_size)), run.it + 1
    with stop_signals() as stop, log:
        while run.it < cfg.max_iters:
            loss = step(*run.loader.next_batch())
            loss_sum += loss
            bad |= ~torch.isfinite(loss)
            if run.it == first:              # the loss of sound weights (initial, or a checked checkpoint)
                rule.start(agree(env, loss.detach().clone(), bad, False)[0])
            last, save_now = run.it == cfg.max_iters, run.it % cfg.ckpt_interval == 0
            stopping = False
            if run.it % cfg.log_interval == 0 or save_now or last or (not env.ddp and stop["signal"] is not None):
                mean, is_bad, stopping = agree(env, loss_sum, bad, stop["signal"] is not None)
                diverged = "non-finite loss" if is_bad else rule.check(mean / max(1, run.it - log.step_last))
                if diverged:                 # before any checkpoint of these weights is written
                    raise FloatingPointError(nonfinite(run.it, diverged))
                log.progress(run.it, mean, lr_at(run.it - 1, cfg))
                loss_sum.zero_()
            for interval, work, metrics in evals:
                if (run.it % interval == 0 or last) and not stopping:
                    sums = reduced_unless_stopped(stop, env, 4, work)
                    if sums is not None:
                        values = metrics(sums)
                        log.metrics(run.it, values)
                        diverged = rule.check_metrics(values)
                        if diverged:
                            raise FloatingPointError(nonfinite(run.it, diverged))
                    stopping = any_rank(env, stop["signal"] is not None)
            if save_now or last or stopping:
                save()
            if keep is not None:
                keep()
            if stopping:
                log.close(f"stopped by signal {stop['signal'] or signal.SIGTERM} at step {run.it}; checkpoint saved "
                          f"to {ckpt_path} " + (f"({what} finished)" if last else "(continue with --resume 1)"))
                return 130
        log.close()
        if env.master:                                 # the shareable model: out_dir/model (hub/pretrained.py)
            folder, _ = export(ckpt_path, os.path.join(cfg.out_dir, "model"))
        try:
            with interruptible(stop):                  # also a signal during the final save
                if env.master and cfg.num_samples > 0:
                    samples()
        except Interrupted:
            if env.master:
                print(f"stopped by signal {stop['signal']} after {what}; checkpoint of step {run.it} saved to "
                      f"{ckpt_path}")
            return 130
    if env.master:                                     # last, after the trackers have closed
        print(finish_lines(cfg, what, run.it, ckpt_path, folder))
    return 0


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
    texts = [tok.decode(row) for row in ids.tolist()]
    for i, text in enumerate(texts):
        print(f"--- sample {i} ({cfg.sample_steps} steps) ---\n{text}")
    return texts


if __name__ == "__main__":
    run_cli(main, DataError, FloatingPointError, FileNotFoundError,
            oom_hint="lower the micro-batch: raise --grad_accum (or lower --batch_size)")
