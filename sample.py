"""
Sample text from a trained uniform-state diffusion LM (or from the autoregressive baseline).

    python sample.py --ckpt out/ckpt.pt --num_samples 4 --steps 128
    python sample.py --ckpt out/ckpt.pt --prompt "The history of" --cfg_w 1.1 --top_p 0.9
    python sample.py --ckpt out/ckpt.pt --seq_len 512 --stride 64       # past the block: semi-AR windows

Ancestral sampling (paper Eq. reverse; Duo spec section 6.1). Start from x_1 ~ Uniform(V)^L. On Duo's time
grid ts = linspace(1, t_end, N + 1), step i goes from t = ts[i] to s = ts[i + 1] (dt = (1 - t_end) / N) and
draws x_s ~ q(x_s | x_t, x_theta): the posterior of Eq. (reverse) (diffusion.posterior_weights) with the
denoiser's prediction x_theta = softmax(f(x_t, sigma_t)), sigma_t = -log alpha_t, in place of the clean x0
(diffusion.ancestral_step_from_logits draws it exactly; no host sync inside the loop).
A final step at t_end removes the remaining noise: "ancestral" (one more posterior step to alpha_s = 1),
"greedy" (argmax x_theta) or "none". NFE = N + 1 (N with "none").
Eq. (reverse) with x0 := x_theta is the Bayes posterior of x_s under the prior x0 ~ x_theta, which already
weighs in the likelihood of the position's own noisy token; the sampler is exact per position when
x_theta^l = p(x0^l | x_t^{-l}), the posterior given the other positions (the NELBO's minimiser), not
p(x0^l | x_t) (test_sample.py checks both on a solvable toy distribution).

The Psi sampler (--sampler psi; Duo, Chapter II) draws each step from kappa_t times that posterior plus
(1 - kappa_t) times the posterior to level 0 renoised to s (psi_plan, diffusion.psi_weights); kappa = 1 is the
ancestral sampler. Past the block (--seq_len > block_size) the sampler runs in semi-autoregressive windows
(generate_long). Both, and every flag's use: docs/sampling.md.

Options, all acting on x_theta before the posterior:
  top_p      nucleus filtering of x_theta, renormalised. Never of the posterior: its argmax/nucleus gives
             near-random text (Duo issue #29).
  prompt     a fixed clean prefix; fixed_mask/fixed_ids fix any positions (infilling). Fixed positions start
             clean, not noisy, and are reset after every step, so they are context the model conditions on.
  cfg_w      unsupervised classifier-free guidance (paper, CFG section): the unconditional branch is the same
             x_t with every fixed position replaced by a token drawn uniformly from the vocabulary (one draw
             per sample, for the whole run; null_tokens, guided_logits).

Writes one JSON line per sample (text, ids, settings) appended to --out, and prints the texts.
"""

from plumbing import cli  # first: a stop signal while the imports below load is one line, exit 130
cli.stop_at_once(__name__)

import math
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch
from tqdm import tqdm

import diffusion
from data import DataError
from kernels.gumbel import sample_categorical
from plumbing.cli import (UsageError, autocast_for, finite_float, finite_floats, parse_flags, resolve_device,
                          resolve_dtype, run_cli, whole)
from trained.checkpoint import load_model, load_tokenizer
from plumbing.files import WRITTEN_BY, append_jsonl, check_outputs, refuse_overwrite, signature


# -----------------------------------------------------------------------------------------------
# the denoiser's distribution x_theta

