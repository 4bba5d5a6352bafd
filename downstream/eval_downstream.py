"""
Downstream evaluation of large models (paper Tables: 1.1B models, zero-shot ARC-e, BoolQ, HellaSwag, OBQA,
PIQA, RACE, SIQA, LAMBADA, with and without classifier-free guidance).

    python downstream/eval_downstream.py --ckpt out/ckpt.pt --tasks arc_easy,boolq --cfg both   # through lm-eval
    python downstream/eval_downstream.py --ckpt out/ckpt.pt --jsonl my/arc_easy.jsonl,my/lambada.jsonl
                                                                                         # the built-in runner

Every number is built on one estimate, the conditional NELBO of a continuation given a clean context (with
unsupervised CFG when on), stated in downstream/scoring.py; each metric's definition is in DEFINITIONS below.

JSONL files for the built-in runner: one object a line, either multiple choice
  {"context": str, "choices": [str, ...], "gold": int}   or LAMBADA-style   {"text": str}.
Through lm-eval (lm-eval 0.4.x, optional; its model "sddlm": downstream/lm_eval_sddlm.py) each task's result is
written to --out as soon as it is known; a task that fails (a dataset that cannot be reached, ...) is reported and
the others still run; the exit code is 2 when any failed.
"""

import os, sys  # noqa: E401  (run as a file, python FOLDER/SCRIPT.py: the repository root goes on the path)
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing import cli  # first: a stop signal while the imports below load is one line, exit 130
cli.stop_at_once(__name__)

import argparse
import dataclasses
import functools
import importlib.util
import math

from data import DataError, not_a_file, read_text
from downstream.lm_eval_adapter import (LM_EVAL, check_lm_eval_tasks, hub_offline_check, lm_eval_model_class,
                                        run_lm_eval)
from downstream.scoring import GREEDY_CHECKS, EvalError, load_scorer
from metrics import mean_se
from plumbing.cli import finite_float, parse_flags, resolve_device, run_cli
from plumbing.files import WRITTEN_BY, check_outputs, refuse_overwrite, save_atomic, signature, text_mark, write_json
from plumbing.runlog import jsonl_records
from sample import check_sampler, check_stride

# the paper's eight zero-shot benchmarks, by their lm-eval names
PAPER_TASKS = ["arc_easy", "boolq", "hellaswag", "openbookqa", "piqa", "race", "social_iqa", "lambada_standard"]
PAPER_CFG_W = 1.1   # the paper (Appendix): "we set w = 1.1 for training and evaluation"
# SMDM's per-task guidance weights for its 1.1B masked model (eval_mdm.sh), selectable with --cfg_w_task smdm
SMDM_CFG_W = {"lambada_standard": 1.1, "openbookqa": 1.6, "boolq": 1.6, "piqa": 0.6, "arc_easy": 0.6,
              "social_iqa": 0.6, "race": 0.7, "hellaswag": 0.7}


# -----------------------------------------------------------------------------------------------
# the built-in runner: local JSONL files

def read_jsonl(path, limit=0):
    """-> (kind, the first `limit` items, all for 0) with kind "multiple_choice" or "lambada"; every line is
    checked, errors name the line."""
    if not os.path.isfile(path):
        raise EvalError(not_a_file(path, f"JSONL file not found: {path}", "the JSONL file"))
    items, kinds = [], set()
    for n, item in jsonl_records(read_text(path), lambda n, e: EvalError(f"{path}:{n}: not JSON ({e.msg})")):
        if isinstance(item, dict) and "choices" in item:
            gold = item.get("gold")
            ok = (isinstance(item.get("context"), str) and isinstance(item["choices"], list) and item["choices"]
                  and all(isinstance(c, str) and c.strip() for c in item["choices"])    # no empty choice
                  and isinstance(gold, int) and not isinstance(gold, bool)             # "gold": true is no index
                  and 0 <= gold < len(item["choices"]))
            kinds.add("multiple_choice")
        else:
            ok = isinstance(item, dict) and isinstance(item.get("text"), str) and " " in item["text"].strip()
            kinds.add("lambada")
        if not ok:
            raise EvalError(f"{path}:{n}: expected {{\"context\": str, \"choices\": [non-empty str], \"gold\": "
                            f"int in range}} or {{\"text\": str with at least two words}}")
        items.append(item)
    if not items:
        raise EvalError(f"{path} has no items")
    if len(kinds) > 1:
        raise EvalError(f"{path} mixes multiple-choice and LAMBADA-style lines; use one file per task")
    return kinds.pop(), items[:limit or None]


