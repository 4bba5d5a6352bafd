"""
Downstream scores of a diffusion LM, on token ids (functions) and on strings (Scorer): downstream/eval_downstream.py
runs tasks with them, downstream/lm_eval_adapter.py serves them to lm-eval.

Every downstream number is built on one estimate, the conditional log-likelihood of a continuation given a clean
context:
  x0 = [context ; continuation] (context truncated from the left to fit block_size), t_j stratified in
  [1e-3, 1] over the draws j = 1..J, alpha_t = 1 - (1 - 1e-3) t (log-linear), sigma = -log alpha_t;
  only the continuation is corrupted, x_t = [context ; continuation_t], continuation_t ~ q_t(. | continuation);
      log p(cont | ctx) >= - 1/J sum_j sum_{i in cont} usdm_nelbo_loss(log p~(. | x_t_j), x0_i, x_t_j,i)  (Eq. usdm)
  Without CFG p~ is the denoiser p_theta(x0 | x_t). With CFG (paper, CFG section; unsupervised CFG of SMDM with
  random tokens in place of [MASK]) the unconditional input is the same x_t with every context position replaced
  by a token drawn uniformly from the vocabulary, both go through one batched forward and
      log p~ = log_softmax((1 + w) log p_c - w log p_u),  i.e. p~ proportional to p_c^(1+w) / p_u^w.
Every metric built on it is defined in downstream/eval_downstream.py's DEFINITIONS, written beside every result.
Deterministic given --seed: every request draws its t's, its noise and its null contexts from generators seeded
with the same seed, so results do not depend on request order or batch size, and the choices of one question
share their random numbers (common random numbers make the comparison between choices less noisy).
"""
import torch
from tqdm import tqdm

import diffusion
import losses
from plumbing.cli import UsageError, autocast_for, bar_hidden, resolve_dtype
from sample import device_of, generate_long, guided_logits, null_tokens
from trained.checkpoint import load_model, load_tokenizer

T_MIN = 1e-3
GREEDY_CHECKS = ("argmax", "generate")
MAX_GEN_TOKS = 256   # generate_until's length when a task gives no max_gen_toks (lm-eval's HF model default)


class EvalError(UsageError):
    """Bad evaluation input (a file, a task, a request that does not fit): one line, exit code 2."""


# -----------------------------------------------------------------------------------------------
# the estimate: log p(continuation | context) for token ids

def join_context(ctx_ids, cont_ids, block_size, device=None):
    """x0 = [context ; continuation] as a (1, L) tensor, the context cut from the left so that L <= block_size.
    -> (x0, n_ctx). The continuation is never cut: one longer than block_size is an EvalError."""
    if len(cont_ids) > block_size:
        raise EvalError(f"a continuation of {len(cont_ids)} tokens does not fit the model's context window "
                        f"(block_size {block_size})")
    ctx_ids = list(ctx_ids)[max(0, len(ctx_ids) - (block_size - len(cont_ids))):]
    x0 = torch.tensor([ctx_ids + list(cont_ids)], dtype=torch.long, device=device)
    return x0, len(ctx_ids)


def guided_log_probs(model, xt, sigma, n_ctx, cfg_w=0.0, null_ctx=None, autocast=None):
    """log p~(x0 | x_t) at the continuation positions n_ctx.. : xt (B, L) ids -> (B, L - n_ctx, V) float32.
    cfg_w = 0 (or no context): log p_theta. Otherwise sample.guided_logits with the unconditional input
    xt whose context is replaced by null_ctx (B, n_ctx) and the SAME noisy continuation. sigma (B,) is
    ignored by models without time conditioning (the llama presets)."""
    guided = cfg_w != 0 and n_ctx > 0
    null_xt = torch.cat([null_ctx, xt[:, n_ctx:]], dim=1) if guided else None
    logits = guided_logits(model, xt, sigma, null_xt=null_xt, cfg_w=cfg_w if guided else 0.0, autocast=autocast,
                           start=n_ctx)
    return torch.log_softmax(logits.float(), dim=-1)


