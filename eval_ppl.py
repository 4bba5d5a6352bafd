"""
Likelihood and sample-quality metrics for sddlm checkpoints (Duo spec sections 3.3 and 7).

    python eval_ppl.py --ckpt out/ckpt.pt --metric nelbo                          # validation NELBO perplexity
    python eval_ppl.py --ckpt out/ckpt.pt --metric zeroshot --dataset wikitext103,lambada   # or a .txt file
    python eval_ppl.py --ckpt out/ckpt.pt --metric genppl --judge gpt2-large --steps 32,64,128
    python eval_ppl.py --ckpt out/ckpt.pt --metric genppl --sampler psi --psi_eta 0.9 --steps 64,1024
    python eval_ppl.py --metric genppl --samples out/samples.jsonl --judge out-ar/ckpt.pt   # sample.py's samples
    python eval_ppl.py --ckpt out/ckpt.pt --metric genppl --seq_len 512 --stride 64     # past the block

nelbo     PPL = exp(token-mean of usdm_nelbo_loss) over the whole split, the log-linear schedule, EMA weights: an
          upper bound on the true PPL, estimated by Monte Carlo with its standard error and 95% interval. Each
          sequence gets its own draws (seeded by --seed, its index and the round; the same as training's validation
          at the defaults): rounds of --mc_draws times stratified over [t_min, 1], at least --rounds of them, more
          until the PPL's relative standard error is --rel_se (default 2%) on 30+ degrees of freedom or --max_rounds
          is reached; the SE comes from the rounds' spread, the 95% interval from Student's t (nelbo_ppl). Two
          checkpoints scored with one seed see the same draws. The AR baseline gets its exact PPL instead,
          exp(token-mean of ar_loss).
zeroshot  the same estimator on a text the model never saw (a local .txt, or a named set via data.py's
          loaders and detokenizers), wrapped as Duo's zero-shot runs do (spec 7.4, data.insert_valid_eos=False;
          paper Appendix: no EOS between segments): documents are concatenated WITHOUT an EOS between them,
          cut into pieces of L - 2 tokens, and each block is [BOS] + piece + [EOS] (Duo's wrap); the final
          remainder is dropped. The paper uses L = 1024, its models' length: L is at most the model's block_size.
genppl    generative perplexity under a judge LM (spec 7.1): retokenize each sample with the judge's tokenizer
          (no BOS added), truncate to the sample length L, score it in one forward of the judge (a sample longer
          than the judge's context: sliding windows, each token scored once given up to the judge's context
          before it, judge_windows); the first token is never scored; every non-EOS token is scored, EOS only at
          its first occurrence (Duo's mask `(cumsum(is_eos) == 1) | ~is_eos`: text after an EOS is still scored,
          later EOS are not); Gen PPL = exp(sum NLL / number of scored tokens) pooled over all samples, its
          standard error over the samples (a ratio estimator, delta method).
          Judges: a Hugging Face causal LM (gpt2-large, needs transformers) or an AR checkpoint of this repo
          (train.py --loss ar), offline; with the sampler's own tokenizer the ids are scored as they are (no
          retokenization). The judge's name is part of every result. --seq_len past the model's block_size
          draws samples in semi-autoregressive windows (sample.generate_long; the AR baseline slides its context).
entropy   per-sample unigram entropy (nats) of the generated ids, averaged over samples (spec 7.2), with the
          standard error of that mean.

Differences from Duo, all deliberate: padding is never scored (Duo pads GPT-2 with EOS and scores the first pad
of a sample that has no EOS), and no sample is dropped (Duo drops n mod 8).
"""

from plumbing import cli  # first: a stop signal while the imports below load is one line, exit 130
cli.stop_at_once(__name__)

import itertools
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import diffusion
import losses
from kernels import fused_head
from plumbing.cli import (UsageError, autocast_for, first_line, parse_flags, resolve_device, resolve_dtype,
                          run_cli)
from data import get_tokenizer, not_a_file, read_text
from diffusion import default_final_step, draw_noise, loss_terms
from plumbing.checkpoint import ema_weights
from trained.checkpoint import load_model, load_tokenizer
from plumbing.memory import check_fits
from plumbing.files import WRITTEN_BY, append_jsonl, check_outputs, refuse_overwrite, signature, write_json
from plumbing.runlog import jsonl_records
from sample import check_sample_size, check_sampler, check_stride, generate, generate_ar, generate_long, psi_from_flags
from trained.folder import is_model_folder

ZERO_SHOT_SETS = ("wikitext103", "wikitext2", "ptb", "lambada", "ag_news", "arxiv", "pubmed", "lm1b")


