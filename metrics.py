"""The estimators of sddlm's metrics, each with its standard error (Duo spec sections 3.3 and 7): what eval_ppl.py
prints, what training logs (validation.py) and what SDDLM.score returns.

nelbo     PPL = exp(token-mean of usdm_nelbo_loss) over the whole split, the log-linear schedule, EMA weights: an
          upper bound on the true PPL, by Monte Carlo (nelbo_ppl, the estimator below); the AR baseline gets its
          exact PPL instead, exp(token-mean of ar_loss).
genppl    generative perplexity under a judge LM (spec 7.1; gen_ppl): a Hugging Face causal LM (gpt2-large) or an AR
          checkpoint of this repo, offline (load_judge). The judge's name is part of every result.
entropy   per-sample unigram entropy (nats) of the generated ids, averaged over samples (spec 7.2; entropies).

Differences from Duo, all deliberate: padding is never scored (Duo pads GPT-2 with EOS and scores the first pad
of a sample that has no EOS), and no sample is dropped (Duo drops n mod 8).
"""
import math
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

import diffusion
import losses
from data import DataError, check_tokenizer, not_a_file
from kernels import fused_head
from plumbing import cli
from plumbing.cli import UsageError, autocast_for, first_line
from plumbing.memory import check_fits
from trained.checkpoint import load_model, load_tokenizer
from trained.folder import is_model_folder

# -----------------------------------------------------------------------------------------------
# likelihood: the NELBO estimator and its standard error (exact PPL for the AR baseline)
#
# The NELBO of a sequence is an integral over t of an expectation over x_t; one (t, x_t) draw estimates it without
# bias but with a large variance: a token corrupted at small t weighs ~1/t, a rare, heavy event. So each sequence
# gets rounds of stratified draws from a generator of its own (sequence_draws), seeded by (seed, its index in its
# split, the round) only; the rounds' spread is the standard error (nelbo_summary). Why, and what it buys (the same
# draws for any batch or world size, and for two checkpoints): docs/sampling.md, "Precision".

EVAL_SEED = 0       # the validation of train.py and distill.py: its seed, its stratified times per round, its rounds
VAL_DRAWS = 8       # per sequence; eval_ppl.py's defaults (--seed, --mc_draws, --rounds), so that its first rounds
VAL_ROUNDS = 2      # are these draws (a test holds the two equal)
Z95 = 1.959963984540054   # the standard normal's 97.5% quantile: mean +- Z95 SE is a 95% interval for a known SE
NU_MIN = 30         # --rel_se judges a standard error only on this many degrees of freedom or more


def t95(dof):
    """Student's t 97.5% quantile on dof >= 1 degrees of freedom: T = sqrt(dof) tan(th) has P(|T| <= sqrt(dof)
    tan(th)) = int_0^th cos^(dof - 1) / int_0^(pi/2) cos^(dof - 1), here by the trapezoid rule."""
    if dof > 1e3:        # Cornish and Fisher's first term (the next < 3e-6); Z95 at infinity
        return Z95 + (Z95 ** 3 + Z95) / (4 * dof)
    th = np.linspace(0, math.pi / 2, 20_001)
    f = np.cos(th) ** (dof - 1)
    area = np.concatenate([[0.0], np.cumsum(f[1:] + f[:-1])])
    return math.sqrt(dof) * math.tan(float(np.interp(0.95 * area[-1], area, th)))


def ppl_summary(nll, se, prefix, dof=math.inf):
    """A perplexity exp(nll) with its delta-method standard error and 95% interval exp(nll -+ t95(dof) se), se^2
    a variance estimate on dof degrees of freedom (None: se is None, one sample)."""
    ppl = math.exp(min(nll, 700.0))
    if se is None:
        return {prefix: ppl, f"{prefix}_se": None, f"{prefix}_lo": None, f"{prefix}_hi": None}
    q = t95(dof)
    return {prefix: ppl, f"{prefix}_se": ppl * se, f"{prefix}_lo": math.exp(min(nll - q * se, 700.0)),
            f"{prefix}_hi": math.exp(min(nll + q * se, 700.0))}


