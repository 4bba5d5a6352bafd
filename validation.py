"""What a training run logs of its model (train.py, distillation/distill.py): the objective and the NELBO on the
validation split with the EMA weights, the quality of samples during training (Gen PPL under a judge, entropy),
each the same for any number of GPUs, and the samples printed at the end of a run."""
import torch

import diffusion
from data import DataError, eval_pieces, get_tokenizer
from diffusion import draw_noise, loss_terms
from metrics import (EVAL_SEED, VAL_DRAWS, VAL_ROUNDS, draw_seed, entropies, gen_ppl, judge_shares_tokenizer,
                     load_judge, mean_se, nelbo_summary, ppl_summary, ratio_moments, ratio_summary, round_sums,
                     sequence_nelbo)
from plumbing import cli
from plumbing.checkpoint import ema_weights
from plumbing.cli import UsageError, autocast_for, resolve_dtype
from sample import generate, generate_ar


# -----------------------------------------------------------------------------------------------
# sample quality: Gen PPL and entropy of samples (eval_ppl.py --metric genppl, and during training)

def score_samples(ids, texts, tok, judge, batch_size, device, label, steps, show_progress=True, per_sample=False):
    """Gen PPL (ids as they are when the judge shares the sampler's tokenizer, else the decoded texts
    retokenized), batch_size sequences per judge forward, and entropy of the sampler's own ids, each with its
    standard error over the samples (entropy_se: of their mean). per_sample: gen_ppl's per-sample sums, and
    sample_entropy, too."""
    shared, top = judge_shares_tokenizer(judge, tok), max(map(max, ids))
    if shared and top >= tok.vocab_size:
        raise UsageError(f"the samples of {label} hold token id {top}, not below their tokenizer's vocabulary "
                         f"{tok.vocab_size}: not samples of that tokenizer")
    if not shared and any(t is None for t in texts):
        raise UsageError("the samples have no text and the judge uses another tokenizer: cannot retokenize")
    result = gen_ppl(ids if shared else texts, judge, max_length=max(map(len, ids)), batch_size=batch_size,
                     device=device, show_progress=show_progress, per_sample=per_sample)
    how = ("ids scored directly: the judge uses the sampler's tokenizer" if shared else
           "decoded text retokenized with the judge's tokenizer")
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
    t, draws) -> (per-token loss, token weights or None), and the NELBO (sequence_nelbo at eval_ppl.py's defaults;
    the exact NLL for a causal model). As the NELBO's, the objective's draws belong to the sequence, not to a rank
    or a batch: its rounds draw from draw_seed's rounds -1, -2, never the NELBO's.
    -> this rank's float64 sums (VAL_SUMS,), for the caller to add over ranks (validation_record)."""
    micro = cfg.batch_size // (env.world_size * cfg.grad_accum)
    autocast = autocast_for(env.device, resolve_dtype(cfg.dtype, env.device))
    pieces = eval_pieces(data_dir, "val", cfg.batch_size, cfg.eval_iters or None, env.rank, env.world_size, micro,
                         env.device)
    sums = torch.zeros(VAL_SUMS, dtype=torch.float64)
    with ema_weights(run) as raw:
        raw.eval()
        model = raw if run.eval_model is None else run.eval_model     # compiled when the run compiles
        K = raw.config.vocab_size
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
            sums[4:] += round_sums(*sequence_nelbo(model, x0, mask, first, range(VAL_ROUNDS), autocast=autocast))
        raw.train()
    return sums


def evaluate(run, cfg, data_dir, env):
    """validation_sums of the training objective (curriculum off, the draws of objective.draw_noise) and of the
    NELBO (exact NLL for 'ar'). -> this rank's float64 sums (VAL_SUMS,); the caller adds them over ranks
    (validation_record)."""
    def per_token_loss(model, x0, mask, t, draws):
        per_token, _ = loss_terms(model, cfg, x0, t, cfg.curriculum_iters, None, draws)
        return per_token, diffusion.OBJECTIVES[cfg.loss].token_weights(mask)
    return validation_sums(run, cfg, data_dir, env, per_token_loss, draw_noise)


