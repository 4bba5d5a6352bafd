"""The run's plumbing behind one face, for the two training loops (train.py, distillation/distill.py): the launch
(launch, launch_training: the launch environment and every flag checked before anything is made, then this process
in its place of a torchrun job, out_dir locked for the whole process), the run's state (Run) and RunPlumbing: out_dir
opened (the checkpoint to resume), where the weights start (that checkpoint, a trained model, or as built), the model
placed for the run (the memory probe, DDP, torch.compile), out_dir's config.json, log.jsonl and trackers, the
checkpoints and what they record, the model folder exported at the end (a full disk: one line, the checkpoint kept),
the lines printed before, during (the curriculum's end) and after; and the stop signals and the divergence rule that
decide when a run stops. Each method is named for what the loop does and takes what the loop knows; how is here, in
the rooms it calls."""
import math
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from plumbing.checkpoint import keep_checkpoint, open_out_dir, restore, save
from plumbing.cli import Interrupted
from plumbing.distributed import agree, any_rank, check_launch, compiles, run_distributed, wrap_model
from plumbing.export import export
from plumbing.files import write_json, writing
from plumbing.finetune import start_from
from plumbing.flags import check_train_flags
from plumbing.integrity import DivergenceRule
from plumbing.memory import check_run_fits, fit_micro_batch, probe_steps
from plumbing.runlog import Log, curriculum_end_note, finish_lines, kept, start_lines, started_line
from plumbing.signals import interruptible, reduced_unless_stopped, stop_signals


# -----------------------------------------------------------------------------------------------
# the launch: everything checked before out_dir is locked or made

def launch(cfg, check, work):
    """A training script's start: the launch environment and the CPU threads as a whole (WORLD_SIZE, RANK,
    MASTER_ADDR, ..., --threads, OMP_NUM_THREADS: plumbing.distributed.check_launch), then check(launch) -> what the
    run starts from (the script's flags and sizes, each bad one a line, exit code 2), then work(env, that) in this
    process's place of a torchrun job, out_dir locked for the whole process (plumbing.distributed.run_distributed).
    -> work's exit code."""
    start = check(check_launch(cfg))
    return run_distributed(cfg, lambda env: work(env, start))


def launch_training(cfg, given, model_config, work):
    """train.py's launch, checking every flag, its data preparation's among them, and no output over an input
    (plumbing.flags.check_train_flags); the model's shape at any vocabulary (model_config(cfg, vocab_size) ->
    ModelConfig, else ConfigError) and its size against the machine (plumbing.memory.check_run_fits); with --init
    (or a resumed fine-tuning run) reading SOURCE and checking the flags given against it, whose model is then the
    run's (plumbing.finetune.start_from; given: the flags on the command line) -> work(env, that Source or None)."""
    def check(where):
        check_train_flags(cfg, where.world_size)
        if not cfg.init:                  # with --init the model is SOURCE's (plumbing.finetune.check_flags)
            check_run_fits(cfg, model_config(cfg, cfg.vocab_size or 2), where)    # impossible, or too large
        return start_from(cfg, given)
    return launch(cfg, check, work)


# -----------------------------------------------------------------------------------------------
# the run: its state, and its plumbing

@dataclass
class Run:
    """The state a training run carries from step to step (and saves in its checkpoint): train.build_run makes it,
    the step (train.train_step, distill.dcd_step) advances it, RunPlumbing places, saves and restores it."""
    raw_model: torch.nn.Module           # the DiffusionTransformer itself
    model: torch.nn.Module               # what the step calls: raw_model, or it in DDP and/or compiled (wrap_model)
    optimizer: torch.optim.Optimizer
    ema: list                            # EMA copies of raw_model.parameters(), or None
    loader: object                       # a data.BatchLoader (None in bench/bench.py: random tokens)
    gen_shared: torch.Generator          # identical on every rank: times and corruption noise
    gen_local: torch.Generator           # per rank: the curriculum's Gaussian latent
    it: int = 0                          # optimizer steps done
    n_ema: int = 0                       # EMA updates done
    eval_model: torch.nn.Module = None   # what evaluation calls: raw_model compiled (--compile), or None: raw_model