def stratified_times(draws, generator, t_min=diffusion.T_MIN):
    """One round's times of one sequence and their weights: t_h in stratum h = [a_h, b_h) of [t_min, 1], edges
    t_min + (1 - t_min) (h / n)^2 (n = draws: narrower near t_min, where the NELBO's draws vary most), with weight
    w_h = one over t_h's density in [a_h, b_h), over the length of [t_min, 1]: uniform, w_h = (b_h - a_h) /
    (1 - t_min), but log-uniform in the first stratum, t_0 = a_0 (b_0 / a_0)^u, w_0 = t_0 log(b_0 / a_0) /
    (1 - t_min). For any f, sum_h w_h f(t_h) is an unbiased estimate of E_{t ~ U[t_min, 1]} f(t). Near t_min a
    token is corrupted with probability ~t and then weighs ~1/t: the log-uniform draw takes that 1/t out of the
    weight, which keeps the variance but tames the rare huge draws that made a few rounds' spread a poor estimate
    of it (RESULTS.md). -> (t, w), each (draws,) float64."""
    edges = t_min + (1 - t_min) * (torch.arange(draws + 1, dtype=torch.float64) / draws) ** 2
    a, b = edges[:-1], edges[1:]
    u = torch.rand(draws, generator=generator, dtype=torch.float64)
    t, w = a + u * (b - a), (b - a) / (1 - t_min)
    t[0] = a[0] * (b[0] / a[0]) ** u[0]
    w[0] = t[0] * torch.log(b[0] / a[0]) / (1 - t_min)
    return t, w


def draw_seed(seed, index, rnd):
    """The seed of one sequence's draws in one round: (seed, index, round) mixed by splitmix64's finaliser into the
    32 bits torch's CPU generator keeps (two distinct keys collide with probability 2^-32)."""
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + rnd * 0x94D049BB133111EB + 1) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) & 0xFFFFFFFF


def sequence_draws(seed, index, rnd, draws, length, vocab_size, t_min=diffusion.T_MIN):
    """The NELBO draws of sequence `index` (its place in the split) in round `rnd`, on the CPU from a generator of
    its own: stratified_times, then per time the keep-uniforms and replacement ids of Eq. (discrete_marginal).
    -> (t (draws,), w (draws,), u (draws, length), replacement ids (draws, length))."""
    g = torch.Generator().manual_seed(draw_seed(seed, index, rnd))
    t, w = stratified_times(draws, g, t_min)
    return t, w, torch.rand(draws, length, generator=g), torch.randint(0, vocab_size, (draws, length), generator=g)


@torch.no_grad()
def sequence_nelbo(model, x0, mask, first, rounds, *, seed=EVAL_SEED, draws=VAL_DRAWS, t_min=diffusion.T_MIN,
                   autocast=None, tick=None):
    """Rounds `rounds` (a range) of the NELBO estimate of each sequence of x0 (B, L), rows first, first + 1, ... of
    its split; mask (B, L) bool or None (False = padding, not counted). Per round and stratum one forward of the
    batch: sum_h w_h sum_l mask * nelbo_per_token; after each, tick(the share of the batch's forwards done). A causal
    model (the AR baseline) gets its exact NLL (losses.ar_loss, one forward, no draws) in every round's row.
    -> nats (len(rounds), B) float64 (each row an unbiased estimate of every sequence's summed NELBO) and tokens
    (B,) float64."""
    B, L = x0.shape
    K = model.config.vocab_size
    autocast = autocast or autocast_for(x0.device, None)
    mask = torch.ones_like(x0, dtype=torch.bool) if mask is None else mask.bool()
    if model.config.causal:
        with autocast:
            logits = model(x0)
        nats = (losses.ar_loss(logits, x0).double() * mask[:, 1:]).sum(1).cpu()
        return nats.repeat(len(rounds), 1), mask[:, 1:].sum(1).double().cpu()
    # a round's draws are drawn whole before its forwards: 12 bytes a (draw, token) (float32 keep-uniforms, int64
    # ids), twice while stacked; a --mc_draws past the machine is one line here, not the kernel's OOM killer
    check_fits(24 * B * draws * L, "cpu", f"the --mc_draws {draws} draws of a batch of {B} x {L} tokens",
               "lower --mc_draws (more --rounds draw as many, a round at a time)")
    nats = torch.zeros(len(rounds), B, dtype=torch.float64)
    for k, rnd in enumerate(rounds):
        t, w, u, ids = (torch.stack(d, 1).to(x0.device) for d in
                        zip(*(sequence_draws(seed, first + b, rnd, draws, L, K, t_min) for b in range(B))))
        for h in range(draws):
            per_token = nelbo_per_token(model, x0, t[h].float(), K, autocast, draws=(u[h], ids[h]))
            nats[k] += (w[h] * (per_token.double() * mask).sum(1)).cpu()
            if tick:
                tick((k * draws + h + 1) / (len(rounds) * draws))
    return nats, mask.sum(1).double().cpu()


