"""
Train a uniform-state diffusion LM (or the AR baseline) with any of the objectives in losses.py.

    python train.py                                   # tiny preset on the built-in corpus, 2 CPU cores, minutes
    python train.py --loss sddlm_v1 --max_iters 2000
    torchrun --nproc_per_node=8 train.py --loss sddlm_v1   # the paper's recipe: --preset small, OpenWebText
    python train.py --out_dir out --resume 1          # continue exactly where a run stopped
    python train.py --init out/ckpt.pt --loss sddlm_v1 --out_dir out-ft   # fine-tune a trained model (or duo:PATH)

Every field of TrainConfig is a flag (--help: what it does, the value the run takes); --preset applies a recipe
(TRAIN_PRESETS: tiny without --preset, small for a torchrun launch on CUDA), explicit flags win. Top to bottom: the
config, the step (paper Algorithm 1), the run and its loop, whose plumbing is one face (plumbing/run.py).
"""
from plumbing import cli  # first: a stop signal while the imports below load is one line, exit 130
cli.stop_at_once(__name__)

import math
from dataclasses import asdict, dataclass

import torch

import diffusion
import losses
import curriculum.gaussian as curriculum
from curriculum.gaussian import GAMMA_LIMIT
from data import BatchLoader, DataError, get_tokenizer
from kernels.fused_head import HEADS
from validation import evaluate, gen_metrics, load_gen_judge, print_samples, sample_quality, validation_record
from model import PRESETS, ModelConfig, build_model
from plumbing import checkpoint
from plumbing.flags import check_train_flags
from plumbing.memory import check_run_fits
from plumbing.run import Run, RunPlumbing, launch
from prepare import prepare_for_run
from trained.checkpoint import open_out_dir
from trained.export import export
from trained.finetune import start_at, start_from


@dataclass
class OptimConfig:
    """The fields train.py and distillation/distill.py share (same flags, same meaning; distill.py's defaults)."""
    # optimisation
    max_iters: int = 1000            # optimizer steps of the whole run (a resumed run trains up to this step)
    batch_size: int = 32             # global batch in sequences (all ranks x accumulation steps)
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
    sample_top_p: float = 1.0        # nucleus of the samples printed at the end (1 = off; the tiny preset: 0.8)
    out_dir: str = "out"             # the run's folder: ckpt.pt, config.json, log.jsonl, model/
    resume: bool = False             # continue out_dir/ckpt.pt exactly where it stopped (same data, RNG, optimizer)
    # runtime
    seed: int = 1                    # seeds the data order, every noise draw and (train.py) the initial weights
    device: str = "auto"             # auto | cpu | cuda
    dtype: str = "auto"              # auto (bf16 autocast on GPU, float32 on CPU) | float32 | bfloat16
    compile: str = "auto"            # torch.compile the model: auto (on CUDA for every preset but tiny) | 1 | 0
    threads: int = 0                 # CPU: torch threads per process; 0 = $OMP_NUM_THREADS or idle cores / local procs
    dist_timeout: float = 600.0      # torchrun: seconds a rank waits for the others to join at start (then exit 2)
    wandb: bool = False              # log.jsonl's scalars, the config and the samples to wandb too (pip install wandb)
    wandb_project: str = "sddlm"     # the wandb project; the run is named after out_dir, its id kept in out_dir
    tensorboard: bool = False        # log.jsonl's scalars to out_dir/tensorboard too (pip install tensorboard)