def null_tokens(shape, vocab_size, seed, device=None):
    """The paper's unconditional prompt: tokens drawn uniformly from the vocabulary from their own generator
    (seeded with `seed`), so turning CFG on or off never changes any other random number. -> (shape) int64."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, vocab_size, shape, generator=gen, device=device)


def nucleus_logits(logits, top_p, chunk_elems=1 << 24):
    """Nucleus filtering (Holtzman et al.) on logits: -inf outside the smallest set of most likely tokens whose
    mass reaches top_p (tokens tied with the least likely kept one are kept too; the most likely always).
    Sorted chunk_elems at a time, in float32 (float64 logits stay float64). (..., V) -> (..., V) float32;
    top_p >= 1 returns logits unchanged."""
    if top_p >= 1:
        return logits
    out = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
    flat = out.view(-1, out.shape[-1])
    rows = max(1, chunk_elems // out.shape[-1])
    for i in range(0, flat.shape[0], rows):
        z = flat[i:i + rows]
        sorted_z = z.sort(dim=-1, descending=True).values
        p = torch.softmax(sorted_z, dim=-1)
        kept = ((p.cumsum(-1) - p) < top_p).sum(-1, keepdim=True)         # mass of the strictly more likely < top_p
        z.masked_fill_(z < sorted_z.gather(-1, kept - 1), float("-inf"))
    return out


def guided_logits(model, xt, sigma, *, null_xt=None, cfg_w=0.0, autocast=None, start=0):
    """The model's logits of positions start.. of xt (B, L) at sigma (B,) -> (B, L - start, V). With CFG (null_xt,
    the unconditional input of the same shape, and cfg_w != 0): ONE forward of [xt; null_xt] (2B rows) and
    (1 + w) f_c - w f_u of the two branches' logits f in at least float32, whose softmax is p_c^(1+w) / p_u^w
    renormalised (paper, CFG section: the per-position log-sum-exps cancel in the softmax)."""
    guided = null_xt is not None and cfg_w != 0
    x_in, s_in = (torch.cat([xt, null_xt]), torch.cat([sigma, sigma])) if guided else (xt, sigma)
    with autocast or nullcontext():
        logits = model(x_in, s_in)[:, start:]
    if not guided:
        return logits
    f_c, f_u = logits.to(torch.promote_types(logits.dtype, torch.float32)).chunk(2)
    return torch.lerp(f_u, f_c, 1 + cfg_w)      # (1 + w) f_c - w f_u = f_u + (1 + w)(f_c - f_u): one fused pass


def denoiser_logits(model, xt, alpha_t, *, null_xt=None, cfg_w=0.0, top_p=1.0, autocast=None):
    """log x_theta(. | xt) up to a constant per position, at the noise level alpha_t (a float): guided_logits at
    sigma = -log alpha_t; with top_p < 1, -inf outside the nucleus. xt (B, L) -> (B, L, V); x_theta = softmax of
    it. Never a float64 (B, L, V) tensor."""
    sigma = torch.full((xt.shape[0],), -math.log(alpha_t), device=xt.device)
    return nucleus_logits(guided_logits(model, xt, sigma, null_xt=null_xt, cfg_w=cfg_w, autocast=autocast), top_p)


def prompt_rows(prompt_ids, num_samples, device=None):
    """prompt_ids (P,) or (B, P) -> (B, P) int64 on device, one row per sample."""
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    return prompt.expand(num_samples, -1) if prompt.dim() == 1 else prompt


def fixed_positions(num_samples, seq_len, prompt_ids=None, fixed_mask=None, fixed_ids=None, device=None):
    """The clean positions a sample is conditioned on: a prompt prefix and/or arbitrary infilling positions.
    prompt_ids (P,) or (B, P); fixed_mask (L,) or (B, L) bool with fixed_ids of the same shape (values read
    where the mask is set). -> (mask (B, L) bool, ids (B, L) int64), or (None, None) when nothing is fixed."""
    B, L = num_samples, seq_len
    mask = torch.zeros(B, L, dtype=torch.bool, device=device)
    ids = torch.zeros(B, L, dtype=torch.long, device=device)
    if prompt_ids is not None:
        prompt = prompt_rows(prompt_ids, B, device)
        if prompt.shape[0] != B or prompt.shape[1] > L:
            raise ValueError(f"prompt_ids of shape {tuple(prompt.shape)} do not fit {B} samples of length {L}")
        mask[:, :prompt.shape[1]], ids[:, :prompt.shape[1]] = True, prompt
    if fixed_mask is not None:
        if fixed_ids is None:
            raise ValueError("fixed_mask needs fixed_ids (the tokens to hold at the fixed positions)")
        m = torch.as_tensor(fixed_mask, dtype=torch.bool, device=device).expand(B, L)
        v = torch.as_tensor(fixed_ids, dtype=torch.long, device=device).expand(B, L)
        mask, ids = mask | m, torch.where(m, v, ids)
    return (mask, ids) if mask.any() else (None, None)


def device_of(model):
    """The device of the model's parameters (the CPU for a model without any)."""
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


# -----------------------------------------------------------------------------------------------
# the Psi sampler's kappa_t and time grid (Duo, Chapter II; kappa = 1 is the ancestral sampler)

SAMPLERS = ("ancestral", "psi")
KAPPA_MODES = ("eta", "max_capped", "max_rescale", "sigma_constant")
PROFILES = ("linear", "loop")
RESCALES = ("remdm", "duo")   # max_rescale's cap: ReMDM's sigma_max = min(1, .), or min(eta, .) as Duo's code
GRIDS = ("ours", "duo")       # how the phases split the steps: ours, or Duo's code step for step


class Psi(NamedTuple):
    """The Psi sampler's settings: per phase (one entry, or three: the high, middle and low phases) a kappa mode
    of KAPPA_MODES and its eta; the profile (linear in time, or loop: the middle phase held at the time loop_t);
    the fractions of the steps the three phases take; max_rescale's cap (RESCALES) and the grid (GRIDS)."""
    kappa: tuple = ("eta",)
    eta: tuple = (0.9,)
    profile: str = "linear"
    loop_t: float = 0.1
    fracs: tuple = (0.45, 0.5, 0.05)
    rescale: str = "remdm"
    grid: str = "ours"