class RunPlumbing:
    """One training run's plumbing. cfg: the script's config (train.TrainConfig, distill.DistillConfig: out_dir,
    max_iters, the intervals, the trackers, ...); env: where this process runs (plumbing.distributed.Env); mcfg,
    meta: the model's config and the data's meta, which every checkpoint records; source: the trained model a
    fine-tuning run starts from (plumbing.finetune.Source: its weights, and where the run started, which config.json,
    the start lines and every checkpoint record), or None. what: "training" | "distillation", in the lines it
    prints; label: the objective as the progress bar names it (default cfg.loss); loss_name: the loss as a
    divergence names it; extra() -> more top-level checkpoint entries (distill.py: its settings and the round's
    teacher; default: source's)."""

    def __init__(self, cfg, env, mcfg, meta, source=None, what="training", label=None, loss_name="loss", extra=None):
        self.cfg, self.env, self.mcfg, self.meta, self.source = cfg, env, mcfg, meta, source
        self.what, self.label, self.loss_name = what, label or cfg.loss, loss_name
        self.extra = extra or (source.extra if source is not None else None)
        self.ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
        self.model_dir = os.path.join(cfg.out_dir, "model")
        self.log = self.stop = self.rule = None
        self.marks = [("start-up", env.started), ("data", time.time())]   # (phase, when it ended): started_line

    def mark(self, phase):
        self.marks.append((phase, time.time()))

    # -------------------------------------------------------------------------------------------
    # before the loop

    def open_out_dir(self):
        """train.py's out_dir, before anything is written there: a fresh run never overwrites a checkpoint nor mixes
        its log with an earlier run's; a resume's checkpoint must match this run (plumbing.checkpoint.open_out_dir).
        -> the checkpoint to resume, or None. A resumed run whose curriculum came from its share (--curriculum_share)
        keeps the steps its checkpoint recorded: it continues as it started, whatever --max_iters is now."""
        ckpt = open_out_dir(self.cfg, self.mcfg, self.meta)
        if ckpt is not None and self.cfg.curriculum_share:
            self.cfg.curriculum_iters = ckpt["train_config"].get("curriculum_iters", self.cfg.curriculum_iters)
        return ckpt

    def done(self, ckpt):
        """Whether the checkpoint resumed (None: a fresh run) is already at --max_iters: then nothing is trained and
        config.json is left as it is; the model folder that the stopped run did not export (a full disk) is
        exported now, and one line says so."""
        if ckpt is None or ckpt["step"] != self.cfg.max_iters:
            return False
        if self.env.master:
            if not os.path.isdir(self.model_dir):
                self.export_model()
            print(f"{self.ckpt_path} is already at step {self.cfg.max_iters} = --max_iters; nothing to do (raise "
                  f"--max_iters to go on)")
        return True

    def start_weights(self, run, ckpt):
        """Where the run's weights start: the checkpoint's state, to continue bit for bit (resume); else SOURCE's
        weights, the EMA at them (fine-tuning: plumbing.finetune.Source.start); else as build_run made them."""
        if ckpt is not None:
            self.resume(run, ckpt)
        elif self.source is not None:
            self.source.start(run)

    def resume(self, run, ckpt):
        """The checkpoint's state into the run: weights, EMA, optimizer, step, this rank's data position and RNG
        states (plumbing.checkpoint.restore), so the run continues bit for bit."""
        restore(run, ckpt, self.env, os.path.join(self.cfg.out_dir, "ckpt.pt"))

    def place_model(self, run, probe=True):
        """The model as the run trains and evaluates it: with probe (train.py's step), on CUDA, the micro-batch probe
        first (plumbing.memory.fit_micro_batch: --grad_accum raised until the micro-batch fits), then run.model =
        raw_model in DDP under torchrun and compiled (plumbing.distributed.wrap_model; --compile auto: the paper's
        presets on CUDA), each kind of step compiled now (probe_steps; the probe's graphs where they are kept), not
        when the curriculum ends; run.eval_model = raw_model compiled for evaluation, or None. -> whether it
        compiles."""
        cfg, env = self.cfg, self.env
        compile = compiles(cfg.compile, cfg.preset, env.device)
        self.mark("model")
        if probe and env.device.type == "cuda":
            fit_micro_batch(run, cfg, env, compile)
            self.mark("probe")
        run.model = wrap_model(run.raw_model, env, compile)      # after the probe: see wrap_model
        if probe and compile:
            probe_steps(run, cfg, env, cfg.batch_size // (env.world_size * cfg.grad_accum), run.model)
            self.mark("compilation")
        run.eval_model = torch.compile(run.raw_model) if compile else None
        return compile

    def start(self, run, config, lines=None):
        """The run starts at step run.it: config.json (config: the run's configs) and `lines` (what the run is, in a
        few lines; default: train.py's, runlog.start_lines) from rank 0, then the progress bar, log.jsonl (cut back
        to run.it on a resume) and the trackers. A fine-tuning run adds where it started (its source) to both.
        Used as `with plumbing.start(...):` around the loop: inside, a stop signal (SIGINT, SIGTERM, ...) sets a flag
        the loop reads (sync_loss_and_stop) instead of ending the process; the way out closes the bar and trackers
        and puts the handlers back."""
        if self.source is not None:
            config = {**config, **self.source.extra()}
            lines = lines or self.source.lines(self.cfg, run.raw_model, self.env)
        if self.env.master:
            write_json(os.path.join(self.cfg.out_dir, "config.json"), config)
            print(lines or start_lines(self.cfg, run.raw_model, self.env), flush=True)
        self.log = Log(self.cfg, self.env, run.it, config=config, label=self.label, block_size=self.mcfg.block_size)
        self.rule = DivergenceRule(self.cfg.diverge_margin, math.log(self.mcfg.vocab_size))
        self.first_step, self.logged_step, self.lr = run.it + 1, run.it, None
        self.curriculum_end = getattr(self.cfg, "curriculum_iters", 0)   # train.py's curriculum (distill.py has none)
        self.loss_sum = self.bad = None
        return self

    def __enter__(self):
        self.exits = ExitStack()
        self.stop = self.exits.enter_context(stop_signals())
        self.exits.enter_context(self.log)
        return self

    def __exit__(self, *exc):
        return self.exits.__exit__(*exc)

    # -------------------------------------------------------------------------------------------
    # in the loop

    def sync_loss_and_stop(self, step, loss, lr):
        """After optimizer step `step`, its training loss (a 0-dim tensor) at learning rate lr: summed on the device,
        no host sync. Every --log_interval steps, before a checkpoint (--ckpt_interval, the last step) and, in one
        process, at once after a stop signal: the loop's one host sync (plumbing.distributed.agree) gives the sum
        over the ranks and whether any rank saw a non-finite loss or a stop signal; the divergence rule checks the
        mean (the first step's loss, of sound weights, starts its history), then it is logged. A diverged loss
        raises FloatingPointError: no checkpoint of these weights is written. -> whether the run stops (a stop
        signal on any rank: the loop saves and ends, stopped). After the curriculum's last step (train.py's
        --curriculum_iters), the log says why the loss jumps there (event)."""
        cfg, env = self.cfg, self.env
        if self.loss_sum is None:
            self.loss_sum = torch.zeros((), device=loss.device)
            self.bad = torch.zeros((), device=loss.device, dtype=torch.bool)   # a non-finite loss since the start
        self.loss_sum += loss
        self.bad |= ~torch.isfinite(loss)
        self.lr = lr
        if step == self.first_step:
            self.rule.start(agree(env, loss.detach().clone(), self.bad, False)[0])
            self.mark("first step")
            self.log.say(started_line(self.marks))     # how long the start took, and where it went
        signalled = self.stop["signal"] is not None
        saves = step % cfg.ckpt_interval == 0 or step == cfg.max_iters
        stopping = False
        if step % cfg.log_interval == 0 or saves or (signalled and not env.ddp):
            total, bad, stopping = agree(env, self.loss_sum, self.bad, signalled)
            why = "non-finite loss" if bad else self.rule.check(total / max(1, step - self.logged_step))
            if why:
                raise self.diverged(why, step)
            self.log.progress(step, total, lr)
            self.logged_step = step
            self.loss_sum.zero_()
        if step == self.curriculum_end < cfg.max_iters:      # the loss jumps here: the log says why
            self.event(step, "curriculum_end", curriculum_end_note(cfg, self.mcfg.vocab_size))
        return stopping

    def event(self, step, name, message):
        """A change in what the run does after step `step` (e.g. "curriculum_end": the loss jumps there), said on the
        console and logged (runlog.Log.event), so that the curves can mark it."""
        self.log.event(step, name, message)

    def sync_metrics_and_stop(self, step, sums, metrics):
        """An evaluation at `step`: sums() -> this rank's float64 sums, work that a stop signal on any rank abandons
        (plumbing.signals.reduced_unless_stopped); metrics(the sums added over the ranks) -> the record logged. A
        diverged validation NELBO raises FloatingPointError: no checkpoint of these weights is written. -> whether
        the run stops (a stop signal on any rank)."""
        summed = reduced_unless_stopped(self.stop, self.env, sums)
        if summed is not None:
            record = metrics(summed)
            self.log.metrics(step, record)
            why = self.rule.check_metrics(record)
            if why:
                raise self.diverged(why, step)
        return any_rank(self.env, self.stop["signal"] is not None)

    def save(self, run):
        """out_dir/ckpt.pt, written atomically (plumbing.checkpoint.save): what resumes the run bit for bit (weights,
        EMA, optimizer, step, every rank's data position and RNG states), the configs, the data's meta, and extra()."""
        extra = self.extra() if self.extra is not None and self.env.master else None
        save(run, self.cfg, self.mcfg, self.meta, self.env, extra=extra)

    def keep(self, run):
        """out_dir/ckpt_<step>.pt (rank 0): the weights and EMA weights of this step, for evaluation afterwards."""
        if self.env.master:
            keep_checkpoint(run, self.cfg, self.mcfg, self.meta)

    def stopped(self, run):
        """The run stopped by a signal, its checkpoint saved: the bar closed, one line. -> exit code 130."""
        return self.log.stopped(self.stop["signal"], run.it, self.what, finished=run.it == self.cfg.max_iters)

    def diverged(self, why, step):
        """The error a diverged run ends with (exit code 2), saying what is kept and what to change."""
        why = why.replace(" loss", f" {self.loss_name}", 1)
        if step == 0:             # before any step: the weights the run starts from (train.py --init)
            return FloatingPointError(f"{why} at step 0, before any training: the weights the run starts from are not "
                                      f"sound (--init {getattr(self.cfg, 'init', '')}); {kept(self.cfg)}")
        return FloatingPointError(f"{why} by step {step}; {kept(self.cfg)}. Lower --lr (now {self.lr:.2e}) or check "
                                  f"the data.")

    # -------------------------------------------------------------------------------------------
    # after the loop

    def finish(self, run, samples):
        """The end of a run that reached --max_iters with its checkpoint saved: the bar closed, the model folder
        out_dir/model exported (rank 0), the samples printed (samples() -> their texts, on rank 0; a stop signal
        abandons them: exit code 130), the trackers closed, then log.jsonl's last record {"step", "t", "event": "end"}
        (the end of the run, read from the log) and the finish lines. -> the exit code, 0."""
        self.log.close()
        folder = None
        if self.env.master:
            folder = self.export_model(then=f"{self.ckpt_path} is saved: free space and run the same command with "
                                            f"--resume 1")
        try:
            with interruptible(self.stop):
                if self.env.master and self.cfg.num_samples > 0:
                    self.log.samples(run.it, samples())
        except Interrupted:
            return self.log.stopped(self.stop["signal"], run.it, self.what, finished=True, after=True)
        self.log.close_trackers()
        if self.env.master:                  # last, after the trackers have closed
            self.log.end(run.it)
            print(finish_lines(self.cfg, self.what, run.it, self.ckpt_path, folder))
        return 0

    def export_model(self, then=""):
        """out_dir/model from the checkpoint (the shareable model folder: plumbing.export.export). A write that fails
        for want of space or another fault of the OS -> one OSError (plumbing.files.writing: what failed, the free
        space, what is kept, and `then`). -> the folder."""
        folder, _ = writing(self.model_dir, export, self.ckpt_path, self.model_dir, then=then)
        return folder
