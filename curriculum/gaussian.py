"""Duo's Gaussian-guided curriculum (Duo spec section 2): Duo's training trick for the first curriculum_iters steps
(--curriculum_iters), which diffusion.corrupt uses in place of Eq. (discrete_marginal) while it lasts.

A Gaussian latent w = alpha~ e_x0 + sigma~ eps over the K one-hot coordinates, with
alpha~^2 = sigmoid(-gamma), sigma~^2 = sigmoid(gamma), has argmax distributed exactly as the uniform-state
marginal with alpha = T(gamma) (the "diffusion transformation operator"), a 1-D integral (alpha_table).
The network's input is the tempered softmax of w (soft_input), kept on its top-k coordinates (top_k_latent).
Shapes: x0, xt (B, L) int64; gamma (B, 1); soft inputs (B, L, K), or SoftTokens (B, L, k)."""
import functools
import math
from typing import NamedTuple

import torch

GAMMA_LIMIT = 15      # alpha_table's quadrature holds for |gamma| <= 15 (at -20 it gives alpha > 1; --gamma_min/max)


@functools.lru_cache(maxsize=8)
def alpha_table(vocab_size, gamma_min=-5.0, gamma_max=-1.0, n_points=2049, device="cpu"):
    """T(gamma) and dT/dgamma on a uniform gamma grid, by trapezoid quadrature in float64 (cached, on `device`: a
    training step's lookup needs no host round trip).
    P(gamma) = Pr[argmax w = x0] = int phi(z - nu) Phi(z)^(K-1) dz,  nu = exp(-gamma/2),
    dP/dgamma = int -nu/2 (z - nu) phi(z - nu) Phi(z)^(K-1) dz,   alpha = (K P - 1) / (K - 1).
    -> (gamma grid, alpha, dalpha/dgamma), each (n_points,) float64."""
    K = vocab_size
    gamma = torch.linspace(gamma_min, gamma_max, n_points, dtype=torch.float64)
    z = torch.linspace(-10.0, math.exp(-gamma_min / 2) + 10.0, 8001, dtype=torch.float64)
    log_cdf = (K - 1) * torch.special.log_ndtr(z)
    P, dP = [], []
    for g in gamma.split(256):
        nu = torch.exp(-g / 2)[:, None]
        dens = torch.exp(-0.5 * (z - nu) ** 2 - 0.5 * math.log(2 * math.pi) + log_cdf)
        P.append(torch.trapezoid(dens, z, dim=-1))
        dP.append(torch.trapezoid(-0.5 * nu * (z - nu) * dens, z, dim=-1))
    P, dP = torch.cat(P), torch.cat(dP)
    return tuple(x.to(device) for x in (gamma, (K * P - 1) / (K - 1), K / (K - 1) * dP))


clear_alpha_tables = alpha_table.cache_clear    # on the host and every device (bench/bench.py: each row from scratch)


def gamma_to_alpha(gamma, vocab_size, gamma_min=-5.0, gamma_max=-1.0):
    """alpha_t = T(gamma_t) and d alpha / d gamma by linear interpolation in the cached table over
    [min(-5, gamma_min), max(-1, gamma_max)] (one table for the flags' usual ranges).
    gamma (...) tensor within [gamma_min, gamma_max] -> (alpha, dalpha_dgamma) of gamma's dtype."""
    gamma_min, gamma_max = min(-5.0, gamma_min), max(-1.0, gamma_max)
    grid, alpha, dalpha = alpha_table(vocab_size, float(gamma_min), float(gamma_max), device=str(gamma.device))
    g = gamma.detach().double().clamp(gamma_min, gamma_max)
    pos = (g - gamma_min) / (gamma_max - gamma_min) * (grid.numel() - 1)
    lo = pos.floor().long().clamp(max=grid.numel() - 2)
    frac = pos - lo
    return tuple((v[lo] * (1 - frac) + v[lo + 1] * frac).to(gamma.dtype) for v in (alpha, dalpha))


def alpha_range(vocab_size, gamma_min, gamma_max):
    """The discrete alpha_t = T(gamma) the curriculum's inputs span (as curriculum_sample reads it) -> (alpha at
    gamma_max, alpha at gamma_min): floats."""
    gamma = torch.tensor([gamma_max, gamma_min], dtype=torch.float64)
    return tuple(gamma_to_alpha(gamma, vocab_size, gamma_min, gamma_max)[0].tolist())


