"""
The uniform-state diffusion process: noise schedules, the forward marginal, the reverse posterior and the
ancestral (or Psi predictor-corrector) sampling step that draws from it, and Algorithm 1's objective with the
table of objectives (Duo's Gaussian-guided curriculum, which replaces the forward process early in training, is
curriculum/gaussian.py).

Each token x0 is kept with probability alpha_t and otherwise replaced by a token drawn uniformly from
the whole vocabulary of size K (which may be x0 itself):
  Eq. (discrete_marginal)  q_t(. | x0) = Cat(alpha_t e_x0 + (1 - alpha_t) / K)       -> sample_xt
  Eq. (reverse)            q(x_s | x_t, x0), s < t, as the three-part mixture of       -> posterior_weights,
                           its terms; the sampler draws from it                           ancestral_step_from_logits
  Psi step (Duo, Ch. II)   kappa Eq. (reverse) + (1 - kappa) q(x0 | x_t, x_theta) renoised to s -> psi_weights
The law as a (B, L, K) tensor, and the ancestral step on probabilities, are the tests' reference forms
(tests/laws.py): nothing here builds the posterior over the vocabulary.
Shapes: x0, xt (B, L) int64; probabilities (B, L, K); alpha_t one per sequence, (B, 1) or a float.
"""
import math
from dataclasses import dataclass
from typing import Callable

import torch

import curriculum.gaussian as curriculum
import losses
from kernels import fused_head
from kernels.gumbel import block_logsumexp, gumbel_argmax

T_MIN = 1e-3   # Duo trains on t in [1e-3, 1]


# -----------------------------------------------------------------------------------------------
# noise schedules: t in [0, 1] -> (alpha_t, d alpha_t / dt)

def log_linear_schedule(t, eps=1e-3):
    """Duo's log-linear schedule alpha_t = 1 - (1 - eps) t, so alpha_1 = eps (not 0)."""
    t = torch.as_tensor(t, dtype=torch.float64 if not torch.is_tensor(t) else t.dtype)
    return 1 - (1 - eps) * t, torch.full_like(t, -(1 - eps))


def cosine_schedule(t, eps=1e-3):
    """alpha_t = 1 - cos(pi/2 (1 - t')) with t' = (1 - eps) t (the chain factor (1 - eps) is kept in alpha')."""
    t = torch.as_tensor(t, dtype=torch.float64 if not torch.is_tensor(t) else t.dtype)
    tp = (1 - eps) * t
    return 1 - torch.cos(math.pi / 2 * (1 - tp)), -torch.sin(math.pi / 2 * (1 - tp)) * math.pi / 2 * (1 - eps)


SCHEDULES = {"loglinear": log_linear_schedule, "cosine": cosine_schedule}


def sigma_from_alpha(alpha_t):
    """The network is conditioned on sigma = -log alpha_t (as Duo), not on t."""
    return -torch.log(alpha_t)


def sample_t(n, generator=None, t_min=T_MIN, device=None):
    """Stratified ("antithetic") times over a batch of n: t_i = t_min + (1 - t_min)(u_i + i)/n, u_i ~ U(0,1).
    Draw n = the GLOBAL batch from a generator seeded identically on every rank, then slice per rank and
    micro-batch (plumbing.distributed.rank_slice), so the strata cover the global batch as in Duo. -> (n,) float32."""
    u = torch.rand(n, generator=generator, device=device)
    e = (u + torch.arange(n, device=device)) / n
    return t_min + (1 - t_min) * e


# -----------------------------------------------------------------------------------------------
# forward process and reverse posterior

def sample_xt(x0, alpha_t, vocab_size, generator=None, draws=None):
    """Eq. (discrete_marginal): keep each token with prob alpha_t, else a uniform token of the vocabulary.
    x0 (B, L) int64; alpha_t broadcastable to x0, e.g. (B, 1) -> xt (B, L).
    draws: optional pre-drawn (u ~ U(0,1), uniform token ids), each (B, L), e.g. slices of global-batch
    draws so that a DDP run corrupts every sequence exactly as a single-process run would."""
    if draws is None:
        draws = (torch.rand(x0.shape, generator=generator, device=x0.device),
                 torch.randint(0, vocab_size, x0.shape, generator=generator, device=x0.device))
    u, noise = draws
    return torch.where(u < torch.as_tensor(alpha_t, device=x0.device), x0, noise)


