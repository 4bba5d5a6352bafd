"""
The paper's figures and the rows of its main table, from train.py run folders, eval_ppl.py and bench/bench.py JSON.

    python figures/plot.py --runs out-sddlm,out-sddlm_v1,out-sddlm_v2,out-duo     # PNGs in ./plots/
    python figures/plot.py --runs out                                              # PNGs in out/plots/
    python figures/plot.py --evals evals/sddlm-genppl.json,evals/duo-genppl.json --table table.md
    python figures/plot.py --bench bench.json                       # bench/bench.py --json 1 > bench.json

The figures (each the paper's figure it redraws), the tables, where the PNGs go and when one is replaced:
docs/training.md, "Figures".
"""
import os, sys  # noqa: E401  (run as a file, python FOLDER/SCRIPT.py: the repository root goes on the path)
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing import cli  # first: a stop signal while the imports below load is one line, exit 130
cli.stop_at_once(__name__)

import json
import pathlib
import re
from dataclasses import dataclass

import losses
from plumbing.cli import UsageError, parse_flags, run_cli
from plumbing.files import PNG_SOFTWARE, check_outputs, refuse_overwrite, save_atomic, text_mark


@dataclass
class PlotConfig:
    runs: str = ""                   # comma list of train.py out_dir folders (their log.jsonl and config.json)
    evals: str = ""                  # comma list of eval_ppl.py --out JSON files (genppl and/or nelbo)
    bench: str = ""                  # a bench/bench.py --json 1 output file
    out_dir: str = ""                # where the PNG files go ("" = a plots/ folder beside the data: in the run's
                                     # folder, in the runs' common parent, or beside the first --evals or --bench file)
    table: str = ""                  # also write the markdown tables here ("-" = print only)
    table_steps: int = 0             # sampling steps of the table's Gen PPL (0 = the most steps evaluated)
    dpi: int = 110                   # resolution of the PNG files
    overwrite: bool = False          # 1: replace PNG and table files that exist already (0: refuse, write nothing)


# -----------------------------------------------------------------------------------------------
# reading the data (no matplotlib)

def _split(s):
    return [x for x in s.split(",") if x]


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not JSON ({e})") from None


def run_config(folder):
    """train_config of the run in `folder` (its config.json, else its ckpt.pt), or {} when it has neither."""
    path = os.path.join(folder, "config.json")
    if os.path.isfile(path):
        config = _read_json(path)
        if not isinstance(config, dict) or not isinstance(config.get("train_config", {}), dict):
            raise UsageError(f"{path}: not a train.py config.json (expected an object with 'train_config')")
        return config.get("train_config", {})
    if os.path.isfile(os.path.join(folder, "ckpt.pt")):
        import torch
        return torch.load(os.path.join(folder, "ckpt.pt"), map_location="cpu", weights_only=True).get(
            "train_config", {})
    return {}


def label_of(train_config, fallback):
    """The objective's name, with ε when a V1/V2 run does not use the default losses.EPS."""
    loss = train_config.get("loss")
    if loss is None:
        return fallback
    eps = train_config.get("eps", losses.EPS)
    return f"{loss} (ε={eps:g})" if loss in ("sddlm_v1", "sddlm_v2") and eps != losses.EPS else loss


