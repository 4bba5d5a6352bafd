"""
Training objectives for uniform-state diffusion language models (USDMs).

Copy this file alone into your project: it imports nothing but torch, math and typing.
Every loss takes logits (B, L, V) and token ids (B, L) and returns PER-TOKEN losses (B, L);
the caller masks (padding) and reduces (Duo: sum over valid tokens / number of valid tokens).
In place of the logits the SDDLM losses, ar_loss and usdm_nelbo_loss_lean also take a Head (the final hidden
state and the output layer): they then compute the logits in chunks of rows, never all of them at once.

Paper: "Simple Denoising Diffusion Language Models" (SDDLM). Equation names refer to its labels:
  Eq. (naive)      naive_denoising_loss   -log p(x0|xt) at every position (unstable ablation)
  Eq. (denoising)  sddlm_loss             -log p(x0|xt) only where xt != x0
  Eq. (negative)   sddlm_v1_loss          ... + log(p(x_hat|xt) + eps), x_hat ~ U(V), eps on both terms
                   sddlm_v2_loss          ... the negative token is xt itself
  Eq. (usdm)       usdm_nelbo_loss        Duo's continuous-time NELBO (sign-corrected, >= 0)
                   usdm_nelbo_loss_lean   the same numbers, computed in chunks of rows (memory-lean)
                   ar_loss                next-token cross-entropy (autoregressive baseline)

The SDDLM family never builds a (B, L, V) float32 tensor: one log-sum-exp over the vocabulary
(computed in float32, chunked over rows) and gathers are all they need, so bf16 logits stay bf16.
Given a Head they never build the (B, L, V) logits either: each chunk's logits are computed, reduced to a
log-sum-exp and the gathered entries, and recomputed in backward (the idea of fused linear + cross-entropy;
logits that fit in one chunk, 2^27 numbers, are simply kept).
"""
import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

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
        neg = torch.randint(0, vocab_size_of(logits), x0.shape, device=x0.device, generator=generator)
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


def usdm_nelbo_loss_lean(logits, x0, xt, alpha_t, dalpha_t, chunk_elems=1 << 25):
    """usdm_nelbo_loss computed chunk_elems // V rows at a time, each chunk recomputed in backward: the same
    numbers (equal to float32 rounding, values and gradients) without its (B, L, V) float32 tensors, and, given a
    Head, without the (B, L, V) logits. logits (B, L, V) or a Head; the rest as usdm_nelbo_loss -> (B, L)."""
    shape = x0.shape
    if isinstance(logits, Head):
        x, weight, bias = logits.hidden.reshape(-1, logits.hidden.shape[-1]), logits.weight, logits.bias
        width = weight.shape[0]
    else:
        x, weight, bias, width = logits.reshape(-1, logits.shape[-1]), None, None, logits.shape[-1]
    acc = _acc_dtype(x.dtype)
    rows = lambda a: a.expand(shape).reshape(-1)
    alpha_t, dalpha_t = (torch.as_tensor(a, dtype=acc, device=x0.device) for a in (alpha_t, dalpha_t))
    while alpha_t.dim() < x0.dim():
        alpha_t, dalpha_t = alpha_t.unsqueeze(-1), dalpha_t.unsqueeze(-1)
    out = _RowChunks.apply(usdm_nelbo_loss, _chunk_rows(width, chunk_elems), vocab_size_of(logits), x, weight, bias,
                           x0.reshape(-1), xt.reshape(-1), rows(alpha_t), rows(dalpha_t))
    return out.view(shape)


def ar_loss(logits, x):
    """Next-token cross-entropy for the autoregressive baseline: -log p(x^{l+1} | x^{<=l}).
    logits (B, L, V) or a Head computed on x (the last position is dropped), or on x[:, :-1] -> (B, L-1)."""
    if isinstance(logits, Head):
        logits = logits._replace(hidden=logits.hidden[:, : x.shape[1] - 1])
    else:
        logits = logits[:, : x.shape[1] - 1]
    return -log_probs(logits, x[:, 1:])[0]


# ---------------------------------------------------------------------------------------------------------
# Head: the output layer in place of logits, and the two reductions every loss above is written in

class Head(NamedTuple):
    """The output layer and its input, in place of logits: logits = hidden @ weight.T + bias, of which the
    first vocab_size columns are the vocabulary (the rest pads the matrix to a fast size and is never scored).
    hidden (B, L, d), weight (V_pad, d), bias (V_pad,) or None, all in the dtype the logits are computed in."""
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    vocab_size: Optional[int] = None