def nelbo_summary(sums):
    """The NELBO per token, its perplexity and their Monte-Carlo standard errors from float64 sums over sequences
    i (each rank's added): sums = (sum_i nats_i, sum_i tokens_i, sum_i var_i, sum_i var_i^2 / (R - 1)), nats_i a
    sequence's estimate (the mean of its R rounds), var_i = s_i^2 / R its variance estimate (s_i^2: the unbiased
    spread of its rounds, on R - 1 degrees of freedom; 0 for an exact NLL). The sequences are fixed and their draws
    independent, so Var(nll) = sum_i Var(nats_i) / T^2, T = sum_i tokens_i, estimated on Satterthwaite's
    (sum_i var_i)^2 / sum_i (var_i^2 / (R - 1)) degrees of freedom (R - 1 for one sequence, ~N (R - 1) for N alike):
    the 95% interval's t quantile (ppl_summary). -> dict(nll, nll_se, dof, ppl, ppl_se, ppl_lo, ppl_hi, rel_se =
    SE(PPL) / PPL = SE(nll))."""
    nats, tokens, var, var2 = (float(v) for v in sums)
    nll, se, dof = nats / tokens, math.sqrt(max(var, 0.0)) / tokens, var * var / var2 if var2 > 0 else math.inf
    return dict(nll=nll, nll_se=se, dof=dof, **ppl_summary(nll, se, "ppl", dof), rel_se=se)


def round_sums(nats, tokens):
    """sequence_nelbo's rounds (R, B) and tokens (B,) -> the float64 sums of nelbo_summary (nats_i the mean of
    sequence i's rounds, var_i their unbiased variance / R; R >= 2)."""
    R = nats.shape[0]
    var = nats.var(0, unbiased=True) / R
    return torch.stack([nats.mean(0).sum(), tokens.sum(), var.sum(), (var * var).sum() / (R - 1)])


