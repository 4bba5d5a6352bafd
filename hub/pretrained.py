"""
Model folders: a trained model as the Hugging Face ecosystem shares one, and the three-line Python API.

    out/model/
      model.safetensors   the weights only (EMA by default): reading them runs no code, unlike a pickle
      config.json         "model_type": "sddlm" and the model's fields on top (the hub's flat form), the objective, the
                          noise schedule, the default final step, the tokenizer (spec, sha256, special ids), the step,
                          the validation NELBO the run measured, the training config, the weights' sha256 (checked
                          by every reader)
      tokenizer.model     the SentencePiece model, when the tokenizer is a local file (gpt2 and hf:NAME are not)
      README.md           the model card: the hub's metadata header, then what the model is and how to load it

    from hub.pretrained import SDDLM
    lm = SDDLM.from_pretrained("out/model")       # a model folder, a train.py/distill.py checkpoint, a hub name
    print(lm.generate(2)[0], lm.score(["The os module provides"]))

train.py and distillation/distill.py write out_dir/model at the end of a run; any checkpoint exports with

    python hub/pretrained.py --ckpt out/ckpt.pt --out out/model        # --weights raw: the live weights, not the EMA

and every script's --ckpt reads a folder as it reads a checkpoint (plumbing.checkpoint.load_model). push_to_hub uploads a folder
(huggingface_hub, an optional package imported only there). Writing a folder never deletes what the project did not
write: into an existing model folder it replaces only its own files (weights, config, tokenizer, its own model card);
a folder holding anything else is refused; a README.md of the user's is kept (no card is written then).

Why not huggingface_hub's PyTorchModelHubMixin: it would make huggingface_hub a dependency of the model class, and its
from_pretrained loads with strict=False (missing weights pass silently) and falls back to pytorch_model.bin (a
pickle) when a repository has no safetensors; it knows neither the tokenizer file and its sha256 check nor
train.py's checkpoints. This file keeps those guarantees and follows the mixin's conventions (model.safetensors,
config.json, a README.md card with library_name and tags, a user's README.md never overwritten).
"""
import os, sys  # noqa: E401  (run as a file, python FOLDER/SCRIPT.py: the repository root goes on the path)
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing import cli  # first: a stop signal while the imports below load is one line, exit 130
cli.stop_at_once(__name__)

import json
import os
import shutil
from dataclasses import dataclass

import torch

from plumbing.files import remove_stale_temps, writing
from plumbing.integrity import sha256_file
from plumbing.signals import deferred_signals
from plumbing.folder import (CARD, CARD_MARK, CONFIG, FORMAT, MODEL_TYPE, TOKENIZER, WEIGHTS, _sha256,  # noqa: F401
                             check_target, is_model_folder, is_our_card, load_folder, our_files)


def folder_config(ckpt, weights, validation=None):
    """A checkpoint dict (train.py, distillation/distill.py, or load_duo_checkpoint's) -> config.json's content, flat
    as the hub's (model_type, then the model's fields), without the tokenizer file's new place (save_folder sets
    it). validation: what the run measured (measured_validation), else the checkpoint's own."""
    from sample import default_final_step
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
        **({"distilled_from": ckpt["distilled_from"]} if ckpt.get("distilled_from") else {}),
        **({"finetuned_from": ckpt["finetuned_from"]} if ckpt.get("finetuned_from") else {}),
        **({"source": ckpt["source"]} if ckpt.get("source") else {}),
    }


