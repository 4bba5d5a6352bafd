"""Checkpoints: the one state dict a run saves (ckpt.pt to resume, ckpt_<step>.pt to evaluate), writing and
restoring it, the checks before a resume, and loading a model with its tokenizer for sampling and evaluation.
A checkpoint is a dict: model, ema, optimizer, model_config, train_config, meta, step, n_ema, data_state, rng
(the last two per rank), plus a script's own entries (distillation/distill.py: distill_config, distilled_from, teacher)."""
import os
import pickle
import warnings
import zipfile
from contextlib import contextmanager
from dataclasses import asdict

import torch
import torch.distributed as dist

from data import DataError, full_data_key, get_tokenizer, not_a_file
from model import ModelConfig, build_model
from plumbing.cli import ConfigError, UsageError, first_line, os_error_line
from plumbing.files import (check_run_outputs, check_writable, remove_stale_temps, run_output_names, save_atomic,
                            written_by_us)
from plumbing.folder import check_target
from plumbing.lock import LOCK
from plumbing.memory import check_model_memory
from plumbing.integrity import (check_checkpoint_fields, check_config_matches, check_finite_weights,
                                check_state_fits, check_tokenizer_identity, check_weights, check_zip)
from plumbing.signals import deferred_signals

# what a resumed run requires of its checkpoint (save writes them)
RESUME_KEYS = ("model", "optimizer", "model_config", "train_config", "step", "data_state", "rng")
# every key a checkpoint of this version holds (distill.py's and a fine-tuning run's extra() among them)
CHECKPOINT_KEYS = RESUME_KEYS + ("ema", "meta", "n_ema", "distill_config", "distilled_from", "teacher", "finetuned_from")


def checkpoint_state(run, cfg, mcfg, meta, resume=None):
    """The checkpoint dict of this moment of a run: weights, EMA weights, configs, step. resume: every rank's
    (data position, RNG states), as gathered by save -> also the optimizer and those, for --resume 1."""
    ema = None if run.ema is None else {k: e.detach().clone()
                                        for (k, _), e in zip(run.raw_model.named_parameters(), run.ema)}
    state = {"model": run.raw_model.state_dict(), "ema": ema}
    if resume is not None:
        state["optimizer"] = run.optimizer.state_dict()
    state.update(model_config=asdict(mcfg), train_config=asdict(cfg), meta=meta, step=run.it, n_ema=run.n_ema)
    if resume is not None:
        state.update(data_state=resume[0], rng=resume[1])
    return state


def keep_checkpoint(run, cfg, mcfg, meta):
    """out_dir/ckpt_<step>.pt, written atomically: the weights, EMA weights, configs and step of this moment
    (no optimizer or RNG state: for eval_ppl.py / sample.py, not for --resume), so that any curve over
    training can be recomputed after the run."""
    state = checkpoint_state(run, cfg, mcfg, meta)
    save_atomic(os.path.join(cfg.out_dir, f"ckpt_{run.it}.pt"), lambda tmp: torch.save(state, tmp))


def save(run, cfg, mcfg, meta, env, extra=None):
    """Write out_dir/ckpt.pt atomically: weights, EMA, optimizer, configs, step, and every rank's data
    position and RNG states (gathered to rank 0), so --resume 1 continues bit-identically. extra: more
    top-level entries (distillation/distill.py records its settings and teacher there), added last."""
    rng = {"torch": torch.get_rng_state(), "gen_shared": run.gen_shared.get_state(),
           "gen_local": run.gen_local.get_state(),
           "cuda": torch.cuda.get_rng_state() if env.device.type == "cuda" else None}
    states = [run.loader.state_dict(), rng]
    if env.ddp:
        gathered = []
        for obj in states:
            out = [None] * env.world_size
            dist.all_gather_object(out, obj)
            gathered.append(out)
        states = gathered
    if not env.master:
        return
    state = {**checkpoint_state(run, cfg, mcfg, meta, resume=states), **(extra or {})}
    save_atomic(os.path.join(cfg.out_dir, "ckpt.pt"), lambda tmp: torch.save(state, tmp))


def restore(run, ckpt, env, path="ckpt.pt"):
    """Load a checkpoint written by save (read from `path`) into the run (this rank's data position and RNG
    states). A checkpoint whose state does not fit or load -> ConfigError (one line)."""
    try:
        check_resume_state(run, ckpt, path)
        _restore(run, ckpt, env)
    except (DataError, ConfigError):
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


def _restore(run, ckpt, env):
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