def remdm_sigma(mode, eta, alpha_t, alpha_s, rescale="remdm"):
    """ReMDM's renoising rate sigma_t (Wang et al. 2025), bounded by sigma_t^max = min(1, (1 - a_s) / a_t):
    "max_capped" min(eta, sigma_t^max), "max_rescale" eta sigma_t^max, "sigma_constant" eta.
    max_rescale caps sigma_t^max at 1, as ReMDM defines it, not at eta: eta then scales the largest rate the
    posterior allows and the mode stays a rescaling. rescale="duo" is what Duo's code computes instead (and its
    published Psi scripts ran), eta min(eta, (1 - a_s) / a_t): at eta = 0.05 a far weaker corrector.
    alphas floats -> float."""
    ratio = (1 - alpha_s) / alpha_t
    if mode == "max_rescale":
        return eta * min(eta if rescale == "duo" else 1.0, ratio)
    return {"max_capped": min(eta, min(1.0, ratio)), "sigma_constant": eta}[mode]


def kappa_from_sigma(sigma, alpha_s):
    """kappa_t = clip(1 - sigma_t / (1 - a_s), 0, 1): the predictor's share of the Psi step for a ReMDM rate
    sigma_t. a_s = 1 (nothing left to renoise) -> 1."""
    return 1.0 if alpha_s >= 1 else min(1.0, max(0.0, 1 - sigma / (1 - alpha_s)))


def psi_kappa(mode, eta, alpha_t, alpha_s, rescale="remdm"):
    """kappa_t of one step from a_t to a_s: eta itself ("eta"), or kappa_from_sigma of remdm_sigma."""
    return eta if mode == "eta" else kappa_from_sigma(remdm_sigma(mode, eta, alpha_t, alpha_s, rescale), alpha_s)


def phase_sizes(n, fracs):
    """round(f_high n), round(f_middle n) and the rest (Python's round: half to even). Our linear profile splits
    its n steps so; Duo's code splits its n = steps + 1 grid points so. -> (hi, mid, lo), lo may be < 0."""
    hi, mid = round(fracs[0] * n), round(fracs[1] * n)
    return hi, mid, n - hi - mid


def time_grid(steps, t_end, psi=None):
    """The times ts (steps + 1,) of the reverse steps and each step's phase (steps,): Duo's linspace(1, t_end)
    (phase 0, or with three phases phase_sizes of the steps), or with psi.profile == "loop" three phases: linear
    from 1 to loop_t, loop_t held for the middle phase (steps from a level to itself: only the corrector moves
    tokens), then linear from loop_t to t_end. Our grid; duo_time_grid is Duo's."""
    if psi is None or psi.profile == "linear":
        hi, mid, lo = (steps, 0, 0) if psi is None or len(psi.kappa) == 1 else phase_sizes(steps, psi.fracs)
        return torch.linspace(1, t_end, steps + 1, dtype=torch.float64), [0] * hi + [1] * mid + [2] * lo
    hi = max(1, round(psi.fracs[0] * steps))                        # the high and low phases at least one step
    mid = max(0, min(steps - hi - 1, round(psi.fracs[1] * steps)))
    lo, c = steps - hi - mid, psi.loop_t
    ts = torch.cat([torch.linspace(1, c, hi + 1, dtype=torch.float64), torch.full((mid,), c, dtype=torch.float64),
                    torch.linspace(c, t_end, lo + 1, dtype=torch.float64)[1:]])
    return ts, [0] * hi + [1] * mid + [2] * lo


def duo_time_grid(steps, t_end, psi):
    """Duo's code's grid of steps + 1 points and each point's phase (steps + 1,): the points split by phase_sizes
    (one phase: all of them), linspace(1, t_end) for the linear profile, or linspace(1, c, hi), c repeated mid
    times, linspace(c, t_end, lo) for the loop (c = loop_t). The loop so holds c for mid + 1 steps from c to c,
    and its high and low ramps take one step fewer than the points they hold. -> (ts float64, phases)."""
    n = steps + 1
    hi, mid, lo = (n, 0, 0) if len(psi.kappa) == 1 else phase_sizes(n, psi.fracs)
    if lo < 0:
        raise UsageError(f"--psi_fracs {','.join(f'{f:g}' for f in psi.fracs)} round to more than the {n} points "
                         f"of --psi_grid duo at --steps {steps}: lower a fraction")
    if psi.profile == "linear":
        ts = torch.linspace(1, t_end, n, dtype=torch.float64)
    else:
        c = psi.loop_t
        ts = torch.cat([torch.linspace(1, c, hi, dtype=torch.float64), torch.full((mid,), c, dtype=torch.float64),
                        torch.linspace(c, t_end, lo, dtype=torch.float64)])
    return ts, [0] * hi + [1] * mid + [2] * lo


