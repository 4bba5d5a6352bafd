"""The run log: rank 0's progress bar, out_dir/log.jsonl and the trackers (Log); the lines a run prints before its
bar starts and after it ends; and the one reader of JSONL files the evaluation scripts take as input. What is
logged, and when, the training loop's plumbing decides (plumbing/run.py)."""
import importlib.util
import json
import os
import shlex
import signal
import time

from plumbing.cli import LAUNCH
from plumbing.files import append_jsonl, save_atomic
from plumbing.tracking import open_trackers


class Log:
    """Rank 0's progress bar, out_dir/log.jsonl from `step` on and the trackers cfg asks for (config: the run's config
    dict); what they hold: docs/training.md, "What a run writes and logs". label: the objective the bar names (default
    cfg.loss); block_size: tokens per sequence, for tokens/s (default cfg.block_size); what: "training" |
    "distillation", in the line a stopped run ends with."""

    def __init__(self, cfg, env, step, config=None, label=None, block_size=None, what="training"):
        self.path, self.master = os.path.join(cfg.out_dir, "log.jsonl"), env.master
        self.what, self.max_iters = what, cfg.max_iters
        self.tokens_per_step = cfg.batch_size * (block_size or cfg.block_size)
        self.t_last, self.step_last = time.time(), step
        self.pbar, self.trackers = None, []
        if self.master:
            if cfg.resume:
                truncate_log(self.path, step)
            from tqdm import tqdm
            self.pbar = tqdm(total=cfg.max_iters, initial=step, desc=f"train {label or cfg.loss}", dynamic_ncols=True)
            self.trackers = open_trackers(cfg, step, config or {})

    def _write(self, record):
        record = {"step": record["step"], "t": round(time.time() - LAUNCH, 3), **record}
        append_jsonl(self.path, [record])
        for tracker in self.trackers:
            tracker.log(record)

    def samples(self, step, texts):
        """The end-of-run samples (texts) to the trackers; log.jsonl keeps only numbers."""
        for tracker in self.trackers:
            tracker.samples(step, texts)

    def progress(self, step, loss_sum, lr):
        """The training loss summed over the steps since the last progress (loss_sum), its mean, lr and tokens/s,
        to the bar and the log."""
        steps, dt = step - self.step_last, time.time() - self.t_last
        self.t_last, self.step_last = time.time(), step
        if self.master:
            tok_s = self.tokens_per_step * steps / dt
            # the new loss first, then the step count: tqdm's update() draws the bar with the postfix it holds,
            # so the other order shows each update twice, the first time with the previous interval's loss
            self.pbar.set_postfix(loss=f"{loss_sum / max(1, steps):.4f}", lr=f"{lr:.1e}", tok_s=f"{tok_s:,.0f}",
                                  refresh=False)
            if not self.pbar.update(steps):    # within tqdm's mininterval it does not draw: draw once here
                self.pbar.refresh()
            self._write({"step": step, "loss": loss_sum / max(1, steps), "lr": lr, "tokens_per_s": tok_s})

    def metrics(self, step, metrics):
        """An evaluation's metrics to the bar and the log."""
        if self.master:
            self.pbar.write(f"step {step}: {metrics_line(metrics)}")
            self._write({"step": step, **metrics})
        self.t_last = time.time()    # keep evaluation out of the tokens/s figure

    def end(self, step):
        """The run's end (its model folder and samples done) in the log: {"step", "t", "event": "end"}."""
        self._write({"step": step, "event": "end"})

    def say(self, line):
        """A line on the console above the bar (rank 0), not in the log."""
        if self.master:
            self.pbar.write(line)

    def event(self, step, name, message):
        """A change in what the run does (e.g. "curriculum_end") to the console and to the log as {"step", "event",
        "message"}, so that a jump in the curves says why where it happens (figures/plot.py marks the event)."""
        if self.master:
            self.pbar.write(f"step {step}: {message}")
            self._write({"step": step, "event": name, "message": message})

    def stopped(self, signum, step, after=False):
        """The bar closed and the run's last line, when a stop signal (signum; None: another rank's) ended it with
        its checkpoint of `step` saved, during the run or, `after`, during the samples at its end. -> exit code 130."""
        path = os.path.join(os.path.dirname(self.path), "ckpt.pt")
        if after:
            self.close(f"stopped by signal {signum} after {self.what}; checkpoint of step {step} saved to {path}")
        else:
            self.close(f"stopped by signal {signum or int(signal.SIGTERM)} at step {step}; checkpoint saved to {path} "
                       + (f"({self.what} finished)" if step == self.max_iters else "(continue with --resume 1)"))
        return 130

    def close(self, message=None):
        if self.master:
            self.pbar.close()
            if message:
                print(message)

    def close_trackers(self):
        """The trackers closed (after the samples, which come after the bar ends)."""
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):   # an error ends the bar's line, so its one-line message starts a line of its own
        self.close()
        self.close_trackers()


