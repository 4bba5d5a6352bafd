"""Writing a model folder (model.safetensors + config.json + the tokenizer's file + the README.md model card), the
other side of trained/folder.py, which reads one: hub/pretrained.py's export, and the model folder at the end of a
train.py or distillation/distill.py run (plumbing.run.RunPlumbing)."""
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from diffusion import default_final_step
from trained.checkpoint import load_model
from plumbing.cli import UsageError
from plumbing.files import CARD_MARK, remove_stale_temps, temp_name
from trained.folder import (CARD, CONFIG, FORMAT, MODEL_TYPE, TOKENIZER, WEIGHTS, check_target, is_our_card,
                             our_files)
from plumbing.integrity import sha256_file
from plumbing.signals import deferred_signals


def folder_config(ckpt, weights, validation=None):
    """A checkpoint dict (train.py, distillation/distill.py, or load_duo_checkpoint's) -> config.json's content, flat
    as the hub's (model_type, then the model's fields), without the tokenizer file's new place (save_folder sets
    it). validation: what the run measured (measured_validation), else the checkpoint's own."""
    train_config = dict(ckpt.get("train_config") or {})
    meta = ckpt.get("meta") or {}
    validation = validation or ckpt.get("validation")
    return {
        "model_type": MODEL_TYPE,
        "format": FORMAT,
        **ckpt["model_config"],
        "objective": train_config.get("loss"),
        "noise_schedule": train_config.get("noise_schedule") or "loglinear",
        "final_step": "none" if ckpt["model_config"].get("causal") else default_final_step(ckpt),
        "weights": weights,
        "step": ckpt.get("step"),
        **({"validation": validation} if validation else {}),
        "tokenizer": {"spec": meta.get("tokenizer"), "sha256": meta.get("tokenizer_sha256"),
                      **{k: meta.get(k) for k in ("vocab_size", "bos_id", "eos_id", "pad_id")}},
        "train_config": train_config,
        **{k: ckpt[k] for k in ("distilled_from", "finetuned_from", "source") if ckpt.get(k)},
    }