@dataclass
class TrainConfig(OptimConfig):
    # preset and objective
    preset: str = "tiny"             # model and recipe: tiny (CPU demo) | small (the paper's OWT run) | owt | lm1b |
                                     # medium | large | llama_*; none: tiny, but small for a torchrun launch on CUDA
    loss: str = "sddlm"              # the training objective: sddlm | sddlm_v1 | sddlm_v2 | naive | duo | duo_lean | ar
    eps: float = losses.EPS          # epsilon of SDDLM-V1/V2 in log(p + eps)
    head: str = "auto"               # output layer + loss: auto (fused on CUDA, plain on CPU) | plain (full logits) |
                                     # fused (in chunks, logits kept) | fused_recompute (recomputed in backward)
    # fine-tuning
    # start from a trained model: its weights, its model, its tokenizer and block size (unless given; a preset's are
    # not), no curriculum unless asked for; the optimizer, the schedule, the step count and the EMA start fresh
    init: str = ""                   # the trained model: a ckpt.pt (train.py, distill.py), a model folder, duo:PATH or
                                     # duo:USER/NAME (Duo's release on the hub); "" = random weights
    init_ema: bool = True            # with --init: its EMA weights, where it has them (0: its live weights)
    # data
    dataset: str = "pydoc"           # pydoc (built in) | path to .txt file/folder | HF name (openwebtext, lm1b, ...)
    tokenizer: str = "sp_train:2048"  # gpt2 | sp:/path/tokenizer.model | hf:NAME | sp_train:VOCAB (train on corpus)
    data_dir: str = ""               # the prepared data folder ("" = data/<dataset>-<tokenizer>-<L>-<key>, made once)
    block_size: int = 128            # sequence length L
    vocab_size: int = 0              # model K (0 = the tokenizer's size; --vocab_multiple pads the output layer)
    vocab_multiple: int = 0          # pad the output layer to a multiple of this (masked rows); 0 = the model preset's
    wrap: bool = True                # 1: pack documents into full blocks (OWT); 0: a padded sequence per line (LM1B)
    text_field: str = "text"         # the text of a record (.jsonl, .parquet, Arrow, hf:REPO), as prepare.py
    num_proc: int = 0                # processes tokenizing the corpus (0 = the usable cores; same bytes for any)
    verify: bool = False             # hash every file of the prepared data at start (else size and time only)
    # model
    n_layer: int = 0                 # Transformer blocks (0 = from the preset)
    n_head: int = 0                  # attention heads, a divisor of n_embd (0 = from the preset)
    n_embd: int = 0                  # hidden width (0 = from the preset)
    dropout: float = 0.0             # dropout in the blocks during training (the paper's DiT-small: 0.1)
    # runtime
    auto_accum: bool = True          # CUDA: if the micro-batch does not fit, raise grad_accum until it does (0: stop)
    # diffusion
    noise_schedule: str = "loglinear"  # alpha_t of the forward process: loglinear (1 - (1 - 1e-3) t) | cosine
    # Duo's Gaussian-guided curriculum
    # the first curriculum_iters steps corrupt through a Gaussian latent (Duo's curriculum); 0 steps = off
    curriculum_iters: int = 0        # curriculum steps at the start (0 = off; paper: 500K of 1M)
    curriculum_share: float = 0.0    # without --curriculum_iters: the curriculum over this share of --max_iters, for
                                     # the diffusion losses (0 = none; the presets: 0.5)
    gamma_min: float = -3.55         # the Gaussian log-SNR gamma_t = gamma_min + t (gamma_max - gamma_min): at t = 0
    gamma_max: float = -1.85         # ... and at t = 1
    log10_tau_start: float = -3.0    # log10 of the softmax temperature tau of the soft input at the first step
    log10_tau_end: float = -3.0      # ... at the last curriculum step (log-linear in between)
    # evaluation, logging, checkpoints
    keep_every: int = 0              # also keep out_dir/ckpt_<step>.pt (weights + EMA) every N steps (0 = none)
    # sample quality during training
    # the paper's Gen PPL and entropy curves (LM1B figures): of gen_num_samples EMA samples -> log.jsonl
    gen_interval: int = 0            # steps between two measurements of sample quality (0 = off)
    gen_num_samples: int = 64        # in 8 groups, each with its own seed: the same samples for any number of GPUs
    gen_steps: int = 1000            # reverse steps of the ancestral sampler (final step ancestral)
    gen_seed: int = 0                # the samples' seed, the same at every measurement (curves compare like with like)
    judge: str = "gpt2-large"        # the Gen PPL judge: a HF causal LM (needs transformers) | an AR ckpt.pt of ours