def measured_validation(ckpt_path, step):
    """The validation NELBO the run measured at the checkpoint's step (else its last one before it), read from the
    log.jsonl beside the checkpoint file -> {"step", "nelbo", "ppl"} and, where the log has them, the Monte-Carlo
    standard errors "nelbo_se", "ppl_se" and the 95% interval "ppl_lo", "ppl_hi" (eval_ppl.val_metrics), or None
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


def save_folder(folder, state, config, name=None):
    """Write a model folder: state (name -> tensor) as model.safetensors, config as config.json, the model card
    README.md, and the tokenizer's file when its spec is a local SentencePiece model (checked against the recorded
    sha256, so a folder never ships another tokenizer than the one its ids came from). Nothing the project did not
    write is touched: a new or empty folder is built beside the target and renamed into place (it appears whole or
    not at all); over an earlier model folder only our files are replaced, config.json last (check_target refuses
    a folder holding anything else); a README.md of the user's is kept and no card is written (said on stderr).
    name: how the card's loading lines name the model (default: the folder as given)."""
    from safetensors.torch import save_file
    from plumbing.cli import UsageError
    config = json.loads(json.dumps(config))          # a copy; JSON types only
    tok = config["tokenizer"]
    spec = tok.get("spec") or ""
    source = spec.removeprefix("sp:") if spec.startswith("sp:") or spec.endswith(".model") else None
    if source is not None:
        if not os.path.isfile(source):
            raise UsageError(f"the tokenizer file {source} is missing: a model folder carries its tokenizer; "
                             f"put the file back (or re-export from a copy of it)")
        if tok.get("sha256") and _sha256(source) != tok["sha256"]:
            raise UsageError(f"{source} is not the tokenizer this model was trained with (sha256 "
                             f"{_sha256(source)[:12]}..., recorded {tok['sha256'][:12]}...)")
        tok.update(spec="sp:" + TOKENIZER, file=TOKENIZER, sha256=tok.get("sha256") or _sha256(source))
    folder = os.path.normpath(folder)
    check_target(folder)
    existing = os.path.isdir(folder) and bool(os.listdir(folder))
    card = os.path.join(folder, CARD)
    users_card = existing and os.path.lexists(card) and not is_our_card(card)
    tmp = f"{folder}.tmp{os.getpid()}"
    remove_stale_temps(folder)
    try:
        os.makedirs(tmp)                 # inside: a stop signal right after it still finds tmp to remove
        # safetensors refuses shared storage and wants contiguous tensors
        save_file({k.removeprefix("_orig_mod."): v.detach().to("cpu").contiguous().clone() for k, v in state.items()},
                  os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
        os.chmod(os.path.join(tmp, WEIGHTS), 0o644)     # safetensors writes it owner-only; a folder is for sharing
        config["weights_sha256"] = sha256_file(os.path.join(tmp, WEIGHTS))   # every reader checks the bytes by it
        with open(os.path.join(tmp, CONFIG), "w") as f:
            json.dump(config, f, indent=1)
            f.write("\n")
        if source is not None:
            shutil.copyfile(source, os.path.join(tmp, TOKENIZER))
        if not users_card:
            with open(os.path.join(tmp, CARD), "w", encoding="utf-8") as f:
                f.write(model_card(config, name or folder))
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
    """Any checkpoint cli.load_model reads (train.py / distillation/distill.py ckpt.pt, duo:PATH, a model folder) -> a model
    folder at `out` with its EMA weights (weights="ema"; the live ones when it has no EMA) or its live ones
    (weights="raw"). -> (folder, the weights written: "ema" | "raw")."""
    from plumbing.cli import UsageError
    from plumbing.checkpoint import load_model
    if weights not in ("ema", "raw"):
        raise UsageError(f"--weights must be ema or raw, got {weights!r}")
    check_target(os.path.normpath(str(out)), "--out")          # before the weights load
    model, info = load_model(str(ckpt), "cpu", use_ema=weights == "ema")
    has_ema = info.get("ema") is not None or bool(info.get("used_ema"))
    used = "ema" if weights == "ema" and has_ema else "raw"
    # the run evaluated its EMA weights, or its live ones when it kept no EMA: its log describes those only
    validation = measured_validation(ckpt, info.get("step")) if used == ("ema" if has_ema else "raw") else None
    return save_folder(out, model.state_dict(), folder_config(info, used, validation)), used


# -----------------------------------------------------------------------------------------------
# reading

def snapshot(repo_id, revision=None):
    """A hub repository's files (huggingface_hub, imported here only) -> the local folder holding them."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"{repo_id} is not a local folder or file, and loading it from the Hugging Face hub "
                         f"needs huggingface_hub (pip install huggingface_hub)") from None
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=[WEIGHTS, CONFIG, TOKENIZER, CARD])
    except Exception as e:
        raise ValueError(f"{repo_id} is not a local folder or checkpoint, and not a hub repository that could be "
                         f"downloaded ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None


def push_to_hub(folder, repo_id, private=False, token=None, commit_message="Upload sddlm model"):
    """Upload a model folder to the Hugging Face hub as the repository repo_id (created if absent) -> the
    commit info huggingface_hub returns. Only the folder's own files travel (weights, config, tokenizer, our model
    card); anything else in it, a README.md of the user's included, stays local."""
    if not is_model_folder(folder):
        raise ValueError(f"{folder} is not an sddlm model folder (export one with python hub/pretrained.py)")
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise ValueError("push_to_hub needs huggingface_hub (pip install huggingface_hub)") from None
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    return api.upload_folder(folder_path=folder, repo_id=repo_id, commit_message=commit_message,
                             allow_patterns=[WEIGHTS, CONFIG, TOKENIZER] + ([CARD] if is_our_card(
                                 os.path.join(folder, CARD)) else []))


# -----------------------------------------------------------------------------------------------
# the Python API

