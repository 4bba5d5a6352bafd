"""
Training objectives for uniform-state diffusion language models (USDMs), as the formulas that run.

Copy this file alone into your project (test_losses.py, its tests, travels with it): it imports nothing but
torch and math. Every loss takes logits (B, L, V) and token ids (B, L) and returns PER-TOKEN losses (B, L);
the caller masks (padding) and reduces (Duo: sum over valid tokens / number of valid tokens).

Paper: "Simple Denoising Diffusion Language Models" (SDDLM). Equation names refer to its labels:
  Eq. (naive)      naive_denoising_loss   -log p(x0|xt) at every position (unstable ablation)
  Eq. (denoising)  sddlm_loss             -log p(x0|xt) only where xt != x0
  Eq. (negative)   sddlm_v1_loss          ... + log(p(x_hat|xt) + eps), x_hat ~ U(V), eps on both terms
                   sddlm_v2_loss          ... the negative token is xt itself
  Eq. (usdm)       usdm_nelbo_loss        Duo's continuous-time NELBO (sign-corrected, >= 0)
                   ar_loss                next-token cross-entropy (autoregressive baseline)

The SDDLM family and ar_loss need log p of one or two tokens per position: one log-sum-exp over the vocabulary
and gathers (log_probs), never a (B, L, V) float32 tensor for bf16 logits. In place of the logits they also take
a fused output layer: any object with .shape (B, L, V), row slicing and .log_probs(*token_sets), such as
kernels/fused_head.py's Head, which never builds the (B, L, V) logits (training's default on CUDA).
"""
import math

import torch
from torch.utils.checkpoint import checkpoint

# eps bounds the gradient of log(p + eps) for tiny p: it stops pushing a token down once p << eps.
# We pick it well below 1/V for every vocabulary we use (GPT-2 1/50258 = 2e-5, Llama 1/32000 = 3e-5),
# so the regulariser still approximates -KL(U || p) of the Appendix, while the loss stays bounded
# below by log(eps) ~ -13.8 per token (without eps, log p(x_hat) -> -inf and training diverges).
EPS = 1e-6


def naive_denoising_loss(logits, x0):
    """Eq. (naive): -log p_theta(x0^l | xt) at every position l. (B, L, V), (B, L) -> (B, L)."""
    return -log_probs(logits, x0)[0]


def sddlm_loss(logits, x0, xt):
    """Eq. (denoising): -log p_theta(x0^l | xt) * 1[xt^l != x0^l] (only noise-replaced tokens)."""
    return -log_probs(logits, x0)[0] * (xt != x0)


def sddlm_v1_loss(logits, x0, xt, neg=None, eps=EPS, generator=None):
    """Eq. (negative) with eps on both terms (paper Sec. 3.2):
        (-log(p(x0|xt) + eps) + log(p(neg|xt) + eps)) * 1[xt != x0],   neg ~ U(V) when None.
    In expectation over neg the second term is -KL(U || p) + const (Appendix A.1): anti-uniform sharpening."""
    if neg is None:
        neg = torch.randint(0, logits.shape[-1], x0.shape, device=x0.device, generator=generator)
    log_p_x0, log_p_neg = log_probs(logits, x0, neg)
    return (log_p_plus_eps(log_p_neg, eps) - log_p_plus_eps(log_p_x0, eps)) * (xt != x0)


def sddlm_v2_loss(logits, x0, xt, eps=EPS):
    """SDDLM-V2: Eq. (negative) with the negative token x_hat = xt (the corrupted token itself)."""
    return sddlm_v1_loss(logits, x0, xt, neg=xt, eps=eps)


