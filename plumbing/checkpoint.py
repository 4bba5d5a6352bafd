"""Checkpoints: the one state dict a run saves (ckpt.pt to resume, ckpt_<step>.pt to evaluate; its keys:
CHECKPOINT_KEYS), writing and restoring it, and the checks before a resume that need no model (what needs one:
trained/checkpoint.py)."""
import os
import pickle
import warnings
from contextlib import contextmanager
from dataclasses import asdict

import torch
import torch.distributed as dist

from plumbing.cli import ConfigError, UsageError, first_line, os_error_line
from plumbing.files import (check_run_outputs, check_writable, remove_stale_temps, run_output_names, save_atomic,
                            writer_of)
from plumbing.lock import LOCK
from plumbing.integrity import check_finite_weights, check_state_fits, check_zip
from plumbing.signals import deferred_signals

# what a resumed run requires of its checkpoint (save writes them)
RESUME_KEYS = ("model", "optimizer", "model_config", "train_config", "step", "data_state", "rng")
# every key a checkpoint of this version holds (distill.py's and a fine-tuning run's extra() among them)
CHECKPOINT_KEYS = RESUME_KEYS + ("ema", "meta", "n_ema", "distill_config", "distilled_from", "teacher",
                                 "finetuned_from", "tokenizer_model")


def checkpoint_state(run, cfg, mcfg, meta, resume=None):
    """The checkpoint dict of this moment of a run: weights, EMA weights, configs, step. resume: every rank's
    (data position, RNG states), as gathered by save -> also the optimizer and those, for --resume 1."""
    ema = None if run.ema is None else {k: e.detach().clone()
                                        for (k, _), e in zip(run.raw_model.named_parameters(), run.ema)}
    state = dict(model=run.raw_model.state_dict(), ema=ema, model_config=asdict(mcfg), train_config=asdict(cfg),
                 meta=meta, step=run.it, n_ema=run.n_ema)
    if resume is not None:
        state.update(optimizer=run.optimizer.state_dict(), data_state=resume[0], rng=resume[1])
    spec = (meta or {}).get("tokenizer") or ""
    if spec.startswith("sp:") and os.path.isfile(spec[3:]):   # its SentencePiece model: it decodes where data/ is not
        with open(spec[3:], "rb") as f:
            state["tokenizer_model"] = f.read()
    return state


def keep(run, cfg, mcfg, meta):
    """out_dir/ckpt_<step>.pt, written atomically: checkpoint_state without the resume's part (for eval_ppl.py /
    sample.py), so that any curve over training can be recomputed after the run."""
    state = checkpoint_state(run, cfg, mcfg, meta)
    save_atomic(os.path.join(cfg.out_dir, f"ckpt_{run.it}.pt"), lambda tmp: torch.save(state, tmp))


def save(run, cfg, mcfg, meta, env, extra=None):
    """Write out_dir/ckpt.pt atomically: checkpoint_state with every rank's data position and RNG states (gathered
    to rank 0), so --resume 1 continues bit-identically; extra() -> more top-level entries (rank 0), added last."""
    rng = {"torch": torch.get_rng_state(), "gen_shared": run.gen_shared.get_state(),
           "gen_local": run.gen_local.get_state(),
           "cuda": torch.cuda.get_rng_state() if env.device.type == "cuda" else None}
    states = [run.loader.state_dict(), rng]
    if env.ddp:
        gathered = [[None] * env.world_size for _ in states]
        for out, obj in zip(gathered, states):
            dist.all_gather_object(out, obj)
        states = gathered
    if not env.master:
        return
    state = {**checkpoint_state(run, cfg, mcfg, meta, resume=states), **(extra() if extra else {})}
    save_atomic(os.path.join(cfg.out_dir, "ckpt.pt"), lambda tmp: torch.save(state, tmp))


