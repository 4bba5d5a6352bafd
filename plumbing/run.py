"""The run's plumbing for the two training loops (train.py, distillation/distill.py): the launch, the run's state
(Run) and everything around the loop but the step and the checkpoints (RunPlumbing). Nothing here knows the model or
the objective: what a script's run needs of them comes in as a value or a callable."""
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plumbing.cli import Interrupted, OutOfMemory, UsageError, oom_summary
from plumbing.distributed import (agree, any_rank, check_threads, compiles, launch_env, omp_threads, on_rank0,
                                  setup_distributed, wrap_model)
from plumbing.files import write_json, writing
from plumbing.integrity import DivergenceRule
from plumbing.lock import acquire_folder
from plumbing.memory import fit_micro_batch, probe_steps
from plumbing.runlog import Log, finish_lines, start_lines, started_line
from plumbing.signals import deferred_signals, interruptible, reduced_unless_stopped, stop_signals


# -----------------------------------------------------------------------------------------------
# the launch: everything checked before out_dir is locked or made

def launch(cfg, check, work):
    """A training script's start: the launch environment and the CPU threads checked, then check(where) -> what the
    run starts from (each bad flag a line, exit code 2), then work(env, that) holding the lock on cfg.out_dir (one
    run per folder), the process group torn down after it. Out of memory -> one line naming the micro-batch and the
    flag that halves it. -> work's exit code."""
    where = launch_env()
    if cfg.threads < 0:
        raise UsageError(f"--threads must be >= 0 (0 = OMP_NUM_THREADS or the idle cores), got {cfg.threads}")
    check_threads(cfg.threads, "--threads")      # 0: none asked for
    omp_threads()
    if not cfg.dist_timeout > 0:
        raise UsageError(f"--dist_timeout must be > 0 seconds, got {cfg.dist_timeout}")
    start = check(where)
    env = setup_distributed(cfg, where)
    held = []

    def lock():
        with deferred_signals():      # a signal now must not leave a lock (or a new empty out_dir) unrecorded
            held.append(acquire_folder(cfg.out_dir))
    try:
        on_rank0(env, lock, UsageError)
        return work(env, start)
    except torch.OutOfMemoryError as e:
        micro = cfg.batch_size // (env.world_size * cfg.grad_accum)
        fix = (f"set --grad_accum {2 * cfg.grad_accum} (micro-batch {micro // 2})" if micro > 1 and
               cfg.batch_size % (2 * env.world_size * cfg.grad_accum) == 0 else
               "lower --batch_size, --block_size or the model size")
        raise OutOfMemory(f"out of memory at micro-batch {micro} (--batch_size {cfg.batch_size} / {env.world_size} "
                          f"rank(s) / --grad_accum {cfg.grad_accum}): {oom_summary(e)}; {fix}; the last checkpoint "
                          f"in {cfg.out_dir} is kept") from None
    finally:
        for folder in held:
            folder.release()
        if env.ddp and dist.is_initialized():
            dist.destroy_process_group()


# -----------------------------------------------------------------------------------------------
# the run: its state, and its plumbing