def read_checkpoint(path, map_location="cpu", mmap=False):
    """torch.load with weights_only=True, quietly, of bytes that are the ones written: every member of the zip
    is checked against its CRC-32 first (integrity.check_zip; torch.load checks none), in the same open file.
    A damaged file, or one that is no checkpoint (random bytes can look like a pickle of an unknown protocol,
    which torch warns about) -> ValueError with a short reason, for the caller's one line. mmap=True: a peek at
    the fields (no weights read, no check)."""
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


def load_resume_checkpoint(cfg):
    """What train.py and distillation/distill.py share at start: out_dir writable and cleared of a killed save's temp file;
    a fresh run (cfg.resume false) refused where a checkpoint or an earlier run's log.jsonl exists -> None;
    a resume -> the checkpoint out_dir/ckpt.pt as read by torch.load (one line if missing or unreadable), refused
    when out_dir/model, which the run's end writes, holds what is not a model folder of ours (folder.check_target)."""
    check_writable(cfg.out_dir, "--out_dir", folder=True)
    os.makedirs(cfg.out_dir, exist_ok=True)
    path = os.path.join(cfg.out_dir, "ckpt.pt")
    remove_stale_temps(path)              # a save killed half-way (SIGKILL) leaves its temp file
    if not cfg.resume:
        if os.path.isfile(path) and written_by_us(path):       # (a user's ckpt.pt: refused below, as theirs)
            raise ConfigError(f"{path} exists; pass --resume 1 to continue it or choose another --out_dir")
        log = os.path.join(cfg.out_dir, "log.jsonl")
        if os.path.isfile(log) and written_by_us(log):
            raise ConfigError(f"{os.path.join(cfg.out_dir, 'log.jsonl')} holds the log of an earlier run that left no "
                              f"checkpoint; delete it or choose another --out_dir")
        theirs = sorted(set(os.listdir(cfg.out_dir)) & set(run_output_names(cfg.out_dir)) - {LOCK})
        if theirs:      # a fresh run would write over them: a user's file, or what another run left
            raise ConfigError(f"{os.path.join(cfg.out_dir, theirs[0])} exists and a new run would replace it; move "
                              f"it elsewhere or choose another --out_dir")
        return None
    if not os.path.exists(path):
        raise ConfigError(f"--resume: no checkpoint at {path}")
    check_run_outputs(cfg.out_dir)       # what the run appends to and replaces: files and folders, no links
    # the run ends by exporting out_dir/model: a folder there of the user's is refused now, not after the training
    check_target(os.path.join(cfg.out_dir, "model"), f"--out_dir {cfg.out_dir}: its model folder",
                 "move them elsewhere, then resume")
    try:
        ckpt = read_checkpoint(path)
    except ValueError as e:
        raise ConfigError(f"cannot resume from {path}: not a readable checkpoint ({e})") from None
    check_checkpoint_fields(ckpt, path)
    unknown = sorted(map(str, set(ckpt) - set(CHECKPOINT_KEYS)))
    if unknown:         # a later version's: the checkpoints this one writes would drop them
        raise ConfigError(f"cannot resume from {path}: it holds {', '.join(unknown)}, which this version of sddlm does "
                          f"not know and would drop; resume with the version that wrote it (upgrade sddlm)")
    check_finite_weights(ckpt, path)      # one saved after a divergence is no place to continue from
    return ckpt


def check_resume_data(cfg, key):
    """Before any data preparation: a resume asks for the data its checkpoint was trained on (key: prepare.data_key
    of this run's flags, against the checkpoint's meta['data_key']), so a changed --block_size, --tokenizer,
    --dataset or --wrap fails now, not after preparing a whole new dataset. Reads the checkpoint memory-mapped (no
    weights are read); one that cannot be read this way is left to the full check after preparation."""
    path = os.path.join(cfg.out_dir, "ckpt.pt")
    if not cfg.resume or not os.path.isfile(path) or not zipfile.is_zipfile(path):   # torch.save's format is a zip
        return
    try:
        old = full_data_key(read_checkpoint(path, mmap=True)["meta"]["data_key"])
    except Exception:
        return
    flags = {"block_size": "--block_size", "wrap": "--wrap", "corpus": "--dataset", "tokenizer": "--tokenizer"}
    changed = [k for k, v in full_data_key(key).items() if old.get(k) != v]
    detail = [f"{flags[k]} {getattr(cfg, flags[k][2:])!r} is another by content" if k in ("corpus", "tokenizer") else
              f"{flags.get(k, k)} was {old.get(k)!r}, now {key.get(k, 'text')!r}" for k in changed]
    if changed:
        raise ConfigError(f"cannot resume from {path}: the training data differ from the checkpoint's "
                          f"({', '.join(changed)} changed): {'; '.join(detail)}; resume with the flags it was trained "
                          f"with (its config.json) or start a new run in another --out_dir")