def restore(run, ckpt, env, path="ckpt.pt"):
    """Load a checkpoint written by save (read from `path`) into the run (this rank's data position and RNG
    states). A checkpoint whose state does not fit or load -> ConfigError (one line)."""
    try:
        check_resume_state(run, ckpt, path)
        run.raw_model.load_state_dict(ckpt["model"])
        run.optimizer.load_state_dict(ckpt["optimizer"])
        if run.ema is not None and ckpt.get("ema") is not None:
            for e, v in zip(run.ema, ckpt["ema"].values()):
                e.copy_(v)
        run.it, run.n_ema = ckpt["step"], ckpt.get("n_ema", ckpt["step"])
        per_rank = lambda v: v[env.rank] if isinstance(v, list) else v
        run.loader.load_state_dict(per_rank(ckpt["data_state"]))
        r = per_rank(ckpt["rng"])
        torch.set_rng_state(r["torch"])
        if r["cuda"] is not None and env.device.type == "cuda":
            torch.cuda.set_rng_state(r["cuda"])
        run.gen_shared.set_state(r["gen_shared"])
        run.gen_local.set_state(r["gen_local"])
    except UsageError:              # a one-line fault already (the data position: data.DataError)
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(f"cannot resume: the checkpoint's state does not load ({type(e).__name__}: "
                          f"{first_line(e)})") from None


def check_resume_state(run, ckpt, path):
    """The weights (model, EMA, a distillation's teacher) and the optimizer's moments a resume loads fit this run's
    model, tensor by tensor, before any is loaded (load_state_dict names none in its first line, and AdamW takes
    moments of another shape until its first step fails) -> ConfigError naming the file and the tensor."""
    want = run.raw_model.state_dict()
    fix = "resume from an earlier checkpoint (ckpt_<step>.pt) or start a new run in another --out_dir"
    for name in ("model", "ema", "teacher"):        # the teacher: distillation/distill.py's frozen copy
        if ckpt.get(name) is not None:
            check_state_fits(want, weight_set(ckpt, name), f"cannot resume from {path}", name, fix)
    saved, params = ckpt["optimizer"], [p for g in run.optimizer.param_groups for p in g["params"]]
    groups = saved.get("param_groups")
    ids = [i for g in groups for i in g.get("params", [])] if isinstance(groups, list) and all(
        isinstance(g, dict) for g in groups) else None
    if not isinstance(saved.get("state"), dict) or ids is None or len(ids) != len(params):
        raise ConfigError(f"cannot resume from {path}: its optimizer state is not the one AdamW saves for this model "
                          f"({len(params)} parameters); {fix}")
    shapes = dict(zip(ids, (tuple(p.shape) for p in params)))
    for i, state in saved["state"].items():
        for k, v in (state.items() if isinstance(state, dict) else [("(the entry)", state)]):
            if i not in shapes or (torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) != shapes[i]):
                got = list(v.shape) if torch.is_tensor(v) else type(v).__name__
                raise ConfigError(f"cannot resume from {path}: its optimizer state {i} {k} ({got}) does not fit "
                                  f"parameter {i} ({list(shapes.get(i, ())) if i in shapes else 'none'}); {fix}")