@torch.no_grad()
def nelbo_ppl(model, batches, vocab_size=None, *, seed=EVAL_SEED, mc_draws=VAL_DRAWS, rounds=VAL_ROUNDS, rel_se=0.0,
              max_rounds=32, device=None, t_min=diffusion.T_MIN, dtype=None, show_progress=True, n_sequences=None):
    """Token-mean NELBO over all batches, its perplexity and their standard errors (Duo spec 3.3; the estimator
    above). batches: a list, or a function returning a fresh iterable, of x0 (B, L) int64 or (x0, mask) with mask
    (B, L) bool or None (False = padding); sequences are numbered in that order. Past `rounds` (>= 2), more rounds
    follow while rel_se (> 0) is not reached on NU_MIN degrees of freedom, up to max_rounds. A causal model (the
    AR baseline) is scored exactly (one pass, standard error 0). vocab_size: unused, the model's. n_sequences: the
    progress bar's total (it counts sequences, a batch's in steps of its forwards). -> dict(nll, nll_se, dof, ppl,
    ppl_se, ppl_lo, ppl_hi (95% interval), rel_se, bpd, tokens, sequences, estimator "nelbo" | "ar_exact",
    mc_draws (per sequence, all rounds), rounds, seed)."""
    if mc_draws < 1 or rounds < 2 or max_rounds < rounds or rel_se < 0:
        raise ValueError(f"need mc_draws >= 1, 2 <= rounds <= max_rounds and rel_se >= 0; got {mc_draws}, {rounds}, "
                         f"{max_rounds}, {rel_se}")
    causal = model.config.causal
    autocast = autocast_for(device or "cpu", dtype)
    fresh = batches if callable(batches) else (lambda: batches)

    def passes(todo):          # one pass over the batches: per sequence the rounds in `todo`
        nats, tokens = [], []
        bar = tqdm(desc="ar ppl" if causal else f"nelbo rounds {todo.start + 1}-{todo.stop}",
                   disable=cli.bar_hidden(show_progress), leave=False, total=n_sequences, unit="seq")
        first = 0
        for batch in fresh():
            x0, mask = batch if isinstance(batch, (tuple, list)) else (batch, None)
            x0, mask = x0.to(device), None if mask is None else mask.to(device)
            tick = lambda done: bar.update(first + int(done * len(x0)) - bar.n)    # noqa: E731
            n, m = sequence_nelbo(model, x0, mask, first, todo, seed=seed, draws=mc_draws, t_min=t_min,
                                  autocast=autocast, tick=tick)
            nats.append(n)
            tokens.append(m)
            first += x0.shape[0]
            bar.update(first - bar.n)
        bar.close()
        if not tokens or float(torch.cat(tokens).sum()) == 0:
            raise ValueError("no tokens to evaluate (empty split or all padding)")
        return torch.cat(nats, 1), torch.cat(tokens)

    nats, tokens = passes(range(rounds))       # a causal model's rounds are equal: standard error 0, no more
    while True:
        summary = nelbo_summary(round_sums(nats, tokens))
        done = nats.shape[0]
        se, dof = summary["rel_se"], summary["dof"]
        if rel_se <= 0 or (se <= rel_se and dof >= NU_MIN) or done >= max_rounds:
            break
        # SE ~ 1 / sqrt(R), dof ~ R - 1 (an SE on few is below its value by chance as often as not: no stop on it)
        more = max(1, min(max_rounds, math.ceil(max(done * (se / rel_se) ** 2, 1 + (done - 1) * NU_MIN / dof)))
                   - done)
        if show_progress:          # the wait that follows, said before it starts
            why = (f"above --rel_se {100 * rel_se:g}%" if se > rel_se else
                   f"on {dof:.3g} < {NU_MIN} degrees of freedom")
            tqdm.write(f"relative SE {100 * se:.2f}% after {done} rounds, {why}: {more} more "
                       f"round{'s' * (more > 1)} (~{more / done:.3g}x the time so far; at most --max_rounds "
                       f"{max_rounds} in all)", file=sys.stderr)
        nats = torch.cat([nats, passes(range(done, done + more))[0]])
    return dict(**summary, bpd=summary["nll"] / math.log(2), tokens=int(tokens.sum()), sequences=len(tokens),
                estimator="ar_exact" if causal else "nelbo", mc_draws=0 if causal else mc_draws * nats.shape[0],
                rounds=0 if causal else nats.shape[0], seed=None if causal else seed)


def nelbo_per_token(model, x0, t, vocab_size, autocast, generator=None, draws=None):
    """The NELBO's per-token terms (B, L) of x0 (B, L) at times t (B,) under the log-linear schedule, one draw
    xt ~ q_t(. | x0) (Eq. (discrete_marginal)) from generator, or from draws (u, replacement ids), each (B, L);
    fused_head.usdm_nelbo_loss_lean, so no (B, L, V) float32."""
    alpha_t, dalpha_t = diffusion.log_linear_schedule(t)
    alpha_t, dalpha_t = alpha_t.unsqueeze(-1), dalpha_t.unsqueeze(-1)
    xt = diffusion.sample_xt(x0, alpha_t, vocab_size, generator, draws)
    with autocast:
        logits = model(xt, diffusion.sigma_from_alpha(alpha_t.squeeze(-1)))
    return fused_head.usdm_nelbo_loss_lean(logits, x0, xt, alpha_t, dalpha_t)


# -----------------------------------------------------------------------------------------------
# sample quality: generative perplexity under a judge, unigram entropy

@dataclass
class Judge:
    """A causal LM that scores samples; `name` goes into every result."""
    name: str
    logits: Callable                 # (ids (B, T) int64, attention_mask (B, T) bool) -> next-token logits (B, T, V)
    encode: Callable                 # str -> list[int] in the judge's vocabulary
    eos_id: int
    context: int                     # tokens per scored chunk (Duo: 1024)
    tokenizer_meta: Optional[dict] = None   # AR checkpoints: the data meta of their tokenizer


