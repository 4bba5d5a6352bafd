"""Reading a model folder (model.safetensors + config.json + the tokenizer's file, as hub/pretrained.py writes one) as
a checkpoint: every script's --ckpt takes a folder through plumbing.checkpoint.load_model."""
import hashlib
import json
import os

FORMAT = "sddlm-model-1"
WEIGHTS, CONFIG, TOKENIZER = "model.safetensors", "config.json", "tokenizer.model"


def is_model_folder(path):
    """True for a folder holding a config.json of this format (not, e.g., a Duo or transformers folder)."""
    config = os.path.join(str(path), CONFIG)
    if not os.path.isfile(config):
        return False
    try:
        with open(config) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -----------------------------------------------------------------------------------------------
# writing

def load_folder(folder, device="cpu", use_ema=True):
    """A model folder -> (model in eval mode, a checkpoint-like dict: model_config, train_config (objective and
    noise schedule), meta (the tokenizer, as the folder's own file), step, ema) as model.load_checkpoint returns,
    so every script treats a folder as a checkpoint. Raises ValueError (one line) for a broken folder."""
    from safetensors.torch import load_file
    from model import build_model
    if not is_model_folder(folder):
        inside = [f for f in ("model", "ckpt.pt") if os.path.exists(os.path.join(folder, f))]
        raise ValueError(f"{folder} is a folder but not a model folder (no {CONFIG} of format {FORMAT})"
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
    model = build_model(config["model_config"])
    try:
        model.load_state_dict(load_file(path))
    except Exception as e:     # a truncated file (SafetensorError) or weights of another shape (RuntimeError)
        raise ValueError(f"{path}: weights do not load ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    state = model.state_dict()
    ckpt = {"model_config": config["model_config"],
            "train_config": {**(config.get("train_config") or {}), "loss": config.get("objective"),
                             "noise_schedule": config.get("noise_schedule")},
            "meta": {"tokenizer": tok.get("spec"), "tokenizer_sha256": tok.get("sha256"),
                     **{k: tok.get(k) for k in ("vocab_size", "bos_id", "eos_id", "pad_id")}},
            "step": config.get("step"), "model": state, "ema": state if config.get("weights") == "ema" else None,
            "final_step": config.get("final_step"), "source": folder, "format": FORMAT}
    if config.get("distilled_from"):
        ckpt["distilled_from"] = config["distilled_from"]
    return model.to(device).eval(), ckpt