def psi_plan(steps, t_end, psi=None, schedule="loglinear"):
    """The sampler's times ts (steps + 1,) and each step's kappa (steps floats; 1.0: the ancestral step), step i
    going from ts[i] to ts[i + 1]. --psi_grid ours: time_grid, kappa = psi_kappa of the step's phase.
    --psi_grid duo, as Duo's code: duo_time_grid; each phase's kappas come from its own points, so a ReMDM mode
    (max_capped, max_rescale, sigma_constant) gives kappa = 1 to the step from the last point of its phase
    (Duo's no-op evaluations at the loop's edges: a posterior step from c to c stays put), eta gives eta."""
    if psi is None:
        return time_grid(steps, t_end)[0], [1.0] * steps
    ts, phase = (duo_time_grid if psi.grid == "duo" else time_grid)(steps, t_end, psi)
    a = diffusion.SCHEDULES[schedule](ts)[0].tolist()
    duo_edge = lambda i, p: psi.grid == "duo" and psi.kappa[p] != "eta" and phase[i + 1] != p
    return ts, [1.0 if duo_edge(i, p) else psi_kappa(psi.kappa[p], psi.eta[p], a[i], a[i + 1], psi.rescale)
                for i, p in enumerate(phase[:steps])]


def parse_psi(sampler="ancestral", kappa="eta", eta="0.9", profile="linear", loop_t=0.1, fracs="0.45,0.5,0.05",
              steps=None, rescale="remdm", grid="ours"):
    """The sampler flags -> Psi, or None for the ancestral sampler. kappa and eta: one value, or three
    comma-separated, for the high, middle and low phases (the loop profile always has three; the linear one
    splits its steps by fracs). Raises UsageError naming the flag."""
    if sampler not in SAMPLERS:
        raise UsageError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    if sampler == "ancestral":
        return None
    for flag, value, allowed in (("profile", profile, PROFILES), ("rescale", rescale, RESCALES), ("grid", grid, GRIDS)):
        if value not in allowed:
            raise UsageError(f"--psi_{flag} must be one of {', '.join(allowed)}, got {value!r}")
    modes = tuple(str(kappa).replace(" ", "").split(","))
    etas, fr = finite_floats(eta, "--psi_eta"), finite_floats(fracs, "--psi_fracs")   # nan, inf: one line each
    phases = 3 if profile == "loop" or 3 in (len(modes), len(etas)) else 1
    modes, etas = (modes * phases if len(modes) == 1 else modes), (etas * phases if len(etas) == 1 else etas)
    if len(modes) != phases or len(etas) != phases:
        raise UsageError(f"--psi_kappa and --psi_eta take 1 value, or 3 (high, middle, low phases); got {kappa!r}, "
                         f"{eta!r} for --psi_profile {profile}")
    bad = [m for m in modes if m not in KAPPA_MODES]
    if bad:
        raise UsageError(f"--psi_kappa must be one of {', '.join(KAPPA_MODES)}, got {bad[0]!r}")
    if not all(0 <= e <= 1 for e in etas):
        raise UsageError(f"--psi_eta must be in [0, 1], got {eta!r}")
    if phases == 3 and (len(fr) != 3 or min(fr) < 0 or abs(sum(fr) - 1) > 1e-6):
        raise UsageError(f"--psi_fracs must be 3 non-negative fractions of the steps summing to 1, got {fracs!r}")
    if profile == "loop":
        if not 0 < loop_t < 1:
            raise UsageError(f"--psi_loop_t must be in (0, 1) (the loop's time level), got {loop_t}")
        if steps is not None and steps < 2:
            raise UsageError(f"--psi_profile loop needs --steps >= 2 (a high and a low phase), got {steps}")
    psi = Psi(modes, etas, profile, float(loop_t), fr, rescale, grid)
    if grid == "duo" and steps is not None:
        duo_time_grid(steps, 1e-5, psi)            # the fractions fit the grid
    return psi


def psi_from_flags(cfg, steps=None):
    """parse_psi of a CLI config's --sampler and --psi_* fields (sample.py's and eval_ppl.py's)."""
    return parse_psi(cfg.sampler, cfg.psi_kappa, cfg.psi_eta, cfg.psi_profile, cfg.psi_loop_t, cfg.psi_fracs, steps,
                     cfg.psi_rescale, cfg.psi_grid)


# -----------------------------------------------------------------------------------------------
# samplers

def check_sampler(steps, final_step="ancestral", top_p=1.0, t_end=1e-5, schedule="loglinear", cfg_w=0.0):
    """The sampler's settings, checked once (by generate, and by the CLI before it loads a model), with the CLI's
    own checkers for the Python API's values; the messages name the flags, which are generate's keyword arguments.
    final_step may be "auto" (the CLI's default, which default_final_step resolves once the checkpoint is
    loaded). Raises UsageError (a ValueError)."""
    whole(steps, "--steps", 1)
    finite_float(cfg_w, "--cfg_w")
    if final_step not in (*diffusion.FINAL_STEPS, "auto"):
        raise UsageError(f"--final_step must be one of {', '.join(diffusion.FINAL_STEPS)}, auto; got {final_step!r}")
    if schedule not in diffusion.SCHEDULES:
        raise UsageError(f"--noise_schedule must be one of {', '.join(diffusion.SCHEDULES)}, got {schedule!r}")
    if not 0 < top_p <= 1:
        raise UsageError(f"--top_p must be in (0, 1], got {top_p}")
    if not 0 < t_end < 1:
        raise UsageError(f"--t_end must be in (0, 1), got {t_end}")