def multiple_choice_requests(items):
    """One (context, " " + choice) request per choice, lm-eval's target_delimiter."""
    return [(item["context"], " " + choice) for item in items for choice in item["choices"]]


def accuracy_se(hits, n):
    """The standard error of an accuracy, hits of n items (a binomial proportion p): sqrt(p (1 - p) / (n - 1)), the
    standard error of the mean of the n outcomes 0 / 1 (lm-eval's acc_stderr); None for one item. The items are the
    draws: the Monte-Carlo noise of each item's score is inside its outcome."""
    if n < 2:
        return None
    p = hits / n
    return math.sqrt(p * (1 - p) / (n - 1))


def run_multiple_choice(items, loglikelihood):
    """items [{"context", "choices", "gold"}]; loglikelihood([(ctx, cont)]) -> [(ll, is_greedy)].
    -> {"acc", "acc_se", "acc_norm", "acc_norm_se", "n"} with acc_norm dividing ll by the choice's length in
    characters, each with its standard error (accuracy_se)."""
    lls = [ll for ll, _ in loglikelihood(multiple_choice_requests(items))]
    acc = acc_norm = 0
    for item in items:
        scores, lls = lls[:len(item["choices"])], lls[len(item["choices"]):]
        acc += max(range(len(scores)), key=lambda k: scores[k]) == item["gold"]
        acc_norm += max(range(len(scores)), key=lambda k: scores[k] / max(1, len(item["choices"][k]))) == item["gold"]
    n = len(items)
    return {"acc": acc / n, "acc_se": accuracy_se(acc, n), "acc_norm": acc_norm / n,
            "acc_norm_se": accuracy_se(acc_norm, n), "n": n}


def lambada_request(item):
    """{"text"} -> (passage minus its last word, " " + last word), as lm-eval's lambada tasks."""
    context, word = item["text"].strip().rsplit(" ", 1)
    return context, " " + word


def run_lambada(items, scorer, cfg_w=0.0):
    """-> {"acc_generate" (protocol a), "acc_argmax" (protocol b), "perplexity", "n"}, each with its standard error
    over the passages ("_se": accuracy_se; the perplexity's by the delta method, perplexity x the SE of the mean
    of -ll)."""
    pairs = [lambada_request(item) for item in items]
    scored = scorer.loglikelihood(pairs, cfg_w, "argmax", desc="lambada likelihood")
    generated = scorer.generate_matches(pairs, cfg_w, desc="lambada generate")
    n = len(items)
    nll = [-ll for ll, _ in scored]
    ppl, se = math.exp(min(sum(nll) / n, 700.0)), mean_se(n, sum(nll), sum(v * v for v in nll))
    return {"acc_generate": sum(generated) / n, "acc_generate_se": accuracy_se(sum(generated), n),
            "acc_argmax": sum(g for _, g in scored) / n, "acc_argmax_se": accuracy_se(sum(g for _, g in scored), n),
            "perplexity": ppl, "perplexity_se": None if se is None else ppl * se, "n": n}


# -----------------------------------------------------------------------------------------------
# command line

@dataclasses.dataclass
class EvalConfig:
    # model
    ckpt: str = "out/ckpt.pt"        # a train.py / distillation/distill.py checkpoint, a model folder, or duo:PATH
    use_ema: bool = True             # evaluate the EMA weights (the live ones when the checkpoint has no EMA)
    add_bos: bool = True             # BOS before the context (training blocks start with BOS)
    # tasks
    tasks: str = ""                  # lm-eval task names, comma-separated; "paper" = the paper's eight
    jsonl: str = ""                  # local JSONL files, comma-separated (task name = file stem): built-in runner
    data_dir: str = "data/downstream"  # without lm-eval (or with --builtin 1), --tasks NAME reads NAME.jsonl here
    builtin: bool = False            # use the built-in runner for --tasks even when lm-eval is installed
    include_path: str = ""           # extra lm-eval task YAML folder (offline tasks over local files)
    limit: int = 0                   # first N items per task (0 = all)
    out: str = ""                    # results JSON (and the table as .md next to it), rewritten after every task
    # scoring
    mc_draws: int = 128              # Monte Carlo draws per request (SMDM 1024, LLaDA 128)
    cfg: str = "off"                 # off | on | both (one row each, as the paper's Tables)
    cfg_w: float = PAPER_CFG_W       # guidance weight w when CFG is on (paper: 1.1)
    cfg_w_task: str = ""             # per-task w: "boolq=1.6,piqa=0.6", "smdm" (SMDM's tuned table), or both
    greedy_check: str = "argmax"     # is_greedy handed to lm-eval (its LAMBADA acc): argmax | generate
    lambada_steps: int = 8           # reverse steps of LAMBADA protocol (a)
    steps: int = 128                 # lm-eval generate_until: reverse steps of the diffusion sampler
    final_step: str = "auto"         # lm-eval generate_until: ancestral | greedy | none | auto (by objective)
    top_p: float = 1.0               # lm-eval generate_until: nucleus on x_theta
    stride: int = 0                  # lm-eval generate_until past block_size: new tokens per window (0 = half a block)
    rolling_context: int = 1         # lm-eval loglikelihood_rolling: clean tokens before each window's piece
    # runtime
    seed: int = 1234                 # every request's times, noise and null contexts are drawn from this seed
    batch_size: int = 16             # MC draws per forward (2 x rows with CFG)
    device: str = "auto"             # auto | cpu | cuda
    dtype: str = "auto"              # auto (bf16 on GPU, float32 on CPU) | float32 | bfloat16