def _per_sequence(a, like):
    """alpha as a tensor of like's dtype, shaped to broadcast against like (e.g. (B, 1) -> (B, 1, 1) against
    (B, L, K)); a Python float stays a float (on CUDA, a new device tensor from a float would wait for the GPU)."""
    if not torch.is_tensor(a):
        return float(a)
    a = a.to(like.dtype)
    while a.dim() < like.dim():
        a = a.unsqueeze(-1)
    return a


def posterior_weights(x0_at_xt, K, alpha_t, alpha_s):
    """Eq. (reverse) grouped by what its four terms multiply: e_xt (the first two), x0, or the uniform 1 / K,
        q(x_s | x_t, x0) = m_x0 x0 + m_unif / K + m_stay e_xt,      Z = K a_t x0[x_t] + 1 - a_t,
        m_x0 = (a_s - a_t) / Z,  m_unif = (1 - a_{t|s})(1 - a_s) / Z,  m_stay = (K a_t x0[x_t] + a_{t|s} - a_t) / Z,
    which sum to 1 (the numerator sums to Z). x0 enters only through itself and x0[x_t], so the sampler draws from
    the three-part mixture without building the (B, L, K) law (mixture_step; tests/laws.py builds it, the reference).
    x0_at_xt = x0[x_t], any shape; alphas floats or (B, 1) -> (m_x0, m_unif, m_stay), each of x0_at_xt's shape."""
    a_t = _per_sequence(alpha_t, x0_at_xt)
    a_s = _per_sequence(alpha_s, x0_at_xt)
    Z = K * a_t * x0_at_xt + 1 - a_t
    return (a_s - a_t) / Z, (1 - a_t / a_s) * (1 - a_s) / Z, (K * a_t * x0_at_xt + a_t / a_s - a_t) / Z


def corrector_weights(p_z, K, alpha_t, alpha_s):
    """The Psi-samplers' corrector: the posterior to level 0, q(x0 | x_t, x_theta) = (K a_t x_theta[x_t] e_xt
    + (1 - a_t) x_theta) / Z (Eq. (reverse) with a_s = 1), pushed forward to level s by Eq. (discrete_marginal),
    a_s q(x0 | x_t, x_theta) + (1 - a_s) / K: the same three parts as posterior_weights, with weights
        m_theta = a_s (1 - a_t) / Z,  m_unif = 1 - a_s,  m_stay = a_s K a_t x_theta[x_t] / Z.
    It renoises from x_t's level to s whatever s is, so s = t (a loop step) still moves tokens.
    p_z = x_theta[x_t] (B, L) float64 -> (m_theta, m_unif), each (B, L) float64."""
    a_t = _per_sequence(alpha_t, p_z)
    a_s = _per_sequence(alpha_s, p_z)
    Z = K * a_t * p_z + 1 - a_t
    return a_s * (1 - a_t) / Z, (1 - a_s) * torch.ones_like(p_z)


def psi_weights(p_z, K, alpha_t, alpha_s, kappa=1.0):
    """The Psi step (Duo, Chapter II): x_s ~ kappa q(x_s | x_t, x_theta) + (1 - kappa) a_s q(x0 | x_t, x_theta)
    + (1 - kappa)(1 - a_s) / K, i.e. kappa posterior_weights + (1 - kappa) corrector_weights (a mixture of two
    three-part mixtures over the same three parts). kappa = 1 is Eq. (reverse) itself, bit for bit.
    p_z (B, L) float64; kappa a float in [0, 1] -> (m_theta, m_unif), each (B, L) float64."""
    m_theta, m_unif, _ = posterior_weights(p_z, K, alpha_t, alpha_s)
    if kappa == 1:
        return m_theta, m_unif
    c_theta, c_unif = corrector_weights(p_z, K, alpha_t, alpha_s)
    return kappa * m_theta + (1 - kappa) * c_theta, kappa * m_unif + (1 - kappa) * c_unif