@torch.no_grad()
def generate(model, num_samples, seq_len, vocab_size, steps, *, alpha_schedule="loglinear", t_end=1e-5,
             final_step="ancestral", prompt_ids=None, fixed_mask=None, fixed_ids=None, cfg_w=0.0, cfg_seed=None,
             top_p=1.0, psi=None, generator=None, device=None, dtype=None, show_progress=True):
    """Ancestral sampling of num_samples sequences of length seq_len with `steps` reverse steps -> (B, L) int64;
    with psi (a Psi, from parse_psi) the Psi sampler (psi_plan).

    model(x (B, L) int64, sigma (B,)) -> logits (B, L, V) with V = vocab_size; alpha_schedule a key of
    diffusion.SCHEDULES; generator a torch.Generator on `device` (default: the model's device) for the prior
    and the Gumbel noise; dtype an autocast dtype for the network (None / float32: no autocast).
    CFG's null prompt: null_tokens seeded with cfg_seed (default: the seed of `generator`, or torch.initial_seed(),
    plus 1); cfg_w = 0 skips the unconditional branch."""
    check_sampler(steps, final_step, top_p, t_end, alpha_schedule, cfg_w)
    if final_step == "auto":
        raise ValueError("generate needs a concrete final_step: resolve 'auto' with default_final_step(ckpt)")
    if psi is not None and psi.profile == "loop" and steps < 2:
        raise ValueError(f"the loop profile needs steps >= 2 (a high and a low phase), got {steps}")
    device = torch.device(device) if device is not None else device_of(model)
    B, L, K = num_samples, seq_len, vocab_size
    fixed, fixed_val = fixed_positions(B, L, prompt_ids, fixed_mask, fixed_ids, device)
    if cfg_w != 0 and fixed is None:
        raise ValueError("cfg_w != 0 needs a prompt or fixed positions: unsupervised CFG contrasts them with "
                         "random tokens")
    keep_fixed = (lambda x: x) if fixed is None else (lambda x: torch.where(fixed, fixed_val, x))

    x = keep_fixed(torch.randint(0, K, (B, L), generator=generator, device=device))
    if cfg_w != 0 and cfg_seed is None:
        cfg_seed = (generator.initial_seed() if generator is not None else torch.initial_seed()) + 1
    null_fill = null_tokens((B, L), K, cfg_seed, device) if cfg_w != 0 else None

    def x_theta(xt, alpha):      # logits of x_theta, guided and nucleus-filtered
        null_xt = None if null_fill is None else torch.where(fixed, null_fill, xt)
        logits = denoiser_logits(model, xt, alpha, null_xt=null_xt, cfg_w=cfg_w, top_p=top_p,
                                 autocast=autocast_for(device, dtype))
        if logits.shape[-1] != K:
            raise ValueError(f"the model returns {logits.shape[-1]} classes, vocab_size is {K}")
        return logits

    def step(xt, alpha_t, alpha_s, kappa=1.0):
        return diffusion.ancestral_step_from_logits(xt, x_theta(xt, alpha_t), alpha_t, alpha_s, generator,
                                                    kappa=kappa)

    ts, kappas = psi_plan(steps, t_end, psi, alpha_schedule)
    alphas = diffusion.SCHEDULES[alpha_schedule](ts)[0].tolist()
    for i in tqdm(range(steps), desc=f"sampling ({steps} steps)", disable=cli.bar_hidden(show_progress), leave=False):
        x = keep_fixed(step(x, alphas[i], alphas[i + 1], kappas[i]))
    if final_step == "ancestral":
        x = step(x, alphas[-1], 1.0)
    elif final_step == "greedy":
        x = x_theta(x, alphas[-1]).argmax(-1)
    return keep_fixed(x)


def check_sample_size(num_samples, seq_len, device=None, names=("num_samples", "seq_len")):
    """num_samples sequences of seq_len tokens: both integers >= 1 (a bool, a float or 0 -> ValueError naming them,
    as names says them: the flags, or the API's keywords), and their tokens within the memory there is: at least
    24 bytes a token (the int64 samples, their copy while a window is appended, a list's slot once returned), so a
    length past the machine is refused at the start in one line, not after hours of windows or by the kernel's
    out-of-memory killer (which kills without a word)."""
    from plumbing.memory import check_fits
    for value, name in zip((num_samples, seq_len), names):
        whole(value, name, 1)
    device, tokens = torch.device(device if device is not None else "cpu"), num_samples * seq_len
    needs = {torch.device("cpu"): 8 * tokens}
    needs[device] = needs.get(device, 0) + 16 * tokens
    for where, need in needs.items():
        check_fits(need, where, f"{names[0]} {num_samples} x {names[1]} {seq_len}: {tokens:,} tokens",
                   f"lower {names[1]} or {names[0]}")