def open_out_dir(cfg, mcfg, meta=None):
    """The checkpoint to resume (None for a fresh run). A fresh run never overwrites an existing checkpoint nor
    mixes its log with an earlier run's; a resume must match the saved model, objective, batch, tokenizer (by
    content) and data (meta: this run's prepared data), and reach beyond the saved step. A refused run changes
    nothing in out_dir."""
    ckpt = load_resume_checkpoint(cfg)
    return None if ckpt is None else check_resume(ckpt, cfg, mcfg, meta)


def written_by(ckpt):
    """The script whose run wrote a checkpoint, as its content records it: "distillation/distill.py" (it holds distill_config,
    and the teacher that a resumed round needs), "train.py" (a model and train_config without it), else None."""
    if not isinstance(ckpt, dict):
        return None
    if "distill_config" in ckpt:
        return "distillation/distill.py"
    return "train.py" if "model" in ckpt and "train_config" in ckpt else None


def refuse_other_script(ckpt, out_dir, script):
    """--resume continues a folder only with the script that wrote it (train.py would drop a distillation's teacher
    and settings; distillation/distill.py would train a base model with DCD): else one line naming the command that does."""
    writer = written_by(ckpt)
    if writer is None or writer == script:
        return
    path = os.path.join(out_dir, "ckpt.pt")
    also = (f", or distil it into a new folder: python distillation/distill.py --init {path} --out_dir NEW"
            if writer == "train.py" else "")
    raise ConfigError(f"cannot resume from {path} with {script}: it was written by {writer}; continue it with "
                      f"python {writer} --out_dir {out_dir} --resume 1{also}")