@dataclass
class SDDLM:
    """A loaded model with its tokenizer and the sampler settings its config names."""
    model: torch.nn.Module
    ckpt: dict
    tokenizer: object

    @classmethod
    def from_pretrained(cls, name, device="cpu", use_ema=True):
        """A model folder, a train.py / distillation/distill.py checkpoint, duo:PATH, or a hub repository id (downloaded with
        huggingface_hub) -> SDDLM. The tokenizer is the folder's own file (or the checkpoint's)."""
        from plumbing.checkpoint import load_model, load_tokenizer
        name = str(name)
        if not os.path.exists(name) and not name.startswith("duo:"):
            name = snapshot(name)
        model, ckpt = load_model(name, device, use_ema)
        tok, why = load_tokenizer(ckpt, name)
        if tok is None:
            raise ValueError(f"{name}: {why}")
        return cls(model, ckpt, tok)

    @property
    def device(self):
        return next(self.model.parameters()).device

    def save_pretrained(self, folder, name=None):
        """Write this model as a model folder (its loaded weights; the tokenizer file travels with it), replacing
        only what an earlier export wrote there (save_folder). name: the model's name in the card's loading lines."""
        weights = "ema" if self.ckpt.get("ema") is not None or self.ckpt.get("used_ema") else "raw"
        return writing(folder, save_folder, folder, self.model.state_dict(), folder_config(self.ckpt, weights), name)

    def push_to_hub(self, repo_id, private=False, token=None):
        """save_pretrained into a temporary folder, then upload it (push_to_hub)."""
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            folder = self.save_pretrained(os.path.join(tmp, "model"), name=repo_id)
            return push_to_hub(folder, repo_id, private=private, token=token)

    def generate(self, num_samples=1, steps=128, length=None, prompt=None, seed=0, stride=0, seq_len=None,
                 **sampler):
        """num_samples texts of `length` tokens (default block_size; seq_len: the same, sample.py's name) from the
        default sampler: the config's noise schedule and final step (an AR model: one token per step from BOS).
        Longer than the block: windows that draw `stride` tokens each (0 = half a block; sample.generate_long).
        prompt: a clean prefix. sampler: more of sample.generate's keywords (top_p, cfg_w, t_end, final_step, psi).
        -> list of str."""
        from diffusion import default_final_step
        from sample import generate_ar, generate_long
        if length and seq_len and length != seq_len:
            raise ValueError(f"length={length} and seq_len={seq_len} name the same thing; give one")
        seq_len = length or seq_len or self.model.config.block_size
        prompt_ids = self.tokenizer.encode(prompt) if prompt else None
        g = torch.Generator(device=self.device).manual_seed(seed)
        if self.model.config.causal:
            ids = generate_ar(self.model, num_samples, seq_len, bos_id=None if prompt_ids else self.tokenizer.bos_id,
                              prompt_ids=prompt_ids, top_p=sampler.get("top_p", 1.0), generator=g,
                              show_progress=False)
        else:
            sampler.setdefault("final_step", self.ckpt.get("final_step") or default_final_step(self.ckpt))
            ids = generate_long(self.model, num_samples, seq_len, self.model.config.vocab_size, steps, stride=stride,
                                alpha_schedule=(self.ckpt.get("train_config") or {}).get("noise_schedule")
                                or "loglinear", prompt_ids=prompt_ids, generator=g, show_progress=False, **sampler)
        return [self.tokenizer.decode(row) for row in ids.tolist()]

    def score(self, texts, mc_draws=16, seed=0):
        """Each text's NELBO (nats per token, an upper bound on -log p(x) / L; exact for an AR model), averaged
        over mc_draws noise draws (two rounds of mc_draws / 2 stratified times, eval_ppl.nelbo_ppl's estimator), with
        its Monte-Carlo standard error -> list of dict(nll, nll_se, ppl, ppl_se, tokens)."""
        from eval_ppl import nelbo_ppl
        out = []
        for text in ([texts] if isinstance(texts, str) else texts):
            ids = self.tokenizer.encode(text)
            if not 1 <= len(ids) <= self.model.config.block_size:
                raise ValueError(f"a text of {len(ids)} tokens; the model scores 1 to {self.model.config.block_size}")
            r = nelbo_ppl(self.model, [torch.tensor([ids], device=self.device)], seed=seed,
                          mc_draws=max(1, mc_draws // 2), rounds=2, device=self.device, show_progress=False)
            out.append(dict(nll=r["nll"], nll_se=r["nll_se"], ppl=r["ppl"], ppl_se=r["ppl_se"], tokens=len(ids)))
        return out


# -----------------------------------------------------------------------------------------------

@dataclass
class ExportConfig:
    ckpt: str = "out/ckpt.pt"        # a train.py / distillation/distill.py checkpoint, duo:PATH, or a model folder
    out: str = ""                    # the model folder to write ("" = model/ beside the checkpoint); a new or empty
                                     # folder, or an earlier model folder (only its own files are replaced)
    weights: str = "ema"             # ema | raw (the live weights)


def main(argv=None):
    from plumbing.cli import parse_flags
    from plumbing.files import check_writable, refuse_overwrite
    cfg = parse_flags(ExportConfig, argv, description="Export a checkpoint as a model folder (safetensors).")
    out = cfg.out or os.path.join(os.path.dirname(os.path.abspath(cfg.ckpt)), "model")
    refuse_overwrite({"--out": out}, {"--ckpt": cfg.ckpt})
    check_writable(out, "--out", folder=True)
    check_target(out, "--out")
    folder, used = writing(out, export, cfg.ckpt, out, cfg.weights)   # a full disk: one line, nothing half-written
    note = " (the checkpoint has no EMA)" if used != cfg.weights else ""
    print(f"wrote {folder}: {used} weights{note}, " + ", ".join(sorted(os.listdir(folder))))
    return 0


if __name__ == "__main__":
    from plumbing.cli import run_cli
    run_cli(main, ValueError)