DEFINITIONS = {
    "ll": "log p(cont|ctx) >= -(1/J) sum_j sum_{i in cont} usdm_nelbo_loss at t_j stratified in [1e-3,1], "
          "log-linear alpha_t, context clean, continuation ~ q_t; CFG: log_softmax((1+w) log p_c - w log p_u), "
          "unconditional context = uniform random tokens, same noisy continuation",
    "acc": "argmax_k ll(' ' + choice_k) == gold",
    "acc_norm": "argmax_k ll(' ' + choice_k) / len(choice_k in characters) == gold",
    "acc_generate": "LAMBADA protocol (a): span of the gold token length generated by sample.generate "
                    "(context fixed, lambada_steps steps, final step greedy); decoded span == last word",
    "acc_argmax": "LAMBADA protocol (b): span fully noised (t=1), argmax of the (guided) denoiser == gold "
                  "token at every target position (the is_greedy given to lm-eval by default)",
    "perplexity": "exp(-mean over passages of ll(' ' + last word))",
    "generate_until": "lm-eval generation tasks: max_gen_toks tokens sampled by sample.generate after the fixed "
                      "context (steps, final_step, top_p, same CFG; past block_size - 1 in windows of stride new "
                      "tokens, the rest of the block held fixed), cut at EOS "
                      "and before the task's first stop string",
    "word_perplexity": "UPPER BOUND: lm-eval's exp(-sum ll / words) with ll = the rolling lower bound on log p(doc): "
                       "sum of ll over windows of block_size tokens (rolling_context clean tokens before each piece)",
    "byte_perplexity": "UPPER BOUND: exp(-sum ll / UTF-8 bytes), ll the rolling lower bound as for word_perplexity",
    "bits_per_byte": "UPPER BOUND: -sum ll / (bytes ln 2), ll the rolling lower bound as for word_perplexity",
}
METRIC_ORDER = ["acc", "acc_norm", "acc_generate", "acc_argmax", "perplexity", "word_perplexity",
                "byte_perplexity", "bits_per_byte"]
PLAIN_METRICS = {"perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte"}   # not shown in percent
ROW_KEYS = {"task", "setting", "cfg_w", "runner", "n", "output_type"}


def task_weights(cfg, tasks):
    """w per task when CFG is on: --cfg_w for all, then SMDM's table if 'smdm' is listed, then name=w pairs."""
    weights = {task: cfg.cfg_w for task in tasks}
    for part in filter(None, (p.strip() for p in cfg.cfg_w_task.split(","))):
        if part == "smdm":
            weights.update({t: w for t, w in SMDM_CFG_W.items() if t in weights})
            continue
        name, _, value = part.partition("=")
        try:
            w = finite_float(value)
        except argparse.ArgumentTypeError:
            raise EvalError(f"--cfg_w_task: expected NAME=W (W a finite number) or 'smdm', got {part!r}") from None
        if name.strip() not in weights:
            raise EvalError(f"--cfg_w_task: {name.strip()!r} is not one of the tasks ({', '.join(weights)})")
        weights[name.strip()] = w
    return weights


