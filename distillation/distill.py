"""
Discrete Consistency Distillation (DCD, Duo spec section 8) of a diffusion checkpoint of this repo, for
few-step generation. Works for every objective (sddlm, sddlm_v1, sddlm_v2, duo, naive).

    python distillation/distill.py --init out-duo/ckpt.pt --out_dir out-duo-dcd      # tiny schedule, CPU, minutes
    torchrun --nproc_per_node=8 distillation/distill.py --preset small --init ckpt.pt --out_dir dcd  # distil_owt.sh
    python distillation/distill.py --out_dir out-duo-dcd --resume 1                  # continue a stopped run exactly
    python sample.py --ckpt out-duo-dcd/ckpt.pt --steps 8                            # few-step samples

One step: x0 ~ data, t stratified in [1e-3, 1], dt = 2^round / T, t <- min(t + dt, 1), s = t - dt; the two
times become Gaussian log-SNRs gamma = gamma_min + t (gamma_max - gamma_min) and discrete levels
alpha = T(gamma) (Duo's diffusion transformation operator, curriculum.gamma_to_alpha). ONE Gaussian noise
eps ~ N(0, I_K) per token gives both noisy tokens, z_t = argmax(alpha~_t e_x0 + sigma~_t eps) and
z_s = argmax(alpha~_s e_x0 + sigma~_s eps) (a deterministic coupling: z_s is z_t with some of its noise
removed). Loss = KL(x_theta(z_t, sigma_t) || x_teacher(z_s, sigma_s)) per token (Duo's default 'kl-bwd'),
token mean. The teacher is a frozen copy of the student, refreshed at the start of every round (round_iters
steps), so each round distils two steps of size dt into one, and dt doubles from round to round.

Differences from Duo's code, all deliberate: the teacher runs in eval mode (make_teacher) and is saved in the
checkpoint, so a resume mid-round keeps the round's teacher (Duo rebuilds it from the current student); the pair is
drawn from three numbers per token (draw_pair_noise); the KL is one fused float32 pass (_KLFromLogits).

Checkpoints have train.py's format plus checkpoint_extra's fields. Everything else is train.py's: flags from one
dataclass, DDP via torchrun (noise drawn for the global batch and sliced per rank), EMA weights for evaluation and
sampling, atomic checkpoints, Ctrl-C saves, --resume 1 continues bit-identically.
"""
import os, sys  # noqa: E401  (run as a file, python FOLDER/SCRIPT.py: the repository root goes on the path)
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing import cli  # first: a stop signal while the imports below load is one line, exit 130
cli.stop_at_once(__name__)

import copy
from dataclasses import asdict, dataclass

import torch

import curriculum.gaussian as curriculum
import diffusion
import train
from data import DataError, check_tokenizer, get_tokenizer, load_meta, verify_prepared
from validation import print_samples, validation_record, validation_sums
from model import ModelConfig
from plumbing.checkpoint import RESUME_KEYS as CKPT_KEYS, restore
from plumbing.cli import UsageError, parse_flags, run_cli
from plumbing.flags import check_run_flags
from plumbing.integrity import check_tokenizer_identity
from plumbing.memory import check_run_fits
from plumbing.run import RunPlumbing, launch
from trained.checkpoint import read_resume
from trained.export import export
from trained.finetune import read_init, start_at, tokenizer_identity