def mixture_step(xt, p_z, draw_x_theta, K, alpha_t, alpha_s, generator, kappa=1.0):
    """Draw x_s from the three-part mixture of psi_weights (draw from x_theta, draw uniformly, or stay at x_t);
    kappa = 1 is Eq. (reverse) (posterior_weights): one uniform u per token picks the part (x_theta below
    m_theta, uniform below m_theta + m_unif, else x_t), so each part is taken with its weight exactly.
    Every token gets its x_theta draw and the pick keeps it or not: no count of the tokens that pick x_theta,
    so no wait for the GPU (a host sync) inside the sampling loop.
    p_z = x_theta[x_t] (B, L) float64; draw_x_theta() -> (B, L) draws from x_theta."""
    m_theta, m_unif = psi_weights(p_z, K, alpha_t, alpha_s, kappa)
    u = torch.rand(xt.shape, generator=generator, device=xt.device, dtype=torch.float64)
    xs = torch.where(u < m_theta + m_unif, torch.randint(0, K, xt.shape, generator=generator, device=xt.device), xt)
    return torch.where(u < m_theta, draw_x_theta(), xs)


def ancestral_step_from_logits(xt, logits, alpha_t, alpha_s, generator=None, kappa=1.0):
    """One reverse step x_s ~ q(x_s | x_t, x_theta) (Eq. reverse with x_theta = softmax(logits) for x0), exact in
    distribution, drawn from its three-part mixture (mixture_step), the (B, L, K) posterior never built; alpha_s = 1
    is the final 'ancestral' denoising step; kappa < 1: the Psi step of psi_weights, the same draw. One pass over
    the vocabulary: one float32 log-sum-exp pass per block of tokens (block_logsumexp; one fused kernel on CUDA)
    gives the normaliser, so x_theta[x_t] and the per-token mixture weights (float64 only for these per-token
    scalars); the x_theta draws are the two-stage Gumbel-max of gumbel_argmax on those block log-sum-exps and one
    block of logits per token (O(K / block + block) per token). No float64 and no probability tensor over the
    vocabulary. xt (B, L); logits (B, L, K) any float dtype, -inf marking tokens x_theta excludes (e.g. outside a
    nucleus) -> x_s (B, L)."""
    K = logits.shape[-1]
    block_lse = block_logsumexp(logits)                                      # (B, L, ceil(K / block))
    log_p_z = logits.gather(-1, xt.unsqueeze(-1)).squeeze(-1).to(block_lse.dtype) - torch.logsumexp(block_lse, -1)
    p_z = torch.exp(log_p_z.double())
    flat, flat_lse = logits.reshape(-1, K), block_lse.reshape(-1, block_lse.shape[-1])
    return mixture_step(xt, p_z, lambda: gumbel_argmax(flat, generator, block_lse=flat_lse).view(xt.shape),
                         K, alpha_t, alpha_s, generator, kappa)


# -----------------------------------------------------------------------------------------------
# Algorithm 1: the objective of one training step. Corrupt clean tokens x0 at times t, run the model on the
# noisy tokens xt, score its output with the per-token loss of losses.py named by --loss (OBJECTIVES):
#     draws = draw_noise(...)                     # keep-uniforms, replacement tokens, SDDLM-V1 negatives
#     c = corrupt(cfg, x0, t, it, K, gen, draws)  # xt ~ q_t(. | x0), Eq. (discrete_marginal), or Duo's curriculum
#     out = model(c.net_in, sigma(alpha_t))       # the logits (or a fused Head: --head)
#     per_token = OBJECTIVES[cfg.loss](out, c, cfg.eps)
# loss_terms is those four lines; train.py takes the token mean and the optimizer step.


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


@dataclass(frozen=True)
class Objective:
    """What --loss names: the per-token loss, per_token(out, c, eps) -> (B, L), of the model's output `out` on the
    corrupted batch c, and the kind of objective it is, which the run reads here and nowhere else.
    causal: the autoregressive baseline: a causal model without time input (train.model_config_for), fed the clean
      x0; its loss at position i scores token i + 1, so it is (B, L - 1) and the batch's mask aligns as mask[:, 1:].
    full_logits: always given the (B, L, V) logits; the others, with --head fused (auto: on CUDA), get a
      kernels.fused_head.Head (the last hidden state and the output layer: the loss computes the logits chunk by
      chunk and never holds all of them).
    final_step: the sampler's final step for its models (default_final_step), measured (RESULTS.md, few-step
      generation: the lower Gen PPL among final steps whose sample entropy stays within 1 nat of the data's):
      greedy (Duo's tail) for the NELBO, whose x_theta is trained on every position, x_t included; ancestral for
      the SDDLM family, whose x_theta puts (almost) no mass on x_t, so argmax x_theta would replace clean tokens
      and the entropy collapse. The same with or without distillation."""
    per_token: Callable
    causal: bool = False
    full_logits: bool = False
    final_step: str = "ancestral"

    def __call__(self, out, c, eps):
        return self.per_token(out, c, eps)

    def token_weights(self, mask):
        """The weights of the per-token loss's terms: the batch's mask (B, L) (padding 0), aligned as the loss
        scores tokens; None (no padding) stays None."""
        return None if mask is None else (mask[:, 1:] if self.causal else mask)


