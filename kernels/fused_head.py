"""
The output layer fused with the loss: the formulas of losses.py computed from the last hidden state and the output
matrix in chunks of rows, never holding the (B, L, V) logits or a float32 tensor of that size. Training uses it by
default on CUDA (train.py --head auto), where the logits of a micro-batch (64 x 1024 x 50K) would take gigabytes.
losses.py's SDDLM losses and ar_loss take a Head as they take logits (it has .shape, row slicing and .log_probs).

Each chunk's logits are either kept for backward (Head.keep_logits: three matrix products in all, forward and the
two of backward) or recomputed there (four products, the memory of one chunk); train.py's memory probe
(plumbing/memory.py) keeps them unless they do not fit. On CUDA each chunk's pass over the vocabulary is one
compiled kernel (fused()). The numbers are those of losses.py (tests/test_fused_head.py).
"""
import dataclasses
import functools
from typing import Optional

import torch
import torch.nn.functional as F

import losses

HEADS = ("auto", "plain", "fused", "fused_recompute")    # train.py --head


def fused_head_wanted(head, device):
    """--head (HEADS) -> whether training's output layer is a Head: 'auto' on CUDA, where it pays."""
    return head in ("fused", "fused_recompute") or (head == "auto" and torch.device(device).type == "cuda")