def training_curves(folder):
    """log.jsonl of a run -> {"label", "loss": [(step, training loss)], "val": [(step, val_ppl)], "gen": [(step,
    gen_ppl, gen_entropy)], the 95% bands where the log has them: "val_band": [(step, lo, hi)] of the PPL,
    "gen_band": [(step, Gen PPL lo, hi, entropy lo, hi)], "curriculum_end": the step after which the curriculum
    ended (its "curriculum_end" event, else config.json's curriculum_iters when the run passed it; None),
    "judges": set of judge names, "gen_settings": set of (samples, steps, seed, sampler)}."""
    path = os.path.join(folder, "log.jsonl")
    if not os.path.isfile(path):
        raise UsageError(f"--runs {folder}: no log.jsonl there")
    config = run_config(folder)
    curves = dict(label=label_of(config, os.path.basename(os.path.normpath(folder))), loss=[], val=[], gen=[],
                  val_band=[], gen_band=[], curriculum_end=None, judges=set(), gen_settings=set())
    records, skipped = read_log(path)
    for r in records:
        if _is_number(r.get("loss")):
            curves["loss"].append((r["step"], r["loss"]))
        if r.get("event") == "curriculum_end":
            curves["curriculum_end"] = r["step"]
        if "val_ppl" in r:
            curves["val"].append((r["step"], r["val_ppl"]))
            if _is_number(r.get("val_ppl_lo")) and _is_number(r.get("val_ppl_hi")):
                curves["val_band"].append((r["step"], r["val_ppl_lo"], r["val_ppl_hi"]))
        if "gen_ppl" in r:
            curves["gen"].append((r["step"], r["gen_ppl"], r["gen_entropy"]))
            curves["judges"].add(r["gen_judge"])
            curves["gen_settings"].add((r["gen_samples"], r["gen_steps"], r["gen_seed"], r["gen_sampler"]))
            if all(_is_number(r.get(k)) for k in ("gen_ppl_lo", "gen_ppl_hi", "gen_entropy_se")):
                half = 1.96 * r["gen_entropy_se"]
                curves["gen_band"].append((r["step"], r["gen_ppl_lo"], r["gen_ppl_hi"], r["gen_entropy"] - half,
                                           r["gen_entropy"] + half))
    last = max((step for step, _ in curves["loss"]), default=0)
    if curves["curriculum_end"] is None and 0 < (config.get("curriculum_iters") or 0) < last:   # an older log
        curves["curriculum_end"] = config["curriculum_iters"]
    if skipped:
        shown = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
        print(f"figures/plot.py: {path}: skipped {len(skipped)} unreadable line(s) (torn by a crash, or not a log "
              f"record): line {shown}", file=sys.stderr)
    return curves


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def read_log(path):
    """log.jsonl -> (records, numbers of the lines skipped). A line that is not a whole log record (a power cut
    leaves NUL bytes; a crash a half-written line; anything else that is not a JSON object with an integer step
    and numeric metrics) is skipped rather than fatal: the rest of the run's curves are still good."""
    records, skipped = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except ValueError:
                r = None
            ok = isinstance(r, dict) and isinstance(r.get("step"), int) and \
                all(_is_number(r[k]) for k in ("val_ppl", "gen_ppl") if k in r) and \
                ("gen_ppl" not in r or (_is_number(r.get("gen_entropy")) and isinstance(r.get("gen_judge"), str) and
                                        all(k in r for k in ("gen_samples", "gen_steps", "gen_seed", "gen_sampler"))))
            if ok:
                records.append(r)
            else:
                skipped.append(n)
    return records, skipped


def eval_rows(paths):
    """eval_ppl.py JSON files -> (genppl rows, nelbo rows by checkpoint). Each genppl row: the result row plus
    its file's checkpoint, step, label and sampler settings."""
    gen, nelbo = [], {}
    for path in paths:
        e = _read_json(path)
        if not isinstance(e, dict):
            raise UsageError(f"{path}: not an eval_ppl.py result (a JSON {type(e).__name__}; expected an object with "
                             f"'metric' and 'results', as eval_ppl.py --out writes)")
        if e.get("metric") not in ("genppl", "nelbo"):
            raise UsageError(f"{path}: not an eval_ppl.py genppl or nelbo result (metric {e.get('metric')!r})")
        needed = ("steps", "samples", "gen_ppl", "entropy", "judge") if e["metric"] == "genppl" else ("ppl",)
        rows = e.get("results")
        if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) and all(k in r for k in needed)
                                                             for r in rows):
            raise UsageError(f"{path}: 'results' is not a list of {e['metric']} rows with {', '.join(needed)}, as "
                             f"eval_ppl.py --out writes")
        ckpt = e.get("ckpt") if isinstance(e.get("ckpt"), str) else ""
        cfg = e.get("config") if isinstance(e.get("config"), dict) else {}
        train_config = run_config(os.path.dirname(ckpt)) if ckpt and not ckpt.startswith("duo:") else {}
        label = label_of(train_config, ckpt or path)
        if e["metric"] == "nelbo":
            nelbo[ckpt] = e["results"][0]
            continue
        for r in e["results"]:
            gen.append(dict(r, label=label, ckpt=ckpt, ckpt_step=r.get("ckpt_step", e.get("ckpt_step")),
                            seed=cfg.get("seed"), final_step=cfg.get("final_step"), top_p=cfg.get("top_p"), file=path,
                            loss=train_config.get("loss"), eps=train_config.get("eps", losses.EPS)))
    return gen, nelbo