@dataclass
class Run:
    """The state a training run carries from step to step (and saves in its checkpoint): train.build_run makes it,
    the step (train.train_step) advances it, plumbing.checkpoint saves and restores it."""
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
    """One training run's plumbing. cfg: the script's config (train.TrainConfig, distill.DistillConfig); env: where
    this process runs (plumbing.distributed.Env); mcfg, meta: the model's config and the data's meta, which every
    checkpoint records; source: the trained model a fine-tuning run starts from (trained.finetune.Source), or None.
    what, label: as runlog.Log takes them; loss_name: the loss as a divergence names it; extra() -> more top-level
    checkpoint entries (distill.py: its settings and the round's teacher; default: source's); export(ckpt_path,
    folder) writes the model folder of a finished run; events: {step: (name, message)} for Log.event after that
    step (train.py's curriculum end: the loss jumps there)."""

    def __init__(self, cfg, env, mcfg, meta, export, source=None, what="training", label=None, loss_name="loss",
                 extra=None, events=None):
        self.cfg, self.env, self.mcfg, self.meta, self.source, self.export = cfg, env, mcfg, meta, source, export
        self.what, self.label, self.loss_name = what, label or cfg.loss, loss_name
        self.extra = extra or (source.extra if source is not None else None)
        self.ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
        self.model_dir = os.path.join(cfg.out_dir, "model")
        self.events = events or {}
        self.marks = [("start-up", env.started), ("data", time.time())]   # (phase, when it ended): started_line

    # -------------------------------------------------------------------------------------------
    # before the loop

    def done(self, ckpt):
        """Whether the checkpoint resumed (None: a fresh run) is already at --max_iters: then nothing is trained and
        config.json is left as it is; the model folder that the stopped run did not export (a full disk) is
        exported now, and one line says so."""
        if ckpt is None or ckpt["step"] != self.cfg.max_iters:
            return False
        if self.env.master:
            if not os.path.isdir(self.model_dir):
                writing(self.model_dir, self.export, self.ckpt_path, self.model_dir)
            print(f"{self.ckpt_path} is already at step {self.cfg.max_iters} = --max_iters; nothing to do (raise "
                  f"--max_iters to go on)")
        return True

    def place_model(self, run, probe=None, fusable=False):
        """run.model and run.eval_model as the run trains and evaluates: with probe (train.py's step on random
        tokens, as fit_micro_batch takes it) on CUDA the micro-batch probe first, then each kind of step compiled now
        (probe_steps), not when the curriculum ends. -> whether it compiles."""
        cfg, env = self.cfg, self.env
        compile = compiles(cfg.compile, cfg.preset, env.device)
        self.marks.append(("model", time.time()))
        if probe and env.device.type == "cuda":
            fit_micro_batch(run, cfg, env, compile, probe, fusable)
            self.marks.append(("probe", time.time()))
        run.model = wrap_model(run.raw_model, env, compile)      # after the probe: see wrap_model
        if probe and compile:
            probe_steps(run, cfg, env, cfg.batch_size // (env.world_size * cfg.grad_accum), probe, run.model)
            self.marks.append(("compilation", time.time()))
        run.eval_model = torch.compile(run.raw_model) if compile else None
        return compile

    @contextmanager
    def start(self, run, config, lines=None):
        """`with plumbing.start(...):` around the loop, from step run.it: config.json (config: the run's configs) and
        `lines` (default: runlog.start_lines) from rank 0, a fine-tuning run's source added to both, then the log
        (runlog.Log); inside, a stop signal sets a flag that sync_loss_and_stop reads instead of ending the process."""
        if self.source is not None:
            config = {**config, **self.source.extra()}
            lines = lines or self.source.lines(self.cfg, run.raw_model, self.env)
        if self.env.master:
            write_json(os.path.join(self.cfg.out_dir, "config.json"), config)
            print(lines or start_lines(self.cfg, run.raw_model, self.env), flush=True)
        self.log = Log(self.cfg, self.env, run.it, config=config, label=self.label, block_size=self.mcfg.block_size,
                       what=self.what)
        self.rule = DivergenceRule(self.cfg.diverge_margin, math.log(self.mcfg.vocab_size))
        self.first_step, self.logged_step, self.lr = run.it + 1, run.it, None
        self.loss_sum = torch.zeros((), device=self.env.device)
        self.bad = torch.zeros((), device=self.env.device, dtype=torch.bool)   # a non-finite loss since the start
        with stop_signals() as self.stop, self.log:
            yield self

    # -------------------------------------------------------------------------------------------
    # in the loop

    def sync_loss_and_stop(self, step, loss, lr):
        """After optimizer step `step`, its training loss (a 0-dim tensor) at learning rate lr: summed on the device.
        Every --log_interval steps, before a checkpoint and, in one process, at once after a stop signal: the loop's
        one host sync (agree), the divergence rule (docs/reliability.md) and the log; a diverged loss raises
        FloatingPointError. -> whether the run stops (a stop signal on any rank: the loop saves and ends)."""
        cfg, env = self.cfg, self.env
        self.loss_sum += loss
        self.bad |= ~torch.isfinite(loss)
        self.lr = lr
        if step == self.first_step:
            self.rule.start(agree(env, loss.detach().clone(), self.bad, False)[0])
            self.marks.append(("first step", time.time()))
            self.log.say(started_line(self.marks))
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
        if step in self.events:
            self.log.event(step, *self.events[step])
        return stopping

    def sync_metrics_and_stop(self, step, sums, metrics):
        """An evaluation at `step`: sums() -> this rank's float64 sums, work that a stop signal on any rank abandons;
        metrics(the sums added over the ranks) -> the record logged. A diverged validation NELBO raises
        FloatingPointError. -> whether the run stops (a stop signal on any rank)."""
        summed = reduced_unless_stopped(self.stop, self.env, sums)
        if summed is not None:
            record = metrics(summed)
            self.log.metrics(step, record)
            why = self.rule.check_metrics(record)
            if why:
                raise self.diverged(why, step)
        return any_rank(self.env, self.stop["signal"] is not None)

    def diverged(self, why, step):
        """The error a diverged run ends with (exit code 2), saying what is kept and what to change."""
        why = why.replace(" loss", f" {self.loss_name}", 1)
        # the last checkpoint is sound: a fault stops the run before a save
        kept = (f"the last good checkpoint {self.ckpt_path} is kept" if os.path.exists(self.ckpt_path) else
                "no checkpoint was written")
        if step == 0:             # before any step: the weights the run starts from (train.py --init)
            return FloatingPointError(f"{why} at step 0, before any training: the weights the run starts from are not "
                                      f"sound (--init {getattr(self.cfg, 'init', '')}); {kept}")
        return FloatingPointError(f"{why} by step {step}; {kept}. Lower --lr (now {self.lr:.2e}) or check "
                                  f"the data.")

    # -------------------------------------------------------------------------------------------
    # after the loop

    def finish(self, run, samples):
        """The end of a run that reached --max_iters with its checkpoint saved: the model folder exported, the
        samples (samples() -> their texts, rank 0; a stop signal abandons them: exit code 130), log.jsonl's last
        record and the finish lines. -> the exit code, 0."""
        self.log.close()
        folder = None
        if self.env.master:        # a full disk: one line (plumbing.files.writing), the checkpoint kept
            folder, _ = writing(self.model_dir, self.export, self.ckpt_path, self.model_dir,
                                then=f"{self.ckpt_path} is saved: free space and run the same command with --resume 1")
        try:
            with interruptible(self.stop):
                if self.env.master and self.cfg.num_samples > 0:
                    self.log.samples(run.it, samples())
        except Interrupted:
            return self.log.stopped(self.stop["signal"], run.it, after=True)
        self.log.close_trackers()
        if self.env.master:                  # last, after the trackers have closed
            self.log.end(run.it)
            print(finish_lines(self.cfg, self.what, run.it, self.ckpt_path, folder))
        return 0
