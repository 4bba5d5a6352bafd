"""The reference forms of laws the running code draws from or computes in a cheaper way; the tests hold each
running function against them. Nothing in training or sampling calls these.

  reverse_posterior  Eq. (reverse), q(x_s | x_t, x0), as the (B, L, K) tensor; the sampler never builds it and
                     draws from its three-part mixture (diffusion.ancestral_step_from_logits)
  ancestral_step     the sampler's reverse step with x_theta given as probabilities (one-hot x0 allowed): the
                     running mixture (diffusion.mixture_step), its x_theta part drawn by float64 Gumbel-max
  denoiser_probs     x_theta in float64, the softmax of sample.denoiser_logits (the sampler draws from the logits)
"""
import torch

import diffusion
from kernels.gumbel import sample_categorical
from sample import denoiser_logits


def reverse_posterior(xt, x0_probs, alpha_t, alpha_s, vocab_size):
    """Eq. (reverse): q(x_s | x_t, x0) for s < t, with x0 one-hot or the model's prediction x_theta.

        q = [K a_t x0 * e_xt + (a_{t|s} - a_t) e_xt + (a_s - a_t) x0 + (1 - a_{t|s})(1 - a_s)/K]
            / (K a_t <x0, e_xt> + 1 - a_t),          a_{t|s} = a_t / a_s,
    i.e. the three-part mixture of diffusion.posterior_weights (read from the module, so a test that replaces it
    changes this law too). With x0 = x_theta this is the Bayes posterior of x_s given x_t under the prior
    x0 ~ x_theta. xt (B, L); x0_probs (B, L, K) float; alphas per sequence (B, 1) or floats -> (B, L, K), rows sum
    to 1. Built by one scatter at xt, never a K x K matrix."""
    m_x0, m_unif, m_stay = diffusion.posterior_weights(x0_probs.gather(-1, xt.unsqueeze(-1)), vocab_size, alpha_t,
                                                       alpha_s)
    return (m_x0 * x0_probs + m_unif / vocab_size).scatter_add(-1, xt.unsqueeze(-1), m_stay)


def ancestral_step(xt, x0_probs, alpha_t, alpha_s, generator=None, kappa=1.0):
    """One reverse step x_s ~ reverse_posterior(xt, x0_probs, alpha_t, alpha_s) (kappa < 1: the Psi step of
    diffusion.psi_weights), exact in distribution: diffusion.mixture_step, the sampler's own draw from the
    three-part mixture, with its x_theta part drawn by float64 Gumbel-max on x0_probs. alpha_s = 1 is the final
    'ancestral' denoising step. xt (B, L), x0_probs (B, L, K) -> x_s (B, L)."""
    p_z = x0_probs.gather(-1, xt.unsqueeze(-1)).squeeze(-1).double()
    return diffusion.mixture_step(xt, p_z, lambda: sample_categorical(x0_probs, generator), x0_probs.shape[-1],
                                  alpha_t, alpha_s, generator, kappa)


def denoiser_probs(model, xt, alpha_t, *, null_xt=None, cfg_w=0.0, top_p=1.0, autocast=None):
    """x_theta(. | xt) in float64: softmax of sample.denoiser_logits. xt (B, L) -> (B, L, V)."""
    logits = denoiser_logits(model, xt, alpha_t, null_xt=null_xt, cfg_w=cfg_w, top_p=top_p, autocast=autocast)
    return torch.softmax(logits.double(), dim=-1)