def one_judge(judges, what):
    """The single judge of a figure, by its short label; data scored by several judges are refused, never drawn
    together."""
    judges = sorted(judges)
    if len(judges) > 1:
        raise UsageError(f"{what}: the data were scored by different judges ({', '.join(judges)}); plot them apart")
    return judge_label(judges[0]) if judges else "?"


def judge_label(name):
    """A judge as a figure names it: an AR checkpoint of this repo by its folder, file and step
    ("ar:/work/runs/tiny/ar/ckpt.pt@step1000" -> "AR ar/ckpt.pt, step 1000"; a model folder "AR out-ar/model, step
    1000"), a Hugging Face model by its hub name ("hf:gpt2-large" -> "gpt2-large"). Never a whole local path."""
    m = re.fullmatch(r"ar:(duo:)?(.*?)(?:@step(\w+))?", name)
    if m is None:
        return name.removeprefix("hf:")
    parts = os.path.normpath(m.group(2)).split(os.sep)
    step = f", step {m.group(3)}" if m.group(3) not in (None, "None") else ""
    return f"AR {m.group(1) or ''}{'/'.join(parts[-2:])}{step}"


# -----------------------------------------------------------------------------------------------
# figures

def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UsageError("figures/plot.py needs matplotlib for figures (pip install matplotlib); --table works "
                         "without it") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# one (marker, line style) per curve, so that curves lying on top of each other (duo and sddlm at this scale)
# stay distinguishable: open markers of different shapes, different dashes
STYLES = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", (0, (5, 1, 1, 1))), ("P", (0, (8, 2))),
          ("X", (0, (1, 1))), ("*", (0, (3, 1, 1, 1, 1, 1)))]


# the legend beside the axes, where it hides no point
BESIDE = dict(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), borderaxespad=0)

# the objectives' own order (train.py's --loss names): an objective keeps its colour and marker in every figure
NAMES = ["sddlm", "sddlm_v1", "sddlm_v2", "duo", "ar", "naive", "duo_lean"]


def _styles(labels):
    """One style per curve label: an objective's own (NAMES) where the figure has one curve of it, else a style
    no other curve of the figure uses (a second run of an objective, at another ε, stays distinguishable)."""
    names = [label.split(" ")[0].split(",")[0] for label in labels]
    used, out = set(), []
    for name in names:
        k = NAMES.index(name) if name in NAMES else None
        if k is None or k in used:
            k = min(j for j in range(len(NAMES) + len(labels) + 1)
                    if j not in used and (j >= len(NAMES) or NAMES[j] not in names))
        used.add(k)
        marker, dash = STYLES[k % len(STYLES)]
        out.append(dict(marker=marker, linestyle=dash, ms=5, mfc="none", mew=1.2, lw=1.4, color=f"C{k % 10}"))
    return out


def _save(fig, out_dir, name, dpi):
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, metadata={"Software": f"{PNG_SOFTWARE} figures/plot.py"})   # ours: --overwrite 1
    _pyplot().close(fig)
    return path