@dataclass
class DistillConfig(train.OptimConfig):
    """train.OptimConfig's optimisation, evaluation and system flags (train.py's names and meaning), with DCD's
    defaults, and the DCD settings."""
    # the model to distil
    preset: str = "tiny"             # tiny (a short CPU schedule) | small (Duo's distil_owt.sh schedule)
    init: str = "out/ckpt.pt"        # the model to distil: a ckpt.pt or model folder of train.py (of distill.py:
                                     # more rounds), duo:PATH or duo:USER/NAME (Duo's release on the hub)
    init_ema: bool = True            # start from its EMA weights (the ones that are evaluated)
    # DCD
    round_iters: int = 100           # steps per round; the teacher is refreshed and dt doubles every round
    T: int = 64                      # dt = 2^round / T (Duo: T = 512, rounds of 10K steps, 5 rounds)
    gamma_min: float = -4.0          # Gaussian log-SNR range of t in [0, 1] (Duo's distillation: [-4, -1]): t = 0
    gamma_max: float = -1.0          # ... and t = 1 (gamma_t = gamma_min + t (gamma_max - gamma_min))
    divergence: str = "kl_bwd"       # kl_bwd: KL(student || teacher) (Duo's default) | kl_fwd: KL(teacher || student)
    teacher: str = "live"            # the teacher of a round: the student's live weights (Duo) | its ema weights
    data_dir: str = ""               # prepared data ("" = the one recorded in --init)
    # DCD's defaults of train.OptimConfig's fields
    max_iters: int = 400
    lr: float = 1e-4
    lr_schedule: str = "constant"
    warmup_iters: int = 10
    ema: float = 0.99
    eval_interval: int = 100         # validation DCD loss and NELBO (EMA weights) every N steps and at the end
    eval_iters: int = 4
    ckpt_interval: int = 100
    sample_steps: int = 8            # reverse steps of the few-step samples printed at the end
    out_dir: str = "out-dcd"


DISTILL_PRESETS = {
    "tiny": {},
    # Duo's scripts/distil_owt.sh: 5 rounds of 10K steps, T = 512, lr 6e-5, warm-up 500, batch 128, EMA 0.999
    "small": dict(round_iters=10_000, T=512, max_iters=50_000, batch_size=128, lr=6e-5, warmup_iters=500,
                  ema=0.999, eval_interval=10_000, eval_iters=8, ckpt_interval=1000, sample_steps=32),
}
DIVERGENCES = ("kl_bwd", "kl_fwd")

# the settings a resumed run must share with the run that wrote its checkpoint
RESUME_KEYS = ("round_iters", "T", "gamma_min", "gamma_max", "divergence", "teacher", "batch_size", "seed")


# -----------------------------------------------------------------------------------------------
# the DCD targets: two noise levels, one Gaussian noise

