"""
Training objectives for uniform-state diffusion language models (USDMs).

Copy this file alone into your project: it imports nothing but torch and math.
Every loss takes logits (B, L, V) and token ids (B, L) and returns PER-TOKEN losses (B, L);
the caller masks (padding) and reduces (Duo: sum over valid tokens / number of valid tokens).

Paper: "Simple Denoising Diffusion Language Models" (SDDLM). Equation names refer to its labels:
  Eq. (naive)      naive_denoising_loss   -log p(x0|xt) at every position (unstable ablation)
  Eq. (denoising)  sddlm_loss             -log p(x0|xt) only where xt != x0
  Eq. (negative)   sddlm_v1_loss          ... + log(p(x_hat|xt) + eps), x_hat ~ U(V), eps on both terms
                   sddlm_v2_loss          ... the negative token is xt itself
  Eq. (usdm)       usdm_nelbo_loss        Duo's continuous-time NELBO (sign-corrected, >= 0)
                   ar_loss                next-token cross-entropy (autoregressive baseline)

The SDDLM family never builds a (B, L, V) float32 tensor: one log-sum-exp over the vocabulary
(computed in float32, chunked over rows) and gathers are all they need, so bf16 logits stay bf16.
"""
import math

import torch

# eps bounds the gradient of log(p + eps) for tiny p: it stops pushing a token down once p << eps.
# We pick it well below 1/V for every vocabulary we use (GPT-2 1/50258 = 2e-5, Llama 1/32000 = 3e-5),
# so the regulariser still approximates -KL(U || p) of the Appendix, while the loss stays bounded
# below by log(eps) ~ -13.8 per token (without eps, log p(x_hat) -> -inf and training diverges).
EPS = 1e-6


def _at_least_fp32(x):
    return x if x.dtype == torch.float64 else x.float()


def _chunked_lse(flat, chunk_rows):
    """(N, V) any float dtype -> (N,) log-sum-exp in at least float32, computed chunk_rows rows at a time."""
    lse = torch.empty(flat.shape[0], dtype=torch.promote_types(flat.dtype, torch.float32), device=flat.device)
    for i in range(0, flat.shape[0], chunk_rows):
        lse[i:i + chunk_rows] = torch.logsumexp(flat[i:i + chunk_rows].to(lse.dtype), dim=-1)
    return lse


class _LogSumExpFP32(torch.autograd.Function):
    """logsumexp over the last dim in float32, chunked over rows; saves only the input and the result."""

    @staticmethod
    def forward(ctx, logits, chunk_rows):
        lse = _chunked_lse(logits.reshape(-1, logits.shape[-1]), chunk_rows)
        ctx.save_for_backward(logits, lse)
        ctx.chunk_rows = chunk_rows
        return lse.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_lse):
        logits, lse = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        g = grad_lse.reshape(-1).to(lse.dtype)
        grad = torch.empty_like(flat)
        for i in range(0, flat.shape[0], ctx.chunk_rows):
            j = slice(i, i + ctx.chunk_rows)
            grad[j] = (torch.exp(flat[j].to(lse.dtype) - lse[j, None]) * g[j, None]).to(grad.dtype)
        return grad.view(logits.shape), None


class _LogProbsFP32(torch.autograd.Function):
    """log p(tokens_i) for k token sets from one float32 log-sum-exp pass, chunked over rows. The backward
    forms sum_i g_i (onehot_i - softmax) in float32 per chunk and rounds once to the logits' dtype (a gather
    plus a separate logsumexp would round the target entry twice: ~13% gradient error at p = 0.9 in bf16)."""

    @staticmethod
    def forward(ctx, logits, tokens, chunk_rows):
        flat = logits.reshape(-1, logits.shape[-1])
        tok = tokens.reshape(tokens.shape[0], -1)                                      # (k, N)
        lse = _chunked_lse(flat, chunk_rows)
        ctx.save_for_backward(logits, lse, tok)
        ctx.chunk_rows = chunk_rows
        return (flat.gather(-1, tok.T).T.to(lse.dtype) - lse).view(tokens.shape)

    @staticmethod
    def backward(ctx, grad_out):
        logits, lse, tok = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        g = grad_out.reshape(tok.shape).to(lse.dtype)
        g_total, grad = g.sum(0), torch.empty_like(flat)
        for i in range(0, flat.shape[0], ctx.chunk_rows):
            j = slice(i, i + ctx.chunk_rows)
            chunk = torch.exp(flat[j].to(lse.dtype) - lse[j, None]) * -g_total[j, None]
            for t, gt in zip(tok[:, j], g[:, j]):
                chunk.scatter_add_(-1, t[:, None], gt[:, None])
            grad[j] = chunk.to(grad.dtype)
        return grad.view(logits.shape), None, None


def _chunk_rows(logits, chunk_elems):
    return max(1, chunk_elems // logits.shape[-1])


def logsumexp_fp32(logits, chunk_elems=1 << 25):
    """log sum_v exp(logits[..., v]) in float32 without materialising a float32 copy of the logits.
    logits: (..., V) any float dtype -> (...) float32 (float64 for float64 logits)."""
    if logits.dtype in (torch.float32, torch.float64):
        return torch.logsumexp(logits, dim=-1)
    return _LogSumExpFP32.apply(logits, _chunk_rows(logits, chunk_elems))


def log_probs(logits, *token_sets, chunk_elems=1 << 25):
    """log p(tokens | .) for each (B, L) id tensor in token_sets, from logits (B, L, V) -> tuple of (B, L),
    float32 (float64 for float64 logits). One log-sum-exp over the vocabulary, gathers, no (B, L, V)
    float32 tensor for low-precision logits."""
    tokens = torch.stack(token_sets)
    if logits.dtype in (torch.float32, torch.float64):
        lse = torch.logsumexp(logits, dim=-1)
        out = torch.stack([logits.gather(-1, t.unsqueeze(-1)).squeeze(-1) for t in token_sets]) - lse
    else:
        out = _LogProbsFP32.apply(logits, tokens, _chunk_rows(logits, chunk_elems))
    return tuple(out)


def log_p_plus_eps(log_p, eps):
    """log(p + eps) computed from log p as logaddexp(log p, log eps): exact and stable for tiny p."""
    if eps == 0:
        return log_p
    return torch.logaddexp(log_p, torch.full_like(log_p, math.log(eps)))


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
    Cost: one float32 pass over the full vocabulary (the price the SDDLM losses avoid)."""
    K = logits.shape[-1]
    log_p = torch.log_softmax(_at_least_fp32(logits), dim=-1)
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
    logits (B, L, V) computed on x (the last position is dropped) or (B, L-1, V) on x[:, :-1] -> (B, L-1)."""
    logits = logits[:, : x.shape[1] - 1]
    return -log_probs(logits, x[:, 1:])[0]