def default_out_dir(cfg):
    """--out_dir "" -> plots/ beside the data: in the one run's folder, in the common parent of several runs, else
    beside the first --evals or --bench file. Never the repository's own figures/ (its committed PNGs)."""
    runs = [os.path.abspath(r) for r in _split(cfg.runs)]
    if len(runs) == 1:
        base = runs[0]
    elif runs:
        base = os.path.commonpath([os.path.dirname(r) for r in runs])
    else:
        base = os.path.dirname(os.path.abspath((_split(cfg.evals) or [cfg.bench])[0]))
    return os.path.relpath(os.path.join(base, "plots"))


def figure_names(curves, gen, bench):
    """The PNG files this call will write (as plot_training, plot_gen_ppl_vs_steps, plot_time_memory decide)."""
    gen_curves = any(c["gen"] for c in curves)
    drawn = {"training_gen_ppl.png": gen_curves, "training_entropy.png": gen_curves,
             "training_val_ppl.png": any(c["val"] for c in curves), "training_loss.png": any(c["loss"] for c in curves),
             "gen_ppl_vs_steps.png": any(isinstance(r["steps"], int) for r in gen),
             "time_memory.png": bench is not None}
    return [name for name, wanted in drawn.items() if wanted]


def _mark_curriculum_end(ax, curves):
    """A vertical line after the last curriculum step of the runs that had one, named in the legend: the training
    loss jumps there because the task changes (train.curriculum_end_note)."""
    ends = {}
    for c in curves:
        if c["curriculum_end"] is not None:
            ends.setdefault(c["curriculum_end"], []).append(c["label"])
    for step, labels in sorted(ends.items()):
        ax.axvline(step, color="0.35", linestyle=":", lw=1.2,
                   label=f"curriculum ends after step {step}" + (f" ({', '.join(labels)})" if len(curves) > 1 else ""))


def plot_training(curves, cfg):
    """Figs. ppl_curve_lm1b, entropy_curve_lm1b and eppl_curve_lm1b from run folders, and the training loss ->
    written paths. Bands: the 95% intervals the log recorded; a dotted line: where a curriculum ended."""
    plt, written = _pyplot(), []
    figures = []        # (PNG, curve key, the point's y index, y label, log scale, title, the band's lo and hi indices)
    with_gen = [c for c in curves if c["gen"]]
    if with_gen:
        judge = one_judge(set().union(*(c["judges"] for c in with_gen)), "training Gen PPL")
        settings = set().union(*(c["gen_settings"] for c in with_gen))
        how = "; ".join(f"{n} samples, {'AR' if s is None else f'{s} steps'}, seed {seed}"
                        for n, s, seed, _ in sorted(settings, key=str))
        note = (f"over training (judge: {judge})\neach point: {how}, EMA weights (live without EMA); band: 95% "
                f"interval over the samples")
        figures += [("training_gen_ppl.png", "gen", 1, "Gen PPL (lower is better)", True, f"Gen PPL {note}", (1, 2)),
                    ("training_entropy.png", "gen", 2, "sample entropy (nats)", False, f"Sample entropy {note}",
                     (3, 4))]
    else:
        print("figures/plot.py: no Gen PPL in the runs' logs (train.py --gen_interval): training_gen_ppl.png and "
              "training_entropy.png skipped")
    figures += [("training_val_ppl.png", "val", 1, "validation NELBO PPL (upper bound; AR: exact)", True,
                 "Validation perplexity over training\neach point: validation NELBO PPL at that step, EMA weights "
                 "(live without EMA); band: 95% interval of its Monte-Carlo draws", (1, 2)),
                ("training_loss.png", "loss", 1, "training loss (each run's objective)", False,
                 "Training loss over training\neach point: the mean over the steps since the previous point", None)]
    for name, key, index, ylabel, log, title, band in figures:
        drawn = [c for c in curves if c[key]]
        if not drawn:
            continue
        fig, ax = plt.subplots(figsize=(8.4, 4.2))
        for c, style in zip(drawn, _styles([c["label"] for c in drawn])):
            label = c["label"] + (" (exact PPL)" if key == "val" and c["label"] == "ar" else "")
            ax.plot([p[0] for p in c[key]], [p[index] for p in c[key]], label=label,
                    **(style if band else {**style, "ms": 0}))
            if band and c[key + "_band"]:         # the 95% intervals, shaded in the curve's colour
                points, (lo, hi) = c[key + "_band"], band
                ax.fill_between([b[0] for b in points], [b[lo] for b in points], [b[hi] for b in points],
                                color=style["color"], alpha=0.18, lw=0)
        _mark_curriculum_end(ax, drawn)
        ax.set(xlabel="training step", ylabel=ylabel, yscale="log" if log else "linear")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(**BESIDE)
        written.append(_save(fig, cfg.out_dir, name, cfg.dpi))
    return written