def vocab_size_of(logits):
    """V of logits (..., V) or of a Head."""
    if isinstance(logits, Head):
        return logits.vocab_size or logits.weight.shape[0]
    return logits.shape[-1]


def log_probs(logits, *token_sets, chunk_elems=None):
    """log p(tokens | .) for each (B, L) id tensor in token_sets, from logits (B, L, V) or a Head -> tuple of
    (B, L), float32 (float64 for float64 logits). One log-sum-exp over the vocabulary, gathers, no (B, L, V)
    float32 tensor for low-precision logits, and no (B, L, V) tensor at all for a Head. chunk_elems: logits per
    chunk of rows (default 2^25 for logits; 2^27 for a Head, whose chunks also carry three matrix products)."""
    tokens = torch.stack(token_sets)
    tok = tokens.reshape(tokens.shape[0], -1)                                         # (k, N)
    if isinstance(logits, Head):
        hidden = logits.hidden.reshape(-1, logits.hidden.shape[-1])
        out = _HeadLogProbs.apply(hidden, logits.weight, logits.bias, tok, vocab_size_of(logits),
                                  _chunk_rows(logits.weight.shape[0], chunk_elems or 1 << 27))
    elif logits.dtype in (torch.float32, torch.float64) and logits.device.type != "cuda":
        lse = torch.logsumexp(logits, dim=-1)
        out = torch.stack([logits.gather(-1, t.unsqueeze(-1)).squeeze(-1) for t in token_sets]) - lse
    else:
        flat = logits.reshape(-1, logits.shape[-1])
        out = _LogProbsFP32.apply(flat, tok, _chunk_rows(flat.shape[-1], chunk_elems or 1 << 25))
    return tuple(out.view(tokens.shape))


def logsumexp_fp32(logits, chunk_elems=1 << 25):
    """log sum_v exp(logits[..., v]) in float32 without materialising a float32 copy of the logits.
    logits: (..., V) any float dtype -> (...) float32 (float64 for float64 logits)."""
    if logits.dtype in (torch.float32, torch.float64) and logits.device.type != "cuda":
        return torch.logsumexp(logits, dim=-1)
    flat = logits.reshape(-1, logits.shape[-1])
    return _LogSumExpFP32.apply(flat, _chunk_rows(flat.shape[-1], chunk_elems)).view(logits.shape[:-1])


def log_p_plus_eps(log_p, eps):
    """log(p + eps) computed from log p as logaddexp(log p, log eps): exact and stable for tiny p."""
    if eps == 0:
        return log_p
    return torch.logaddexp(log_p, torch.full_like(log_p, math.log(eps)))


# =============================================================================================================
# KERNELS BEGIN. Everything above is the method; everything below only makes it fast and memory-lean: float32
# log-sum-exps over chunks of rows, gathers, and autograd Functions that recompute a Head's logits in backward.
# The numbers are the same as the plain formulas (tests/test_fastpaths.py and test_losses.py check them).
# =============================================================================================================

def _at_least_fp32(x):
    return x if x.dtype == torch.float64 else x.float()


def _acc_dtype(dtype):
    return torch.promote_types(dtype, torch.float32)


# -----------------------------------------------------------------------------------------------
# one pass over a chunk of rows of the logits; compiled into one kernel each on CUDA (see _fused)


def _lse_rows(z, V):
    """z (n, V_pad) any float dtype -> log-sum-exp of its first V columns, (n,) in at least float32."""
    return torch.logsumexp(z[:, :V].to(_acc_dtype(z.dtype)), dim=-1)


def _lse_and_picked(z, tokens, V):
    """z (n, V_pad), tokens (k, n) -> (lse (n,), z at tokens (k, n)), in at least float32."""
    zf = z[:, :V].to(_acc_dtype(z.dtype))
    return torch.logsumexp(zf, dim=-1), zf.gather(-1, tokens.T).T