def plan_tasks(cfg):
    """-> [(task name, runner, path or None)], runner "lm-eval" or "builtin"; checks files and names first."""
    names = [t.strip() for t in cfg.tasks.split(",") if t.strip()]
    names = [n for t in names for n in (PAPER_TASKS if t == "paper" else [t])]
    have_lm_eval = importlib.util.find_spec("lm_eval") is not None
    plan = []
    for name in names:
        path = os.path.join(cfg.data_dir, f"{name}.jsonl")
        if have_lm_eval and not cfg.builtin:
            plan.append((name, "lm-eval", None))
        elif os.path.isfile(path):
            plan.append((name, "builtin", path))
        else:
            why = "--builtin 1 was given" if have_lm_eval else f"lm-eval is not installed (pip install {LM_EVAL})"
            raise EvalError(f"unknown task {name!r}: {why} and there is no local file {path}; "
                            f"give its items with --jsonl PATH")
    for path in filter(None, (p.strip() for p in cfg.jsonl.split(","))):
        if not os.path.isfile(path):
            raise EvalError(not_a_file(path, f"--jsonl: file not found: {path}", "--jsonl"))
        plan.append((os.path.splitext(os.path.basename(path))[0], "builtin", path))
    if not plan:
        raise EvalError("nothing to evaluate: give --tasks (e.g. --tasks paper) and/or --jsonl PATH[,PATH]")
    return plan


def validate(cfg):
    if cfg.mc_draws < 1 or cfg.batch_size < 1 or cfg.lambada_steps < 1 or cfg.limit < 0:
        raise EvalError("--mc_draws, --batch_size and --lambada_steps must be >= 1, --limit >= 0")
    if cfg.cfg not in ("off", "on", "both"):
        raise EvalError(f"--cfg must be off, on or both, got {cfg.cfg!r}")
    if cfg.greedy_check not in GREEDY_CHECKS:
        raise EvalError(f"--greedy_check must be one of {', '.join(GREEDY_CHECKS)}, got {cfg.greedy_check!r}")
    check_sampler(cfg.steps, cfg.final_step, cfg.top_p)
    if cfg.rolling_context < 0:
        raise EvalError(f"--rolling_context must be >= 0, got {cfg.rolling_context}")
    if not cfg.ckpt.startswith("duo:") and not (os.path.isfile(cfg.ckpt) or os.path.isdir(cfg.ckpt)):   # duo: later
        raise EvalError(not_a_file(cfg.ckpt, f"checkpoint not found: {cfg.ckpt}", "--ckpt"))


def markdown_table(rows):
    """One line per (task, guidance setting); accuracies in percent as the paper's Tables, each ± its standard
    error (a metric's "_se") where the run gave one."""
    present = {m for r in rows for m in r if m not in ROW_KEYS and not (m.endswith("_se") and m[:-3] in r)}
    metrics = [m for m in METRIC_ORDER if m in present] + sorted(present - set(METRIC_ORDER))

    def cell(r, m):
        if m not in r:
            return "–"
        scale = 1 if m in PLAIN_METRICS else 100
        se = r.get(f"{m}_se")
        return f"{scale * r[m]:.2f}" + (f" ± {scale * se:.2f}" if isinstance(se, (int, float)) else "")
    lines = ["| task | setting | w | runner | n | " + " | ".join(metrics) + " |",
             "|---|---|---:|---|---:|" + "---:|" * len(metrics)]
    for r in rows:
        lines.append(f"| {r['task']} | {r['setting']} | {r['cfg_w']:g} | {r['runner']} | {r['n']} | "
                     + " | ".join(cell(r, m) for m in metrics) + " |")
    return "\n".join(lines)


def write_results(path, result):
    """result as JSON at `path` and its table (with the definitions) as .md next to it, both written atomically."""
    table = markdown_table(result["results"])
    failed = "".join(f"\n- FAILED {f['task']} ({f['setting']}): {f['error']}" for f in result["failed"])

    def write_md(tmp):
        with open(tmp, "w") as f:
            f.write(text_mark("downstream/eval_downstream.py") + "\n" + table + "\n" + failed + "\n\n"
                    + "\n".join(f"- {k}: {v}" for k, v in DEFINITIONS.items()) + "\n")
    write_json(path, result)
    save_atomic(results_md(path), write_md)


def results_md(path):
    """The table written beside --out: res.json -> res.md (refused, like --out itself, unless sddlm wrote it)."""
    return os.path.splitext(path)[0] + ".md"