@dataclasses.dataclass
class Head:
    """The output layer and its input, in place of logits: logits = hidden @ weight.T + bias, of which the
    first vocab_size columns are the vocabulary (the rest pads the matrix to a fast size and is never scored).
    hidden (B, L, d), weight (V_pad, d), bias (V_pad,) or None, all in the dtype the logits are computed in.
    keep_logits: keep each chunk's logits for backward (else recompute them); chunk_elems: logits per chunk."""
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    vocab_size: Optional[int] = None
    keep_logits: bool = True
    chunk_elems: int = 1 << 27

    @property
    def shape(self):
        """The shape of the logits it stands for, (B, L, V)."""
        return torch.Size((*self.hidden.shape[:-1], self.vocab_size or self.weight.shape[0]))

    def __getitem__(self, positions):
        """The Head of logits[positions] (positions index the leading (B, L) dimensions)."""
        return dataclasses.replace(self, hidden=self.hidden[positions])

    def log_probs(self, *token_sets):
        """losses.log_probs of the logits this Head stands for: a tuple of (B, L), float32 (float64 for float64)."""
        tokens = torch.stack(token_sets)
        hidden = self.hidden.reshape(-1, self.hidden.shape[-1])
        out = _HeadLogProbs.apply(hidden, self.weight, self.bias, tokens.reshape(tokens.shape[0], -1),
                                  self.shape[-1], max(1, self.chunk_elems // self.weight.shape[0]),
                                  self.keep_logits and torch.is_grad_enabled())   # in evaluation: nothing to keep
        return tuple(out.view(tokens.shape))


def usdm_nelbo_loss_lean(logits, x0, xt, alpha_t, dalpha_t, chunk_elems=1 << 25):
    """losses.usdm_nelbo_loss computed chunk_elems // V rows at a time, each chunk's float32 graph recomputed in
    backward: the same numbers (to float32 rounding, values and gradients) without its (B, L, V) float32 tensors,
    and, given a Head, without the (B, L, V) logits (a Head's chunks too are chunk_elems logits here: its own
    chunk_elems sizes log_probs, whose chunks hold fewer float32 temporaries than this graph's several).
    logits (B, L, V) or a Head; the rest as usdm_nelbo_loss -> (B, L)."""
    shape = x0.shape
    if isinstance(logits, Head):
        x, weight, bias, keep = (logits.hidden.reshape(-1, logits.hidden.shape[-1]), logits.weight, logits.bias,
                                 logits.keep_logits and torch.is_grad_enabled())
    else:
        x, weight, bias, keep = logits.reshape(-1, logits.shape[-1]), None, None, False
    acc = _acc_dtype(x.dtype)
    rows = lambda a: a.expand(shape).reshape(-1)
    alpha_t, dalpha_t = (torch.as_tensor(a, dtype=acc, device=x0.device) for a in (alpha_t, dalpha_t))
    while alpha_t.dim() < x0.dim():
        alpha_t, dalpha_t = alpha_t.unsqueeze(-1), dalpha_t.unsqueeze(-1)
    width = x.shape[-1] if weight is None else weight.shape[0]
    out = _RowChunks.apply(losses.usdm_nelbo_loss, max(1, chunk_elems // width), logits.shape[-1], keep,
                           x, weight, bias, x0.reshape(-1), xt.reshape(-1), rows(alpha_t), rows(dalpha_t))
    return out.view(shape)


# -----------------------------------------------------------------------------------------------
# one pass over a chunk of rows of the logits; compiled into one kernel each on CUDA (see fused())

def _acc_dtype(dtype):
    return torch.promote_types(dtype, torch.float32)


def _lse_and_picked(z, tokens, V):
    """z (n, V_pad), tokens (k, n) -> (lse (n,), z at tokens (k, n)), in at least float32."""
    zf = z[:, :V].to(_acc_dtype(z.dtype))
    return torch.logsumexp(zf, dim=-1), zf.gather(-1, tokens.T).T


def _logits_grad(z, lse, tokens, g, V):
    """d/dz of sum_i g_i log p(tokens_i) = sum_i g_i onehot(tokens_i) - (sum_i g_i) softmax(z): formed in float32
    and rounded ONCE to z's dtype (a gather plus a separate log-sum-exp would round the target entry twice:
    ~13% gradient error at p = 0.9 in bf16); zero on the padding columns >= V.
    z (n, V_pad), lse (n,), tokens and g (k, n) -> (n, V_pad)."""
    grad = z.to(lse.dtype, copy=True).sub_(lse[:, None]).exp_().mul_(-g.sum(0)[:, None])     # -(sum_i g_i) softmax(z)
    if V < z.shape[-1]:
        grad[:, V:] = 0
    if torch.compiler.is_compiling():     # the targets as comparisons: all of it fuses into one kernel
        col = torch.arange(z.shape[-1], device=z.device)
        for t, gt in zip(tokens, g):
            grad = grad + torch.where(col == t[:, None], gt[:, None], 0.0)
    else:                                 # eager: in place, no further (n, V_pad) temporaries
        for t, gt in zip(tokens, g):
            grad.scatter_add_(-1, t[:, None], gt[:, None])
    return grad.to(z.dtype)


def fused(fn, like):
    """fn compiled by torch.compile when `like` is on CUDA (one kernel: each chunk of logits is read once instead
    of by several element-wise passes), else fn itself. Same numbers either way (tested on CPU)."""
    return _compiled(fn) if like.device.type == "cuda" else fn


@functools.cache
def _compiled(fn):
    """fn compiled, when torch.compile can build GPU kernels here (TorchDynamo supported, Triton installed)."""
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return fn
    return torch.compile(fn, dynamic=True) if torch._dynamo.is_dynamo_supported() and has_triton() else fn


def _chunks(n, chunk_rows):
    return [slice(i, min(n, i + chunk_rows)) for i in range(0, n, chunk_rows)]


def _own_dtypes(x):
    """No autocast around a Function's products: the Head's dtype in forward and backward, grads in float32."""
    return torch.autocast(x.device.type, enabled=False)


def _add_product_(acc, a, b):
    """acc += a @ b with the product summed into acc's dtype (float32), never rounded to a's (bf16) first."""
    if a.dtype != acc.dtype and acc.device.type == "cuda":
        return acc.add_(torch.mm(a, b, out_dtype=acc.dtype))   # bf16 inputs, float32 output (cuBLAS)
    a, b = a.to(acc.dtype), b.to(acc.dtype)                     # the CPU has no mixed-dtype product
    return torch.addmm(acc, a, b, out=acc)                      # (addmm_ would hide from torch's FLOP counter)


def _backprop_logits(dz, x, weight, grads, j):
    """Chain a chunk's logits gradient dz (n, V_pad) through logits = x @ weight.T + bias: grads = [grad_x (N, d),
    grad_w (V_pad, d) float32, grad_b (V_pad,) float32], each None when not needed; rows j of grad_x."""
    grad_x, grad_w, grad_b = grads
    if grad_x is not None:
        torch.mm(dz, weight, out=grad_x[j])
    if grad_w is not None:
        _add_product_(grad_w, dz.T, x)
    if grad_b is not None:
        grad_b += dz.sum(0, dtype=grad_b.dtype)


def _head_grads(needs, x, weight, bias):
    """The gradients _backprop_logits accumulates, allocated where autograd needs them (needs: x, weight, bias)."""
    acc = lambda t: torch.zeros(t.shape, dtype=_acc_dtype(t.dtype), device=t.device)
    return [torch.empty_like(x) if needs[0] else None, acc(weight) if needs[1] and weight is not None else None,
            acc(bias) if needs[2] and bias is not None else None]


def _cast_back(grads, x, weight, bias):
    return tuple(None if g is None else g.to(t.dtype) for g, t in zip(grads, (x, weight, bias)))


# -----------------------------------------------------------------------------------------------
# autograd Functions over chunks of rows

class _HeadLogProbs(torch.autograd.Function):
    """log p(tokens_i) from a Head without the (N, V) logits: per chunk of rows, logits = hidden @ W.T + b in
    the Head's dtype, a float32 log-sum-exp over the first V columns and gathers; backward forms _logits_grad from
    each chunk's logits (kept from forward, or recomputed) and multiplies it into the gradients of hidden, W and b
    (W's and b's summed over chunks in float32). Saves hidden, W, b, one float per row, and the kept logits.
    Logits that fit in one chunk are always kept (no extra product)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tok, V, chunk_rows, keep):
        lse = torch.empty(hidden.shape[0], dtype=_acc_dtype(hidden.dtype), device=hidden.device)
        picked = torch.empty(tok.shape, dtype=lse.dtype, device=hidden.device)
        kernel = fused(_lse_and_picked, hidden)
        chunks = _chunks(hidden.shape[0], chunk_rows)
        keep = (keep or len(chunks) == 1) and any(ctx.needs_input_grad[:3])
        kept = []
        with _own_dtypes(hidden):
            for j in chunks:
                z = F.linear(hidden[j], weight, bias)
                lse[j], picked[:, j] = kernel(z, tok[:, j], V)
                if keep:
                    kept.append(z)
        ctx.save_for_backward(hidden, weight, bias, tok, lse, *kept)
        ctx.V, ctx.chunk_rows = V, chunk_rows
        return picked - lse

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, tok, lse, *kept = ctx.saved_tensors
        grads = _head_grads(ctx.needs_input_grad[:3], hidden, weight, bias)
        g = grad_out.to(lse.dtype)
        kernel = fused(_logits_grad, hidden)
        with _own_dtypes(hidden):
            for i, j in enumerate(_chunks(hidden.shape[0], ctx.chunk_rows)):
                z = kept[i] if kept else F.linear(hidden[j], weight, bias)
                _backprop_logits(kernel(z, lse[j], tok[:, j], g[:, j], ctx.V), hidden[j], weight, grads, j)
        return _cast_back(grads, hidden, weight, bias) + (None,) * 4


class _RowChunks(torch.autograd.Function):
    """out (N,) = per_row(z, *row_args) with z = the logits of a chunk of rows: x[j] (weight None) or
    x[j] @ weight.T + bias, first V columns. Backward reruns per_row on each chunk's logits (kept from forward or
    recomputed) and lets autograd give their gradient (a checkpoint per chunk), which is chained through the
    output layer as in _HeadLogProbs. Saves x, weight, bias, per-row values and the kept logits."""

    @staticmethod
    def forward(ctx, per_row, chunk_rows, V, keep, x, weight, bias, *row_args):
        out = torch.empty(x.shape[0], dtype=_acc_dtype(x.dtype), device=x.device)
        fn = fused(per_row, x)
        chunks = _chunks(x.shape[0], chunk_rows)
        keep = weight is not None and (keep or len(chunks) == 1) and any(ctx.needs_input_grad[4:7])
        kept = []
        with _own_dtypes(x):
            for j in chunks:
                z = x[j] if weight is None else F.linear(x[j], weight, bias)
                out[j] = fn(z[:, :V], *(a[j] for a in row_args))
                if keep:
                    kept.append(z)
        ctx.save_for_backward(x, weight, bias, *row_args, *kept)
        ctx.per_row, ctx.chunk_rows, ctx.V, ctx.n_args = per_row, chunk_rows, V, len(row_args)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, *rest = ctx.saved_tensors
        row_args, kept = rest[:ctx.n_args], rest[ctx.n_args:]
        grads = _head_grads(ctx.needs_input_grad[4:7], x, weight, bias)
        fn = fused(ctx.per_row, x)
        with _own_dtypes(x):
            for i, j in enumerate(_chunks(x.shape[0], ctx.chunk_rows)):
                z = x[j] if weight is None else kept[i] if kept else F.linear(x[j], weight, bias)
                with torch.enable_grad():
                    z = z.detach().requires_grad_(True)
                    out = fn(z[:, :ctx.V], *(a[j] for a in row_args))
                    dz, = torch.autograd.grad(out, z, grad_out[j].to(out.dtype))
                if weight is None:
                    grads[0][j] = dz                  # x are the logits themselves
                else:
                    _backprop_logits(dz, x[j], weight, grads, j)
        return (None,) * 4 + _cast_back(grads, x, weight, bias) + (None,) * len(row_args)