def gaussian_latent(x0, gamma, vocab_size, generator=None):
    """w = alpha~ e_x0 + sigma~ eps, eps ~ N(0, I_K): Duo's exact (and memory-hungry) method, 6.6 GB at B=32,
    L=1024, K=50258. x0 (B, L); gamma (B, 1) -> w (B, L, K) float32."""
    g = gamma.float().unsqueeze(-1)
    w = torch.randn(*x0.shape, vocab_size, generator=generator, device=x0.device) * torch.sqrt(torch.sigmoid(g))
    return w.scatter_add_(-1, x0.unsqueeze(-1), torch.sqrt(torch.sigmoid(-g)).expand(*x0.shape, 1))


def soft_input(w, tau):
    """Tempered softmax softmax(w / tau) over the vocabulary: the curriculum's network input (the model
    embeds it as softmax @ E). As tau -> 0 it becomes one-hot at argmax w, i.e. the discrete process."""
    return torch.softmax(w / tau, dim=-1)


def tau_schedule(step, log10_tau_start=-3.0, log10_tau_end=-3.0, start=0, end=500_000):
    """Softmax temperature of the curriculum: log10 tau constant before `start`, linear in log10 on
    [start, end), Duo's scripts use tau = 1e-3 throughout with the curriculum ending at 500K steps."""
    f = 1.0 if step >= end else max(0.0, (step - start) / max(1, end - start))
    return 10 ** (log10_tau_start + f * (log10_tau_end - log10_tau_start))


class SoftTokens(NamedTuple):
    """A probability vector over the vocabulary given on its k largest entries per position (zero elsewhere):
    ids (B, L, k) int64, probs (B, L, k) float32. The model embeds it as sum_j probs_j E[ids_j]."""
    ids: torch.Tensor
    probs: torch.Tensor


CURRICULUM_TOP_K = 32       # latent coordinates kept per position by curriculum_input
TOP_K_MAX_TAU = 2e-3        # above this temperature curriculum_input keeps the whole (B, L, K) soft input


def _distinct_uniform(n, k, rows, generator=None, device=None):
    """k distinct integers of [0, n) per row, as a uniformly random ordered k-tuple: Floyd's algorithm (for
    j = n-k..n-1 take t ~ U{0..j}, or j if t is already taken) with all k draws at once, "taken" resolved by pointer
    jumping (docs/training.md, "The curriculum's top-k latent"), in a uniformly random order. O(k log k) per row
    (a sort finds the repeated t's), no O(n) work and no loop over k. -> (rows, k) int64."""
    j = torch.arange(n - k, n, device=device)
    t = torch.randint(0, 1 << 62, (rows, k), generator=generator, device=device) % (j + 1)   # U{0..j} (bias < n / 2^62)
    sorted_t, at = t.sort(dim=-1, stable=True)                        # equal values in drawing order
    repeat = torch.cat([torch.zeros_like(sorted_t[:, :1], dtype=torch.bool), sorted_t[:, 1:] == sorted_t[:, :-1]], -1)
    taken = torch.zeros_like(repeat).scatter(-1, at, repeat)                               # t_i equals an earlier t
    i = torch.arange(k, device=device)
    parent = t - (n - k)                                                                   # t_i = j_parent
    parent = torch.where((parent >= 0) & (parent < i), parent, i)                          # an earlier j, or itself
    for _ in range(max(1, (k - 1).bit_length())):
        taken, parent = taken | taken.gather(-1, parent), parent.gather(-1, parent)
    picked = torch.where(taken, j, t)
    order = torch.rand(rows, k, generator=generator, device=device, dtype=torch.float64).argsort(-1)
    return picked.gather(-1, order)