def _logits_grad(z, lse, tokens, g, V):
    """d/dz of sum_i g_i log p(tokens_i) = sum_i g_i onehot(tokens_i) - (sum_i g_i) softmax(z): formed in float32
    and rounded ONCE to z's dtype (a gather plus a separate log-sum-exp would round the target entry twice:
    ~13% gradient error at p = 0.9 in bf16); zero on the padding columns >= V.
    z (n, V_pad), lse (n,), tokens and g (k, n) -> (n, V_pad)."""
    grad = _softmax_times(z, lse, -g.sum(0), V)
    if torch.compiler.is_compiling():     # the targets as comparisons: all of it fuses into one kernel
        col = torch.arange(z.shape[-1], device=z.device)
        for t, gt in zip(tokens, g):
            grad = grad + torch.where(col == t[:, None], gt[:, None], 0.0)
    else:                                 # eager: in place, no further (n, V_pad) temporaries
        for t, gt in zip(tokens, g):
            grad.scatter_add_(-1, t[:, None], gt[:, None])
    return grad.to(z.dtype)


def _softmax_times(z, lse, g, V):
    """softmax(z) * g in float32 (the gradient of g * lse), zero on the padding columns; z (n, V_pad), lse and
    g (n,) -> (n, V_pad) float32 (at least)."""
    grad = z.to(lse.dtype, copy=True).sub_(lse[:, None]).exp_().mul_(g[:, None])
    if V < z.shape[-1]:
        grad[:, V:] = 0
    return grad


_COMPILED = {}


def _fused(fn, like):
    """fn compiled by torch.compile when `like` is on CUDA (one kernel: each chunk of logits is read once instead
    of by several element-wise passes), else fn itself. Same numbers either way (tested on CPU)."""
    if like.device.type != "cuda" or not _can_compile():
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


def _can_compile():
    """torch.compile can build GPU kernels here (TorchDynamo supported, Triton installed)."""
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return torch._dynamo.is_dynamo_supported() and has_triton()


