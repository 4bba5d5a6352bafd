"""Reading a model folder (model.safetensors + config.json + the tokenizer's file + the README.md model card, as
trained/export.py writes one) as a checkpoint: every script's --ckpt takes a folder through
trained.checkpoint.load_model. Which files of a folder are ours, so that writing one replaces only those."""
import dataclasses
import json
import os
import sys

import diffusion
from data import not_a_file
from diffusion import FINAL_STEPS
from model import ModelConfig
from plumbing.cli import UsageError
from plumbing.files import CARD_MARK, check_writable, kind_of
from plumbing.integrity import check_config_matches, check_weights, sha256_file
from trained.fields import built_model, check_train_config_values, check_values, checked_model_config, int_from

FORMAT = "sddlm-model-2"          # config.json flat, as the hub's: "model_type": "sddlm" and the model's fields on top
FORMATS = ("sddlm-model-1", FORMAT)   # -1: the model's fields nested under "model_config" (still read)
MODEL_TYPE = "sddlm"
WEIGHTS, CONFIG, TOKENIZER, CARD = "model.safetensors", "config.json", "tokenizer.model", "README.md"


def is_model_folder(path):
    """True for a folder holding a config.json of one of our formats (not, e.g., a Duo or transformers folder)."""
    try:
        return bool(read_config(str(path)))
    except (OSError, ValueError):
        return False


def is_our_card(path):
    """True for a README.md that an export wrote (it holds CARD_MARK), False for anyone else's."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return CARD_MARK in f.read(1 << 16)
    except OSError:
        return False


def our_files(folder):
    """The files of a model folder that the project wrote and may replace: weights, config, tokenizer, and the
    README.md only when it is our model card. Everything else in the folder is the user's."""
    ours = [WEIGHTS, CONFIG, TOKENIZER] + ([CARD] if is_our_card(os.path.join(folder, CARD)) else [])
    return [name for name in ours if os.path.lexists(os.path.join(folder, name))]


def check_target(folder, flag="the output folder", fix="choose another"):
    """A model folder may be written into a new or empty folder, or over a model folder of ours (replacing only
    our_files); a folder holding anything else is the user's: one line (UsageError, ending in `fix`) before any
    work."""
    check_writable(folder, flag, folder=True)      # a folder (not a file, pipe or device, nor under one); writable
    if not os.path.isdir(folder):
        return
    if is_model_folder(folder):
        odd = [(name, kind_of(os.path.join(folder, name))) for name in our_files(folder)]
        odd = [(name, kind) for name, kind in odd if kind != "file"]
        if odd:          # os.replace would drop a link (or a device node) the user put there
            raise UsageError(f"{flag} {folder}: its {odd[0][0]} is a {odd[0][1]}, not a file sddlm wrote, so it is "
                             f"not replaced: {fix}")
        return
    entries = sorted(os.listdir(folder))
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise UsageError(f"{flag} {folder} already holds files that are not an sddlm model folder ({shown}); a model "
                         f"folder is written only into a new or empty folder or over an earlier one: {fix}")


# -----------------------------------------------------------------------------------------------
# reading

FOLDER_FIX = "export the folder again (python hub/pretrained.py --ckpt CKPT --out FOLDER)"


def read_config(folder):
    """A model folder's config.json -> its dict; one that is missing, not JSON or of another format -> ValueError
    saying which (a broken config.json is not "no config.json")."""
    path = os.path.join(folder, CONFIG)
    inside = [f for f in ("model", "ckpt.pt") if os.path.exists(os.path.join(folder, f))]
    hint = f"; give {' or '.join(os.path.join(folder, f) for f in inside)}" if inside else ""   # a run's folder
    if not os.path.isfile(path):          # (a pipe or a device there is named as one: data.not_a_file)
        raise ValueError(not_a_file(path, f"{folder} is a folder but not a model folder (no {CONFIG}){hint}"))
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); it was damaged or edited: {FOLDER_FIX}") from None
    if not isinstance(config, dict) or config.get("format") not in FORMATS:
        shown = config.get("format") if isinstance(config, dict) else type(config).__name__
        if str(shown).startswith("sddlm-model-"):        # ours, of a format this version does not know: a later one
            raise ValueError(f"{folder} is a model folder of format {shown!r}, newer than this version of sddlm reads "
                             f"({' or '.join(FORMATS)}): upgrade sddlm (git pull) to load it")
        raise ValueError(f"{folder} is a folder but not a model folder (its {CONFIG} is of format {shown!r}, not "
                         f"{' or '.join(FORMATS)}){hint}")
    return config