def top_k_latent(x0, gamma, vocab_size, k=CURRICULUM_TOP_K, generator=None):
    """The k largest coordinates of the curriculum's Gaussian latent w = alpha~ e_x0 + sigma~ eps (gaussian_latent),
    drawn exactly in law in O(k) per position, without the other K - k coordinates (the proof: docs/training.md,
    "The curriculum's top-k latent"): the k largest of the n = K - 1 others by Renyi's representation,
        S_j = sum_{i <= j} E_i / (n - i + 1),  E_i iid Exp(1),   w_(j) = -sigma~ ndtri(-expm1(-S_j)),
    in float64 through the small tail probability (no 1 - U cancellation), carried by a uniformly random ordered
    k-tuple of distinct other tokens (_distinct_uniform); x0's own w_x0 = alpha~ + sigma~ eps_0 is among the k
    largest exactly when it exceeds w_(k).
    x0 (B, L); gamma (B, 1); 1 <= k < K -> (values (B, L, k) float64, descending; ids (B, L, k) int64)."""
    B, L = x0.shape
    n, N, dev = vocab_size - 1, x0.numel(), x0.device
    g = gamma.double().expand(B, L).reshape(-1, 1)
    scale, signal = torch.sqrt(torch.sigmoid(g)), torch.sqrt(torch.sigmoid(-g))
    E = torch.empty(N, k, device=dev, dtype=torch.float64).exponential_(generator=generator)
    S = (E / torch.arange(n, n - k, -1, device=dev, dtype=torch.float64)).cumsum(-1)
    U = (-torch.expm1(-S)).clamp_min(1e-300)                     # U > 0 keeps w finite should an E_i be 0
    others = -scale * torch.special.ndtri(U)                                      # (N, k), descending
    other_ids = _distinct_uniform(n, k, N, generator, dev)
    x0 = x0.reshape(-1, 1)
    other_ids = other_ids + (other_ids >= x0)                                    # skip x0's own token
    at_x0 = signal + scale * torch.randn(N, 1, generator=generator, device=dev, dtype=torch.float64)
    values, order = torch.cat([others, at_x0], dim=-1).topk(k, dim=-1)
    ids = torch.cat([other_ids, x0], dim=-1).gather(-1, order)
    return values.view(B, L, k), ids.view(B, L, k)


def curriculum_input(x0, gamma, vocab_size, tau, generator=None, top_k=CURRICULUM_TOP_K):
    """The curriculum's latent xt = argmax w and soft input softmax(w / tau), kept on the top_k largest coordinates
    of w per position (SoftTokens from top_k_latent: no (B, L, K) tensor and no O(K) work).
    xt and the kept coordinates are exact in law; the soft input equals the dense softmax(w / tau) to float32
    rounding but with probability < 1e-20 per position at tau <= TOP_K_MAX_TAU and top_k = 32 (docs/training.md,
    "The curriculum's top-k latent"); above TOP_K_MAX_TAU (or K <= top_k) this draws the dense (B, L, K) w and
    returns the dense soft input.
    x0 (B, L); gamma (B, 1) -> xt (B, L), SoftTokens (or the (B, L, K) float32 soft input)."""
    if tau > TOP_K_MAX_TAU or vocab_size <= top_k:
        w = gaussian_latent(x0, gamma, vocab_size, generator)
        return w.argmax(-1), soft_input(w, tau)
    values, ids = top_k_latent(x0, gamma, vocab_size, top_k, generator)
    return ids[..., 0], SoftTokens(ids, torch.softmax(values / tau, dim=-1).float())


def curriculum_sample(x0, t, vocab_size, gamma_min, gamma_max, tau, generator=None):
    """One curriculum corruption at gamma_t = gamma_min + t (gamma_max - gamma_min): the hard latent xt (used by the
    loss) and the soft network input (curriculum_input), and the discrete alpha_t = T(gamma_t),
    d alpha_t / dt = (gamma_max - gamma_min) dT/dgamma.
    x0 (B, L), t (B,) -> xt (B, L), soft input, alpha_t (B, 1), dalpha_t (B, 1)."""
    gamma = (gamma_min + t * (gamma_max - gamma_min)).unsqueeze(-1)
    xt, soft = curriculum_input(x0, gamma, vocab_size, tau, generator)
    alpha_t, dalpha_dgamma = gamma_to_alpha(gamma, vocab_size, gamma_min, gamma_max)
    return xt, soft, alpha_t, dalpha_dgamma * (gamma_max - gamma_min)