def _chunk_rows(width, chunk_elems):
    return max(1, chunk_elems // width)


def _chunks(n, chunk_rows):
    return [slice(i, min(n, i + chunk_rows)) for i in range(0, n, chunk_rows)]


# -----------------------------------------------------------------------------------------------
# log-sum-exp and log-probabilities of gathered tokens, chunked over rows


class _LogSumExpFP32(torch.autograd.Function):
    """logsumexp over the last dim in float32, chunked over rows; saves only the input and the result."""

    @staticmethod
    def forward(ctx, flat, chunk_rows):
        V = flat.shape[-1]
        lse = torch.empty(flat.shape[0], dtype=_acc_dtype(flat.dtype), device=flat.device)
        kernel = _fused(_lse_rows, flat)
        for j in _chunks(flat.shape[0], chunk_rows):
            lse[j] = kernel(flat[j], V)
        ctx.save_for_backward(flat, lse)
        ctx.chunk_rows = chunk_rows
        return lse

    @staticmethod
    def backward(ctx, grad_lse):
        flat, lse = ctx.saved_tensors
        g = grad_lse.to(lse.dtype)
        grad = torch.empty_like(flat)
        kernel = _fused(_softmax_times, flat)
        for j in _chunks(flat.shape[0], ctx.chunk_rows):
            grad[j] = kernel(flat[j], lse[j], g[j], flat.shape[-1])      # rounded once to the logits' dtype
        return grad, None


class _LogProbsFP32(torch.autograd.Function):
    """log p(tokens_i) for k token sets from one float32 log-sum-exp pass over logits (N, V), chunked over
    rows; backward by _logits_grad (the target entries rounded once)."""

    @staticmethod
    def forward(ctx, flat, tok, chunk_rows):
        V = flat.shape[-1]
        lse = torch.empty(flat.shape[0], dtype=_acc_dtype(flat.dtype), device=flat.device)
        picked = torch.empty(tok.shape, dtype=lse.dtype, device=flat.device)
        kernel = _fused(_lse_and_picked, flat)
        for j in _chunks(flat.shape[0], chunk_rows):
            lse[j], picked[:, j] = kernel(flat[j], tok[:, j], V)
        ctx.save_for_backward(flat, lse, tok)
        ctx.chunk_rows = chunk_rows
        return picked - lse

    @staticmethod
    def backward(ctx, grad_out):
        flat, lse, tok = ctx.saved_tensors
        g = grad_out.to(lse.dtype)
        grad = torch.empty_like(flat)
        kernel = _fused(_logits_grad, flat)
        for j in _chunks(flat.shape[0], ctx.chunk_rows):
            grad[j] = kernel(flat[j], lse[j], tok[:, j], g[:, j], flat.shape[-1])
        return grad, None, None


class _HeadLogProbs(torch.autograd.Function):
    """log p(tokens_i) from a Head without the (N, V) logits: per chunk of rows, logits = hidden @ W.T + b in
    the Head's dtype (as the model's output layer computes them), a float32 log-sum-exp over the first V columns
    and gathers; backward recomputes each chunk's logits, forms _logits_grad and multiplies it into the
    gradients of hidden, W (accumulated in float32 over chunks) and b. Saves hidden, W, b and one float per row;
    when all rows fit in one chunk, its logits are kept instead of recomputed (small logits: no extra product)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tok, V, chunk_rows):
        lse = torch.empty(hidden.shape[0], dtype=_acc_dtype(hidden.dtype), device=hidden.device)
        picked = torch.empty(tok.shape, dtype=lse.dtype, device=hidden.device)
        kernel = _fused(_lse_and_picked, hidden)
        chunks = _chunks(hidden.shape[0], chunk_rows)
        with torch.autocast(hidden.device.type, enabled=False):   # the Head's dtype, in forward and backward
            for j in chunks:
                z = F.linear(hidden[j], weight, bias)
                lse[j], picked[:, j] = kernel(z, tok[:, j], V)
        ctx.save_for_backward(hidden, weight, bias, tok, lse, z if len(chunks) == 1 else None)
        ctx.V, ctx.chunk_rows = V, chunk_rows
        return picked - lse

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, tok, lse, kept = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g = grad_out.to(lse.dtype)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=lse.dtype, device=bias.device) if need_b else None
        kernel = _fused(_logits_grad, hidden)
        with torch.autocast(hidden.device.type, enabled=False):
            for j in _chunks(hidden.shape[0], ctx.chunk_rows):
                z = kept if kept is not None else F.linear(hidden[j], weight, bias)
                dz = kernel(z, lse[j], tok[:, j], g[:, j], ctx.V)
                if need_h:
                    grad_h[j] = dz @ weight
                if need_w:
                    grad_w += dz.T @ hidden[j]
                if need_b:
                    grad_b += dz.sum(0, dtype=grad_b.dtype)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None)


class _RowChunks(torch.autograd.Function):
    """out (N,) = per_row(z, *row_args) with z = the logits of a chunk of rows: logits[j] (weight None) or
    hidden[j] @ weight.T + bias, first V columns. Each chunk is recomputed in backward, where autograd of
    per_row gives its gradients (a checkpoint per chunk), so only per-row values are kept for backward."""

    @staticmethod
    def forward(ctx, per_row, chunk_rows, V, x, weight, bias, *row_args):
        out = torch.empty(x.shape[0], dtype=_acc_dtype(x.dtype), device=x.device)
        fn = _fused(per_row, x)
        with torch.autocast(x.device.type, enabled=False):
            for j in _chunks(x.shape[0], chunk_rows):
                out[j] = fn(_RowChunks.logits(x[j], weight, bias, V), *(a[j] for a in row_args))
        ctx.save_for_backward(x, weight, bias, *row_args)
        ctx.per_row, ctx.chunk_rows, ctx.V = per_row, chunk_rows, V
        return out

    @staticmethod
    def logits(x, weight, bias, V):
        return x if weight is None else F.linear(x, weight, bias)[:, :V]

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, *row_args = ctx.saved_tensors
        need = ctx.needs_input_grad[3:6]
        grad_x = torch.empty_like(x) if need[0] else None
        acc = [None if w is None or not n else torch.zeros(w.shape, dtype=_acc_dtype(w.dtype), device=w.device)
               for w, n in ((weight, need[1]), (bias, need[2]))]
        fn = _fused(ctx.per_row, x)
        with torch.autocast(x.device.type, enabled=False):
            for j in _chunks(x.shape[0], ctx.chunk_rows):
                with torch.enable_grad():
                    xj, w, b = (None if t is None else t.detach().requires_grad_(n)
                                for t, n in ((x[j], need[0]), (weight, need[1]), (bias, need[2])))
                    out = fn(_RowChunks.logits(xj, w, b, ctx.V), *(a[j] for a in row_args))
                    wanted = [t for t, n in ((xj, need[0]), (w, need[1]), (b, need[2])) if n]
                    grads = iter(torch.autograd.grad(out, wanted, grad_out[j].to(out.dtype)))
                if need[0]:
                    grad_x[j] = next(grads)
                for a, n in zip(acc, need[1:]):
                    if n:
                        a += next(grads)
        cast = lambda a, w: None if a is None else a.to(w.dtype)
        return (None, None, None, grad_x, cast(acc[0], weight), cast(acc[1], bias)) + (None,) * len(row_args)
