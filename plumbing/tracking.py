"""Experiment trackers beside log.jsonl: --wandb and --tensorboard. The run log (runlog.Log) hands every record
it writes to log.jsonl to open_trackers' trackers, so they hold the same scalars at the same steps; only rank 0
opens them. wandb and tensorboard are optional and imported only when asked for."""
import importlib.util
import os

from plumbing.cli import UsageError

WANDB_ID_FILE = "wandb_run_id"     # in out_dir: a resumed run (--resume 1) continues the same wandb run
TENSORBOARD_DIR = "tensorboard"    # in out_dir: one event stream per out_dir, like log.jsonl


def require_trackers(cfg):
    """At start-up, before any work: each tracker asked for has its package, else one line naming the install."""
    for name in ("wandb", "tensorboard"):         # each flag is named after its package
        if getattr(cfg, name, False) and importlib.util.find_spec(name) is None:
            raise UsageError(f"--{name} needs the {name} package: pip install {name}")


def open_trackers(cfg, step, config):
    """The trackers cfg asks for (cfg.wandb, cfg.tensorboard; absent fields = off), opened at `step`, the step
    the run starts from (the checkpoint's on --resume 1). config: the run's config dict, recorded once."""
    trackers = []
    if getattr(cfg, "wandb", False):
        trackers.append(WandbTracker(cfg, config))
    if getattr(cfg, "tensorboard", False):
        trackers.append(TensorBoardTracker(cfg, step, config))
    return trackers


def scalars(record):
    """The numbers of a log.jsonl record, without its step (trackers take the step as their axis) and its "t" (they
    keep their own wall time)."""
    return {k: v for k, v in record.items()
            if k not in ("step", "t") and isinstance(v, (int, float)) and not isinstance(v, bool)}


class WandbTracker:
    """A wandb run whose x axis is the training step logged as "step", not wandb's own counter: a resumed run
    logs again the steps after its checkpoint, which wandb's monotone counter would drop."""

    def __init__(self, cfg, config):
        import wandb
        self.wandb = wandb
        id_path = os.path.join(cfg.out_dir, WANDB_ID_FILE)
        run_id = None
        if cfg.resume and os.path.exists(id_path):
            with open(id_path) as f:
                run_id = f.read().strip() or None
        self.run = wandb.init(project=getattr(cfg, "wandb_project", "sddlm") or "sddlm", dir=cfg.out_dir,
                              name=os.path.basename(os.path.abspath(cfg.out_dir)), config=config, id=run_id,
                              resume="allow" if run_id else None)
        with open(id_path, "w") as f:
            f.write(self.run.id + "\n")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, record):
        values = scalars(record)
        if values:
            self.run.log({"step": record["step"], **values})

    def samples(self, step, texts):
        self.run.log({"step": step, "samples": self.wandb.Table(columns=["step", "sample"],
                                                                 data=[[step, t] for t in texts])})

    def close(self):
        self.run.finish()


class TensorBoardTracker:
    """out_dir/tensorboard; on --resume 1 the events after the checkpoint's step are purged, as log.jsonl's
    lines are (runlog.truncate_log), so the curves continue from the checkpoint."""

    def __init__(self, cfg, step, config):
        import json
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(os.path.join(cfg.out_dir, TENSORBOARD_DIR),
                                    purge_step=step + 1 if cfg.resume else None)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", step)

    def log(self, record):
        for k, v in scalars(record).items():
            self.writer.add_scalar(k, v, record["step"])
        self.writer.flush()

    def samples(self, step, texts):
        self.writer.add_text("samples", "\n\n".join(f"    {t}".replace("\n", "\n    ") for t in texts), step)
        self.writer.flush()

    def close(self):
        self.writer.close()