# Appendix Table (hyperparameters) for small/medium; SMDM's 1.1B recipe for large; tiny = CPU demo.
TRAIN_PRESETS = {
    # CPU demo: the tiny model, curriculum for the first half, no EMA, samples at top-p 0.8 (RESULTS.md)
    "tiny": dict(max_iters=900, lr=2e-3, beta2=0.95, warmup_iters=50, curriculum_share=0.5, ema=0.0,
                 sample_top_p=0.8),
    "small": dict(dataset="openwebtext", tokenizer="gpt2", block_size=1024, max_iters=1_000_000, batch_size=512,
                  lr=3e-4, lr_schedule="linear", warmup_iters=2500, beta2=0.999, weight_decay=0.0, ema=0.9999,
                  dropout=0.1, curriculum_share=0.5, gamma_min=-3.55, gamma_max=-1.85, eval_interval=5000,
                  ckpt_interval=500, eval_iters=50, sample_steps=1024),
    "large": dict(dataset="slimpajama", tokenizer="sp:tokenizer.model", block_size=2048, max_iters=250_000,
                  batch_size=256, lr=2e-4, lr_schedule="linear", warmup_iters=2500, beta2=0.95, weight_decay=0.1,
                  ema=0.9999, eval_interval=5000, ckpt_interval=1000, eval_iters=50, sample_steps=1024),
}
TRAIN_PRESETS["medium"] = TRAIN_PRESETS["small"]
# The paper's two small-model experiments: `small` (the Appendix table on Duo's data and curriculum) with the Gen PPL
# and entropy curves of its figures (GPT-2 Large judge: transformers and the network) and kept checkpoints.
PAPER_CURVES = dict(gen_interval=5000, gen_num_samples=64, gen_steps=1000, judge="gpt2-large", keep_every=100_000)
TRAIN_PRESETS["owt"] = {**TRAIN_PRESETS["small"], **PAPER_CURVES}
TRAIN_PRESETS["lm1b"] = {**TRAIN_PRESETS["small"], **PAPER_CURVES, "dataset": "lm1b",
                         "tokenizer": "hf:bert-base-uncased", "block_size": 128, "wrap": False,
                         "gamma_min": -3.5, "gamma_max": -1.75}
TRAIN_PRESETS.update({name: TRAIN_PRESETS["large"] for name in PRESETS if name.startswith("llama_")})  # SMDM ladder


# -----------------------------------------------------------------------------------------------
# config

def parse_config(argv=None, given=None):
    """The command line -> TrainConfig, parsed once: the preset (--preset, else default_preset's), the flags given
    over it, and the curriculum's share of the run (curriculum_from_share). given: a dict that receives the flags
    on the command line (--init's rules need them: trained.finetune.start_from)."""
    return cli.parse_flags(TrainConfig, argv, __doc__.split("\n\n")[0], presets=TRAIN_PRESETS, given=given,
                           default_preset=default_preset, resolve=curriculum_from_share,
                           preset_note=lambda name: f"its model (--n_layer etc. of 0 take these): "
                                                    f"{', '.join(f'{k}={v}' for k, v in PRESETS[name].items())}")


FLAGSHIP_PRESET = "small"    # what a torchrun launch on CUDA trains without --preset: the paper's recipe
FLAGSHIP_NOTE = ("torchrun on CUDA: training the paper's recipe, --preset small (DiT-small, OpenWebText, GPT-2 BPE, "
                 "L = 1024, global batch 512, Duo's curriculum for 500K steps), the default of a torchrun launch on "
                 "CUDA; --preset tiny gives the offline demo")