@torch.no_grad()
def conditional_nelbo(model, ctx_ids, cont_ids, *, mc_draws=128, batch_size=16, cfg_w=0.0, seed=0, autocast=None):
    """The Monte Carlo NELBO of the module docstring, one value per draw j: (mc_draws,) float64, log p(cont | ctx)
    >= -mean. All randomness is drawn up front from generators seeded with `seed`, so the
    result does not depend on batch_size (draws per forward; 2 x batch_size rows with CFG)."""
    device = device_of(model)
    V = model.config.vocab_size
    x0, n_ctx = join_context(ctx_ids, cont_ids, model.config.block_size, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    t = diffusion.sample_t(mc_draws, gen, t_min=T_MIN, device=device)
    alpha_t, dalpha_t = diffusion.log_linear_schedule(t, eps=T_MIN)
    cont = x0[:, n_ctx:].expand(mc_draws, -1)
    cont_t = diffusion.sample_xt(cont, alpha_t[:, None], V, gen)
    null_ctx = null_tokens((mc_draws, n_ctx), V, seed + 1, device) if cfg_w != 0 else None
    nelbo = []
    for j in range(0, mc_draws, batch_size):
        b = slice(j, j + batch_size)
        xt = torch.cat([x0[:, :n_ctx].expand(cont_t[b].shape[0], -1), cont_t[b]], dim=1)
        log_p = guided_log_probs(model, xt, diffusion.sigma_from_alpha(alpha_t[b]), n_ctx, cfg_w,
                                 None if null_ctx is None else null_ctx[b], autocast)
        per_token = losses.usdm_nelbo_loss(log_p, cont[b], cont_t[b], alpha_t[b, None], dalpha_t[b, None])
        nelbo.append(per_token.double().sum(-1))
    return torch.cat(nelbo)


def conditional_loglik(model, ctx_ids, cont_ids, **kwargs):
    """The lower bound on log p(cont | ctx) as a float: -mean of conditional_nelbo (same keyword arguments)."""
    return -conditional_nelbo(model, ctx_ids, cont_ids, **kwargs).mean().item()


@torch.no_grad()
def argmax_at_t1(model, ctx_ids, cont_ids, *, cfg_w=0.0, seed=0, autocast=None):
    """LAMBADA protocol (b): the continuation fully noised (x_1 ~ q_1(. | cont), alpha_1 = 1e-3), one (guided)
    forward; True iff argmax_v p~(v | x_1) equals the gold token at every continuation position."""
    device = device_of(model)
    V = model.config.vocab_size
    x0, n_ctx = join_context(ctx_ids, cont_ids, model.config.block_size, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    alpha_1 = diffusion.log_linear_schedule(torch.ones(1, device=device), eps=T_MIN)[0]
    cont_1 = diffusion.sample_xt(x0[:, n_ctx:], alpha_1[:, None], V, gen)
    null_ctx = null_tokens((1, n_ctx), V, seed + 1, device) if cfg_w != 0 else None
    log_p = guided_log_probs(model, torch.cat([x0[:, :n_ctx], cont_1], 1), diffusion.sigma_from_alpha(alpha_1),
                             n_ctx, cfg_w, null_ctx, autocast)
    return bool((log_p.argmax(-1) == x0[:, n_ctx:]).all())


def generate_continuation(model, ctx_ids, n_tokens, *, steps, final_step="ancestral", top_p=1.0, cfg_w=0.0, seed=0,
                          schedule="loglinear", dtype=None, psi=None, stride=0):
    """n_tokens ids sampled after the fixed clean context by sample.generate_long (the keywords are its, schedule
    its alpha_schedule) -> list of n_tokens ids. Fewer than block_size: one block, the context cut from the left
    to fit it; more: windows of `stride` new tokens after the whole context. The generator is seeded with `seed`
    for every call, so a request's result does not depend on the others."""
    device, block_size = device_of(model), model.config.block_size
    ctx_ids = list(ctx_ids)
    if n_tokens < block_size:
        ctx_ids = ctx_ids[max(0, len(ctx_ids) - (block_size - n_tokens)):]
    gen = torch.Generator(device=device).manual_seed(seed)
    seq_len = len(ctx_ids) + n_tokens           # past the block, CFG guides the windows that hold tokens
    ids = generate_long(model, 1, seq_len, model.config.vocab_size, steps, stride=stride, alpha_schedule=schedule,
                        final_step=final_step, top_p=top_p, prompt_ids=ctx_ids or None,
                        cfg_w=cfg_w if ctx_ids or seq_len > block_size else 0.0, psi=psi, generator=gen,
                        device=device, dtype=dtype, show_progress=False)
    return ids[0, len(ctx_ids):].tolist()


def rolling_windows(ids, n_prefix, block_size, context=1):
    """The windows of a whole document for the rolling log-likelihood. ids = prefix (n_prefix tokens, e.g. BOS)
    + document; the document is cut into consecutive pieces of block_size - context tokens, and each piece comes
    with the tokens before it that fit a window of block_size (`context` of them; more for a shorter last piece).
    -> [(ctx_ids, piece_ids)], the pieces partitioning ids[n_prefix:]."""
    if not 0 <= context < block_size:
        raise EvalError(f"rolling_context must be in [0, {block_size - 1}] (block_size - 1), got {context}")
    windows = []
    for start in range(n_prefix, len(ids), block_size - context):
        piece = ids[start:start + block_size - context]
        windows.append((ids[max(0, start - (block_size - len(piece))):start], piece))
    return windows


# -----------------------------------------------------------------------------------------------
# strings -> requests -> (log-likelihood, is_greedy): what lm-eval's loglikelihood needs

class Scorer:
    """One model and its tokenizer, scoring (context, continuation) string pairs."""

    def __init__(self, model, tokenizer, *, mc_draws=128, batch_size=16, seed=1234, lambada_steps=8,
                 dtype=torch.float32, add_bos=True, progress=True, schedule="loglinear", final_step="ancestral"):
        """schedule: the noise schedule the model was trained with (its sampler's time grid); final_step: what
        final_step=auto means for this model (diffusion.default_final_step of its checkpoint)."""
        if model.config.causal:
            raise EvalError("this checkpoint is autoregressive (causal); eval_downstream scores diffusion models")
        self.model, self.tokenizer = model, tokenizer
        self.mc_draws, self.batch_size, self.seed = mc_draws, batch_size, seed
        self.lambada_steps, self.dtype, self.add_bos, self.progress = lambada_steps, dtype, add_bos, progress
        self.schedule, self.final_step = schedule, final_step
        self.prefix = [tokenizer.bos_id] if add_bos else []       # training blocks start with BOS

    def _bar(self, items, desc):
        return tqdm(items, desc=desc, disable=bar_hidden(self.progress), leave=False)

    def _encoded(self, pairs, desc):
        """[(context, continuation)] -> a progress bar over ((ctx ids, cont ids), (context, continuation))."""
        return self._bar(list(zip(self.encode_all(pairs), pairs)), desc)

    @property
    def autocast(self):
        return autocast_for(device_of(self.model), self.dtype)

    def encode(self, context, continuation):
        """lm-eval's split: trailing whitespace of the context moves to the continuation; the continuation ids
        are those of context + continuation after the context's own ids; BOS first (training blocks start with it)."""
        n_space = len(context) - len(context.rstrip())
        if n_space:
            context, continuation = context[:-n_space], context[-n_space:] + continuation
        ctx = self.tokenizer.encode(context)
        cont = self.tokenizer.encode(context + continuation)[len(ctx):]
        return self.prefix + ctx, cont

    def encode_all(self, pairs):
        """Encode and check every request before any work (a too-long continuation fails at once)."""
        encoded = [self.encode(c, x) for c, x in pairs]
        for (ctx, cont), (_, text) in zip(encoded, pairs):
            if len(cont) > self.model.config.block_size:
                raise EvalError(f"continuation {text[:40]!r}... is {len(cont)} tokens, longer than the model's "
                                f"context window (block_size {self.model.config.block_size})")
        return encoded

    def loglikelihood(self, pairs, cfg_w=0.0, greedy_check="argmax", desc="loglikelihood"):
        """[(context, continuation)] -> [(log-likelihood bound, is_greedy)], is_greedy by protocol (b) 'argmax'
        or (a) 'generate'. An empty continuation has log-likelihood 0."""
        if greedy_check not in GREEDY_CHECKS:          # a direct caller's typo is refused, never read as 'generate'
            raise EvalError(f"greedy_check must be one of {', '.join(GREEDY_CHECKS)}, got {greedy_check!r}")
        out = []
        for (ctx, cont), (_, text) in self._encoded(pairs, desc):
            if not cont:
                out.append((0.0, True))
                continue
            ll = conditional_loglik(self.model, ctx, cont, mc_draws=self.mc_draws, batch_size=self.batch_size,
                                    cfg_w=cfg_w, seed=self.seed, autocast=self.autocast)
            greedy = (argmax_at_t1(self.model, ctx, cont, cfg_w=cfg_w, seed=self.seed, autocast=self.autocast)
                      if greedy_check == "argmax" else self._generated_matches(ctx, cont, text, cfg_w))
            out.append((ll, greedy))
        return out

    def generate_matches(self, pairs, cfg_w=0.0, desc="generate"):
        """Protocol (a) for each (context, target): does the generated span decode to the target?"""
        return [self._generated_matches(ctx, cont, text, cfg_w)
                for (ctx, cont), (_, text) in self._encoded(pairs, desc)]

    def _generated_matches(self, ctx, cont, text, cfg_w):
        """LAMBADA protocol (a): the span generated after the fixed context (lambada_steps ancestral steps, final
        step greedy, the same CFG) decodes to the target. Caveat: SDDLM-family denoisers are trained only on
        replaced tokens, so their argmax tends to avoid the current token (docs/sampling.md, final step)."""
        span = generate_continuation(self.model, ctx, len(cont), steps=self.lambada_steps, final_step="greedy",
                                     cfg_w=cfg_w, seed=self.seed, schedule=self.schedule, dtype=self.dtype)
        return self.tokenizer.decode(span).strip() == text.strip()

    def generate_until(self, requests, cfg_w=0.0, steps=128, final_step="ancestral", top_p=1.0,
                       desc="generate_until", psi=None, stride=0):
        """[(context, gen_kwargs)] -> [continuation]: gen_kwargs["max_gen_toks"] tokens (default 256, as lm-eval's
        HF model; past block_size - 1 in windows of `stride` new tokens) sampled after the context by
        generate_continuation, cut at the first EOS, decoded, then cut before the first of the stop strings
        gen_kwargs["until"] (a str or a list)."""
        out = []
        for context, kwargs in self._bar(requests, desc):
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            n = int(kwargs.get("max_gen_toks", MAX_GEN_TOKS))
            ctx = self.prefix + self.tokenizer.encode(context)
            ids = generate_continuation(self.model, ctx, n, steps=steps, final_step=final_step, top_p=top_p,
                                        cfg_w=cfg_w, seed=self.seed, schedule=self.schedule,
                                        dtype=self.dtype, psi=psi, stride=stride) if n > 0 else []
            if self.tokenizer.eos_id in ids:
                ids = ids[:ids.index(self.tokenizer.eos_id)]
            text = self.decode_after(ctx, ids)
            for stop in filter(None, until):          # lm-eval's convention: the text before the first stop string
                text = text.split(stop, 1)[0]
            out.append(text)
        return out

    def decode_after(self, ctx, ids):
        """The text of `ids` as it continues `ctx` (keeps a leading space that decoding `ids` alone may drop)."""
        head, full = self.tokenizer.decode(ctx), self.tokenizer.decode(ctx + ids)
        return full[len(head):] if full.startswith(head) else self.tokenizer.decode(ids)

    def loglikelihood_rolling(self, texts, cfg_w=0.0, context=1, desc="loglikelihood_rolling"):
        """[text] -> [a lower bound on log p(text)]: the sum over rolling_windows (BOS first when add_bos) of the
        conditional bound -mean(conditional_nelbo); window k draws with seed + k. An empty text scores 0."""
        out = []
        for text in self._bar(texts, desc):
            windows = rolling_windows(self.prefix + self.tokenizer.encode(text), len(self.prefix),
                                      self.model.config.block_size, context)
            bound = sum(conditional_loglik(self.model, ctx, piece, mc_draws=self.mc_draws, batch_size=self.batch_size,
                                           cfg_w=cfg_w, seed=self.seed + k, autocast=self.autocast)
                        for k, (ctx, piece) in enumerate(windows))
            out.append(float(bound))
        return out


def load_scorer(path, device, use_ema=True, dtype="auto", **settings):
    """The model and tokenizer of a checkpoint, a model folder or duo:PATH in a Scorer (its sampler on the noise
    schedule it was trained with, final_step=auto its objective's) -> (scorer, the checkpoint dict)."""
    model, ckpt = load_model(str(path), device, use_ema)
    tokenizer, why = load_tokenizer(ckpt, str(path))
    if tokenizer is None:
        raise EvalError(f"{path}: {why}")
    return Scorer(model, tokenizer, dtype=resolve_dtype(dtype, device), final_step=diffusion.default_final_step(ckpt),
                  schedule=(ckpt.get("train_config") or {}).get("noise_schedule") or "loglinear", **settings), ckpt