def judge_windows(n_tokens, context, stride):
    """The judge's sliding windows over a sequence of n_tokens -> [(start, end, first)]: the window ids[start:end]
    (at most `context` tokens) scores its tokens first..end-1, each predicted from the tokens before it in the
    window. The first window is ids[:context] (tokens 1.. scored); each next one ends `stride` tokens later (the
    last at n_tokens) and scores its new tokens given at least context - stride before them. So tokens 1..n-1 are
    each scored exactly once, given up to the judge's context of preceding tokens; the first token never."""
    if not 0 < stride < context:
        raise ValueError(f"the judge's stride must be in [1, {context - 1}] (its context - 1), got {stride}")
    windows, end = [(0, min(n_tokens, context), 1)] if n_tokens else [], context
    while end < n_tokens:
        new_end = min(end + stride, n_tokens)
        windows.append((new_end - context, new_end, end))
        end = new_end
    return windows


def ratio_summary(moments):
    """The ratio estimator R = sum_j n_j / sum_j m_j over N independent units j (samples) and its standard error by
    the delta method, Var(R) = sum_j (n_j - R m_j)^2 / (N (N - 1) mbar^2), from the float64 moments (N, sum n,
    sum m, sum n^2, sum m^2, sum n m), which add over ranks. -> (R, SE; None when N < 2)."""
    N, n, m, nn, mm, nm = (float(v) for v in moments)
    R = n / m
    if N < 2:
        return R, None
    spread = max(nn - 2 * R * nm + R * R * mm, 0.0)      # sum_j (n_j - R m_j)^2
    return R, math.sqrt(spread / (N * (N - 1))) / (m / N)


def ratio_moments(n, m):
    """Per-unit values n, m (N,) -> the float64 moments of ratio_summary."""
    n, m = torch.as_tensor(n, dtype=torch.float64), torch.as_tensor(m, dtype=torch.float64)
    return torch.stack([torch.tensor(float(len(n)), dtype=torch.float64), n.sum(), m.sum(), (n * n).sum(),
                        (m * m).sum(), (n * m).sum()])