def default_preset(given):
    """The preset without --preset (given: the flags): the paper's recipe under torchrun on CUDA, else the demo."""
    return FLAGSHIP_PRESET if cli.torchrun_on_cuda(given.get("device", TrainConfig.device)) else "tiny"


def curriculum_from_share(cfg, given):
    """The curriculum's steps (given: the flags on the command line): --curriculum_iters when given; else, for the
    diffusion losses, round(--curriculum_share x --max_iters): a preset's curriculum (0.5: Duo's 500K of 1M) covers
    its share of any run (a resumed run keeps its checkpoint's steps: trained.checkpoint.open_out_dir). None for the AR
    baseline, nor from a trained model (--init) unless asked for: Duo's curriculum starts from random weights."""
    causal = cfg.loss in diffusion.OBJECTIVES and diffusion.OBJECTIVES[cfg.loss].causal
    if causal and given.get("curriculum_share"):
        raise cli.ConfigError("--curriculum_share applies to diffusion losses, not --loss ar")
    if cfg.init and "curriculum_share" not in given:
        cfg.curriculum_share = 0.0
    if "curriculum_iters" in given or causal:      # the user's steps, or none
        cfg.curriculum_iters, cfg.curriculum_share = given.get("curriculum_iters", 0), 0.0
    elif cfg.curriculum_share:
        cfg.curriculum_iters = round(cfg.curriculum_share * cfg.max_iters)
    return cfg


def curriculum_end_note(cfg, vocab_size):
    """Why the training loss jumps when the curriculum ends (logged as the event "curriculum_end" after step
    cfg.curriculum_iters: RunPlumbing's events; figures/plot.py marks it): the curriculum's inputs have alpha_t =
    T(gamma) over [gamma_min, gamma_max] only, the forward process afterwards the schedule's whole range, its
    noisiest inputs included. -> one line."""
    lo, hi = curriculum.alpha_range(vocab_size, cfg.gamma_min, cfg.gamma_max)
    after = diffusion.SCHEDULES[cfg.noise_schedule](torch.tensor([1.0, diffusion.T_MIN], dtype=torch.float64))[0]
    return (f"the curriculum ends (--curriculum_iters {cfg.curriculum_iters}): its inputs had alpha_t in [{lo:.3f}, "
            f"{hi:.3f}] (the Gaussian latent's argmax, gamma in [{cfg.gamma_min:g}, {cfg.gamma_max:g}]); from step "
            f"{cfg.curriculum_iters + 1} they follow Eq. (discrete_marginal) with alpha_t in [{float(after[0]):.3f}, "
            f"{float(after[1]):.3f}] ({cfg.noise_schedule}), the noisiest inputs included: the training loss measures "
            f"another task from here, so it jumps (not a divergence)")