# --loss -> its Objective: the one place a loss is chosen.
OBJECTIVES = {
    "sddlm": Objective(lambda out, c, eps: losses.sddlm_loss(out, c.x0, c.xt)),
    "sddlm_v1": Objective(lambda out, c, eps: losses.sddlm_v1_loss(out, c.x0, c.xt, neg=c.neg, eps=eps)),
    "sddlm_v2": Objective(lambda out, c, eps: losses.sddlm_v2_loss(out, c.x0, c.xt, eps=eps)),
    "naive": Objective(lambda out, c, eps: losses.naive_denoising_loss(out, c.x0)),
    # Duo's NELBO computed as Duo does (the reference); duo_lean is the same, memory-lean
    "duo": Objective(lambda out, c, eps: losses.usdm_nelbo_loss(out, c.x0, c.xt, c.alpha_t, c.dalpha_t),
                     full_logits=True, final_step="greedy"),
    "duo_lean": Objective(lambda out, c, eps: fused_head.usdm_nelbo_loss_lean(out, c.x0, c.xt, c.alpha_t, c.dalpha_t),
                          final_step="greedy"),
    "ar": Objective(lambda out, c, eps: losses.ar_loss(out, c.x0), causal=True),
}
FINAL_STEPS = ("ancestral", "greedy", "none")   # the sampler's last step at t_end (sample.py --final_step)


def default_final_step(ckpt):
    """--final_step auto: the final step of the checkpoint's objective (Objective.final_step), base or distilled;
    ancestral where it names none. ckpt: a checkpoint dict (its train_config names the objective)."""
    loss = (ckpt.get("train_config") or {}).get("loss")
    return OBJECTIVES[loss].final_step if isinstance(loss, str) and loss in OBJECTIVES else "ancestral"


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
        tau = curriculum.tau_schedule(it, cfg.log10_tau_start, cfg.log10_tau_end, 0, cfg.curriculum_iters)
        xt, net_in, alpha_t, dalpha_t = curriculum.curriculum_sample(
            x0, t, vocab_size, cfg.gamma_min, cfg.gamma_max, tau, generator)
    else:
        alpha_t, dalpha_t = SCHEDULES[cfg.noise_schedule](t)
        alpha_t, dalpha_t = alpha_t.unsqueeze(-1), dalpha_t.unsqueeze(-1)
        xt = net_in = sample_xt(x0, alpha_t, vocab_size, draws=draws[:2])
    return Corrupted(x0, xt, net_in, draws[2], alpha_t, dalpha_t)


def loss_terms(model, cfg, x0, t, it, generator, draws=None):
    """Per-token training loss (B, L) (B, L - 1 for a causal objective) of clean x0 (B, L) at times t (B,), and the
    model's output (the logits (B, L, V), or a fused_head.Head: Objective). draws: this micro-batch's slice of
    draw_noise (else drawn from generator)."""
    objective, V = OBJECTIVES[cfg.loss], model.config.vocab_size
    if draws is None:
        draws = draw_noise(x0.shape[0], x0.shape[1], V, generator, x0.device)
    # --head fused: the output layer as a Head, each chunk's logits kept for backward or (fused_recompute) recomputed
    head = {} if objective.full_logits or not fused_head.fused_head_wanted(cfg.head, x0.device) else \
        {"return_head": True, "keep_logits": cfg.head != "fused_recompute"}
    if objective.causal:                  # the AR baseline: the clean tokens, no time
        c = Corrupted(x0, x0, x0, draws[2], None, None)
        out = model(x0, **head)
    else:
        c = corrupt(cfg, x0, t, it, V, generator, draws)
        out = model(c.net_in, sigma_from_alpha(c.alpha_t.squeeze(-1)), **head)
    return objective(out, c, cfg.eps), out


def token_mean(per_token, weights):
    """The mean of the per-token loss over the tokens weights (Objective.token_weights; None: all) keeps."""
    if weights is None:
        return per_token.mean()
    return (per_token * weights).sum() / weights.sum().clamp_min(1)