def read_checkpoint(path, map_location="cpu", mmap=False):
    """torch.load with weights_only=True, quietly, of a zip whose members are checked against their CRC-32 first, in
    the same open file (integrity.check_zip; torch.load checks none). A damaged file, or one that is no checkpoint
    (random bytes can look like a pickle of an unknown protocol, which torch warns about) -> ValueError with a short
    reason, for the caller's one line. mmap=True: a peek at the fields (no weights read, no check)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if mmap:
                return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
            with open(path, "rb") as f:
                check_zip(f, path)
                f.seek(0)
                return torch.load(f, map_location=map_location, weights_only=True)
    except ValueError:                  # check_zip's: a member that fails its CRC
        raise
    except OSError as e:
        raise ValueError(os_error_line(e)) from None
    except pickle.UnpicklingError:      # torch's advice (weights_only=False) would run whatever the file holds
        raise ValueError("not a torch checkpoint, or a damaged one") from None
    except Exception as e:              # the unpickler on garbage: IndexError, KeyError, a bad zip's RuntimeError ...
        raise ValueError(f"not a torch checkpoint, or a damaged one ({type(e).__name__}: {first_line(e)})") from None


def load_resume_checkpoint(cfg, check=None):
    """What train.py and distillation/distill.py share at start: out_dir writable and cleared of a killed save's temp
    file; a fresh run (cfg.resume false) refused where an earlier run's files exist -> None; a resume -> the
    checkpoint out_dir/ckpt.pt (read_checkpoint), check(ckpt, path) first (trained.checkpoint.read_resume), then
    its weights finite."""
    check_writable(cfg.out_dir, "--out_dir", folder=True)
    os.makedirs(cfg.out_dir, exist_ok=True)
    path = os.path.join(cfg.out_dir, "ckpt.pt")
    remove_stale_temps(path)
    if not cfg.resume:
        if os.path.isfile(path) and writer_of(path):           # (a user's ckpt.pt: refused below, as theirs)
            raise ConfigError(f"{path} exists; pass --resume 1 to continue it or choose another --out_dir")
        log = os.path.join(cfg.out_dir, "log.jsonl")
        if os.path.isfile(log) and writer_of(log):
            raise ConfigError(f"{log} holds the log of an earlier run that left no "
                              f"checkpoint; delete it or choose another --out_dir")
        theirs = sorted(set(run_output_names(cfg.out_dir)) - {LOCK})
        if theirs:      # a fresh run would write over them: a user's file, or what another run left
            raise ConfigError(f"{os.path.join(cfg.out_dir, theirs[0])} exists and a new run would replace it; move "
                              f"it elsewhere or choose another --out_dir")
        return None
    if not os.path.exists(path):
        raise ConfigError(f"--resume: no checkpoint at {path}")
    check_run_outputs(cfg.out_dir)       # what the run appends to and replaces: files and folders, no links
    try:
        ckpt = read_checkpoint(path)
    except ValueError as e:
        raise ConfigError(f"cannot resume from {path}: not a readable checkpoint ({e})") from None
    if check is not None:
        check(ckpt, path)
    # keys of a later version, which the checkpoints this one writes would drop (a file without our keys is
    # another's: the script's own check names what it lacks)
    unknown = sorted(map(str, set(ckpt) - set(CHECKPOINT_KEYS)))
    if unknown and all(k in ckpt for k in RESUME_KEYS):
        raise ConfigError(f"cannot resume from {path}: it holds {', '.join(unknown)}, which this version of sddlm does "
                          f"not know and would drop; resume with the version that wrote it (upgrade sddlm)")
    check_finite_weights(ckpt, path)      # one saved after a divergence is no place to continue from
    return ckpt


def refuse_other_script(ckpt, out_dir, script):
    """--resume continues a folder only with the script that wrote it, as its content records it (train.py would drop
    a distillation's teacher and settings; distillation/distill.py would train a base model with DCD): else one line
    naming the command that does."""
    writer = ("distillation/distill.py" if "distill_config" in ckpt else          # and the teacher a round needs
              "train.py" if "model" in ckpt and "train_config" in ckpt else None)
    if writer is None or writer == script:
        return
    path = os.path.join(out_dir, "ckpt.pt")
    also = (f", or distil it into a new folder: python distillation/distill.py --init {path} --out_dir NEW"
            if writer == "train.py" else "")
    raise ConfigError(f"cannot resume from {path} with {script}: it was written by {writer}; continue it with "
                      f"python {writer} --out_dir {out_dir} --resume 1{also}")


@contextmanager
def ema_weights(run):
    """Evaluate or sample with the EMA weights: swap them into the model, and back on exit. A signal that
    interrupts evaluation or sampling waits for a swap to finish, so the weights are never left half-swapped."""
    def swap():
        if run.ema is not None:
            for p, e in zip(run.raw_model.parameters(), run.ema):
                tmp = p.detach().clone()
                p.data.copy_(e)
                e.copy_(tmp)
    with deferred_signals():
        swap()
    try:
        yield run.raw_model
    finally:
        with deferred_signals():
            swap()


def weight_set(ckpt, name):
    """The checkpoint's weight set `name` ("model", "ema", "teacher"), a torch.compile'd model's "_orig_mod." prefix
    dropped."""
    return {k.removeprefix("_orig_mod."): v for k, v in ckpt[name].items()}