def step_size(it, cfg):
    """dt of step `it`: 2^round / T with round = it // round_iters (Duo: 1/512, 2/512, ..., 16/512)."""
    return 2 ** (it // cfg.round_iters) / cfg.T


def gamma_of(t, cfg):
    """The Gaussian log-SNR gamma_t = gamma_min + t (gamma_max - gamma_min) of time t (...) -> (...)."""
    return cfg.gamma_min + t * (cfg.gamma_max - cfg.gamma_min)


def draw_pair_noise(n, length, vocab_size, generator=None, device=None):
    """The Gaussian noise eps ~ N(0, I_K) of one DCD step for n sequences of `length` tokens, reduced to the
    three numbers per token that both argmaxes depend on: eps at the clean token, M = the largest of the other
    K - 1 coordinates, and which of them holds it. They are independent: M has CDF Phi(m)^(K-1) and is drawn
    exactly by inverting it, M = -Phi^-1(1 - U^(1/(K-1))) (computed with expm1 in float64, accurate at K = 50258),
    and the position of the maximum of i.i.d. variables is uniform. Same distribution as Duo's dense (B, L, K)
    draw, O(B L) memory. -> (eps_x0 float64, eps_max float64, other int64 in [0, K - 1)), each (n, length)."""
    eps_x0 = torch.randn(n, length, generator=generator, device=device, dtype=torch.float64)
    u = 1 - torch.rand(n, length, generator=generator, device=device, dtype=torch.float64)    # (0, 1]
    eps_max = -torch.special.ndtri(-torch.expm1(torch.log(u) / (vocab_size - 1)))
    other = torch.randint(0, vocab_size - 1, (n, length), generator=generator, device=device)
    return eps_x0, eps_max, other


def coupled_pair(x0, gamma_t, gamma_s, noise):
    """DCD's pair (z_t, z_s) of argmaxes of the SAME Gaussian noise at two levels (Duo spec 2.1, 8):
    z_u = argmax_k (alpha~_u e_x0 + sigma~_u eps)_k = argmax_k (nu_u e_x0 + eps)_k with nu_u = alpha~_u / sigma~_u
    = exp(-gamma_u / 2), i.e. x0 when nu_u + eps_x0 > M, else the token holding M (the same one at both levels).
    x0 (B, L); gamma_t >= gamma_s, each (B, 1); noise: this batch's draw_pair_noise -> z_t, z_s (B, L)."""
    eps_x0, eps_max, other = noise
    noisy_token = other + (other >= x0).long()            # the K - 1 tokens other than x0
    nu_t, nu_s = torch.exp(-gamma_t.double() / 2), torch.exp(-gamma_s.double() / 2)
    zt = torch.where(nu_t + eps_x0 > eps_max, x0, noisy_token)
    zs = torch.where(nu_s + eps_x0 > eps_max, x0, noisy_token)
    return zt, zs


class _KLFromLogits(torch.autograd.Function):
    """Per-row KL between softmax(student) and softmax(teacher) in float32 (float64 for float64 logits),
    chunked over rows; saves only the two logit tensors and the per-row KL. Gradient for the student only:
    kl_bwd d/dz KL(p || q) = p (log p - log q - KL);  kl_fwd d/dz KL(q || p) = p - q."""

    @staticmethod
    def forward(ctx, student, teacher, reverse, chunk_rows):
        s, t = student.reshape(-1, student.shape[-1]), teacher.reshape(-1, teacher.shape[-1])
        dtype = torch.promote_types(student.dtype, torch.float32)
        kl = torch.empty(s.shape[0], dtype=dtype, device=s.device)
        for i in range(0, s.shape[0], chunk_rows):
            j = slice(i, i + chunk_rows)
            log_p, log_q = torch.log_softmax(s[j].to(dtype), -1), torch.log_softmax(t[j].to(dtype), -1)
            kl[j] = (log_p.exp() * (log_p - log_q)).sum(-1) if reverse else (log_q.exp() * (log_q - log_p)).sum(-1)
        ctx.save_for_backward(student, teacher, kl)
        ctx.reverse, ctx.chunk_rows = reverse, chunk_rows
        return kl.view(student.shape[:-1])

    @staticmethod
    def backward(ctx, grad_kl):
        student, teacher, kl = ctx.saved_tensors
        s, t = student.reshape(-1, student.shape[-1]), teacher.reshape(-1, teacher.shape[-1])
        g = grad_kl.reshape(-1, 1).to(kl.dtype)
        grad = torch.empty_like(s)
        for i in range(0, s.shape[0], ctx.chunk_rows):
            j = slice(i, i + ctx.chunk_rows)
            log_p, log_q = torch.log_softmax(s[j].to(kl.dtype), -1), torch.log_softmax(t[j].to(kl.dtype), -1)
            p = log_p.exp()
            d = p * (log_p - log_q - kl[j, None]) if ctx.reverse else p - log_q.exp()
            grad[j] = (g[j] * d).to(grad.dtype)
        return grad.view(student.shape), None, None, None


def dcd_divergence(student_logits, teacher_logits, divergence="kl_bwd", chunk_elems=1 << 25):
    """DCD's loss per token (Duo spec 8, 'kl-bwd' / 'kl-fwd'): with p = softmax(student), q = softmax(teacher),
    kl_bwd = sum_v p (log p - log q) = KL(p || q), kl_fwd = KL(q || p). Logits (B, L, K), any float dtype,
    the teacher's without gradient -> (B, L) float32 (float64 for float64 logits)."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {', '.join(DIVERGENCES)}, got {divergence!r}")
    chunk_rows = max(1, chunk_elems // student_logits.shape[-1])
    return _KLFromLogits.apply(student_logits, teacher_logits.detach(), divergence == "kl_bwd", chunk_rows)


def dcd_loss_terms(student, teacher, cfg, x0, t, it, noise):
    """Per-token DCD loss (B, L) of clean x0 (B, L) at stratified times t (B,) for step `it`: the two times
    t + dt and t, their levels alpha = T(gamma), the coupled pair from `noise` (this batch's draw_pair_noise),
    the student at (z_t, sigma_t) and the teacher (no gradient) at (z_s, sigma_s)."""
    K = student.config.vocab_size
    dt = step_size(it, cfg)
    t = (t + dt).clamp(max=1.0)
    s = t - dt
    gamma_t, gamma_s = gamma_of(t, cfg).unsqueeze(-1), gamma_of(s, cfg).unsqueeze(-1)
    alpha_t, alpha_s = (curriculum.gamma_to_alpha(g, K, cfg.gamma_min, cfg.gamma_max)[0] for g in (gamma_t, gamma_s))
    zt, zs = coupled_pair(x0, gamma_t, gamma_s, noise)
    with torch.no_grad():
        teacher_logits = teacher(zs, diffusion.sigma_from_alpha(alpha_s.squeeze(-1)))
    student_logits = student(zt, diffusion.sigma_from_alpha(alpha_t.squeeze(-1)))
    return dcd_divergence(student_logits, teacher_logits, cfg.divergence)


# -----------------------------------------------------------------------------------------------
# the parts of a run (train.py's Run, optimizer and EMA, the plumbing of plumbing/run.py; DCD's step and teacher)

def parse_config(argv=None):
    return parse_flags(DistillConfig, argv, __doc__.split("\n\n")[0], presets=DISTILL_PRESETS)


def validate(cfg, world_size):
    """The flags at start-up (plumbing.run.launch's check; world_size: the torchrun job's ranks): every run's
    (plumbing.flags.check_run_flags: no output over an input, each flag against the values it may take) and DCD's
    -> UsageError naming the flag."""
    limit = curriculum.GAMMA_LIMIT
    check_run_flags(cfg, world_size, {"--init": "" if cfg.resume else cfg.init, "--data_dir": cfg.data_dir},
                    dict(divergence=DIVERGENCES, teacher=("live", "ema")),
                    [(name, -limit, limit, True) for name in ("gamma_min", "gamma_max")])
    if cfg.teacher == "ema" and not cfg.ema:
        raise UsageError("--teacher ema needs EMA weights: set --ema > 0")
    if min(cfg.round_iters, cfg.T) < 1:
        raise UsageError(f"--round_iters and --T must be >= 1, got {cfg.round_iters} and {cfg.T}")
    if not cfg.gamma_min < cfg.gamma_max:
        raise UsageError(f"--gamma_min ({cfg.gamma_min}) must be below --gamma_max ({cfg.gamma_max})")
    if step_size(cfg.max_iters - 1, cfg) >= 1:
        raise UsageError(f"dt reaches {step_size(cfg.max_iters - 1, cfg):g} >= 1 in the last round: raise --T or "
                         f"--round_iters, or lower --max_iters")


def load_init(cfg):
    """The model to distil -> (its weights, a checkpoint dict): anything every script's --ckpt reads (a train.py /
    distillation/distill.py checkpoint, a model folder, duo:PATH; trained.finetune.read_init). Refuses the AR
    baseline."""
    model, ckpt = read_init(cfg.init, cfg.init_ema)
    if ckpt["model_config"].get("causal"):
        raise UsageError(f"--init {cfg.init} is the autoregressive baseline; DCD distils diffusion models")
    ckpt["meta"] = tokenizer_identity(ckpt.get("meta"), ckpt["model_config"], f"--init {cfg.init}")   # by content
    return model.state_dict(), ckpt


def base_of(cfg, init_ckpt, record, env):
    """The model config of the checkpoint distilled, checked to fit env's memory, and its prepared data folder
    (--data_dir, else the one recorded in --init), checked against the tokenizer `record` (the checkpoint distilled
    or resumed) was trained with. -> (mcfg, data_dir, meta)."""
    mcfg = ModelConfig(**init_ckpt["model_config"])        # valid: load_model or read_resume built it
    check_run_fits(cfg, mcfg, env, model_from=f"--init {cfg.init}: model_config.")   # before any allocation
    data_dir = cfg.data_dir or (init_ckpt.get("train_config") or {}).get("data_dir")
    if not data_dir:
        raise UsageError(f"--init {cfg.init} records no data folder; pass --data_dir")
    meta = load_meta(data_dir)
    check_tokenizer(meta, mcfg.vocab_size)
    verify_prepared(data_dir, meta)
    check_tokenizer_identity(get_tokenizer(meta["tokenizer"]), record, cfg.init)
    return mcfg, os.path.abspath(data_dir), meta


def open_out_dir(cfg):
    """The checkpoint to resume and what a resumed run needs to know of the model it distils, from its own checkpoint
    (--init is not needed, and may be gone by then); (None, None) for a fresh run. An --init given other than the
    default must name the model it distils: another one would be ignored without a word."""
    ckpt = read_resume(cfg, "distillation/distill.py")
    if ckpt is None:
        return None, None
    path = os.path.join(cfg.out_dir, "ckpt.pt")
    saved = ckpt.get("distill_config")
    if saved is None or any(k not in ckpt for k in (*CKPT_KEYS, "teacher")):
        raise UsageError(f"cannot resume from {path}: not a distillation/distill.py checkpoint")
    diff = {k: (saved.get(k), getattr(cfg, k)) for k in RESUME_KEYS if saved.get(k) != getattr(cfg, k)}
    if diff:
        raise UsageError(f"cannot resume from {path}: DCD settings differ (saved, now) {diff}")
    origin = ckpt.get("distilled_from") or {}
    recorded = origin.get("ckpt")
    if recorded and cfg.init != DistillConfig.init:
        same = (cfg.init == recorded if cfg.init.startswith("duo:") or recorded.startswith("duo:")
                else os.path.realpath(cfg.init) == os.path.realpath(recorded))
        if not same:
            raise UsageError(f"--init {cfg.init}: the run in {cfg.out_dir} distils {recorded}, which --resume 1 "
                             f"continues; leave --init out to resume it, or distil {cfg.init} in another --out_dir")
    cfg.init = recorded or cfg.init
    return ckpt, {"train_config": ckpt.get("train_config"), "model_config": ckpt["model_config"], "path": recorded,
                  "step": origin.get("step"), "distill_config": origin.get("distill_config")}


def make_teacher(raw_model):
    """A frozen copy of the student in eval mode: no dropout in the targets (Duo's teacher inherits train mode)."""
    return copy.deepcopy(raw_model).eval().requires_grad_(False)


def dcd_step(run, teacher, cfg, env, x0, mask=None):
    """One optimizer step of DCD: train.train_step with DCD's draws (draw_pair_noise, for the global batch) and
    per-token loss (dcd_loss_terms, weighted by the mask), the teacher refreshed at the start of a round. -> the
    step's mean loss (a detached 0-dim tensor)."""
    if run.it % cfg.round_iters == 0:        # the round's teacher: the student's live (Duo) or EMA weights
        with torch.no_grad():
            for p, v in zip(teacher.parameters(), run.ema if cfg.teacher == "ema" else run.raw_model.parameters()):
                p.copy_(v)
    it = run.it
    return train.train_step(run, cfg, env, x0, mask, lambda model, x0, mask, t, noise: (
        dcd_loss_terms(model, teacher, cfg, x0, t, it, noise), mask), draw_pair_noise)


def evaluate(run, teacher, cfg, data_dir, env):
    """validation.validation_sums (the same validation set and draws for any world size) of the DCD loss against the
    current teacher at the current round's dt (its pair noise from draw_pair_noise), and of the NELBO. -> this
    rank's float64 sums (DCD loss, its tokens, NELBO, its tokens), added over ranks by the caller (train.loop)."""
    it = max(run.it - 1, 0)           # the step just taken: its round's dt and teacher
    return validation_sums(run, cfg, data_dir, env, lambda model, x0, mask, t, noise: (
        dcd_loss_terms(model, teacher, cfg, x0, t, it, noise), mask), draw_pair_noise)


def checkpoint_extra(cfg, init_ckpt, data_dir, teacher):
    """What a distilled checkpoint adds to train.py's: the base model's train_config (so sample.py and eval_ppl.py
    see its objective, schedule and data), the DCD settings, where it came from, and the round's teacher."""
    return {"train_config": {**(init_ckpt.get("train_config") or {}), "data_dir": data_dir},
            "distill_config": asdict(cfg),
            "distilled_from": {"ckpt": init_ckpt.get("path") or (cfg.init if cfg.init.startswith("duo:") else
                                                                  os.path.abspath(cfg.init)),
                               "step": init_ckpt.get("step"),
                               "distill_config": init_ckpt.get("distill_config")},
            "teacher": {k: v.detach().clone() for k, v in teacher.state_dict().items()}}


# -----------------------------------------------------------------------------------------------

def main(argv=None):
    cfg = parse_config(argv)
    # the launch environment and every flag checked; then this process in its torchrun job, out_dir locked
    return launch(cfg, lambda where: validate(cfg, where.world_size), lambda env, _: distill(cfg, env))


def distill(cfg, env):
    if not cfg.resume:                   # every fault of --init and its data is found before out_dir is made
        weights, init_ckpt = load_init(cfg)
        mcfg, data_dir, meta = base_of(cfg, init_ckpt, init_ckpt, env)
    ckpt, resumed = open_out_dir(cfg)
    if ckpt is not None:
        weights, init_ckpt = None, resumed
        mcfg, data_dir, meta = base_of(cfg, init_ckpt, ckpt, env)
    base = init_ckpt.get("train_config") or {}
    base_loss = base.get("loss", "?")
    plumbing = RunPlumbing(cfg, env, mcfg, meta, export, what="distillation", label=f"dcd {base_loss}",
                           loss_name="DCD loss", extra=lambda: checkpoint_extra(cfg, init_ckpt, data_dir, teacher))
    if plumbing.done(ckpt):
        return 0
    run = train.build_run(cfg, mcfg, env, data_dir)
    if ckpt is not None:
        restore(run, ckpt, env, plumbing.ckpt_path)
    else:
        start_at(run, weights)
    teacher = make_teacher(run.raw_model)
    if ckpt is not None:
        teacher.load_state_dict(ckpt["teacher"])
    teacher_fn = torch.compile(teacher) if plumbing.place_model(run) else teacher
    config = {"distill_config": asdict(cfg), "model_config": asdict(mcfg), "meta": meta,
              "train_config": init_ckpt.get("train_config")}
    schedule = base.get("noise_schedule", "loglinear")
    final_step = diffusion.default_final_step({**init_ckpt, "distill_config": asdict(cfg)})   # --final_step auto's
    with plumbing.start(run, config, describe(cfg, init_ckpt, base_loss, mcfg.vocab_size, env)):
        return train.loop(run, cfg, plumbing, lambda x0, mask: dcd_step(run, teacher_fn, cfg, env, x0, mask),
                          (lambda: evaluate(run, teacher_fn, cfg, data_dir, env),      # validation DCD loss, NELBO
                           # evaluate's sums, added over ranks -> the log.jsonl record, with the round's dt
                           lambda sums: {**validation_record(sums, data_dir, "val_dcd"),
                                         "dt": step_size(max(run.it - 1, 0), cfg)}),
                          lambda: print_samples(run, cfg, meta, env, schedule, final_step))


def describe(cfg, init_ckpt, base_loss, K, env):
    """The distillation in one line, printed before the progress bar starts."""
    a_lo, a_hi = curriculum.alpha_range(K, cfg.gamma_min, cfg.gamma_max)
    rounds = (cfg.max_iters + cfg.round_iters - 1) // cfg.round_iters
    return (f"DCD of {cfg.init} (loss {base_loss}, step {init_ckpt.get('step')}, "
            f"{'EMA' if cfg.init_ema else 'live'} weights): {rounds} rounds of {cfg.round_iters} steps, "
            f"dt = 1/{cfg.T} ... {step_size(cfg.max_iters - 1, cfg):.4g}, gamma in [{cfg.gamma_min}, "
            f"{cfg.gamma_max}] -> alpha in [{a_lo:.4f}, {a_hi:.4f}], {cfg.divergence}, "
            f"teacher = {cfg.teacher} weights; {cfg.batch_size} sequences/step on {env.describe()}")


if __name__ == "__main__":
    run_cli(main, DataError, FloatingPointError, FileNotFoundError,
            oom_hint="lower the micro-batch: raise --grad_accum (or lower --batch_size)")
