"""Reading a model folder (model.safetensors + config.json + the tokenizer's file + the README.md model card, as
hub/pretrained.py writes one) as a checkpoint: every script's --ckpt takes a folder through
plumbing.checkpoint.load_model. Which files of a folder are ours, so that writing one replaces only those."""
import hashlib
import json
import os

FORMAT = "sddlm-model-2"          # config.json flat, as the hub's: "model_type": "sddlm" and the model's fields on top
FORMATS = ("sddlm-model-1", FORMAT)   # -1: the model's fields nested under "model_config" (still read)
MODEL_TYPE = "sddlm"
WEIGHTS, CONFIG, TOKENIZER, CARD = "model.safetensors", "config.json", "tokenizer.model", "README.md"
# the model card's second part starts with this line: a README.md without it is the user's and is never replaced
CARD_MARK = ("<!-- sddlm model card, written by hub/pretrained.py and replaced by the next export into this folder; "
             "delete this line to keep the file as your own -->")


def is_model_folder(path):
    """True for a folder holding a config.json of one of our formats (not, e.g., a Duo or transformers folder)."""
    config = os.path.join(str(path), CONFIG)
    if not os.path.isfile(config):
        return False
    try:
        with open(config) as f:
            return json.load(f).get("format") in FORMATS
    except (OSError, ValueError, AttributeError):
        return False


def is_our_card(path):
    """True for a README.md that hub/pretrained.py wrote (it holds CARD_MARK), False for anyone else's."""
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
    from plumbing.cli import UsageError
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise UsageError(f"{flag} {folder} is a file, not a folder")
    if not os.path.isdir(folder) or is_model_folder(folder):
        return
    entries = sorted(os.listdir(folder))
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise UsageError(f"{flag} {folder} already holds files that are not an sddlm model folder ({shown}); a model "
                         f"folder is written only into a new or empty folder or over an earlier one: {fix}")


def model_config_of(config):
    """config.json's model fields: flat (format -2, the hub's way) or nested under "model_config" (format -1)."""
    from dataclasses import fields
    from model import ModelConfig
    if isinstance(config.get("model_config"), dict):
        return config["model_config"]
    return {f.name: config[f.name] for f in fields(ModelConfig) if f.name in config}


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -----------------------------------------------------------------------------------------------
# reading

def load_folder(folder, device="cpu", use_ema=True):
    """A model folder -> (model in eval mode, a checkpoint-like dict: model_config, train_config (objective and
    noise schedule), meta (the tokenizer, as the folder's own file), step, ema) as model.load_checkpoint returns,
    so every script treats a folder as a checkpoint. Raises ValueError (one line) for a broken folder."""
    from safetensors.torch import load_file
    from model import build_model
    if not is_model_folder(folder):
        inside = [f for f in ("model", "ckpt.pt") if os.path.exists(os.path.join(folder, f))]
        raise ValueError(f"{folder} is a folder but not a model folder (no {CONFIG} of format {' or '.join(FORMATS)})"
                         + (f"; give {' or '.join(os.path.join(folder, f) for f in inside)}" if inside else ""))
    with open(os.path.join(folder, CONFIG)) as f:
        config = json.load(f)
    if not use_ema and config.get("weights") == "ema":
        raise ValueError(f"{folder} holds EMA weights only; for the live ones export them: python hub/pretrained.py "
                         f"--ckpt CKPT --out FOLDER --weights raw")
    path = os.path.join(folder, WEIGHTS)
    if not os.path.isfile(path):
        raise ValueError(f"{folder}: {WEIGHTS} is missing")
    tok = dict(config.get("tokenizer") or {})
    if tok.get("file"):
        file = os.path.join(folder, tok["file"])
        if not os.path.isfile(file):
            raise ValueError(f"{folder}: its tokenizer file {tok['file']} is missing")
        if tok.get("sha256") and _sha256(file) != tok["sha256"]:
            raise ValueError(f"{file} is not the tokenizer recorded in {CONFIG} (sha256 mismatch)")
        tok["spec"] = "sp:" + os.path.abspath(file)
    model_config = model_config_of(config)
    try:
        model = build_model(model_config)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{os.path.join(folder, CONFIG)}: not a model configuration ({e})") from None
    try:
        model.load_state_dict(load_file(path))
    except Exception as e:     # a truncated file (SafetensorError) or weights of another shape (RuntimeError)
        raise ValueError(f"{path}: weights do not load ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    state = model.state_dict()
    ckpt = {"model_config": model_config,
            "train_config": {**(config.get("train_config") or {}), "loss": config.get("objective"),
                             "noise_schedule": config.get("noise_schedule")},
            "meta": {"tokenizer": tok.get("spec"), "tokenizer_sha256": tok.get("sha256"),
                     **{k: tok.get(k) for k in ("vocab_size", "bos_id", "eos_id", "pad_id")}},
            "step": config.get("step"), "model": state, "ema": state if config.get("weights") == "ema" else None,
            "final_step": config.get("final_step"), "source": folder, "format": config.get("format")}
    if isinstance(config.get("validation"), dict):
        ckpt["validation"] = config["validation"]
    if config.get("distilled_from"):
        ckpt["distilled_from"] = config["distilled_from"]
    if config.get("finetuned_from"):
        ckpt["finetuned_from"] = config["finetuned_from"]
    return model.to(device).eval(), ckpt
