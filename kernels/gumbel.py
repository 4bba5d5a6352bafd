"""
Exact draws from a categorical distribution over a vocabulary of K tokens, at the cost of one pass over the
logits: Gumbel-max (argmax(z + G), G iid Gumbel, is distributed as softmax(z)), in float32 with noise from 48-bit
uniforms, and two-stage over blocks of tokens (a block by its log-sum-exp, then a token inside that one block).
diffusion.py's sampling steps draw x_theta's part of the reverse step through these.
"""
import torch

from kernels import fused_head


def sample_categorical(probs, generator=None):
    """Gumbel-max in the division form argmax(p / E), E ~ Exp(1), in float64 (Duo samples in float64:
    float32 Gumbel noise measurably lowers sample entropy). probs (..., K) -> ids (...)."""
    probs = probs.double()
    u = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=torch.float64)
    e = 1e-10 - torch.log(u + 1e-10)
    return (probs / e).argmax(-1)


def gumbel_noise(shape, generator=None, device=None):
    """Gumbel noise G = -log E, E = -log(1 - U) ~ Exp(1), in float32 with U uniform on a grid of 2^-48 built from
    two 24-bit random integers. A float32 uniform (24 bits) would cap G at 16.6 and so never draw a token whose
    logit trails the best by more than ~17 (the entropy loss Duo avoids with float64); here G reaches 33 (float64
    noise: 36.7), so float64 noise is never needed. -> float32 of `shape`."""
    hi, lo = (torch.randint(0, 1 << 24, shape, generator=generator, device=device, dtype=torch.int32).float()
              for _ in range(2))
    u = (hi + (lo + 0.5) * 2.0 ** -24) * 2.0 ** -24
    return -torch.log(-torch.log1p(-u))


GUMBEL_BLOCK = 256     # vocabulary entries per block of the two-stage Gumbel-max (about sqrt(K) for GPT-2's K)


def _block_lse_rows(z, block):
    """z (n, K) -> log-sum-exp of each run of `block` consecutive entries (the last run may be shorter),
    (n, ceil(K / block)) in at least float32: one read of z; compiled into one kernel on CUDA (fused_head.fused)."""
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    full = z.shape[-1] // block * block
    parts = [torch.logsumexp(z[:, :full].unflatten(-1, (-1, block)), dim=-1)] if full else []
    if full < z.shape[-1]:
        parts.append(torch.logsumexp(z[:, full:], dim=-1, keepdim=True))
    return torch.cat(parts, dim=-1)


def block_logsumexp(logits, block=None, chunk_elems=None):
    """log sum_{v in block c} exp(logits[..., v]) for the blocks c of GUMBEL_BLOCK consecutive tokens: the one
    pass over the vocabulary the sampler makes. Their log-sum-exp is the row's normaliser (log-sum-exp is
    associative), and they are the masses the first stage of gumbel_argmax draws from. Chunks of rows: about 4 MB
    of logits on the CPU (a chunk's temporaries stay in cache), 2^25 logits on CUDA.
    logits (..., K) any float dtype -> (..., ceil(K / block)) float32 (float64 for float64 logits)."""
    block = block or GUMBEL_BLOCK
    flat = logits.reshape(-1, logits.shape[-1])
    chunk_elems = chunk_elems or (1 << 25 if flat.device.type == "cuda" else 1 << 20)
    rows = max(1, chunk_elems // flat.shape[-1])
    kernel = fused_head.fused(_block_lse_rows, flat)
    out = torch.cat([kernel(flat[i:i + rows], block) for i in range(0, flat.shape[0], rows)])
    return out.view(*logits.shape[:-1], -1)


def gumbel_argmax(logits, generator=None, chunk_elems=1 << 25, block_lse=None, rows=None):
    """An exact draw from softmax(logits) per row, by Gumbel-max in two stages over blocks of GUMBEL_BLOCK
    consecutive tokens: a block c with probability proportional to exp(lse_c) (argmax of lse_c + G_c over the
    blocks), then a token v of c with probability proportional to exp(logits[v]) (argmax of logits[v] + G_v
    over the block), so P(v) = exp(lse_c - lse) exp(logits[v] - lse_c) = softmax(logits)[v]. Given the block
    log-sum-exps (block_logsumexp: the sampler has them from its one pass), a row costs O(K / block + block)
    random numbers and reads one block of logits, not O(K).
    Precision: G is gumbel_noise (up to 33) added to float32 block log-sum-exps and logits. A block (a token)
    whose log-mass trails the best it competes with by more than ~36 is never drawn: such blocks and tokens carry
    at most K e^-36 < 1e-11 of the law at K = 50258, far below what sampling resolves; the sums round at
    float32's relative 6e-8, the precision the logits themselves carry.
    logits (n, K), -inf allowed; block_lse (n, ceil(K / block)) or None (computed, chunk_elems logits a pass);
    rows: optional (m,) row indices to draw for (only those rows' blocks are read) -> ids (n,) or (m,)."""
    K, block = logits.shape[-1], GUMBEL_BLOCK
    if block_lse is None:
        block_lse = block_logsumexp(logits if rows is None else logits[rows], block, chunk_elems)
    elif rows is not None:
        block_lse = block_lse[rows]
    if rows is None:
        rows = torch.arange(logits.shape[0], device=logits.device)
    c = (block_lse + gumbel_noise(block_lse.shape, generator, logits.device)).argmax(-1)
    cols = c[:, None] * block + torch.arange(min(block, K), device=logits.device)
    z = logits[rows[:, None], cols.clamp(max=K - 1)]
    z = z.to(torch.promote_types(z.dtype, torch.float32)).masked_fill(cols >= K, float("-inf"))
    return c * block + (z + gumbel_noise(z.shape, generator, logits.device)).argmax(-1)