def measured_validation(ckpt_path, step):
    """The validation NELBO the run measured at the checkpoint's step (else its last one before it), read from the
    log.jsonl beside the checkpoint file -> {"step", "nelbo", "ppl"} and, where the log has them, the Monte-Carlo
    standard errors "nelbo_se", "ppl_se" and the 95% interval "ppl_lo", "ppl_hi" (validation.validation_record), or None
    (no log, no evaluation). Lines that are not whole records are skipped."""
    log = os.path.join(os.path.dirname(os.path.abspath(str(ckpt_path))), "log.jsonl")
    if not os.path.isfile(str(ckpt_path)) or not os.path.isfile(log) or not isinstance(step, int):
        return None
    found = None
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    with open(log, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if (isinstance(r, dict) and isinstance(r.get("step"), int) and r["step"] <= step
                    and all(number(r.get(k)) for k in ("val_nelbo", "val_ppl"))):
                found = {"step": r["step"], "nelbo": r["val_nelbo"], "ppl": r["val_ppl"],
                         **{k: r[f"val_{k}"] for k in ("nelbo_se", "ppl_se", "ppl_lo", "ppl_hi")
                            if number(r.get(f"val_{k}"))}}
    return found


def validation_line(val, causal, weights):
    """The card's validation cell: the NELBO (exact NLL for an AR model) and its PPL that the run measured, each
    with its Monte-Carlo standard error and the PPL's 95% interval where the log recorded them."""
    bound = "exact NLL" if causal else "NELBO, an upper bound on the NLL"
    where = f"at step {val['step']} ({weights} weights, the run's log.jsonl"
    if not all(isinstance(val.get(k), (int, float)) for k in ("nelbo_se", "ppl_se", "ppl_lo", "ppl_hi")) \
            or val["nelbo_se"] == 0:         # an older log, or the AR baseline's exact NLL (no draws)
        return f"{val['nelbo']:.4f} nats/token ({bound}), PPL {val['ppl']:.2f}, {where})"
    return (f"{val['nelbo']:.4f} ± {val['nelbo_se']:.4f} nats/token ({bound}), PPL {val['ppl']:.2f} ± "
            f"{val['ppl_se']:.2f} (95% interval {val['ppl_lo']:.2f}–{val['ppl_hi']:.2f}), {where}; ± one standard "
            f"error of its Monte-Carlo draws)")


def model_card(config, name="PATH"):
    """README.md of a model folder: the hub's metadata header (library_name, license, tags), then the objective,
    noise schedule, training steps, data, tokenizer, the validation NELBO/PPL the run measured, and how to load it."""
    train, tok = config.get("train_config") or {}, config.get("tokenizer") or {}
    objective = config.get("objective") or "unknown"
    causal = bool(config.get("causal"))
    val = config.get("validation")
    if val:
        measured = validation_line(val, causal, "EMA" if config.get("weights") == "ema" else "live")
    else:
        measured = ("not recorded for these weights (no evaluation of them in a log.jsonl beside the checkpoint): "
                    "python eval_ppl.py --ckpt FOLDER")
    data = train.get("dataset") or "not recorded"
    if train.get("block_size"):
        data += f", sequences of {train['block_size']} tokens"
    tokenizer = (f"`{tok.get('spec')}`" if tok.get("file") is None else
                 f"`{tok['file']}` (SentencePiece, in this folder)")
    rows = [("objective", f"`{objective}`" + (" (autoregressive baseline)" if causal else "")),
            ("noise schedule", "none (autoregressive)" if causal else f"`{config.get('noise_schedule')}`"),
            ("training steps", config.get("step")),
            ("data", data),
            ("tokenizer", f"{tokenizer}, vocabulary {tok.get('vocab_size')}, sha256 `{str(tok.get('sha256'))[:16]}...`"
             if tok.get("sha256") else f"{tokenizer}, vocabulary {tok.get('vocab_size')}"),
            ("model", f"{config.get('arch')}, {config.get('n_layer')} layers, width {config.get('n_embd')}, "
                      f"{config.get('n_head')} heads, context {config.get('block_size')}"),
            ("weights", "EMA" if config.get("weights") == "ema" else "live (not the EMA)"),
            ("validation", measured),
            ("sampler default", "one token per step" if causal else f"final step `{config.get('final_step')}`")]
    if config.get("distilled_from"):
        origin = config["distilled_from"]
        rows.append(("distilled from", f"`{origin.get('ckpt') if isinstance(origin, dict) else origin}`"))
    if isinstance(config.get("finetuned_from"), dict):       # train.py --init: the model this one started from
        origin = config["finetuned_from"]
        rows.append(("fine-tuned from", f"`{origin.get('source')}`: objective `{origin.get('objective')}`, step "
                                        f"{origin.get('step')}, its {origin.get('weights')} weights"))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return f"""---
library_name: sddlm
license: mit
tags:
- sddlm
- diffusion-language-model
- uniform-state-diffusion
- text-generation
- arxiv:2510.22926
---
{CARD_MARK}

# sddlm model: `{objective}`

A {'autoregressive baseline' if causal else 'uniform-state diffusion language model'} trained with sddlm, the
reference implementation of *Simple Denoising Diffusion Language Models*
([arXiv 2510.22926](https://arxiv.org/abs/2510.22926)).

| | |
|---|---|
{table}

## Load it

With the sddlm code on the Python path:

```python
from hub.pretrained import SDDLM
lm = SDDLM.from_pretrained("{name}")    # this folder, or the hub repository it was pushed to
print(lm.generate(2)[0], lm.score(["The os module provides"]))
```

or `python sample.py --ckpt {name}`. The weights are `{WEIGHTS}` (safetensors: loading runs no code); `{CONFIG}`
holds the settings above and the whole training configuration.

## Citation

```bibtex
{BIBTEX}
```
"""


BIBTEX = """@article{zhu2025simple,
  title   = {Simple Denoising Diffusion Language Models},
  author  = {Zhu, Huaisheng and Chen, Zhengyu and Zhou, Shijie and Xie, Zhihui and Yuan, Yige and Chen, Shiqi and
             Guo, Zhimeng and Xu, Siyuan and Zhang, Hangfan and Honavar, Vasant and Xiao, Teng},
  journal = {arXiv preprint arXiv:2510.22926},
  year    = {2025}
}"""


def save_folder(folder, state, config, name=None, proto=None):
    """Write a model folder: state (name -> tensor), config, the model card, and the tokenizer's file when its spec
    is a local SentencePiece model (so a folder never ships another tokenizer than the one its ids came from).
    Nothing the project did not write is touched, and the folder appears whole or not at all. name: how the card's
    loading lines name the model (default: the folder as given). proto: the SentencePiece model's bytes a checkpoint
    carries, written in place of the spec's file."""
    from safetensors.torch import save_file
    config = json.loads(json.dumps(config))          # a copy; JSON types only
    tok = config["tokenizer"]
    spec = tok.get("spec") or ""
    source = spec.removeprefix("sp:") if spec.startswith("sp:") or spec.endswith(".model") else None
    if source is not None:
        if proto is None and not os.path.isfile(source):
            raise UsageError(f"the tokenizer file {source} is missing: a model folder carries its tokenizer; "
                             f"put the file back (or re-export from a copy of it)")
        proto = Path(source).read_bytes() if proto is None else proto
        sha256 = hashlib.sha256(proto).hexdigest()
        if tok.get("sha256") and sha256 != tok["sha256"]:
            raise UsageError(f"{source} is not the tokenizer this model was trained with (sha256 {sha256[:12]}..., "
                             f"recorded {tok['sha256'][:12]}...)")
        tok.update(spec="sp:" + TOKENIZER, file=TOKENIZER, sha256=sha256)
    folder = os.path.normpath(folder)
    check_target(folder)
    existing = os.path.isdir(folder) and bool(os.listdir(folder))
    card = os.path.join(folder, CARD)
    users_card = existing and os.path.lexists(card) and not is_our_card(card)
    tmp = temp_name(folder)
    remove_stale_temps(folder)
    try:
        os.makedirs(tmp)                 # inside: a stop signal right after it still finds tmp to remove
        # safetensors refuses shared storage and wants contiguous tensors
        save_file({k.removeprefix("_orig_mod."): v.detach().to("cpu").contiguous().clone() for k, v in state.items()},
                  os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
        os.chmod(os.path.join(tmp, WEIGHTS), 0o644)     # safetensors writes it owner-only; a folder is for sharing
        config["weights_sha256"] = sha256_file(os.path.join(tmp, WEIGHTS))   # every reader checks the bytes by it
        Path(tmp, CONFIG).write_text(json.dumps(config, indent=1) + "\n")
        if source is not None:
            Path(tmp, TOKENIZER).write_bytes(proto)
        if not users_card:
            Path(tmp, CARD).write_text(model_card(config, name or folder), encoding="utf-8")
        with deferred_signals():      # a stop signal between the renames would leave a folder half old, half new
            if not existing:
                os.replace(tmp, folder)                  # a new folder, or over an empty one: whole at once
            else:
                new = set(os.listdir(tmp))
                for entry in our_files(folder):          # ours, from the earlier export, that this one does not write
                    if entry not in new:
                        os.remove(os.path.join(folder, entry))
                for entry in sorted(new - {CONFIG}) + [CONFIG]:  # config.json last: it makes the folder a model
                    os.replace(os.path.join(tmp, entry), os.path.join(folder, entry))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if users_card:
        print(f"note: {card} is not a model card of ours: kept as it is, no model card written",
              file=sys.stderr)
    return folder


def export(ckpt, out, weights="ema"):
    """Any checkpoint trained.checkpoint.load_model reads (train.py / distillation/distill.py ckpt.pt, duo:PATH, a
    model folder) -> a model folder at `out` with its EMA weights (weights="ema"; the live ones when it has no EMA)
    or its live ones (weights="raw"). -> (folder, the weights written: "ema" | "raw")."""
    if weights not in ("ema", "raw"):
        raise UsageError(f"--weights must be ema or raw, got {weights!r}")
    check_target(os.path.normpath(str(out)), "--out")          # before the weights load
    model, info = load_model(str(ckpt), "cpu", use_ema=weights == "ema")
    has_ema = info.get("ema") is not None or bool(info.get("used_ema"))
    used = "ema" if weights == "ema" and has_ema else "raw"
    # the run evaluated its EMA weights, or its live ones when it kept no EMA: its log describes those only
    validation = measured_validation(ckpt, info.get("step")) if used == ("ema" if has_ema else "raw") else None
    return save_folder(out, model.state_dict(), folder_config(info, used, validation),
                       proto=info.get("tokenizer_model")), used