def check_resume(ckpt, cfg, mcfg, meta=None):
    """A train.py checkpoint may be resumed by this run: it has RESUME_KEYS, the same model, objective, batch,
    tokenizer (by content) and data (meta: this run's prepared data), and a step within --max_iters."""
    path = os.path.join(cfg.out_dir, "ckpt.pt")
    refuse_other_script(ckpt, cfg.out_dir, "train.py")
    missing = [k for k in RESUME_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ConfigError(f"cannot resume from {path}: not a train.py checkpoint (missing {', '.join(missing)})")
    unknown = sorted(set(ckpt["model_config"]) - set(asdict(mcfg)))
    if unknown:
        raise ConfigError(f"cannot resume from {path}: its model_config has keys this model.py does not know: "
                          f"{', '.join(unknown)}")
    try:
        saved = asdict(ModelConfig(**ckpt["model_config"]))   # fields added since it was saved take their defaults
    except (TypeError, ValueError) as e:
        raise ConfigError(f"cannot resume from {path}: its model_config is invalid ({e})") from None
    if saved != asdict(mcfg):
        diff = {k: (saved.get(k), v) for k, v in asdict(mcfg).items() if saved.get(k) != v}
        raise ConfigError(f"cannot resume from {path}: model differs (saved, now) {diff}")
    old_meta = ckpt.get("meta") or {}
    by_content = meta is not None and old_meta.get("tokenizer_sha256") and meta.get("tokenizer_sha256")
    for k in ("loss", "batch_size") + (() if by_content else ("tokenizer",)):
        if ckpt["train_config"].get(k) != getattr(cfg, k):
            raise ConfigError(f"cannot resume from {path}: --{k} was {ckpt['train_config'].get(k)!r}, now "
                              f"{getattr(cfg, k)!r}")
    if by_content and old_meta["tokenizer_sha256"] != meta["tokenizer_sha256"]:
        raise ConfigError(f"cannot resume from {path}: the tokenizer's content differs from the checkpoint's (sha256 "
                          f"{old_meta['tokenizer_sha256'][:12]}..., now {meta['tokenizer_sha256'][:12]}...)")
    if meta is not None and old_meta.get("data_key") and old_meta["data_key"] != meta.get("data_key"):
        diff = [k for k, v in old_meta["data_key"].items() if (meta.get("data_key") or {}).get(k) != v]
        raise ConfigError(f"cannot resume from {path}: the training data differ from the checkpoint's "
                          f"({', '.join(diff)} changed); restore them or start a new run in another --out_dir")
    if cfg.max_iters < ckpt["step"]:
        raise ConfigError(f"--max_iters {cfg.max_iters} is below the checkpoint's step {ckpt['step']}; nothing to "
                          f"resume (raise --max_iters)")
    return ckpt


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
    swapped = False
    try:
        with deferred_signals():
            swap()
            swapped = True
        yield run.raw_model
    finally:
        if swapped:
            with deferred_signals():
                swap()


# -----------------------------------------------------------------------------------------------
# a trained model and its tokenizer, for sampling and evaluation

def load_checkpoint(path, device="cpu", use_ema=True):
    """Checkpoint written by train.py -> (model in eval mode, checkpoint dict). Uses the EMA weights when
    use_ema and the checkpoint has them. Read with weights_only=True: a checkpoint holds tensors, dicts, lists
    and numbers only (RNG states are tensors), so loading one runs no code."""
    if not os.path.isfile(path):
        raise FileNotFoundError(not_a_file(path, f"checkpoint not found: {path}", "the checkpoint"))
    try:
        ckpt = read_checkpoint(path, device)
    except ValueError as e:
        raise ValueError(f"could not read checkpoint {path}: {e}; use another copy of it") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise ValueError(f"{path} is not an sddlm checkpoint (needs the keys 'model' and 'model_config')")
    check_checkpoint_fields(ckpt, path)          # the model_config too, as its flags would be
    mcfg, state = checked_weights(ckpt, path, use_ema)
    check_model_memory(mcfg, device, lambda field: f"{path}: model_config.{field}")
    model = build_model(mcfg)
    for name in ("model", "ema"):        # both sets, the one not used too: a damaged file is refused whole
        if ckpt.get(name) is not None:
            check_state_fits(model.state_dict(), weight_set(ckpt, name), path, name)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{path}: weights do not fit its model_config ({first_line(e)})") from None
    return model.to(device).eval(), ckpt


def weight_set(ckpt, name):
    """The checkpoint's weight set `name` ("model", "ema", "teacher"), a torch.compile'd model's "_orig_mod." prefix
    dropped."""
    return {k.removeprefix("_orig_mod."): v for k, v in ckpt[name].items()}


def checked_weights(ckpt, path, use_ema=True, error=ConfigError):
    """A checkpoint's weights to load (its EMA's when use_ema and it has them, else the model's; a torch.compile'd
    model's "_orig_mod." prefix dropped), checked before a model is built: floating-point and finite, and as many
    blocks and as wide an embedding as its model_config says -> (ModelConfig, state dict)."""
    ema = use_ema and ckpt.get("ema") is not None
    state = weight_set(ckpt, "ema" if ema else "model")
    check_weights(state, path, "ema" if ema else "model", error)
    if ckpt.get("ema") is not None:      # the set not used is checked too: a damaged file is refused whole
        other = weight_set(ckpt, "model" if ema else "ema")
        check_weights(other, path, "model" if ema else "ema", error)
    mcfg = ModelConfig(**ckpt["model_config"])          # valid: check_checkpoint_fields built it once
    check_config_matches(mcfg, state, path, "model_config.")
    return mcfg, state


def load_model(path, device, use_ema=True):
    """load_checkpoint (or, for "duo:PATH_OR_HUB_NAME", plumbing.duo.load_duo_checkpoint: one of Duo's released
    checkpoints; a folder: plumbing.folder.load_folder, a model folder) with its errors as UsageError (one line)
    -> (model in eval mode, checkpoint)."""
    from plumbing.duo import load_duo_checkpoint
    from plumbing.folder import load_folder
    try:
        if path.startswith("duo:"):
            return load_duo_checkpoint(path[len("duo:"):], device=device, use_ema=use_ema)
        if os.path.isdir(path):                    # a model folder (hub/pretrained.py): safetensors + config.json
            return load_folder(path, device=device, use_ema=use_ema)
        return load_checkpoint(path, device=device, use_ema=use_ema)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    except TypeError as e:    # a model_config with keys this ModelConfig does not know
        raise UsageError(f"{path}: its model_config does not fit this version of model.py ({e})") from None


def load_tokenizer(ckpt, path=None):
    """The checkpoint's tokenizer (data.get_tokenizer(meta["tokenizer"])), or None with the reason. One that loads
    but is not the tokenizer the checkpoint was trained with (check_tokenizer_identity) -> UsageError naming the
    file; path: the checkpoint's, for that message."""
    spec = (ckpt.get("meta") or {}).get("tokenizer")
    if spec is None:
        return None, "the checkpoint has no meta['tokenizer']"
    try:
        tok = get_tokenizer(spec)
    except Exception as e:  # a missing tokenizer file, package or network; reported, never hidden
        return None, f"tokenizer {spec!r} unavailable ({type(e).__name__}: {first_line(e)})"
    check_tokenizer_identity(tok, ckpt, path or "the checkpoint")
    return tok, None