def main(argv=None):
    cfg = parse_flags(EvalConfig, argv, description=__doc__.strip().split("\n\n")[0])
    outputs = {"--out": [cfg.out, results_md(cfg.out)] if cfg.out else ""}
    refuse_overwrite(outputs, {"--ckpt": cfg.ckpt, "--jsonl": cfg.jsonl.split(",")})
    check_outputs(outputs, script="downstream/eval_downstream.py")    # new, or written by it
    validate(cfg)
    plan = plan_tasks(cfg)
    if any(runner == "lm-eval" for _, runner, _ in plan):
        hub_offline_check()     # before lm-eval imports `datasets`
        check_lm_eval_tasks([name for name, runner, _ in plan if runner == "lm-eval"], cfg.include_path)
    data = {name: read_jsonl(path, cfg.limit) for name, runner, path in plan if runner == "builtin"}
    device = resolve_device(cfg.device)
    scorer, ckpt = load_scorer(cfg.ckpt, device, cfg.use_ema, cfg.dtype, mc_draws=cfg.mc_draws,
                               batch_size=cfg.batch_size, seed=cfg.seed, lambada_steps=cfg.lambada_steps,
                               add_bos=cfg.add_bos)
    block_size = scorer.model.config.block_size
    if cfg.rolling_context >= block_size:
        raise EvalError(f"--rolling_context must be < the model's block_size {block_size}")
    check_stride(cfg.stride, block_size)
    for kind, items in data.values():     # every request is checked before any scoring
        scorer.encode_all(multiple_choice_requests(items) if kind == "multiple_choice"
                          else [lambada_request(item) for item in items])
    weights = task_weights(cfg, [name for name, _, _ in plan])
    settings = {"off": [("no CFG", False)], "on": [("CFG", True)],
                "both": [("no CFG", False), ("CFG", True)]}[cfg.cfg]
    print(f"evaluating {cfg.ckpt} (step {ckpt.get('step')}, loss {(ckpt.get('train_config') or {}).get('loss')}, "
          f"{'EMA' if cfg.use_ema and ckpt.get('ema') is not None else 'live'} weights) on {device}: "
          f"{', '.join(f'{n} [{r}]' for n, r, _ in plan)}; {cfg.mc_draws} MC draws, cfg={cfg.cfg}", file=sys.stderr)

    rows, failed = [], []
    result = {WRITTEN_BY: signature("downstream/eval_downstream.py"), "config": dataclasses.asdict(cfg),
              "checkpoint": {"step": ckpt.get("step"), "loss": (ckpt.get("train_config") or {}).get("loss"),
                             "model_config": ckpt.get("model_config")},
              "tokenizer": scorer.tokenizer.spec, "definitions": DEFINITIONS, "results": rows, "failed": failed}
    for name, runner, _ in plan:
        for k, (setting, guided) in enumerate(settings):
            w = weights[name] if guided else 0.0
            try:
                if runner == "lm-eval":
                    lm = lm_eval_model_class()(scorer=scorer, cfg_w=w, greedy_check=cfg.greedy_check,
                                               steps=cfg.steps, final_step=cfg.final_step, top_p=cfg.top_p,
                                               stride=cfg.stride, rolling_context=cfg.rolling_context)
                    metrics = run_lm_eval(name, lm, cfg.limit, cfg.include_path)
                else:
                    kind, items = data[name]
                    if kind == "multiple_choice":
                        metrics = run_multiple_choice(
                            items, functools.partial(scorer.loglikelihood, cfg_w=w, desc=f"{name} ({setting})"))
                    else:
                        metrics = run_lambada(items, scorer, w)
            except EvalError as e:    # this task cannot run (in any setting); the other tasks still do
                failed += [{"task": name, "setting": later, "error": str(e)} for later, _ in settings[k:]]
                print(f"FAILED {name}: {e}", file=sys.stderr)
            else:
                rows.append({"task": name, "setting": setting, "cfg_w": w, "runner": runner, **metrics})
                se = lambda m: f" ± {metrics[m + '_se']:.2g}" if isinstance(metrics.get(m + "_se"), float) else ""
                print(f"done {name} ({setting}): " + ", ".join(f"{m} {v:.4g}{se(m)}" for m, v in metrics.items()
                      if m not in ROW_KEYS and not m.endswith("_se") and isinstance(v, (int, float))), file=sys.stderr)
            if cfg.out:
                write_results(cfg.out, result)
            if failed and failed[-1]["task"] == name:
                break

    if rows:
        print(markdown_table(rows))
    if cfg.out:
        print(f"wrote {cfg.out}", file=sys.stderr)
    if failed:
        raise EvalError(f"{len(failed)} of {len(failed) + len(rows)} task runs failed: "
                        + ", ".join(f"{f['task']} ({f['setting']})" for f in failed)
                        + (f"; the other results are in {cfg.out}" if cfg.out and rows else ""))
    return 0


if __name__ == "__main__":
    run_cli(main, DataError, oom_hint="lower --batch_size (Monte Carlo draws per forward) or --mc_draws "
                                              "(its draws' times are made at once)")