@torch.no_grad()
def generate_ar(model, num_samples, seq_len, *, bos_id=None, prompt_ids=None, top_p=1.0, generator=None,
                device=None, dtype=None, show_progress=True, block_size=None):
    """The autoregressive baseline (a causal model whose logits at l predict token l+1): start from
    [bos_id] + prompt_ids, then one token per forward with full recompute (no KV cache, as Duo), Gumbel-max
    in float64 on the nucleus-filtered next-token distribution. prompt_ids (P,) or (B, P) -> (B, seq_len).
    Any seq_len: each token is predicted from the last block_size tokens at most (a sliding window of the
    model's context; default model.config.block_size, or the whole prefix for a model without a config)."""
    block_size = block_size or getattr(getattr(model, "config", None), "block_size", None)
    device = torch.device(device) if device is not None else device_of(model)
    check_sample_size(num_samples, seq_len, device)
    x = torch.zeros(num_samples, 0, dtype=torch.long, device=device)       # the prefix: [bos_id] + prompt_ids
    if bos_id is not None:
        x = torch.full((num_samples, 1), bos_id, dtype=torch.long, device=device)
    if prompt_ids is not None:
        x = torch.cat([x, prompt_rows(prompt_ids, num_samples, device)], dim=1)
    if not 1 <= x.shape[1] <= seq_len:
        raise ValueError(f"the AR sampler needs a prefix of 1..{seq_len} tokens (bos_id and/or prompt_ids), "
                         f"got {x.shape[1]}")
    check_sampler(1, top_p=top_p)
    for _ in tqdm(range(seq_len - x.shape[1]), desc="sampling (AR)", disable=cli.bar_hidden(show_progress),
                  leave=False):
        with autocast_for(device, dtype):
            logits = model(x if block_size is None else x[:, -block_size:])[:, -1]
        probs = torch.softmax(nucleus_logits(logits.double(), top_p), dim=-1)
        x = torch.cat([x, sample_categorical(probs, generator)[:, None]], dim=1)
    return x


# -----------------------------------------------------------------------------------------------
# longer than the context: semi-autoregressive windows (MDLM's and Duo's semi_ar sampler)

