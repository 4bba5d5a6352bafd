"""
The objective of one training step, paper Algorithm 1: corrupt clean tokens x0 at times t, run the model on
the noisy tokens xt, score its output with the per-token loss of losses.py named by --loss (OBJECTIVES).

    draws = draw_noise(...)                    # keep-uniforms, replacement tokens, SDDLM-V1 negatives
    c = corrupt(cfg, x0, t, it, K, gen, draws)  # xt ~ q_t(. | x0), Eq. (discrete_marginal), or Duo's curriculum
    out = model(c.net_in, sigma(alpha_t))       # a losses.Head (or the logits, for FULL_LOGITS)
    per_token = OBJECTIVES[cfg.loss](out, c, cfg.eps)

loss_terms is those four lines; train.py takes the token mean and the optimizer step.
"""
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import diffusion
import losses


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
