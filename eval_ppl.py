"""
Likelihood and sample-quality metrics for sddlm checkpoints (Duo spec sections 3.3 and 7).

    python eval_ppl.py --ckpt out/ckpt.pt --metric nelbo                          # validation NELBO perplexity
    python eval_ppl.py --ckpt out/ckpt.pt --metric zeroshot --dataset wikitext103,lambada   # or a .txt file
    python eval_ppl.py --ckpt out/ckpt.pt --metric genppl --judge gpt2-large --steps 32,64,128
    python eval_ppl.py --ckpt out/ckpt.pt --metric genppl --sampler psi --psi_eta 0.9 --steps 64,1024
    python eval_ppl.py --metric genppl --samples out/samples.jsonl --judge out-ar/ckpt.pt   # sample.py's samples
    python eval_ppl.py --ckpt out/ckpt.pt --metric genppl --seq_len 512 --stride 64     # past the block

nelbo     the validation NELBO's PPL over the whole split, EMA weights: an upper bound on the true PPL, with its
          standard error and 95% interval (metrics.nelbo_ppl; the AR baseline: its exact PPL).
zeroshot  the same estimator on a text the model never saw (a local .txt, or a named set: zero_shot_documents),
          wrapped as Duo's zero-shot runs do (spec 7.4; paper Appendix: no EOS between segments; zero_shot_blocks)
          into blocks of L tokens; the paper uses L = 1024, its models' length: L is at most the model's block_size.
genppl    generative perplexity of samples under a judge LM, with its standard error (metrics.gen_ppl); --seq_len
          past the model's block_size draws samples in semi-autoregressive windows (sample.generate_long).
entropy   per-sample unigram entropy (nats) of the generated ids, averaged over samples (metrics.entropies).

How each is estimated, and what differs from Duo: metrics.py.
"""

from plumbing import cli  # first: a stop signal while the imports below load is one line, exit 130
cli.stop_at_once(__name__)

import itertools
import json
import math
import os
from dataclasses import asdict, dataclass

import numpy as np
import torch
from tqdm import tqdm

from corpora import load_hf_split
from data import (DataError, check_split, check_tokenizer, eval_batches, load_meta, not_a_file, read_text,
                  verify_prepared, wrap_blocks)
from diffusion import default_final_step
from metrics import EVAL_SEED, NU_MIN, VAL_DRAWS, VAL_ROUNDS, load_judge, nelbo_ppl
from plumbing.cli import UsageError, parse_flags, resolve_device, resolve_dtype, run_cli
from plumbing.files import WRITTEN_BY, append_jsonl, check_outputs, refuse_overwrite, signature, write_json
from plumbing.runlog import jsonl_records
from sample import check_sample_size, check_sampler, check_stride, generate_ar, generate_long, psi_from_flags
from trained.checkpoint import check_data_tokenizer, load_model, load_tokenizer
from validation import score_samples

ZERO_SHOT_SETS = ("wikitext103", "wikitext2", "ptb", "lambada", "ag_news", "arxiv", "pubmed", "lm1b")


# -----------------------------------------------------------------------------------------------
# zero-shot text: documents -> wrapped blocks

def zero_shot_blocks(token_lists, seq_len, bos_id, eos_id):
    """Duo's zero-shot wrap WITHOUT an EOS between documents (its data.insert_valid_eos=False): the documents' ids
    concatenated, then data.wrap_blocks ([BOS] + piece of seq_len - 2 + [EOS]; the remainder dropped).
    -> (N, seq_len) int64."""
    stream = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64)
    return torch.from_numpy(wrap_blocks(stream, seq_len, bos_id, eos_id)[0])


