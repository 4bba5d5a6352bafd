"""A trained model's checkpoint read as the method needs it: for a resume, checked against the run; for sampling and
evaluation, a model with its tokenizer (from a ckpt.pt, a model folder or Duo's release). The run's state itself
(saved atomically, restored bit for bit) is plumbing/checkpoint.py's."""
import os
from dataclasses import asdict

from data import DataError, check_tokenizer, full_data_key, get_tokenizer, not_a_file
from model import ModelConfig
from plumbing.checkpoint import RESUME_KEYS, load_resume_checkpoint, read_checkpoint, refuse_other_script, weight_set
from plumbing.cli import ConfigError, UsageError, first_line
from plumbing.integrity import check_config_matches, check_tokenizer_identity, check_weights
from trained.duo import load_duo_checkpoint
from trained.fields import built_model, check_checkpoint_fields
from trained.folder import check_target, load_folder


def check_data_tokenizer(data_dir, meta, ckpt=None, path=None, need_tokenizer=True, fix=None):
    """Every reader of a prepared folder, before it trusts its ids: its meta.json agrees with the tokenizer it names
    (an edited vocab_size is caught here), and, given the checkpoint (path: its name) the data is read for, that
    tokenizer is the checkpoint's by content (a tokenizer of the same size with other pieces gives ids of other
    text; fix: what its message tells the user to do). need_tokenizer=False: a tokenizer that cannot be loaded here
    (a package or the network missing) skips the first check, and the recorded hashes decide. -> the tokenizer
    (None when skipped)."""
    record = (ckpt or {}).get("meta") or {}
    ours, theirs = meta.get("tokenizer_sha256"), record.get("tokenizer_sha256")
    fix = fix or (f"give the --data_dir {path} was trained on (its config.json names it), or prepare one with its "
                  f"tokenizer")
    if ours and theirs and ours != theirs:
        raise UsageError(f"{data_dir} was prepared with another tokenizer ({meta.get('tokenizer')}, sha256 "
                         f"{ours[:12]}...) than {path} was trained with ({record.get('tokenizer')}, sha256 "
                         f"{theirs[:12]}...); {fix}")
    try:
        tok = get_tokenizer(meta["tokenizer"])
    except DataError:
        if need_tokenizer:
            raise
        return None
    own = dict(vocab_size=tok.vocab_size, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)
    diff = [f"{k} {meta.get(k)!r}, its tokenizer's {v!r}" for k, v in own.items() if meta.get(k) != v]
    if not diff:
        try:
            check_tokenizer(meta, tok)         # the probe text's ids and the content hash
        except DataError:
            diff = ["the tokenizer's ids or content"]
    if diff:
        raise DataError(f"{os.path.join(data_dir, 'meta.json')} does not describe its tokenizer {meta['tokenizer']} "
                        f"({'; '.join(diff)}: edited?); delete {data_dir} to prepare it again")
    if ckpt is not None:
        check_tokenizer_identity(tok, ckpt, path, fix=f"{data_dir} was prepared with it; {fix}")
    return tok


def check_resume_data(cfg, key):
    """Before any data preparation: a resume asks for the data its checkpoint was trained on (key: prepare.data_key
    of this run's flags, against the checkpoint's meta['data_key']), so a changed --block_size, --tokenizer,
    --dataset or --wrap fails now, not after preparing a whole new dataset. Reads the checkpoint memory-mapped (no
    weights are read); one that cannot be read this way is left to the full check after preparation."""
    path = os.path.join(cfg.out_dir, "ckpt.pt")
    if not cfg.resume or not os.path.isfile(path):
        return
    try:
        old = full_data_key(read_checkpoint(path, mmap=True)["meta"]["data_key"])
    except Exception:         # not a zip (torch.save's format), or no data_key
        return
    flags = {"block_size": "--block_size", "wrap": "--wrap", "corpus": "--dataset", "tokenizer": "--tokenizer"}
    changed = [k for k, v in full_data_key(key).items() if old.get(k) != v]
    detail = [f"{flags[k]} {getattr(cfg, flags[k][2:])!r} is another by content" if k in ("corpus", "tokenizer") else
              f"{flags.get(k, k)} was {old.get(k)!r}, now {key.get(k, 'text')!r}" for k in changed]
    if changed:
        raise ConfigError(f"cannot resume from {path}: the training data differ from the checkpoint's "
                          f"({', '.join(changed)} changed): {'; '.join(detail)}; resume with the flags it was trained "
                          f"with (its config.json) or start a new run in another --out_dir")


def read_resume(cfg, script):
    """out_dir's checkpoint for `script` (train.py, distillation/distill.py) to resume, or None for a fresh run, with
    the checks that need the model. out_dir/model, which the run's end exports, must hold a model folder of ours or
    nothing: a user's folder there is refused now, not after the training."""
    if cfg.resume:
        check_target(os.path.join(cfg.out_dir, "model"), f"--out_dir {cfg.out_dir}: its model folder",
                     "move them elsewhere, then resume")
    ckpt = load_resume_checkpoint(cfg, check_checkpoint_fields)
    if ckpt is not None:
        refuse_other_script(ckpt, cfg.out_dir, script)
        if cfg.max_iters < ckpt.get("step", 0):
            raise ConfigError(f"--max_iters {cfg.max_iters} is below the checkpoint's step {ckpt['step']}; nothing "
                              f"to resume (raise --max_iters)")
    return ckpt