# -----------------------------------------------------------------------------------------------
# likelihood: the NELBO estimator and its standard error (exact PPL for the AR baseline)
#
# The NELBO of a sequence is an integral over t of an expectation over x_t; one (t, x_t) draw estimates it without
# bias but with a large variance: a token corrupted at small t weighs ~1/t, a rare, heavy event. So each sequence
# gets its own draws, from a generator of its own (sequence_draws): `rounds` independent rounds of `draws` times
# stratified over [t_min, 1], the strata narrower near t_min (where the draws vary most), and a fresh x_t per time.
# Each round is an unbiased estimate; their mean is the estimate, their spread its standard error (nelbo_summary).
# The draws depend on (seed, the sequence's index in its split, the round) only: the same for any batch size, world
# size or device, the same at every evaluation of a training run, and the same for two checkpoints evaluated with
# one seed, so that their difference is far more precise than either number (common random numbers).

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
    batch: sum_h w_h sum_l mask * nelbo_per_token; after each, tick(the share of the batch's forwards done).
    -> nats (len(rounds), B) float64 (each row an unbiased estimate of every sequence's summed NELBO) and tokens
    (B,) float64."""
    B, L = x0.shape
    K = model.config.vocab_size
    # a round's draws are drawn whole before its forwards: 12 bytes a (draw, token) (float32 keep-uniforms, int64
    # ids), twice while stacked; a --mc_draws past the machine is one line here, not the kernel's OOM killer
    check_fits(24 * B * draws * L, "cpu", f"the --mc_draws {draws} draws of a batch of {B} x {L} tokens",
               "lower --mc_draws (more --rounds draw as many, a round at a time)")
    autocast = autocast or autocast_for(x0.device, None)
    mask = torch.ones_like(x0, dtype=torch.bool) if mask is None else mask.bool()
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
    (B, L) bool or None (False = padding); sequences are numbered in that order. Each sequence gets `rounds`
    (>= 2) rounds of mc_draws stratified (t, x_t) draws (sequence_nelbo); while the PPL's relative standard error is
    above rel_se (> 0), or judged on fewer than NU_MIN degrees of freedom, and fewer than max_rounds are done, more
    rounds follow, as many as the estimated error says (each a pass over the batches: a function re-reads them). A
    causal model (model.config.causal, the AR baseline) is scored exactly with losses.ar_loss instead (one pass, no
    draws, standard error 0). vocab_size: unused, the model's. n_sequences: the progress bar's total (it counts
    sequences, a batch's in steps of its forwards). -> dict(nll, nll_se, dof, ppl, ppl_se, ppl_lo, ppl_hi (95%
    interval), rel_se, bpd, tokens, sequences, estimator "nelbo" | "ar_exact", mc_draws (per sequence, all rounds),
    rounds, seed)."""
    if mc_draws < 1 or rounds < 2 or max_rounds < rounds or rel_se < 0:
        raise ValueError(f"need mc_draws >= 1, 2 <= rounds <= max_rounds and rel_se >= 0; got {mc_draws}, {rounds}, "
                         f"{max_rounds}, {rel_se}")
    causal = bool(getattr(getattr(model, "config", None), "causal", False))
    autocast = autocast_for(device or "cpu", dtype)
    fresh = batches if callable(batches) else (lambda: batches)

    def passes(todo):          # one pass over the batches: per sequence the rounds in `todo`
        nats, tokens = [], []
        bar = tqdm(desc="ar ppl" if causal else f"nelbo rounds {todo.start + 1}-{todo.stop}",
                   disable=cli.bar_hidden(show_progress), leave=False, total=n_sequences, unit="seq")
        first = 0
        for batch in fresh():
            x0, mask = batch if isinstance(batch, (tuple, list)) else (batch, None)
            x0 = x0.to(device)
            mask = torch.ones_like(x0, dtype=torch.bool) if mask is None else mask.to(device).bool()
            if causal:
                with autocast:
                    logits = model(x0)
                weight = mask[:, 1:]
                nats.append((losses.ar_loss(logits, x0).double() * weight).sum(1).cpu()[None])
                tokens.append(weight.sum(1).double().cpu())
            else:
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

    if causal:
        nats, tokens = passes(range(1))
        summary = nelbo_summary((nats.sum(), tokens.sum(), 0.0, 0.0))
    else:
        nats, tokens = passes(range(rounds))
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
# zero-shot text: documents -> wrapped blocks

def zero_shot_blocks(token_lists, seq_len, bos_id, eos_id):
    """Duo's zero-shot wrap WITHOUT an EOS between documents: the documents' ids concatenated, then
    data.wrap_blocks ([BOS] + piece of seq_len - 2 + [EOS]; the remainder dropped). -> (N, seq_len) int64."""
    from data import wrap_blocks
    stream = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64)
    return torch.from_numpy(wrap_blocks(stream, seq_len, bos_id, eos_id)[0])


def zero_shot_documents(name):
    """A local text file (one document: the whole file) or a named zero-shot set: its evaluation split via
    corpora.load_hf_split (Duo's splits, text fields and detokenizers; needs `datasets` and the network)."""
    from data import DataError, read_text
    from corpora import load_hf_split
    if os.path.isfile(name):
        return [read_text(name)]      # not UTF-8 -> one line naming the byte
    if special := not_a_file(name, None, "--dataset"):   # a named pipe: what it is, not "neither a file nor ..."
        raise UsageError(special)
    if name not in ZERO_SHOT_SETS:
        raise UsageError(f"--dataset {name!r} is neither a file nor one of {', '.join(ZERO_SHOT_SETS)}")
    docs = list(load_hf_split(name, "val"))
    if not docs:
        raise DataError(f"{name}: its evaluation split is empty")
    return docs


def tokenize_documents(docs, tok, show_progress=True):
    ids = []
    for i in tqdm(range(0, len(docs), 1024), desc="tokenizing",
                  disable=cli.bar_hidden(show_progress) or len(docs) < 1024, leave=False):
        ids.extend(tok.encode_batch(docs[i:i + 1024]))
    return ids


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
    samples: list of str (retokenized with judge.encode), or id lists / an int64 tensor (N, L) already in the
    judge's vocabulary. Each sequence is truncated to max_length (Duo: the model length L); one of up to
    judge.context tokens is one window (Duo's scoring), a longer one is scored over judge_windows advancing by
    `stride` (default half the judge's context), so each token is scored once with up to the judge's context
    before it. The first token is never scored; the others when they are not EOS or are the sample's first EOS.
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
    for b in tqdm(range(0, len(windows), batch_size), desc=f"gen ppl ({judge.name})",
                  disable=cli.bar_hidden(show_progress), leave=False):
        owner, batch = [w[0] for w in windows[b:b + batch_size]], [w[1:] for w in windows[b:b + batch_size]]
        T = max(len(w) for w, _, _ in batch)
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        attn = torch.zeros(len(batch), T, dtype=torch.bool)
        scored = torch.zeros(len(batch), T - 1, dtype=torch.bool)     # the targets ids[:, 1:]
        for r, (w, keep, first) in enumerate(batch):
            ids[r, :len(w)] = torch.tensor(w, dtype=torch.long)
            attn[r, :len(w)] = True
            scored[r, first - 1:len(w) - 1] = torch.tensor(keep, dtype=torch.bool)
        ids, attn, scored = ids.to(device), attn.to(device), scored.to(device)
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


def entropy(samples):
    """Mean over samples of their unigram entropies (entropies) -> float."""
    values = entropies(samples)
    return sum(values) / len(values)


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
    from data import DataError, check_tokenizer
    if judge.tokenizer_meta is None or tok is None:
        return False
    try:
        check_tokenizer(judge.tokenizer_meta, tok)
        return True
    except (DataError, KeyError):
        return False


# -----------------------------------------------------------------------------------------------
# command line

@dataclass
class EvalConfig:
    # model and metric
    ckpt: str = "out/ckpt.pt"        # the model to evaluate (genppl with --samples does not need it)
    metric: str = "nelbo"            # nelbo | zeroshot | genppl
    use_ema: bool = True             # evaluate the EMA weights (the live ones when the checkpoint has no EMA)
    out: str = ""                    # also write the JSON result here
    # runtime
    seed: int = EVAL_SEED            # seeds the NELBO's draws (training's validation: 0) and the samples of genppl
    device: str = "auto"             # auto | cpu | cuda
    dtype: str = "auto"              # auto (bf16 on GPU, float32 on CPU) | float32 | bfloat16
    batch_size: int = 16             # sequences per forward
    # nelbo / zeroshot
    data_dir: str = ""               # nelbo: prepared data folder ("" = the one the checkpoint was trained on)
    split: str = "val"               # nelbo: the prepared split to score, val | train
    max_batches: int = 0             # score only the first N batches (0 = the whole split / text)
    mc_draws: int = VAL_DRAWS        # (t, xt) draws per sequence in one round, t stratified over [t_min, 1]
    rounds: int = VAL_ROUNDS         # rounds per sequence at least (>= 2: their spread is the standard error)
    rel_se: float = 0.02             # then more rounds until the PPL's relative SE is at most this, on 30+ degrees
                                     # of freedom (0: no)
    max_rounds: int = 32             # the cap on rounds per sequence (--rel_se may stop there, unreached: said so)
    t_min: float = 1e-3              # the smallest time t of the stratified draws in [t_min, 1]
    dataset: str = ""                # zeroshot: comma list of .txt files and/or names (wikitext103, lambada, ...)
    seq_len: int = 0                 # zeroshot block length (at most the model's block_size) / genppl sample length
                                     # (0 = the block_size; paper: 1024); a longer sample: windows of --stride tokens
    stride: int = 0                  # genppl past block_size: new tokens per sampler window (0 = half a block)
    # genppl
    judge: str = "gpt2-large"        # HF causal LM (needs transformers) or an AR checkpoint .pt of this repo
    samples: str = ""                # score the samples of this JSONL (sample.py --out) instead of generating
    steps: str = "128"               # comma list: one row of the "Gen PPL vs sampling steps" table each
    num_samples: int = 16            # samples generated and scored per row
    final_step: str = "auto"         # ancestral | greedy | none | auto (as sample.py: by the objective)
    top_p: float = 1.0               # nucleus on x_theta (1 = off), as sample.py --top_p
    sampler: str = "ancestral"       # ancestral | psi: the --sampler and --psi_* flags of sample.py
    psi_kappa: str = "eta"           # psi: kappa mode eta | max_capped | max_rescale | sigma_constant, as sample.py
    psi_eta: str = "0.9"             # psi: eta of each mode, 1 or 3 values, as sample.py
    psi_profile: str = "linear"      # psi: time profile, linear | loop, as sample.py
    psi_loop_t: float = 0.1          # psi loop: the time level held in the middle phase, as sample.py
    psi_fracs: str = "0.45,0.5,0.05"  # psi loop: fractions of the steps in the high, middle and low phases
    psi_rescale: str = "remdm"       # psi max_rescale: remdm | duo (Duo's code's cap), as sample.py
    psi_grid: str = "ours"           # psi: ours | duo (Duo's code's grid), as sample.py
    judge_batch_size: int = 8        # samples per forward of the judge
    save_samples: str = ""           # append the generated samples (JSONL) here


def _table(rows, columns):
    header = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)
    lines = ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join([header, *lines])


def _fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else "-" if v is None else str(v)


def _read_samples(path):
    if not os.path.isfile(path):
        raise UsageError(not_a_file(path, f"--samples {path}: " + ("a folder; give the JSONL file of sample.py's "
                                                                   "--out" if os.path.isdir(path) else "no such file"),
                                    "--samples"))
    records = []
    for n, record in jsonl_records(read_text(path), lambda n, e: UsageError(f"--samples {path}:{n}: not a JSON line ({e}); "
                                                                 f"a truncated file?")):
        if not isinstance(record, dict) or not isinstance(record.get("ids"), list) or \
                not all(isinstance(i, int) and not isinstance(i, bool) for i in record["ids"]):
            raise UsageError(f"--samples {path}:{n}: expected a JSON object with 'ids' (a list of integers) and "
                             f"'text', as sample.py writes")
        if not record["ids"] or min(record["ids"]) < 0 or not isinstance(record.get("text"), (str, type(None))) \
                or not isinstance(record.get("settings"), (dict, type(None))):
            what = ("an empty sample (no ids)" if not record["ids"] else "a negative token id" if
                    min(record["ids"]) < 0 else "'text' that is not a string" if
                    not isinstance(record.get("text"), (str, type(None))) else "'settings' that is not an object")
            raise UsageError(f"--samples {path}:{n}: {what}; sample.py writes none such: drop or fix that line")
        records.append(record)
    if not records:
        raise UsageError(f"--samples {path}: no samples in it")
    return records


def estimator(cfg):
    """nelbo_ppl's settings from the flags."""
    return dict(seed=cfg.seed, mc_draws=cfg.mc_draws, rounds=cfg.rounds, rel_se=cfg.rel_se, max_rounds=cfg.max_rounds,
                t_min=cfg.t_min)


def precision_line(row, cfg):
    """One line under the table: the estimate, its standard error and 95% interval, and the draws it took."""
    if "gen_ppl" in row:
        if row["gen_ppl_se"] is None:
            return f"{row['model']}, {row['steps']} steps: one sample, no standard error"
        return (f"{row['model']}, {row['steps']} steps: Gen PPL {row['gen_ppl']:.2f} ± {row['gen_ppl_se']:.2f} (95% "
                f"interval {row['gen_ppl_lo']:.2f}–{row['gen_ppl_hi']:.2f}), entropy {row['entropy']:.3f} ± "
                f"{row['entropy_se']:.3f}, over {row['samples']} samples")
    if row["estimator"] != "nelbo":
        return f"{row['data']}: PPL {row['ppl']:.2f}, exact ({row['estimator']}: no Monte-Carlo draws)"
    line = (f"{row['data']}: PPL {row['ppl']:.2f} ± {row['ppl_se']:.2f} (95% interval {row['ppl_lo']:.2f}–"
            f"{row['ppl_hi']:.2f}, t on {row['dof']:.0f} degrees of freedom), relative SE {100 * row['rel_se']:.2f}%, "
            f"{row['mc_draws']} draws per sequence ({row['rounds']} rounds of {cfg.mc_draws}), seed {row['seed']}")
    if cfg.rel_se and (row["rel_se"] > cfg.rel_se or row["dof"] < NU_MIN):
        line += f"; --rel_se {cfg.rel_se:g} not reached at --max_rounds {cfg.max_rounds}"
    return line


def run_nelbo(cfg, model, ckpt, device, dtype):
    from data import DataError, check_split, check_tokenizer, eval_batches, load_meta, verify_prepared
    from trained.checkpoint import check_data_tokenizer
    recorded = (ckpt.get("train_config") or {}).get("data_dir") or (ckpt.get("meta") or {}).get("data_dir")
    data_dir = cfg.data_dir or recorded
    if not data_dir:
        raise UsageError("--data_dir is needed: the checkpoint does not record its prepared data folder")
    try:
        meta = load_meta(data_dir)
        check_data_tokenizer(data_dir, meta, ckpt, cfg.ckpt, need_tokenizer=False)   # the checkpoint's, by content
        check_tokenizer(meta, model.config.vocab_size)
    except DataError as e:
        raise UsageError(str(e)) from None
    if not meta.get(f"{cfg.split}_sequences"):
        raise UsageError(f"--split {cfg.split!r}: {data_dir} has no sequences there (splits: train, val)")
    verify_prepared(data_dir, meta, [f"{cfg.split}.bin", f"{cfg.split}_mask.bin"])   # its sha256 in meta.json
    try:
        check_split(data_dir, cfg.split, meta)       # the files' sizes against meta.json, before the progress bar
    except DataError as e:
        raise UsageError(str(e)) from None
    batches = lambda: eval_batches(data_dir, cfg.split, cfg.batch_size, cfg.max_batches or None, device=device)
    n_sequences = min(meta[f"{cfg.split}_sequences"], cfg.max_batches * cfg.batch_size or math.inf)   # the bar's total
    result = nelbo_ppl(model, batches, model.config.vocab_size, device=device, dtype=dtype, n_sequences=n_sequences,
                       **estimator(cfg))
    return [dict(data=f"{data_dir}:{cfg.split}", **result)]


def run_zeroshot(cfg, model, ckpt, device, dtype):
    if not cfg.dataset:
        raise UsageError("--metric zeroshot needs --dataset (a .txt file or one of " + ", ".join(ZERO_SHOT_SETS) + ")")
    tok, why = load_tokenizer(ckpt, cfg.ckpt)
    if tok is None:
        raise UsageError(f"zeroshot needs the checkpoint's tokenizer: {why}")
    seq_len = cfg.seq_len or model.config.block_size
    if not 3 <= seq_len <= model.config.block_size:      # past it, a NELBO at lengths the model never saw
        raise UsageError(f"--seq_len {seq_len}: zeroshot blocks are [BOS] + tokens + [EOS], from 3 tokens up to the "
                         f"model's block_size {model.config.block_size} (the length it was trained at); use --seq_len "
                         f"{model.config.block_size} or less (0: the block size)")
    rows = []
    for name in [n for n in cfg.dataset.split(",") if n]:
        blocks = zero_shot_blocks(tokenize_documents(zero_shot_documents(name), tok), seq_len, tok.bos_id, tok.eos_id)
        if cfg.max_batches:
            blocks = blocks[:cfg.max_batches * cfg.batch_size]
        if len(blocks) == 0:
            raise UsageError(f"{name} is shorter than one block of {seq_len} tokens; lower --seq_len")
        result = nelbo_ppl(model, list(blocks.split(cfg.batch_size)), model.config.vocab_size, device=device,
                           dtype=dtype, n_sequences=len(blocks), **estimator(cfg))
        rows.append(dict(data=name, blocks=len(blocks), seq_len=seq_len, **result))
    return rows


def run_genppl(cfg, device, dtype):
    saved = _read_samples(cfg.samples) if cfg.samples else None   # a bad file fails before the judge loads
    groups, tokenizers = {}, {}
    for r in saved or ():       # one row per distinct settings (a JSONL may hold several appended runs)
        groups.setdefault(json.dumps(r.get("settings") or {}, sort_keys=True), []).append(r)
    for key in groups:
        spec = json.loads(key).get("tokenizer")
        tokenizers[key], why = load_tokenizer({"meta": {"tokenizer": spec}}) if spec else (None, None)
        if spec and tokenizers[key] is None:    # else the texts would be retokenized: another number, silently
            raise UsageError(f"--samples {cfg.samples}: its settings.tokenizer {spec!r} does not load ({why}); the "
                             f"samples' ids are scored with it: make it loadable where it is recorded")
    judge = load_judge(cfg.judge, device)   # first: fail before any sampling
    if cfg.samples:
        rows = []
        for key, records in groups.items():
            settings, tok = json.loads(key), tokenizers[key]
            rows.append(score_samples([r["ids"] for r in records], [r.get("text") for r in records], tok, judge,
                                      cfg.judge_batch_size, device, label=settings.get("ckpt") or cfg.samples,
                                      steps=settings.get("steps")))
        return rows
    model, ckpt = load_model(cfg.ckpt, device, cfg.use_ema)
    tok, why = load_tokenizer(ckpt, cfg.ckpt)
    if tok is None:
        raise UsageError(f"genppl needs the checkpoint's tokenizer to decode samples: {why}")
    mc = model.config
    try:
        steps_list = [None] if mc.causal else [int(s) for s in cfg.steps.split(",") if s]
    except ValueError:
        raise UsageError(f"--steps must be comma-separated integers, got {cfg.steps!r}") from None
    if not steps_list or any(n is not None and n < 1 for n in steps_list):
        raise UsageError(f"--steps must list integers >= 1, got {cfg.steps!r}")
    schedule = (ckpt.get("train_config") or {}).get("noise_schedule") or "loglinear"
    final_step = default_final_step(ckpt) if cfg.final_step == "auto" else cfg.final_step
    if mc.causal and cfg.sampler != "ancestral":
        raise UsageError(f"--sampler {cfg.sampler} applies to diffusion models; {cfg.ckpt} is autoregressive")
    psi = None if mc.causal else psi_from_flags(cfg, min(steps_list))
    seq_len, stride = cfg.seq_len or mc.block_size, check_stride(cfg.stride, mc.block_size)
    if seq_len < 2:
        raise UsageError(f"--seq_len must be >= 2 for genppl (the judge never scores a sample's first token), "
                         f"got {seq_len}")
    # every sample is kept, as lists, until it is scored (>= 24 bytes a token: a slot and an int object); each
    # sampler call's batch on the device is checked by the sampler itself
    check_sample_size(cfg.num_samples, seq_len, "cpu", ("--num_samples", "--seq_len"))
    length = dict(seq_len=seq_len, **({"stride": stride} if seq_len > mc.block_size and not mc.causal else {}))
    rows = []
    for steps in steps_list:
        generator = torch.Generator(device=device).manual_seed(cfg.seed)
        ids = []
        for b in range(0, cfg.num_samples, cfg.batch_size):
            n = min(cfg.batch_size, cfg.num_samples - b)
            if mc.causal:
                ids += generate_ar(model, n, seq_len, bos_id=tok.bos_id, top_p=cfg.top_p, generator=generator,
                                   device=device, dtype=dtype).tolist()
            else:
                ids += generate_long(model, n, seq_len, mc.vocab_size, steps, stride=stride, alpha_schedule=schedule,
                                     final_step=final_step, top_p=cfg.top_p, psi=psi, generator=generator,
                                     device=device, dtype=dtype).tolist()
        texts = [tok.decode(row) for row in ids]
        if cfg.save_samples:
            settings = dict(ckpt=cfg.ckpt, ckpt_step=ckpt.get("step"), tokenizer=tok.spec, steps=steps,
                            final_step=final_step, top_p=cfg.top_p, seed=cfg.seed, use_ema=cfg.use_ema,
                            sampler="ar" if mc.causal else cfg.sampler, psi=psi._asdict() if psi else None,
                            **length)
            mark = signature("eval_ppl.py")
            append_jsonl(cfg.save_samples, [{WRITTEN_BY: mark, "sample": i, "text": t, "ids": r, "settings": settings}
                                            for i, (t, r) in enumerate(zip(texts, ids))])
        row = dict(score_samples(ids, texts, tok, judge, cfg.judge_batch_size, device, label=cfg.ckpt,
                                 steps=steps if steps else "ar"), ckpt_step=ckpt.get("step"), **length)
        rows.append(row if mc.causal else {**row, "final_step": final_step, "sampler": sampler_label(psi)})
    return rows


def sampler_label(psi):
    """A short name of the sampler for the results table: "ancestral", or "psi" with its kappa modes and etas."""
    if psi is None:
        return "ancestral"
    phases = "/".join(f"{m}={e:g}" for m, e in zip(psi.kappa, psi.eta))
    return (f"psi {phases}" + (f" loop@{psi.loop_t:g}" if psi.profile == "loop" else "")
            + (" rescale=duo" if psi.rescale == "duo" else "") + (" grid=duo" if psi.grid == "duo" else ""))


def score_samples(ids, texts, tok, judge, batch_size, device, label, steps, show_progress=True, per_sample=False):
    """Gen PPL (ids as they are when the judge shares the sampler's tokenizer, else the decoded texts
    retokenized), batch_size sequences per judge forward, and entropy of the sampler's own ids, each with its
    standard error over the samples (entropy_se: of their mean). per_sample: gen_ppl's per-sample sums, and
    sample_entropy, too."""
    max_length = max(map(len, ids))
    if judge_shares_tokenizer(judge, tok):
        top = max(max(row) for row in ids)
        if top >= tok.vocab_size:
            raise UsageError(f"the samples of {label} hold token id {top}, not below their tokenizer's vocabulary "
                             f"{tok.vocab_size}: not samples of that tokenizer")
        result = gen_ppl(ids, judge, max_length=max_length, batch_size=batch_size, device=device,
                         show_progress=show_progress, per_sample=per_sample)
        how = "ids scored directly: the judge uses the sampler's tokenizer"
    else:
        if any(t is None for t in texts):
            raise UsageError("the samples have no text and the judge uses another tokenizer: cannot retokenize")
        result = gen_ppl(texts, judge, max_length=max_length, batch_size=batch_size, device=device,
                         show_progress=show_progress, per_sample=per_sample)
        how = "decoded text retokenized with the judge's tokenizer"
    values = entropies(ids)
    mean = sum(values) / len(values)
    return dict(model=label, steps=steps, entropy=mean, entropy_se=mean_se(len(values), sum(values),
                                                                         sum(v * v for v in values)),
                tokenization=how, **result, **(dict(sample_entropy=values) if per_sample else {}))


# -----------------------------------------------------------------------------------------------
# validation during training (train.py, distillation/distill.py): the objective and the NELBO, with the EMA weights

VAL_SUMS = 8        # validation_sums' length: round_sums of the objective, then of the NELBO


@torch.no_grad()
def validation_sums(run, cfg, data_dir, env, per_token_loss, draw):
    """The EMA weights on the first eval_iters global validation batches of batch_size sequences (0: the whole
    split), each shared out over the ranks (data.eval_pieces): a run's own loss, per_token_loss(model, x0, mask,
    t, draws) -> (per-token loss, token weights or None), and the NELBO by nelbo_ppl's estimator (sequence_nelbo:
    VAL_ROUNDS rounds of VAL_DRAWS stratified draws, seed EVAL_SEED; the exact NLL for a causal model). Every draw
    belongs to its sequence (its index in the split), not to a rank or a batch: the objective's VAL_ROUNDS rounds
    each take t ~ U[t_min, 1] and draw(1, L, K, generator, "cpu") -> its noise, from the sequence's generator of
    that round (draw_seed with rounds -1, -2, never the NELBO's). So the validation set and its draws are the same
    for any world size and at every evaluation, and the NELBO is eval_ppl.py's at its defaults (its first rounds).
    -> this rank's float64 sums (VAL_SUMS,), for the caller to add over ranks (validation_record)."""
    from data import eval_pieces
    micro = cfg.batch_size // (env.world_size * cfg.grad_accum)
    autocast = autocast_for(env.device, resolve_dtype(cfg.dtype, env.device))
    pieces = eval_pieces(data_dir, "val", cfg.batch_size, cfg.eval_iters or None, env.rank, env.world_size, micro,
                         env.device)
    sums = torch.zeros(VAL_SUMS, dtype=torch.float64)
    with ema_weights(run) as raw:
        raw.eval()
        model = raw if run.eval_model is None else run.eval_model     # compiled when the run compiles
        K, causal = raw.config.vocab_size, raw.config.causal
        for j, _, lo, _, x0, mask in pieces:
            first, (B, L) = j * cfg.batch_size + lo, x0.shape         # the piece's rows in the split
            rounds = []
            for r in range(VAL_ROUNDS):
                drawn = []
                for b in range(B):
                    g = torch.Generator().manual_seed(draw_seed(EVAL_SEED, first + b, -1 - r))
                    drawn.append((diffusion.sample_t(1, g), *draw(1, L, K, g, "cpu")))    # t ~ U[t_min, 1]
                t, *draws = (torch.cat(d).to(env.device) for d in zip(*drawn))
                with autocast:
                    per_token, weight = per_token_loss(model, x0, mask, t, draws)
                weight = torch.ones_like(per_token) if weight is None else weight
                rounds.append((per_token.double() * weight).sum(1).cpu())
            sums[:4] += round_sums(torch.stack(rounds), weight.sum(1).double().cpu())
            if causal:
                mask = torch.ones_like(x0, dtype=torch.bool) if mask is None else mask
                with autocast:
                    logits = model(x0)
                nats = (losses.ar_loss(logits, x0).double() * mask[:, 1:]).sum().cpu()
                sums[4:6] += torch.stack([nats, mask[:, 1:].sum().double().cpu()])
            else:
                sums[4:] += round_sums(*sequence_nelbo(model, x0, mask, first, range(VAL_ROUNDS), autocast=autocast))
        raw.train()
    return sums


def evaluate(run, cfg, data_dir, env):
    """validation_sums of the training objective (curriculum off, the draws of objective.draw_noise) and of the
    NELBO (exact NLL for 'ar'). -> this rank's float64 sums (VAL_SUMS,); the caller adds them over ranks
    (val_metrics)."""
    def per_token_loss(model, x0, mask, t, draws):
        per_token, _ = loss_terms(model, cfg, x0, t, cfg.curriculum_iters, None, draws)
        return per_token, diffusion.OBJECTIVES[cfg.loss].token_weights(mask)
    return validation_sums(run, cfg, data_dir, env, per_token_loss, draw_noise)


def validation_record(sums, data_dir, loss_key="val_loss"):
    """validation_sums added over ranks -> the log.jsonl record: the objective (under loss_key) and the NELBO,
    each with its Monte-Carlo standard error (nelbo_summary), the PPL's 95% interval, the tokens and the draws
    per sequence."""
    from data import DataError
    if sums[1] == 0 or sums[5] == 0:
        raise DataError(f"{data_dir}: the validation split has no sequences to evaluate")
    loss, nelbo = nelbo_summary(sums[:4]), nelbo_summary(sums[4:])
    return {loss_key: loss["nll"], f"{loss_key}_se": loss["nll_se"], "val_nelbo": nelbo["nll"],
            "val_nelbo_se": nelbo["nll_se"], "val_ppl": nelbo["ppl"], "val_ppl_se": nelbo["ppl_se"],
            "val_ppl_lo": nelbo["ppl_lo"], "val_ppl_hi": nelbo["ppl_hi"], "val_tokens": int(sums[5]),
            "val_draws": 0 if float(sums[6]) == 0 else VAL_ROUNDS * VAL_DRAWS}


def val_metrics(sums, cfg, data_dir):
    """evaluate's sums, added over ranks -> the log.jsonl record (validation_record)."""
    return validation_record(sums, data_dir)


# -----------------------------------------------------------------------------------------------
# sample quality during training (train.py --gen_interval)

def load_gen_judge(cfg, env):
    """The judge of sample_quality, or None when --gen_interval is 0. Loaded on every rank before the data are
    prepared, so a missing judge fails at once (eval_ppl.load_judge never substitutes another)."""
    if not cfg.gen_interval:
        return None
    return load_judge(cfg.judge, env.device)


GEN_GROUPS = 8   # sample_quality draws its samples in this many groups, each from its own generator
GEN_SUMS = 8     # sample_quality's sums: ratio_moments (6), the entropies' sum and sum of squares


def sample_groups(num_samples, rank, world_size):
    """The groups of sample_quality that a rank draws -> [(k, size)]: num_samples in GEN_GROUPS groups of
    ceil(num_samples / GEN_GROUPS) (the last ones smaller or empty), group k on rank k % world_size. The groups,
    and so the samples, do not depend on the world size; up to GEN_GROUPS ranks share the sampling."""
    size = -(-num_samples // GEN_GROUPS)
    groups = [(k, min(size, num_samples - k * size)) for k in range(GEN_GROUPS)]
    return [(k, n) for k, n in groups if n > 0 and k % world_size == rank]


@torch.no_grad()
def sample_quality(run, cfg, env, judge, tok):
    """Gen PPL and entropy of gen_num_samples samples from the EMA weights (paper Figs. ppl_curve_lm1b and
    entropy_curve_lm1b): the ancestral sampler with gen_steps steps and an ancestral final step (the AR baseline:
    its own sampler). The samples come in groups (sample_groups), group k drawn in one sampler call from a
    generator seeded gen_seed * GEN_GROUPS + k: the same samples for any world size, and the same draws at every
    call, so a curve follows the model and not the sampling noise; each rank scores its groups with the judge
    (eval_ppl.score_samples). -> this rank's float64 sums (GEN_SUMS,): ratio_moments of the samples' NLL over
    their scored tokens, then (sum, sum of squares) of their entropies; added over ranks (gen_metrics), they pool
    all samples exactly as one process would, standard errors included."""
    groups = sample_groups(cfg.gen_num_samples, env.rank, env.world_size)
    n = sum(size for _, size in groups)
    micro = cfg.batch_size // (env.world_size * cfg.grad_accum)
    dtype = resolve_dtype(cfg.dtype, env.device)
    sums = torch.zeros(GEN_SUMS, dtype=torch.float64)
    if n:
        ids = []
        with ema_weights(run) as model:
            model.eval()
            for k, m in groups:
                gen = torch.Generator(device=env.device).manual_seed(cfg.gen_seed * GEN_GROUPS + k)
                if diffusion.OBJECTIVES[cfg.loss].causal:
                    ids += generate_ar(model, m, cfg.block_size, bos_id=tok.bos_id, generator=gen, device=env.device,
                                       dtype=dtype, show_progress=False).tolist()
                else:
                    ids += generate(model, m, cfg.block_size, model.config.vocab_size, cfg.gen_steps,
                                    alpha_schedule=cfg.noise_schedule, final_step="ancestral", generator=gen,
                                    device=env.device, dtype=dtype, show_progress=False).tolist()
            model.train()
        r = score_samples(ids, [tok.decode(row) for row in ids], tok, judge, micro, env.device, label=cfg.out_dir,
                          steps=cfg.gen_steps, show_progress=False, per_sample=True)
        e = torch.tensor(r["sample_entropy"], dtype=torch.float64)
        sums = torch.cat([ratio_moments(r["sample_nll"], r["sample_tokens"]), torch.stack([e.sum(), (e * e).sum()])])
    return sums


def gen_metrics(sums, cfg, judge):
    """sample_quality's sums, added over ranks -> the log.jsonl record: Gen PPL, its NLL and the mean entropy, each
    with its standard error over the samples (the PPL's 95% interval too), naming the judge and sampler settings."""
    (nll, se), causal = ratio_summary(sums[:6]), diffusion.OBJECTIVES[cfg.loss].causal
    n = int(sums[0])
    return {**ppl_summary(nll, se, "gen_ppl", n - 1), "gen_nll": nll, "gen_nll_se": se,
            "gen_entropy": float(sums[6]) / n, "gen_entropy_se": mean_se(n, float(sums[6]), float(sums[7])),
            "gen_samples": n, "gen_steps": None if causal else cfg.gen_steps,
            "gen_sampler": "ar" if causal else "ancestral, final step ancestral",
            "gen_seed": cfg.gen_seed, "gen_judge": judge.name}


def print_samples(run, cfg, meta, env):
    """The end of a train.py run: a few samples from the EMA weights (the live ones with --ema 0), so a newcomer
    sees text: cfg.num_samples of cfg.block_size tokens, the ancestral sampler with cfg.sample_steps steps (the AR
    baseline: its own sampler), nucleus cfg.sample_top_p, the run's --dtype. -> the texts."""
    tok = get_tokenizer(meta["tokenizer"])
    gen = torch.Generator(device=env.device).manual_seed(cfg.seed)
    dtype = resolve_dtype(cfg.dtype, env.device)       # the network in the run's autocast dtype (bf16 on CUDA)
    with ema_weights(run) as model:
        model.eval()
        if diffusion.OBJECTIVES[cfg.loss].causal:
            ids = generate_ar(model, cfg.num_samples, cfg.block_size, bos_id=tok.bos_id, top_p=cfg.sample_top_p,
                              generator=gen, dtype=dtype)
        else:
            ids = generate(model, cfg.num_samples, cfg.block_size, model.config.vocab_size, cfg.sample_steps,
                           alpha_schedule=cfg.noise_schedule, top_p=cfg.sample_top_p, generator=gen,
                           device=env.device, dtype=dtype)
        model.train()
    texts = [tok.decode(row) for row in ids.tolist()]
    for i, text in enumerate(texts):
        cli.show(f"--- sample {i} ({cfg.sample_steps} steps) ---\n{text}")
    return texts


def main(argv=None):
    cfg = parse_flags(EvalConfig, argv, description=__doc__.split("\n\n")[0])
    refuse_overwrite({"--out": cfg.out, "--save_samples": cfg.save_samples},
                     {"--ckpt": "" if cfg.metric == "genppl" and cfg.samples else cfg.ckpt, "--data_dir": cfg.data_dir,
                      "--dataset": cfg.dataset.split(","), "--judge": cfg.judge, "--samples": cfg.samples})
    if cfg.metric not in ("nelbo", "zeroshot", "genppl"):
        raise UsageError(f"--metric must be nelbo, zeroshot or genppl, got {cfg.metric!r}")
    if cfg.batch_size < 1 or cfg.judge_batch_size < 1 or cfg.mc_draws < 1 or cfg.num_samples < 1:
        raise UsageError("--batch_size, --judge_batch_size, --mc_draws and --num_samples must be >= 1")
    if not 2 <= cfg.rounds <= cfg.max_rounds or not 0 <= cfg.rel_se < 1:
        raise UsageError(f"--rounds must be >= 2 (the standard error needs two) and <= --max_rounds, and --rel_se "
                         f"in [0, 1); got {cfg.rounds}, {cfg.max_rounds}, {cfg.rel_se}")
    check_sampler(1, cfg.final_step, cfg.top_p)       # --steps is a list, checked in run_genppl
    psi_from_flags(cfg)
    if not 0 < cfg.t_min < 1:
        raise UsageError(f"--t_min must be in (0, 1), got {cfg.t_min}")
    if cfg.max_batches < 0:
        raise UsageError(f"--max_batches must be >= 0 (0 = all), got {cfg.max_batches}")
    check_outputs({"--out": cfg.out, "--save_samples": cfg.save_samples}, script="eval_ppl.py")   # new, or ours
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    ckpt = None
    if cfg.metric == "genppl":
        rows = run_genppl(cfg, device, dtype)
        columns = ["model", "sampler", "steps", "final_step", "samples", "gen_ppl", "gen_ppl_se", "entropy",
                   "entropy_se", "judge"]
    else:
        model, ckpt = load_model(cfg.ckpt, device, cfg.use_ema)
        run = run_nelbo if cfg.metric == "nelbo" else run_zeroshot
        rows = run(cfg, model, ckpt, device, dtype)
        columns = ["data", "estimator", "tokens", "mc_draws", "nll", "nll_se", "ppl", "ppl_se", "ppl_lo", "ppl_hi"]
    result = dict({WRITTEN_BY: signature("eval_ppl.py")}, metric=cfg.metric,
                  ckpt=None if cfg.metric == "genppl" and cfg.samples else cfg.ckpt,
                  ckpt_step=ckpt.get("step") if ckpt else None, config=asdict(cfg), results=rows)
    text = json.dumps(result, indent=2)
    if cfg.out:
        write_json(cfg.out, result)
    cli.show("\n".join([text, _table(rows, columns)] + [precision_line(row, cfg) for row in rows]))
    return 0


if __name__ == "__main__":
    from data import DataError
    run_cli(main, DataError, oom_hint="lower --batch_size or --mc_draws (a round's draws are made at once; "
                                              "--judge_batch_size for genppl)")