def metrics_line(metrics):
    """An evaluation's metrics on one line, each estimate with its standard error (a key's "_se") and 95% interval
    ("_lo", "_hi") beside it: "val_ppl 181.69 ± 2.86 (95% 176.2–187.4), val_tokens 10240"."""
    number = lambda k: isinstance(metrics.get(k), float)
    parts = []
    for k, v in metrics.items():
        if k.endswith(("_se", "_lo", "_hi")) and k[:-3] in metrics:
            continue
        text = f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
        if number(k) and number(f"{k}_se"):
            text += f" ± {metrics[f'{k}_se']:.4f}"
        if number(k) and number(f"{k}_lo") and number(f"{k}_hi"):
            text += f" (95% {metrics[f'{k}_lo']:.2f}–{metrics[f'{k}_hi']:.2f})"
        parts.append(text)
    return ", ".join(parts)


def truncate_log(path, step):
    """Keep the lines of log.jsonl up to `step`, the checkpoint's: a resumed run logs the later steps again.
    A torn last line (a kill mid-write) goes too; lines that are not JSON (or not UTF-8) elsewhere are kept as they
    are, byte for byte."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        lines = f.readlines()
    keep = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            if i < len(lines) - 1:
                keep.append(line)
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int) or record["step"] <= step:
            keep.append(line if line.endswith(b"\n") else line + b"\n")
    if keep != lines:
        def write(tmp):
            with open(tmp, "wb") as f:
                f.writelines(keep)
        save_atomic(path, write)


def jsonl_records(text, bad_line):
    """(line number, record) for each non-blank line of a JSONL file's text (data.read_text: UTF-8, else one line
    naming the byte). bad_line(n, e) -> the exception raised for line n, which is not JSON (e: json's error)."""
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise bad_line(n, e) from None
        yield n, record


def start_lines(cfg, raw_model, env):
    """The run in two lines, printed before the progress bar starts (the whole config is out_dir/config.json)."""
    per_rank = cfg.batch_size // (env.world_size * cfg.grad_accum)
    return (f"--preset {cfg.preset} --loss {cfg.loss} on {cfg.dataset} ({cfg.tokenizer}, L = {cfg.block_size}), "
            f"{cfg.max_iters} steps at lr {cfg.lr:g}, {env.device}; full config: "
            f"{os.path.join(cfg.out_dir, 'config.json')}\n"
            f"model: {raw_model.num_params() / 1e6:.2f}M parameters "
            f"({raw_model.num_params(non_embedding=True) / 1e6:.2f}M non-embedding); {env.describe()}; "
            f"world {env.world_size} x micro-batch {per_rank} x accum "
            f"{cfg.grad_accum} = {cfg.batch_size} sequences/step")


def started_line(marks):
    """How long the run took to start and where the time went, from marks [(phase, when it ended)] since the launch
    (plumbing.cli.LAUNCH): "started in 12.3 s: start-up 3.1 s, data 0.4 s, model 0.2 s, first step 8.6 s"."""
    ends = [LAUNCH] + [end for _, end in marks]
    parts = ", ".join(f"{phase} {end - begin:.1f} s" for (phase, end), begin in zip(marks, ends))
    return f"started in {ends[-1] - LAUNCH:.1f} s: {parts}"


def finish_lines(cfg, what, step, ckpt_path, folder):
    """The last lines of a finished run: where its checkpoint, its model folder and its samples went, and how to
    open its curves (figures/plot.py; tensorboard when --tensorboard 1 logged them)."""
    if cfg.num_samples > 0:
        nucleus = f", top-p {cfg.sample_top_p:g}" if cfg.sample_top_p < 1 else ""
        samples = (f"the {cfg.num_samples} printed above ({'EMA' if cfg.ema else 'live'} weights, "
                   f"{cfg.sample_steps} steps{nucleus})")
        samples += ", also in the wandb run" if cfg.wandb else ""
        samples += f", also in {os.path.join(cfg.out_dir, 'tensorboard')}" if cfg.tensorboard else ""
    else:
        samples = "none (--num_samples 0)"
    plots_need = "" if importlib.util.find_spec("matplotlib") else "; needs matplotlib: pip install matplotlib"
    return (f"{what} finished at step {step}; log: {os.path.join(cfg.out_dir, 'log.jsonl')}\n"
            f"  checkpoint:   {ckpt_path} (--resume 1 with a higher --max_iters continues it)\n"
            f"  model folder: {folder} (python sample.py --ckpt {folder}; pretrained.SDDLM.from_pretrained)\n"
            f"  samples:      {samples}\n"
            f"  curves:       python figures/plot.py --runs {shlex.quote(cfg.out_dir)} (PNGs in "
            f"{os.path.join(cfg.out_dir, 'plots')}{plots_need})"
            + (f"; tensorboard --logdir {shlex.quote(os.path.join(cfg.out_dir, 'tensorboard'))}" if cfg.tensorboard
               else ""))