def open_out_dir(cfg, mcfg, meta):
    """train.py's checkpoint to resume (read_resume), checked against the run's model, objective, batch, tokenizer (by
    content) and data (meta: this run's prepared data). A refused run changes nothing in out_dir. A resumed run
    whose curriculum came from its share (--curriculum_share) keeps the steps its checkpoint recorded: it continues
    as it started, whatever --max_iters is now."""
    ckpt = read_resume(cfg, "train.py")
    if ckpt is None:
        return None
    path = os.path.join(cfg.out_dir, "ckpt.pt")
    missing = [k for k in RESUME_KEYS if k not in ckpt]
    if missing:
        raise ConfigError(f"cannot resume from {path}: not a train.py checkpoint (missing {', '.join(missing)})")
    saved = asdict(ModelConfig(**ckpt["model_config"]))   # valid (read_resume); fields added since take defaults
    if saved != asdict(mcfg):
        diff = {k: (saved.get(k), v) for k, v in asdict(mcfg).items() if saved.get(k) != v}
        raise ConfigError(f"cannot resume from {path}: model differs (saved, now) {diff}")
    old_meta = ckpt.get("meta") or {}
    by_content = old_meta.get("tokenizer_sha256") and meta.get("tokenizer_sha256")
    for k in ("loss", "batch_size") + (() if by_content else ("tokenizer",)):
        if ckpt["train_config"].get(k) != getattr(cfg, k):
            raise ConfigError(f"cannot resume from {path}: --{k} was {ckpt['train_config'].get(k)!r}, now "
                              f"{getattr(cfg, k)!r}")
    if by_content and old_meta["tokenizer_sha256"] != meta["tokenizer_sha256"]:
        raise ConfigError(f"cannot resume from {path}: the tokenizer's content differs from the checkpoint's (sha256 "
                          f"{old_meta['tokenizer_sha256'][:12]}..., now {meta['tokenizer_sha256'][:12]}...)")
    if old_meta.get("data_key") and old_meta["data_key"] != meta.get("data_key"):
        diff = [k for k, v in old_meta["data_key"].items() if (meta.get("data_key") or {}).get(k) != v]
        raise ConfigError(f"cannot resume from {path}: the training data differ from the checkpoint's "
                          f"({', '.join(diff)} changed); restore them or start a new run in another --out_dir")
    if cfg.curriculum_share:
        cfg.curriculum_iters = ckpt["train_config"].get("curriculum_iters", cfg.curriculum_iters)
    return ckpt


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
    # both weight sets, the one not used too: a damaged file is refused whole
    sets = {name: weight_set(ckpt, name) for name in ("model", "ema") if ckpt.get(name) is not None}
    for name, state in sets.items():          # floating-point and finite
        check_weights(state, path, name, ConfigError)
    use = "ema" if use_ema and "ema" in sets else "model"
    mcfg = ModelConfig(**ckpt["model_config"])          # valid: check_checkpoint_fields built it once
    check_config_matches(mcfg, sets[use], path, "model_config.")     # as many blocks, as wide an embedding
    return built_model(mcfg, device, f"{path}: model_config.", path, sets, use), ckpt


def load_model(path, device, use_ema=True):
    """load_checkpoint (or, for "duo:PATH_OR_HUB_NAME", trained.duo.load_duo_checkpoint: one of Duo's released
    checkpoints; a folder: trained.folder.load_folder, a model folder) with its errors as UsageError (one line)
    -> (model in eval mode, checkpoint)."""
    try:
        if path.startswith("duo:"):
            return load_duo_checkpoint(path[len("duo:"):], device=device, use_ema=use_ema)
        if os.path.isdir(path):                    # a model folder (hub/pretrained.py): safetensors + config.json
            return load_folder(path, device=device, use_ema=use_ema)
        return load_checkpoint(path, device=device, use_ema=use_ema)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None


def load_tokenizer(ckpt, path=None):
    """The checkpoint's tokenizer (from the SentencePiece model's bytes the checkpoint carries where it has them), or
    None with the reason. One that loads but is not the one the checkpoint was trained with -> UsageError naming
    path."""
    spec = (ckpt.get("meta") or {}).get("tokenizer")
    if spec is None:
        return None, "the checkpoint has no meta['tokenizer']"
    try:
        tok = get_tokenizer(spec, proto=ckpt.get("tokenizer_model"))
    except Exception as e:  # a missing tokenizer file, package or network; reported, never hidden
        return None, f"tokenizer {spec!r} unavailable ({type(e).__name__}: {first_line(e)})"
    check_tokenizer_identity(tok, ckpt, path or "the checkpoint")
    return tok, None