def plot_gen_ppl_vs_steps(gen, cfg):
    """Fig. steps: Gen PPL against the number of sampling steps, one line per model -> written path or None.
    V1/V2 models evaluated at one step count only (an ε sweep) go to a panel of their own beside it: Gen PPL
    against ε at that step count, with the same objective at its default ε, on the same Gen PPL axis."""
    rows = [r for r in gen if isinstance(r["steps"], int)]
    if not rows:
        print("figures/plot.py: no diffusion Gen PPL evaluations (eval_ppl.py --metric genppl --out): "
              "gen_ppl_vs_steps.png skipped")
        return None
    plt = _pyplot()
    judge = one_judge({r["judge"] for r in rows}, "Gen PPL vs sampling steps")
    labels = sorted({r["label"] for r in rows})                  # a model's ε variants right after it
    mine = {label: sorted((r for r in rows if r["label"] == label), key=lambda r: r["steps"]) for label in labels}
    lone = [label for label in labels if len({r["steps"] for r in mine[label]}) == 1]
    in_sweep = {label for label in lone if mine[label][0]["loss"] in ("sddlm_v1", "sddlm_v2")}
    # (objective, steps) -> its rows, one per ε: the lone points', and the same objective's at its other ε
    keys = sorted({(r["loss"], r["steps"]) for label in in_sweep for r in mine[label]})
    sweeps = {key: [r for r in rows if (r["loss"], r["steps"]) == key] for key in keys}
    if sweeps:
        fig, (ax, ax_eps) = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True, gridspec_kw=dict(width_ratios=[2, 1]))
    else:
        fig, ax = plt.subplots(figsize=(8.4, 4.2))
    for label, style in zip(labels, _styles(labels)):
        if label in in_sweep:
            continue
        only = f", at {mine[label][0]['steps']} steps only" if label in lone else ""
        # a lone point: a larger marker drawn over the lines, and no line in its legend entry (it has none)
        style = {**style, **(dict(ms=9, zorder=3, linestyle="none") if only else {})}
        ax.plot([r["steps"] for r in mine[label]], [r["gen_ppl"] for r in mine[label]], label=label + only, **style)
    ax.set_xscale("log", base=2)
    steps = sorted({r["steps"] for label in labels if label not in in_sweep for r in mine[label]})
    ax.set_xticks(steps, [str(s) for s in steps])            # the step counts evaluated, as numbers
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.set(yscale="log", xlabel="sampling steps", ylabel="Gen PPL (lower is better)")
    how = sorted({f"{r['samples']} samples, final step {r['final_step']}, top-p {r['top_p']}, seed {r['seed']}"
                  for r in rows})
    ax.set_title(f"Gen PPL vs sampling steps (judge: {judge})\neach point: {'; '.join(how)}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(**(dict(fontsize=8) if sweeps else BESIDE))
    if sweeps:
        for (loss, n_steps), members in sorted(sweeps.items()):
            members = sorted(members, key=lambda r: r["eps"])
            ax_eps.plot([r["eps"] for r in members], [r["gen_ppl"] for r in members],
                        label=f"{loss}, {n_steps} steps", **_styles([loss])[0])
        eps = sorted({r["eps"] for members in sweeps.values() for r in members})
        ax_eps.set(xscale="log", xlabel="ε of log(p + ε) in training")
        ax_eps.set_xticks(eps, [f"{e:g}" + (" (default)" if e == losses.EPS else "") for e in eps], fontsize=8)
        ax_eps.xaxis.set_minor_locator(plt.NullLocator())
        ax_eps.set_title(f"ε sweep at {', '.join(sorted({str(s) for _, s in sweeps}))} sampling steps\n"
                         f"each point: a model trained with that ε", fontsize=9)
        ax_eps.grid(alpha=0.3, which="both")
        ax_eps.legend(fontsize=8)
    return _save(fig, cfg.out_dir, "gen_ppl_vs_steps.png", cfg.dpi)


def plot_time_memory(bench, cfg):
    """Fig. time: step time and memory per objective (bars) from bench/bench.py --json 1 -> written path."""
    plt, res = _pyplot(), bench["losses"]
    names = list(res)
    mem_key, mem_label = (("peak_mem_bytes", "peak memory (MiB)") if bench.get("cuda", False) else
                          ("step_mem_bytes", "memory of the step's tensors (MiB)"))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, values, ylabel in ((axes[0], [res[n]["step_ms"] for n in names], "step time (ms)"),
                               (axes[1], [res[n][mem_key] / 2 ** 20 for n in names], mem_label)):
        bars = ax.bar(names, values, color=["C0" if n.startswith("sddlm") else "C1" if n == "duo" else "C7"
                                            for n in names])
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.grid(alpha=0.3, axis="y")
    m = bench["model"]
    fig.suptitle(f"Training step per objective: {bench['device']}, {bench['dtype']}\n"
                 f"{m['params'] / 1e6:.1f}M params, V = {m['vocab_size']}, L = {bench['block_size']}, "
                 f"B = {bench['bench_config']['batch_size']} (bench/bench.py, {bench['date'][:10]})", fontsize=9)
    return _save(fig, cfg.out_dir, "time_memory.png", cfg.dpi)


# -----------------------------------------------------------------------------------------------
# tables (no matplotlib)

def _fmt(x, spec, se=None):
    """x formatted, "± se" beside it when the evaluation gave its standard error."""
    return "—" if x is None else format(x, spec) + ("" if not isinstance(se, (int, float)) else f" ± {se:{spec}}")


def tables(gen, nelbo, steps):
    """Markdown: the rows of Table main_results_metrics at `steps` sampling steps (0: each model's most) for the
    models at the default ε, and an ε sweep of the V1/V2 models when there is more than one ε. -> str."""
    picked = {}
    for r in gen:
        if not isinstance(r["steps"], int) or (steps and r["steps"] != steps):
            continue
        if r["ckpt"] not in picked or r["steps"] > picked[r["ckpt"]]["steps"]:
            picked[r["ckpt"]] = r
    if not picked:
        raise UsageError(f"--table: no Gen PPL evaluation at {steps or 'any number of'} sampling steps")
    nelbo_of = lambda r: nelbo.get(r["ckpt"], {})
    metrics = lambda r: (f"{_fmt(r['gen_ppl'], '.1f', r.get('gen_ppl_se'))} | "
                         f"{_fmt(r['entropy'], '.2f', r.get('entropy_se'))} | "
                         f"{_fmt(nelbo_of(r).get('ppl'), '.1f', nelbo_of(r).get('ppl_se'))}")
    lines = ["| model | Gen PPL ↓ | entropy ↑ | val NELBO PPL | checkpoint (step) | judge | sampler | samples "
             "| seed |",
             "|---|---:|---:|---:|---|---|---|---:|---:|"]
    lines += [f"| {r['label']} | {metrics(r)} | `{r['ckpt']}` ({r['ckpt_step']}) | `{r['judge']}` | ancestral, "
              f"{r['steps']} steps, final {r['final_step']}, top-p {r['top_p']} | {r['samples']} | {r['seed']} |"
              for r in picked.values() if "ε=" not in r["label"]]      # the ε sweep's models: in its table below
    sweep = {}
    for r in picked.values():
        if r["loss"] in ("sddlm_v1", "sddlm_v2"):
            sweep.setdefault(r["loss"], []).append(r)
    if any(len({r["eps"] for r in rows}) > 1 for rows in sweep.values()):
        lines += ["", "| objective | ε | Gen PPL ↓ | entropy ↑ | val NELBO PPL | checkpoint |",
                  "|---|---:|---:|---:|---:|---|"]
        lines += [f"| {loss} | {r['eps']:g} | {metrics(r)} | `{r['ckpt']}` |"
                  for loss, rows in sweep.items() for r in sorted(rows, key=lambda r: r["eps"])]
    return "\n".join(lines) + "\n"


# -----------------------------------------------------------------------------------------------

def main(argv=None):
    cfg = parse_flags(PlotConfig, argv, description=__doc__.split("\n\n")[0])
    if not cfg.out_dir and (cfg.runs or cfg.evals or cfg.bench):
        cfg.out_dir = default_out_dir(cfg)
    refuse_overwrite({"--out_dir": os.path.join(cfg.out_dir, "*.png"), "--table": cfg.table.removeprefix("-")},
                     {"--runs": [os.path.join(r, f) for r in _split(cfg.runs) for f in ("log.jsonl", "config.json")],
                      "--evals": _split(cfg.evals), "--bench": cfg.bench})
    if not (cfg.runs or cfg.evals or cfg.bench):
        raise UsageError("nothing to plot: give --runs, --evals and/or --bench")
    gen, nelbo = eval_rows(_split(cfg.evals))
    curves = [training_curves(folder) for folder in _split(cfg.runs)]
    bench = _read_json(cfg.bench) if cfg.bench else None
    if bench is not None and not (isinstance(bench, dict) and isinstance(bench.get("losses"), dict)):
        raise UsageError(f"--bench {cfg.bench}: not a bench/bench.py --json 1 output")
    outputs = [os.path.join(cfg.out_dir, name) for name in figure_names(curves, gen, bench)]
    table = [cfg.table] if cfg.table not in ("", "-") else []
    check_outputs({"--out_dir": outputs, "--table": table}, script="figures/plot.py")   # replaces only its own
    there = [p for p in outputs + table if os.path.lexists(p)]     # so what is left to refuse before anything is
    if there and not cfg.overwrite:                                # written is a file --overwrite 1 would replace
        shown = ", ".join(there[:3]) + (f" and {len(there) - 3} more" if len(there) > 3 else "")
        raise UsageError(f"{shown} exist{'s' if len(there) == 1 else ''} already; give --overwrite 1 to replace "
                         f"{'it' if len(there) == 1 else 'them'}, or another --out_dir / --table")
    if outputs:
        _pyplot()                        # without matplotlib: its one line, before a folder is made
        os.makedirs(cfg.out_dir, exist_ok=True)
    written = plot_training(curves, cfg) if curves else []
    if gen:
        written.append(plot_gen_ppl_vs_steps(gen, cfg))
    if bench is not None:
        written.append(plot_time_memory(bench, cfg))
    for path in filter(None, written):
        print(f"wrote {path}")
    if cfg.table:
        text = tables(gen, nelbo, cfg.table_steps)
        print(text)
        if cfg.table != "-":
            marked = text_mark("figures/plot.py") + "\n" + text
            save_atomic(cfg.table, lambda tmp: pathlib.Path(tmp).write_text(marked))
    return 0


if __name__ == "__main__":
    run_cli(main)