def model_config_for(cfg, vocab_size):
    """The run's ModelConfig: the preset's model, the flags over it, the tokenizer's vocab_size; causal for the AR
    baseline. A model the flags cannot build -> ConfigError naming them."""
    if cfg.vocab_size and cfg.vocab_size != vocab_size:   # above: samples would hold ids no tokenizer decodes
        how = "smaller than" if cfg.vocab_size < vocab_size else "above"
        raise cli.ConfigError(f"--vocab_size {cfg.vocab_size} is {how} the tokenizer's vocabulary {vocab_size}; "
                              f"leave it 0 (--vocab_multiple pads the output)")
    base = dict(PRESETS[cfg.preset])
    base.update({k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd") if getattr(cfg, k)})
    base.update(vocab_size=cfg.vocab_size or vocab_size, block_size=cfg.block_size, dropout=cfg.dropout)
    if cfg.vocab_multiple:
        base.update(vocab_multiple=cfg.vocab_multiple)
    if diffusion.OBJECTIVES[cfg.loss].causal:   # the AR baseline: causal attention, no time input
        base.update(causal=True, time_cond=False)
    try:
        return ModelConfig(**base)
    except ValueError as e:        # its message starts with the field's name: the flag's, or the preset's
        field = str(e).split()[0].split("=")[0]
        raise cli.ConfigError(f"--{e}" if hasattr(cfg, field) else f"--preset {cfg.preset}: {e}") from None


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
    """Model and its EMA (the same on every rank: DDP broadcasts rank 0's weights, not its EMA; run.model = raw_model
    until wrap_model), optimizer, loader over data_dir (None: no loader; on CUDA its batches are pinned and copied
    asynchronously) and generators; then torch's RNG seeded per rank (dropout)."""
    torch.manual_seed(cfg.seed)
    raw_model = build_model(mcfg).to(env.device)
    optimizer, ema = make_optimizer(raw_model, cfg, env.device)
    torch.manual_seed(cfg.seed + env.rank)
    loader = None if data_dir is None else BatchLoader(data_dir, "train", cfg.batch_size // env.world_size,
                                                       rank=env.rank, world_size=env.world_size, seed=cfg.seed,
                                                       device=env.device)
    return Run(raw_model, raw_model, optimizer, ema, loader,
               gen_shared=torch.Generator(device=env.device).manual_seed(cfg.seed),
               gen_local=torch.Generator(device=env.device).manual_seed(cfg.seed + 7919 * (env.rank + 1)))


# -----------------------------------------------------------------------------------------------
# the step: one optimizer step on a global batch (paper Algorithm 1)

def train_step(run, cfg, env, x0_all, mask_all=None, per_token_loss=None, draw=None):
    """One optimizer step on this rank's part x0_all (B_rank, L) of a global batch: times t and the noise
    draw(B, L, K, generator, device) drawn for the GLOBAL batch from gen_shared, each micro-batch taking its slice
    (env.micro_batches: a DDP run equals one process); per micro-batch per_token_loss(model, x0, mask, t, draws) ->
    (per-token loss, token weights or None), its token mean and backward; then optimizer_step. The defaults are the
    --loss objective (diffusion.loss_terms: xt ~ q_t(. | x0), the model, the per-token loss) and its draws
    (diffusion.draw_noise); distill.py passes DCD's. -> the step's mean loss (a detached 0-dim tensor: no host
    sync here)."""
    if per_token_loss is None:
        objective, it = diffusion.OBJECTIVES[cfg.loss], run.it
        per_token_loss = lambda model, x0, mask, t, draws: (   # noqa: E731
            diffusion.loss_terms(model, cfg, x0, t, it, run.gen_local, draws)[0], objective.token_weights(mask))
    for g in run.optimizer.param_groups:
        g["lr"] = lr_at(run.it, cfg)
    t_all = diffusion.sample_t(cfg.batch_size, run.gen_shared, device=env.device)
    draws_all = (draw or diffusion.draw_noise)(cfg.batch_size, x0_all.shape[1], run.raw_model.config.vocab_size,
                                               run.gen_shared, env.device)
    total = torch.zeros((), device=env.device)
    for x0, mask, (t, *draws), sync in env.micro_batches(run.model, cfg, x0_all, mask_all, (t_all, *draws_all)):
        with sync:                   # DDP all-reduces the gradients on the last micro-batch only
            with env.autocast(cfg.dtype):
                loss = diffusion.token_mean(*per_token_loss(run.model, x0, mask, t, draws)) / cfg.grad_accum
            loss.backward()
        total += loss.detach()
    run.n_ema = optimizer_step(run.raw_model, run.optimizer, run.ema, cfg, run.n_ema, env.ddp)
    run.it += 1
    return total


def probe_loss(cfg):
    """The step the micro-batch probe runs (plumbing.memory.probe_steps): the --loss objective of random tokens x0
    at step it (Duo's curriculum while it lasts), every draw from gen -> the mean loss."""
    def loss(model, x0, it, gen):
        t = diffusion.sample_t(x0.shape[0], gen, device=x0.device)
        return diffusion.loss_terms(model, cfg, x0, t, it, gen)[0].mean()
    return loss


def optimizer_step(raw_model, optimizer, ema, cfg, n_ema, ddp=False):
    """Clip the gradient norm, AdamW step, zero the gradients (under DDP in place: they are views of its all-reduce
    buckets, wrap_model), update the EMA weights with Duo's warm-up decay min(ema, (1 + n) / (10 + n)).
    n_ema = EMA updates so far -> n_ema + 1."""
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=not ddp)
    if ema is None:
        return n_ema
    n_ema += 1
    d = min(cfg.ema, (1 + n_ema) / (10 + n_ema))
    torch._foreach_lerp_(ema, [p.detach() for p in raw_model.parameters()], 1 - d)
    return n_ema


# -----------------------------------------------------------------------------------------------
# the run

def main(argv=None):
    given = {}
    cfg = parse_config(argv, given)
    # every flag and size checked, --init's SOURCE read; then this process in its torchrun job, out_dir locked
    return launch(cfg, lambda where: check_start(cfg, given, where), lambda env, source: train(cfg, env, source, given))


# what train.py's own flags take, beside every run's (plumbing.flags.check_train_flags): the method's names; eps >= 1
# leaves log(p + eps) within log 2 of a constant (nothing to learn); the curriculum's alpha table is accurate for
# |gamma| <= GAMMA_LIMIT, and tau = 10^x beyond [1e-30, 1e3) overflows its softmax or makes its input uniform
TRAIN_CHOICES = dict(loss=diffusion.OBJECTIVES, preset=PRESETS, head=HEADS, noise_schedule=diffusion.SCHEDULES)
TRAIN_RANGES = [("eps", 0, 1, False), ("dropout", 0, 1, True), ("gamma_min", -GAMMA_LIMIT, GAMMA_LIMIT, True),
                ("gamma_max", -GAMMA_LIMIT, GAMMA_LIMIT, True), ("log10_tau_start", -30, 3, True),
                ("log10_tau_end", -30, 3, True)]


def check_start(cfg, given, where):
    """Before anything is made: every flag, its data preparation's among them, and no output over an input
    (plumbing.flags.check_train_flags); the model's shape at any vocabulary and its size against the machine
    (where: the launch); with --init (or a resumed fine-tuning run) SOURCE read and the flags given (given: those on
    the command line) checked against it, whose model is then the run's -> that Source, or None."""
    check_train_flags(cfg, where.world_size, TRAIN_CHOICES, TRAIN_RANGES)
    if diffusion.OBJECTIVES[cfg.loss].causal and cfg.curriculum_iters:
        raise cli.ConfigError("--curriculum_iters applies to diffusion losses, not --loss ar")
    if not cfg.init:                  # with --init the model is SOURCE's (trained.finetune.check_flags)
        check_run_fits(cfg, model_config_for(cfg, cfg.vocab_size or 2), where)    # impossible, or too large
    return start_from(cfg, given)


def train(cfg, env, source, given):
    if env.master and cfg.preset == FLAGSHIP_PRESET and cli.torchrun_on_cuda(cfg.device) and source is None:
        print(FLAGSHIP_NOTE, flush=True)         # first: the flagship default, before hours of data preparation
    judge = load_gen_judge(cfg, env)             # a judge that cannot load fails before the data are prepared
    data_dir, meta = prepare_for_run(cfg, env, given)   # prepare.py: once per node, agreed on by content
    cfg.data_dir = data_dir                      # absolute: a checkpoint finds its data from any working directory
    # the model: the flags' (a preset's); fine-tuning: SOURCE's, whose tokenizer must be the data's
    mcfg = source.model_config_for(cfg, data_dir, meta) if source else model_config_for(cfg, meta["vocab_size"])
    ckpt = open_out_dir(cfg, mcfg, meta)         # the checkpoint to resume, checked against this run; None: fresh
    ends = 0 < cfg.curriculum_iters < cfg.max_iters          # the loss jumps there: the log says why
    events = {cfg.curriculum_iters: ("curriculum_end", curriculum_end_note(cfg, mcfg.vocab_size))} if ends else {}
    plumbing = RunPlumbing(cfg, env, mcfg, meta, export, source, events=events)
    if plumbing.done(ckpt):
        return 0
    run = build_run(cfg, mcfg, env, data_dir)
    if ckpt is not None:                         # the checkpoint's state, to continue bit for bit
        checkpoint.restore(run, ckpt, env, plumbing.ckpt_path)
    elif source is not None:                     # fine-tuning: SOURCE's weights, the EMA at them
        start_at(run, source.weights)
    fusable = not diffusion.OBJECTIVES[cfg.loss].full_logits     # an objective the fused head computes
    plumbing.place_model(run, probe_loss(cfg), fusable)          # CUDA: the micro-batch probe; DDP, torch.compile
    quality = None if judge is None else (judge, get_tokenizer(meta["tokenizer"]))
    with plumbing.start(run, {"train_config": asdict(cfg), "model_config": asdict(mcfg), "meta": meta}):
        if source is not None and run.it == 0:   # fine-tuning: where it starts (SOURCE's own validation numbers)
            if plumbing.sync_metrics_and_stop(0, lambda: evaluate(run, cfg, data_dir, env), lambda sums: {
                    **validation_record(sums, data_dir), "init": source.described}):
                # stopped in it: saved at step 0, where --resume 1 evaluates again
                checkpoint.save(run, cfg, mcfg, meta, env, plumbing.extra)
                return plumbing.log.stopped(plumbing.stop["signal"], run.it)
        return loop(run, cfg, plumbing, lambda x0, mask: train_step(run, cfg, env, x0, mask),
                    (lambda: evaluate(run, cfg, data_dir, env), lambda sums: validation_record(sums, data_dir)),
                    lambda: print_samples(run, cfg, meta, env),
                    quality and (lambda: sample_quality(run, cfg, env, *quality),
                                 lambda sums: gen_metrics(sums, cfg, quality[0])))


def loop(run, cfg, plumbing, step, validation, samples, quality=None):
    """The training loop from run.it to --max_iters (distill.py's too, with its own step and validation):
    step(x0, mask) -> the step's loss; validation and quality: (sums() -> this rank's sums, metrics(summed) -> the
    record) every --eval_interval / --gen_interval steps and at the end; samples() -> the texts printed at the end.
    -> the exit code."""
    env, mcfg, meta = plumbing.env, plumbing.mcfg, plumbing.meta
    while run.it < cfg.max_iters:
        loss = step(*run.loader.next_batch())
        last = run.it == cfg.max_iters
        stopping = plumbing.sync_loss_and_stop(run.it, loss, lr_at(run.it - 1, cfg))   # the loop's one host sync
        if (run.it % cfg.eval_interval == 0 or last) and not stopping:   # validation loss, NELBO (EMA weights)
            stopping = plumbing.sync_metrics_and_stop(run.it, *validation)
        if quality and (run.it % cfg.gen_interval == 0 or last) and not stopping:   # Gen PPL, entropy
            stopping = plumbing.sync_metrics_and_stop(run.it, *quality)
        if run.it % cfg.ckpt_interval == 0 or last or stopping:
            checkpoint.save(run, cfg, mcfg, meta, env, plumbing.extra)   # ckpt.pt: what --resume 1 continues
        if getattr(cfg, "keep_every", 0) and run.it % cfg.keep_every == 0 and env.master:
            checkpoint.keep(run, cfg, mcfg, meta)                        # ckpt_<step>.pt: weights to evaluate later
        if stopping:
            return plumbing.log.stopped(plumbing.stop["signal"], run.it)
    return plumbing.finish(run, samples)   # model folder, samples, last lines

if __name__ == "__main__":
    cli.run_cli(main, DataError, FloatingPointError, FileNotFoundError,
                oom_hint="lower the micro-batch: raise --grad_accum (or lower --batch_size)")