def zero_shot_documents(name):
    """A local text file (one document: the whole file) or a named zero-shot set: its evaluation split via
    corpora.load_hf_split (Duo's splits, text fields and detokenizers; needs `datasets` and the network)."""
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
    cell = lambda v: f"{v:.3f}" if isinstance(v, float) else "-" if v is None else str(v)    # noqa: E731
    return "\n".join(["| " + " | ".join(columns) + " |\n|" + "---|" * len(columns),
                      *("| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows)])


def _read_samples(path):
    if not os.path.isfile(path):
        raise UsageError(not_a_file(path, f"--samples {path}: " + ("a folder; give the JSONL file of sample.py's "
                                                                   "--out" if os.path.isdir(path) else "no such file"),
                                    "--samples"))
    records = []
    bad = lambda n, e: UsageError(f"--samples {path}:{n}: not a JSON line ({e}); a truncated file?")   # noqa: E731
    for n, record in jsonl_records(read_text(path), bad):
        ids = record.get("ids") if isinstance(record, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise UsageError(f"--samples {path}:{n}: expected a JSON object with 'ids' (a list of integers) and "
                             f"'text', as sample.py writes")
        what = ("an empty sample (no ids)" if not ids else "a negative token id" if min(ids) < 0 else
                "'text' that is not a string" if not isinstance(record.get("text"), (str, type(None))) else
                "'settings' that is not an object" if not isinstance(record.get("settings"), (dict, type(None)))
                else None)
        if what:
            raise UsageError(f"--samples {path}:{n}: {what}; sample.py writes none such: drop or fix that line")
        records.append(record)
    if not records:
        raise UsageError(f"--samples {path}: no samples in it")
    return records


def estimator(cfg):
    """nelbo_ppl's settings from the flags."""
    return {k: getattr(cfg, k) for k in ("seed", "mc_draws", "rounds", "rel_se", "max_rounds", "t_min")}


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
    recorded = (ckpt.get("train_config") or {}).get("data_dir") or (ckpt.get("meta") or {}).get("data_dir")
    data_dir = cfg.data_dir or recorded
    if not data_dir:
        raise UsageError("--data_dir is needed: the checkpoint does not record its prepared data folder")
    meta = load_meta(data_dir)
    check_data_tokenizer(data_dir, meta, ckpt, cfg.ckpt, need_tokenizer=False)   # the checkpoint's, by content
    check_tokenizer(meta, model.config.vocab_size)
    if not meta.get(f"{cfg.split}_sequences"):
        raise UsageError(f"--split {cfg.split!r}: {data_dir} has no sequences there (splits: train, val)")
    verify_prepared(data_dir, meta, [f"{cfg.split}.bin", f"{cfg.split}_mask.bin"])   # its sha256 in meta.json
    check_split(data_dir, cfg.split, meta)       # the files' sizes against meta.json, before the progress bar
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
        docs = zero_shot_documents(name)
        ids = [tok.encode_batch(docs[i:i + 1024]) for i in tqdm(range(0, len(docs), 1024), desc="tokenizing",
                                                                 disable=cli.bar_hidden() or len(docs) < 1024,
                                                                 leave=False)]
        blocks = zero_shot_blocks(itertools.chain(*ids), seq_len, tok.bos_id, tok.eos_id)
        if cfg.max_batches:
            blocks = blocks[:cfg.max_batches * cfg.batch_size]
        if len(blocks) == 0:
            raise UsageError(f"{name} is shorter than one block of {seq_len} tokens; lower --seq_len")
        result = nelbo_ppl(model, list(blocks.split(cfg.batch_size)), model.config.vocab_size, device=device,
                           dtype=dtype, n_sequences=len(blocks), **estimator(cfg))
        rows.append(dict(data=name, blocks=len(blocks), seq_len=seq_len, **result))
    return rows


def run_genppl(cfg, device, dtype):
    groups, tokenizers = {}, {}     # --samples: one row per distinct settings (a JSONL may hold appended runs)
    for r in _read_samples(cfg.samples) if cfg.samples else ():      # a bad file fails before the judge loads
        groups.setdefault(json.dumps(r.get("settings") or {}, sort_keys=True), []).append(r)
    for key in groups:
        spec = json.loads(key).get("tokenizer")
        tokenizers[key], why = load_tokenizer({"meta": {"tokenizer": spec}}) if spec else (None, None)
        if spec and tokenizers[key] is None:    # else the texts would be retokenized: another number, silently
            raise UsageError(f"--samples {cfg.samples}: its settings.tokenizer {spec!r} does not load ({why}); the "
                             f"samples' ids are scored with it: make it loadable where it is recorded")
    judge = load_judge(cfg.judge, device)   # first: fail before any sampling
    if cfg.samples:
        return [score_samples([r["ids"] for r in records], [r.get("text") for r in records], tokenizers[key], judge,
                              cfg.judge_batch_size, device, label=json.loads(key).get("ckpt") or cfg.samples,
                              steps=json.loads(key).get("steps")) for key, records in groups.items()]
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
    if cfg.out:
        write_json(cfg.out, result)
    cli.show("\n".join([json.dumps(result, indent=2), _table(rows, columns), *(precision_line(r, cfg) for r in rows)]))
    return 0


if __name__ == "__main__":
    run_cli(main, DataError, oom_hint="lower --batch_size or --mc_draws (a round's draws are made at once; "
                                              "--judge_batch_size for genppl)")