@torch.no_grad()
def gen_ppl(samples, judge, *, max_length=None, batch_size=8, device=None, show_progress=True, stride=None,
            per_sample=False):
    """Generative perplexity of samples under judge (Duo spec 7.1).
    samples: list of str (retokenized with judge.encode, no BOS added), or id lists / an int64 tensor (N, L)
    already in the judge's vocabulary. Each sequence is truncated to max_length (Duo: the model length L); one of up to
    judge.context tokens is one window (Duo's scoring), a longer one is scored over judge_windows advancing by
    `stride` (default half the judge's context), so each token is scored once with up to the judge's context
    before it. The first token is never scored; the others when they are not EOS or are the sample's first EOS
    (Duo's mask `(cumsum(is_eos) == 1) | ~is_eos`: text after an EOS is still scored, later EOS are not).
    The samples are the draws: the standard error is ratio_summary's over them. -> dict(gen_ppl, gen_ppl_se,
    gen_ppl_lo, gen_ppl_hi (95% interval), nll, nll_se, tokens, samples, judge, retokenized; per_sample: also
    sample_nll, sample_tokens, each sample's sums)."""
    samples = list(samples)
    if not samples:
        raise ValueError("no samples to score")
    retokenize = isinstance(samples[0], str)
    seqs = [judge.encode(s) if retokenize else [int(i) for i in s] for s in samples]
    seqs = [s[:max_length] if max_length else s for s in seqs]
    stride = stride or max(1, judge.context // 2)
    windows = []
    for j, s in enumerate(seqs):
        eos = [i for i, token in enumerate(s) if token == judge.eos_id]
        keep = [token != judge.eos_id or i == eos[0] for i, token in enumerate(s)]   # Duo: the first EOS only
        windows += [(j, s[a:b], keep[f:b], f - a)              # j: the sample the window belongs to
                    for a, b, f in judge_windows(len(s), judge.context, stride)]
    nll_of, count_of = torch.zeros(len(seqs), dtype=torch.float64), torch.zeros(len(seqs), dtype=torch.float64)

    def pad(rows, dtype):             # a batch of lists -> (B, the longest) on the device, zeros (False) after each
        return pad_sequence([torch.tensor(r, dtype=dtype) for r in rows], batch_first=True).to(device)

    for b in tqdm(range(0, len(windows), batch_size), desc=f"gen ppl ({judge.name})",
                  disable=cli.bar_hidden(show_progress), leave=False):
        owner, batch = [w[0] for w in windows[b:b + batch_size]], [w[1:] for w in windows[b:b + batch_size]]
        ids, attn = pad([w for w, _, _ in batch], torch.long), pad([[True] * len(w) for w, _, _ in batch], torch.bool)
        scored = pad([[False] * (first - 1) + keep for _, keep, first in batch], torch.bool)   # the targets ids[:, 1:]
        logits = judge.logits(ids, attn)
        nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
        nll_of.index_add_(0, torch.tensor(owner), (nll.double() * scored).sum(1).cpu())
        count_of.index_add_(0, torch.tensor(owner), scored.sum(1).double().cpu())
    if count_of.sum() == 0:
        raise ValueError("no scored tokens: every sample is at most one token long")
    nll, se = ratio_summary(ratio_moments(nll_of, count_of))
    return dict(**ppl_summary(nll, se, "gen_ppl", len(seqs) - 1), nll=nll, nll_se=se, tokens=int(count_of.sum()),
                samples=len(seqs), judge=judge.name, retokenized=retokenize,
                **(dict(sample_nll=nll_of, sample_tokens=count_of) if per_sample else {}))


def entropies(samples):
    """The unigram entropy (nats) of each sample's own ids, specials included (spec 7.2).
    samples: id lists or an int64 tensor (N, L) -> list of float."""
    values = []
    for s in samples:
        _, counts = torch.unique(torch.as_tensor(s), return_counts=True)
        p = counts.double() / counts.sum()
        values.append(float(-(p * p.log()).sum()))
    if not values:
        raise ValueError("no samples")
    return values


def mean_se(n, total, squares):
    """The standard error of a mean of n independent values from their sum and sum of squares (None when n < 2)."""
    if n < 2:
        return None
    return math.sqrt(max(squares - total * total / n, 0.0) / (n - 1) / n)


def load_judge(spec, device):
    """An AR checkpoint of this repo (a path: a file, a name ending in .pt or a model folder; or duo:PATH, Duo's
    released AR baseline) or a Hugging Face causal LM (hub name or local folder, needs transformers). Never falls
    back to another judge."""
    if special := not_a_file(spec, None, "--judge"):     # a named pipe: what it is, not "no hub model of that name"
        raise UsageError(special)
    if spec.endswith(".pt") or spec.startswith("duo:") or os.path.isfile(spec) or is_model_folder(spec):
        model, ckpt = load_model(spec, device, use_ema=True)
        if not model.config.causal:
            raise UsageError(f"--judge {spec} is a diffusion checkpoint; a judge must be autoregressive "
                             f"(train one with train.py --loss ar)")
        tok, why = load_tokenizer(ckpt, spec)
        if tok is None:
            raise UsageError(f"--judge {spec}: {why}")
        return Judge(name=f"ar:{spec}@step{ckpt.get('step')}", logits=lambda ids, attn: model(ids),
                     encode=tok.encode, eos_id=tok.eos_id, context=model.config.block_size,
                     tokenizer_meta=ckpt.get("meta"))
    offline_hint = "pass --judge path/to/ar_ckpt.pt (a checkpoint trained with train.py --loss ar) for an offline judge"
    try:
        import transformers
    except ImportError:
        raise UsageError(f"judge {spec!r} needs the transformers package, which is not installed; "
                         f"{offline_hint}") from None
    try:
        hf_tok = transformers.AutoTokenizer.from_pretrained(spec)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(spec).to(device).eval()
    except Exception as e:
        raise UsageError(f"could not load judge {spec!r} ({type(e).__name__}: {first_line(e)}); {offline_hint}"
                         ) from None
    context = getattr(hf_model.config, "n_positions", None) or hf_model.config.max_position_embeddings
    return Judge(name=f"hf:{spec}", logits=lambda ids, attn: hf_model(input_ids=ids, attention_mask=attn).logits,
                 encode=lambda text: hf_tok(text)["input_ids"], eos_id=hf_tok.eos_token_id, context=context)


def judge_shares_tokenizer(judge, tok):
    """True when the judge is an AR checkpoint whose tokenizer is `tok` (same vocabulary, specials and ids on
    data.py's probe text): then the sampler's ids are scored without retokenization."""
    if judge.tokenizer_meta is None or tok is None:
        return False
    try:
        check_tokenizer(judge.tokenizer_meta, tok)
        return True
    except (DataError, KeyError):
        return False