def usdm_nelbo_loss(logits, x0, xt, alpha_t, dalpha_t):
    """Eq. (usdm): Duo's continuous-time NELBO integrand for the uniform-state process, per token, >= 0.

    With K = V, x_bar = K alpha e_x0 + (1 - alpha) 1 and x_bar_theta = K alpha p_theta + (1 - alpha) 1,
    z = xt, the paper writes  -alpha'/(K alpha) [K/x_bar_z - K/x_bar_theta_z - sum_j x_bar_j/x_bar_z
    log(x_bar_j x_bar_theta_z / (x_bar_z x_bar_theta_j))].  As printed that is <= 0: the bracket is
    itself <= 0 and alpha' < 0, so the leading minus sign is wrong (Duo's code has +alpha'/(K alpha)).
    Using sum_j x_bar_j = sum_j x_bar_theta_j = K the bracket rearranges into two non-negative parts,
        loss = -alpha' / (alpha x_bar_z) * [ (r - 1 - log r) + KL_K(x_bar || x_bar_theta) / K ],
    r = x_bar_z / x_bar_theta_z, KL_K = sum_j x_bar_j log(x_bar_j / x_bar_theta_j),
    which has no catastrophic cancellation (the printed form subtracts terms of size K/(1-alpha)) and is
    exactly zero when p_theta = one-hot(x0). It equals lim_{dt->0} KL(q(x_s|xt,x0) || q(x_s|xt,p_theta))/dt.

    logits (B, L, V); x0, xt (B, L); alpha_t, dalpha_t broadcastable to (B, L) (e.g. (B, 1)) -> (B, L).
    Cost: one float32 pass over the full vocabulary (the price the SDDLM losses avoid; the same numbers in
    chunks of rows: kernels/fused_head.usdm_nelbo_loss_lean)."""
    K = logits.shape[-1]
    log_p = torch.log_softmax(logits.to(_at_least_fp32(logits.dtype)), dim=-1)
    alpha_t = torch.as_tensor(alpha_t, dtype=log_p.dtype, device=logits.device)
    dalpha_t = torch.as_tensor(dalpha_t, dtype=log_p.dtype, device=logits.device)
    while alpha_t.dim() < x0.dim():
        alpha_t, dalpha_t = alpha_t.unsqueeze(-1), dalpha_t.unsqueeze(-1)
    a = 1 - alpha_t                      # x_bar_j for j != x0
    log_c = torch.log(K * alpha_t) - torch.log(a)   # c = K alpha / (1 - alpha)
    # u_j = log(x_bar_theta_j / a) = log1p(c p_j) = softplus(log c + log p_j)
    u = torch.nn.functional.softplus(log_c.unsqueeze(-1) + log_p)          # (B, L, V)
    u_sum = u.sum(-1)
    u_x = u.gather(-1, x0.unsqueeze(-1)).squeeze(-1)
    u_z = u.gather(-1, xt.unsqueeze(-1)).squeeze(-1)
    log1p_c = torch.nn.functional.softplus(log_c)                          # log(x_bar_x0 / a)
    # KL_K = (a + K alpha) log(x_bar_x0 / x_bar_theta_x0) + a sum_{j != x0} log(a / x_bar_theta_j)
    kl = (a + K * alpha_t) * (log1p_c - u_x) - a * (u_sum - u_x)
    is_x0 = (xt == x0)
    log_r = torch.where(is_x0, log1p_c, torch.zeros_like(u_z)) - u_z     # log(x_bar_z / x_bar_theta_z)
    r_term = torch.expm1(log_r) - log_r                                     # r - 1 - log r >= 0
    x_bar_z = torch.where(is_x0, a + K * alpha_t, a)
    return -dalpha_t / (alpha_t * x_bar_z) * (r_term + kl / K)


def ar_loss(logits, x):
    """Next-token cross-entropy for the autoregressive baseline: -log p(x^{l+1} | x^{<=l}).
    logits (B, L, V) computed on x (the last position is dropped), or on x[:, :-1] -> (B, L-1)."""
    return -log_probs(logits[:, : x.shape[1] - 1], x[:, 1:])[0]


# ---------------------------------------------------------------------------------------------------------
# the two reductions every loss above is written in

def log_probs(logits, *token_sets, chunk_elems=1 << 25):
    """log p(tokens) = logits[tokens] - logsumexp(logits) for each (B, L) id tensor in token_sets -> a tuple of
    (B, L), in float32 (float64 for float64 logits). A fused output layer (not a tensor) computes them itself.

    bf16 / fp16 logits are lifted to float32 chunk_elems logits (a chunk of rows) at a time, and each chunk is
    recomputed in backward (torch.utils.checkpoint), so no (B, L, V) float32 tensor is ever held; a logit's
    gradient (g onehot - g softmax) is then summed in float32 and rounded once to the logits' dtype (in two bf16
    parts, a target's p - 1 would err by ~13% at p = 0.9)."""
    if not isinstance(logits, torch.Tensor):
        return logits.log_probs(*token_sets)
    tokens = torch.stack(token_sets, dim=-1)                                 # (B, L, k)
    if logits.dtype in (torch.float32, torch.float64):
        return tuple(_picked_log_softmax(logits, tokens).unbind(-1))
    flat, tok = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1, tokens.shape[-1])
    rows = max(1, chunk_elems // flat.shape[-1])
    out = [checkpoint(_picked_log_softmax, z, t, use_reentrant=False, preserve_rng_state=False)
           for z, t in zip(flat.split(rows), tok.split(rows))]
    return tuple(torch.cat(out).view(tokens.shape).unbind(-1))


def _picked_log_softmax(logits, tokens):
    """logits (..., V) any float dtype, tokens (..., k) -> log p of each token, (..., k) in at least float32.
    log_softmax saves only its output for backward, like logsumexp saves its input, and runs as one fused
    kernel each way (on CPU half the time of logsumexp's composite of max, exp, sum and its backward)."""
    z = logits.to(_at_least_fp32(logits.dtype))
    return torch.log_softmax(z, dim=-1).gather(-1, tokens)


def log_p_plus_eps(log_p, eps):
    """log(p + eps) computed from log p as logaddexp(log p, log eps): exact and stable for tiny p."""
    if eps == 0:
        return log_p
    return torch.logaddexp(log_p, torch.full_like(log_p, math.log(eps)))


def _at_least_fp32(dtype):
    return torch.promote_types(dtype, torch.float32)