def check_config(config, path):
    """A model folder's config.json, field by field as its flags and a checkpoint's fields are checked (the
    objective, noise schedule, final step, weights, step, the tokenizer record, the training config, the model's
    fields) -> the ModelConfig; else ConfigError naming the file and the field."""
    hex64 = lambda v: isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    top = {"model_type": (lambda v: v == MODEL_TYPE, repr(MODEL_TYPE)),
           "objective": (lambda v: v in diffusion.OBJECTIVES, f"one of {', '.join(diffusion.OBJECTIVES)}"),
           "noise_schedule": (lambda v: v in diffusion.SCHEDULES, f"one of {', '.join(diffusion.SCHEDULES)}"),
           "final_step": (lambda v: v in FINAL_STEPS, f"one of {', '.join(FINAL_STEPS)}"),
           "weights": (lambda v: v in ("ema", "raw"), "ema or raw"),
           "step": int_from(0),
           "weights_sha256": (hex64, "a sha256 (64 hex digits)"),
           "tokenizer": (lambda v: isinstance(v, dict), "an object (spec, sha256, file, vocab_size, ids)"),
           "train_config": (lambda v: isinstance(v, dict), "an object"),
           "distilled_from": (lambda v: isinstance(v, (dict, str)), "an object or a path"),
           "validation": (lambda v: isinstance(v, dict) and all(number(v.get(k)) for k in ("step", "nelbo", "ppl")),
                          "an object with the numbers step, nelbo, ppl")}
    tokenizer = {"spec": (lambda v: isinstance(v, str), "a string"),
                 "sha256": (hex64, "a sha256 (64 hex digits)"),
                 "file": (lambda v: isinstance(v, str) and v and os.path.basename(v) == v and v not in (".", ".."),
                          "a file name inside the folder"),
                 "vocab_size": int_from(1), "bos_id": int_from(0), "eos_id": int_from(0), "pad_id": int_from(0)}
    check_values(config, top, path, "", fix=FOLDER_FIX)                # every field optional: None passes
    check_values(config.get("tokenizer") or {}, tokenizer, path, "tokenizer.", fix=FOLDER_FIX)
    check_train_config_values(config.get("train_config") or {}, path, "train_config.", fix=FOLDER_FIX)
    if isinstance(config.get("model_config"), dict):      # format -1: nested
        return checked_model_config(config["model_config"], path, "model_config.", fix=FOLDER_FIX)
    flat = {f.name: config[f.name] for f in dataclasses.fields(ModelConfig) if f.name in config}   # format -2
    return checked_model_config(flat, path, "", fix=FOLDER_FIX)


def load_folder(folder, device="cpu", use_ema=True):
    """A model folder -> (model in eval mode, a checkpoint dict as trained.checkpoint.load_checkpoint returns), so
    every script treats a folder as a checkpoint. Everything is checked before the model is built; a broken folder
    -> ValueError (one line)."""
    from safetensors.torch import load_file
    config = read_config(folder)
    config_path = os.path.join(folder, CONFIG)
    mcfg = check_config(config, config_path)
    if not use_ema and config.get("weights") == "ema":
        raise ValueError(f"{folder} holds EMA weights only; for the live ones export them: python hub/pretrained.py "
                         f"--ckpt CKPT --out FOLDER --weights raw")
    path = os.path.join(folder, WEIGHTS)
    if not os.path.isfile(path):
        raise ValueError(not_a_file(path, f"{folder}: {WEIGHTS} is missing"))
    tok = dict(config.get("tokenizer") or {})
    if tok.get("file"):
        file = os.path.join(folder, tok["file"])
        if not os.path.isfile(file):
            raise ValueError(not_a_file(file, f"{folder}: its tokenizer file {tok['file']} is missing"))
        if tok.get("sha256") and sha256_file(file) != tok["sha256"]:
            raise ValueError(f"{file} is not the tokenizer recorded in {CONFIG} (sha256 mismatch)")
        tok["spec"] = "sp:" + os.path.abspath(file)
    if config.get("weights_sha256"):
        if sha256_file(path) != config["weights_sha256"]:
            raise ValueError(f"{path} is not the file its {CONFIG} records (sha256 mismatch: damaged or replaced "
                             f"after the export); {FOLDER_FIX}")
    else:
        print(f"note: {config_path} records no sha256 of {WEIGHTS} (exported by an earlier version), so its bytes "
              f"are not checked; {FOLDER_FIX} to record one", file=sys.stderr)
    try:
        weights = load_file(path)
    except Exception as e:     # a truncated file (SafetensorError)
        raise ValueError(f"{path}: weights do not load ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    check_weights(weights, path, "weights", fix=FOLDER_FIX)
    check_config_matches(mcfg, weights, config_path, "", weights=f"the weights ({WEIGHTS})", fix=FOLDER_FIX)
    model = built_model(mcfg, device, f"{config_path}: ", path, {"": weights}, "", FOLDER_FIX)
    state = model.state_dict()
    ckpt = {"model_config": dataclasses.asdict(mcfg),
            "train_config": {**(config.get("train_config") or {}), "loss": config.get("objective"),
                             "noise_schedule": config.get("noise_schedule")},
            "meta": {"tokenizer": tok.get("spec"), "tokenizer_sha256": tok.get("sha256"),
                     **{k: tok.get(k) for k in ("vocab_size", "bos_id", "eos_id", "pad_id")}},
            "step": config.get("step"), "model": state, "ema": state if config.get("weights") == "ema" else None,
            "final_step": config.get("final_step"), "source": folder, "format": config.get("format"),
            **{k: config[k] for k in ("validation", "distilled_from", "finetuned_from") if config.get(k)}}
    return model, ckpt