def validation_record(sums, data_dir, loss_key="val_loss"):
    """validation_sums added over ranks -> the log.jsonl record: the objective (under loss_key) and the NELBO,
    each with its Monte-Carlo standard error (nelbo_summary), the PPL's 95% interval, the tokens and the draws
    per sequence."""
    if sums[1] == 0 or sums[5] == 0:
        raise DataError(f"{data_dir}: the validation split has no sequences to evaluate")
    loss, nelbo = nelbo_summary(sums[:4]), nelbo_summary(sums[4:])
    return {loss_key: loss["nll"], f"{loss_key}_se": loss["nll_se"], "val_nelbo": nelbo["nll"],
            "val_nelbo_se": nelbo["nll_se"], "val_ppl": nelbo["ppl"], "val_ppl_se": nelbo["ppl_se"],
            "val_ppl_lo": nelbo["ppl_lo"], "val_ppl_hi": nelbo["ppl_hi"], "val_tokens": int(sums[5]),
            "val_draws": 0 if float(sums[6]) == 0 else VAL_ROUNDS * VAL_DRAWS}


# -----------------------------------------------------------------------------------------------
# sample quality during training (train.py --gen_interval)

def load_gen_judge(cfg, env):
    """The judge of sample_quality, or None when --gen_interval is 0. Loaded on every rank before the data are
    prepared, so a missing judge fails at once (metrics.load_judge never substitutes another)."""
    return load_judge(cfg.judge, env.device) if cfg.gen_interval else None


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
    its own sampler). Group k of sample_groups comes from a generator seeded gen_seed * GEN_GROUPS + k, so a curve
    follows the model and not the sampling noise. -> this rank's float64 sums (GEN_SUMS,): ratio_moments of the
    samples' NLL over their scored tokens, then (sum, sum of squares) of their entropies, which add over ranks."""
    groups = sample_groups(cfg.gen_num_samples, env.rank, env.world_size)
    if not groups:                   # more ranks than groups: this one draws none
        return torch.zeros(GEN_SUMS, dtype=torch.float64)
    dtype = resolve_dtype(cfg.dtype, env.device)
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
    micro = cfg.batch_size // (env.world_size * cfg.grad_accum)
    r = score_samples(ids, [tok.decode(row) for row in ids], tok, judge, micro, env.device, label=cfg.out_dir,
                      steps=cfg.gen_steps, show_progress=False, per_sample=True)
    e = torch.tensor(r["sample_entropy"], dtype=torch.float64)
    return torch.cat([ratio_moments(r["sample_nll"], r["sample_tokens"]), torch.stack([e.sum(), (e * e).sum()])])


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


def print_samples(run, cfg, meta, env, schedule=None, final_step=None):
    """The end of a run (train.py, distillation/distill.py): a few samples from the EMA weights (the live ones with
    --ema 0), so a newcomer sees text. schedule: default cfg.noise_schedule; final_step: default ancestral
    (distill.py: the one --final_step auto picks). -> the texts."""
    tok = get_tokenizer(meta["tokenizer"])
    gen = torch.Generator(device=env.device).manual_seed(cfg.seed)
    dtype = resolve_dtype(cfg.dtype, env.device)       # the network in the run's autocast dtype (bf16 on CUDA)
    with ema_weights(run) as model:
        model.eval()
        mc = model.config
        if mc.causal:
            ids = generate_ar(model, cfg.num_samples, mc.block_size, bos_id=tok.bos_id, top_p=cfg.sample_top_p,
                              generator=gen, dtype=dtype)
        else:
            ids = generate(model, cfg.num_samples, mc.block_size, mc.vocab_size, cfg.sample_steps,
                           alpha_schedule=schedule or cfg.noise_schedule, final_step=final_step or "ancestral",
                           top_p=cfg.sample_top_p, generator=gen, device=env.device, dtype=dtype)
        model.train()
    texts = [tok.decode(row) for row in ids.tolist()]
    final = f", final step {final_step}" if final_step else ""
    for i, text in enumerate(texts):
        cli.show(f"--- sample {i} ({cfg.sample_steps} steps{final}) ---\n{text}")
    return texts