def check_stride(stride, block_size):
    """--stride -> the stride in [1, block_size]; 0 is half a block (docs/sampling.md says why). Raises UsageError
    naming the flag."""
    if not 0 <= stride <= block_size:
        raise UsageError(f"--stride must be in [1, {block_size}] (the model's block_size; 0 = half of it), "
                         f"got {stride}")
    return stride or max(1, block_size // 2)


def long_windows(prompt_len, seq_len, block_size, stride):
    """The sampler calls of semi-autoregressive generation past the block (seq_len > block_size) -> [(held, new)],
    each one whole block, held + new = block_size: the last `held` tokens so far (the prompt's, then the samples')
    held fixed as its prompt, `new` drawn after them. While the text is shorter than a block the call fills the
    block; afterwards each draws min(stride, what is left), so every window holds at least block_size - stride."""
    windows, n = [], prompt_len
    while n < seq_len:
        new = block_size - n if n < block_size else min(stride, seq_len - n)
        windows.append((block_size - new, new))
        n += new
    return windows


@torch.no_grad()
def generate_long(model, num_samples, seq_len, vocab_size, steps, *, block_size=None, stride=0, prompt_ids=None,
                  cfg_w=0.0, cfg_seed=None, generator=None, device=None, show_progress=True, **sampler):
    """generate to any seq_len -> (B, seq_len) int64: generate itself when seq_len <= block_size (default
    model.config.block_size), else one call of generate per long_windows window, the tokens it holds as
    prompt_ids, `sampler` generate's other keywords. prompt_ids (P,) or (B, P), any P < seq_len. One generator
    runs through the windows. CFG (cfg_w): each window that holds tokens is guided against null_tokens of the same
    cfg_seed in their place; a first window without a prompt holds nothing and is drawn unguided."""
    block_size = block_size or model.config.block_size
    device = torch.device(device) if device is not None else device_of(model)
    check_sample_size(num_samples, seq_len, device)
    if seq_len <= block_size:
        return generate(model, num_samples, seq_len, vocab_size, steps, prompt_ids=prompt_ids, cfg_w=cfg_w,
                        cfg_seed=cfg_seed, generator=generator, device=device, show_progress=show_progress, **sampler)
    stride = check_stride(stride, block_size)
    x = torch.zeros(num_samples, 0, dtype=torch.long, device=device)
    if prompt_ids is not None:
        x = prompt_rows(prompt_ids, num_samples, device)
        if x.shape[0] != num_samples or x.shape[1] >= seq_len:
            raise ValueError(f"prompt_ids of shape {tuple(torch.as_tensor(prompt_ids).shape)} do not fit "
                             f"{num_samples} samples of length {seq_len} (a prompt shorter than seq_len)")
    windows = long_windows(x.shape[1], seq_len, block_size, stride)
    for held, new in tqdm(windows, desc=f"sampling ({len(windows)} windows of {block_size}, {steps} steps)",
                          disable=cli.bar_hidden(show_progress), leave=False):
        ids = generate(model, num_samples, block_size, vocab_size, steps,
                       prompt_ids=x[:, x.shape[1] - held:] if held else None, cfg_w=cfg_w if held else 0.0,
                       cfg_seed=cfg_seed, generator=generator, device=device, show_progress=False, **sampler)
        x = torch.cat([x, ids[:, held:]], dim=1)
    return x


# -----------------------------------------------------------------------------------------------
# command line

@dataclass
class SampleConfig:
    # model
    ckpt: str = "out/ckpt.pt"        # a train.py / distillation/distill.py checkpoint, a model folder, or duo:PATH
                                     # (Duo's release)
    use_ema: bool = True             # sample from the EMA weights (the live ones when the checkpoint has no EMA)
    # sampler
    num_samples: int = 4             # sequences to draw
    batch_size: int = 0              # sequences per sampler call (0 = num_samples)
    seq_len: int = 0                 # tokens per sample (0 = the model's block_size; longer: --stride windows)
    stride: int = 0                  # past block_size: new tokens per sampler call, the block_size - stride before
                                     # them held as its prompt (0 = block_size // 2)
    steps: int = 128                 # reverse steps N (NFE = N + 1 with a final step)
    final_step: str = "auto"         # ancestral | greedy | none | auto (greedy for the NELBO objectives, ancestral
                                     # for the SDDLM ones)
    noise_schedule: str = ""         # loglinear | cosine; "" = the checkpoint's training schedule
    t_end: float = 1e-5              # the grid runs from t = 1 to t_end
    top_p: float = 1.0               # nucleus on x_theta (1 = off)
    cfg_w: float = 0.0               # unsupervised CFG weight w (needs a prompt; SDDLM uses 1.1)
    sampler: str = "ancestral"       # ancestral | psi (predictor-corrector, Duo Chapter II)
    psi_kappa: str = "eta"           # psi: kappa mode eta | max_capped | max_rescale | sigma_constant, 1 or 3 (phases)
    psi_eta: str = "0.9"             # psi: eta of each mode (kappa = eta, or ReMDM's sigma_t), 1 or 3 values (phases)
    psi_profile: str = "linear"      # psi: time profile, linear | loop (high, middle held at psi_loop_t, low)
    psi_loop_t: float = 0.1          # psi loop: the time level held in the middle phase
    psi_fracs: str = "0.45,0.5,0.05"  # psi, 3 phases: fractions of the steps in the high, middle and low phases
    psi_rescale: str = "remdm"       # psi max_rescale: remdm (eta min(1, .), ReMDM) | duo (eta min(eta, .), Duo's code)
    psi_grid: str = "ours"           # psi: ours | duo (Duo's code's grid and phase edges, to rerun its scripts)
    # prompt
    prompt: str = ""                 # text held fixed at the start of every sample
    prompt_ids: str = ""             # or token ids "1,2,3" (used verbatim, no BOS added)
    add_bos: bool = True             # prepend the tokenizer's BOS to --prompt (training blocks start with BOS)
    # runtime
    seed: int = 0                    # seeds the sampler's noise (the same seed gives the same samples)
    device: str = "auto"             # auto | cpu | cuda
    dtype: str = "auto"              # auto (bf16 on GPU, float32 on CPU) | float32 | bfloat16
    out: str = "auto"                # samples appended as JSON lines; auto = samples.jsonl beside the checkpoint
                                     # file or model folder (out/ckpt.pt, out/model -> out/samples.jsonl; a hub
                                     # name: the current folder); "" = print only


def parse_prompt(cfg, tok, vocab_size):
    """--prompt (encoded, BOS first when --add_bos) or --prompt_ids -> list of ids, or None."""
    if cfg.prompt and cfg.prompt_ids:
        raise UsageError("give --prompt or --prompt_ids, not both")
    if cfg.prompt_ids:
        try:
            ids = [int(s) for s in cfg.prompt_ids.replace(" ", "").strip(",").split(",")]
        except ValueError:      # a word, or no id between commas ("," or "1,,2"): not what was meant
            raise UsageError(f"--prompt_ids must be comma-separated integers, got {cfg.prompt_ids!r}") from None
    elif cfg.prompt:
        ids = ([tok.bos_id] if cfg.add_bos else []) + tok.encode(cfg.prompt)
    else:
        return None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise UsageError(f"prompt ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return ids or None


def main(argv=None):
    cfg = parse_flags(SampleConfig, argv, description=__doc__.split("\n\n")[0])
    if cfg.out == "auto":       # samples.jsonl beside what --ckpt names (duo:PATH: beside PATH)
        path = cfg.ckpt.removeprefix("duo:")
        cfg.out = os.path.join(os.path.dirname(os.path.normpath(path)) if os.path.exists(path) else "", "samples.jsonl")
    refuse_overwrite({"--out": cfg.out}, {"--ckpt": cfg.ckpt})
    check_sampler(cfg.steps, cfg.final_step, cfg.top_p, cfg.t_end, cfg.noise_schedule or "loglinear")
    psi = psi_from_flags(cfg, cfg.steps)
    if cfg.num_samples < 1 or cfg.batch_size < 0:
        raise UsageError("--num_samples must be >= 1 and --batch_size >= 0")
    check_outputs({"--out": cfg.out}, append=(("sample", "settings"), "sample.py"))   # before minutes of sampling
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    model, ckpt = load_model(cfg.ckpt, device, cfg.use_ema)
    mc = model.config
    tok, why = load_tokenizer(ckpt, cfg.ckpt)
    if tok is None:       # a checkpoint of train.py carries its SentencePiece model; an older one names a file
        raise UsageError(f"{why}: the samples' text needs it; put that tokenizer back (or sample a model folder "
                         f"exported where it was: python hub/pretrained.py --ckpt {cfg.ckpt} --out FOLDER)")
    seq_len = cfg.seq_len or mc.block_size
    if seq_len < 1:
        raise UsageError(f"--seq_len must be >= 1 (0 = the model's block_size {mc.block_size}), got {seq_len}")
    check_sample_size(min(cfg.batch_size or cfg.num_samples, cfg.num_samples), seq_len, device,
                      ("--batch_size", "--seq_len"))
    stride = check_stride(cfg.stride, mc.block_size)
    long = seq_len > mc.block_size
    prompt = parse_prompt(cfg, tok, mc.vocab_size)
    if prompt is not None and len(prompt) >= seq_len:
        raise UsageError(f"the prompt is {len(prompt)} tokens, longer than the context allows: it must be shorter "
                         f"than --seq_len {seq_len}")
    if cfg.cfg_w != 0 and prompt is None and not long:
        raise UsageError("--cfg_w needs --prompt or --prompt_ids: unsupervised CFG contrasts the prompt with "
                         "random tokens, so without one it would change nothing")
    for flag, used in (("--cfg_w", cfg.cfg_w != 0), ("--sampler psi", psi is not None)):
        if mc.causal and used:
            raise UsageError(f"{flag} applies to diffusion models; this checkpoint is autoregressive")
    schedule = cfg.noise_schedule or (ckpt.get("train_config") or {}).get("noise_schedule") or "loglinear"
    final_step = diffusion.default_final_step(ckpt) if cfg.final_step == "auto" else cfg.final_step

    settings = dict(ckpt=cfg.ckpt, ckpt_step=ckpt.get("step"), loss=(ckpt.get("train_config") or {}).get("loss"),
                    sampler="ar" if mc.causal else cfg.sampler, tokenizer=tok.spec, seq_len=seq_len, seed=cfg.seed,
                    use_ema=cfg.use_ema, top_p=cfg.top_p, prompt=cfg.prompt or None, prompt_ids=prompt)
    if not mc.causal:
        settings.update(steps=cfg.steps, nfe=cfg.steps + (final_step != "none"), final_step=final_step,
                        noise_schedule=schedule, t_end=cfg.t_end, cfg_w=cfg.cfg_w)
    if long:      # past the block: sampler windows (nfe is per window), or the AR model's sliding window
        settings.update(block_size=mc.block_size)
    if long and not mc.causal:
        settings.update(stride=stride, windows=len(long_windows(len(prompt or []), seq_len, mc.block_size, stride)))
    if psi is not None:
        settings.update(psi=psi._asdict())
    print(f"sampling {cfg.num_samples} x {seq_len} tokens from {cfg.ckpt} (step {ckpt.get('step')}, "
          f"{'EMA' if cfg.use_ema and ckpt.get('ema') is not None else 'live'} weights) on {device}: "
          + ", ".join(f"{k}={v}" for k, v in settings.items() if k not in ("ckpt", "ckpt_step", "prompt_ids")),
          file=sys.stderr)

    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    batch_size = cfg.batch_size or cfg.num_samples
    for index in range(0, cfg.num_samples, batch_size):
        n = min(batch_size, cfg.num_samples - index)
        if mc.causal:
            ids = generate_ar(model, n, seq_len, bos_id=None if prompt else tok.bos_id, prompt_ids=prompt,
                              top_p=cfg.top_p, generator=generator, device=device, dtype=dtype)
        else:
            ids = generate_long(model, n, seq_len, mc.vocab_size, cfg.steps, block_size=mc.block_size, stride=stride,
                                alpha_schedule=schedule, t_end=cfg.t_end, final_step=final_step, prompt_ids=prompt,
                                cfg_w=cfg.cfg_w, top_p=cfg.top_p, psi=psi, generator=generator, device=device,
                                dtype=dtype)
        records = [{WRITTEN_BY: signature("sample.py"), "sample": index + i, "text": tok.decode(row), "ids": row,
                    "settings": settings} for i, row in enumerate(ids.tolist())]
        if cfg.out:                    # saved first: a terminal that cannot show them loses nothing (cli.show)
            append_jsonl(cfg.out, records)
        for r in records:
            cli.show(f"--- sample {r['sample']} ---\n{r['text']}")
    if cfg.out:
        print(f"appended {cfg.num_samples} samples to {cfg.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_cli(main, DataError, oom_hint="lower --batch_size (sequences per sampler call)")
