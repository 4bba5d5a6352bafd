"""
Model folders: a trained model as the Hugging Face ecosystem shares one, and the three-line Python API.

    out/model/
      model.safetensors   the weights only (EMA by default): reading them runs no code, unlike a pickle
      config.json         model_config, the objective, the noise schedule, the default final step, the
                          tokenizer (spec, sha256, special ids), the step, the training config
      tokenizer.model     the SentencePiece model, when the tokenizer is a local file (gpt2 and hf:NAME are not)

    from hub.pretrained import SDDLM
    lm = SDDLM.from_pretrained("out/model")       # a model folder, a train.py/distill.py checkpoint, a hub name
    print(lm.generate(2)[0], lm.score(["The os module provides"]))

train.py and distillation/distill.py write out_dir/model at the end of a run; any checkpoint exports with

    python hub/pretrained.py --ckpt out/ckpt.pt --out out/model        # --weights raw: the live weights, not the EMA

and every script's --ckpt reads a folder as it reads a checkpoint (plumbing.checkpoint.load_model). push_to_hub uploads a folder
(huggingface_hub, an optional package imported only there).
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

from plumbing.files import remove_stale_temps
from plumbing.signals import deferred_signals
from plumbing.folder import CONFIG, FORMAT, TOKENIZER, WEIGHTS, _sha256, is_model_folder, load_folder  # noqa: F401


def folder_config(ckpt, weights):
    """A checkpoint dict (train.py, distillation/distill.py, or load_duo_checkpoint's) -> config.json's content, without the
    tokenizer file's new place (save_folder sets it)."""
    from sample import default_final_step
    train_config = dict(ckpt.get("train_config") or {})
    meta = ckpt.get("meta") or {}
    return {
        "format": FORMAT,
        "model_config": ckpt["model_config"],
        "objective": train_config.get("loss"),
        "noise_schedule": train_config.get("noise_schedule") or "loglinear",
        "final_step": "none" if ckpt["model_config"].get("causal") else default_final_step(ckpt),
        "weights": weights,
        "step": ckpt.get("step"),
        "tokenizer": {"spec": meta.get("tokenizer"), "sha256": meta.get("tokenizer_sha256"),
                      **{k: meta.get(k) for k in ("vocab_size", "bos_id", "eos_id", "pad_id")}},
        "train_config": train_config,
        **({"distilled_from": ckpt["distilled_from"]} if ckpt.get("distilled_from") else {}),
        **({"source": ckpt["source"]} if ckpt.get("source") else {}),
    }


def save_folder(folder, state, config):
    """Write a model folder: state (name -> tensor) as model.safetensors, config as config.json, and the
    tokenizer's file when its spec is a local SentencePiece model (checked against the recorded sha256, so a
    folder never ships another tokenizer than the one its ids came from). The folder appears whole or not at
    all: it is built beside the target and renamed over it."""
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
    tmp, old = f"{folder}.tmp{os.getpid()}", f"{folder}.old{os.getpid()}"
    remove_stale_temps(folder)
    try:
        os.makedirs(tmp)                 # inside: a stop signal right after it still finds tmp to remove
        # safetensors refuses shared storage and wants contiguous tensors
        save_file({k.removeprefix("_orig_mod."): v.detach().to("cpu").contiguous().clone() for k, v in state.items()},
                  os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
        os.chmod(os.path.join(tmp, WEIGHTS), 0o644)     # safetensors writes it owner-only; a folder is for sharing
        with open(os.path.join(tmp, CONFIG), "w") as f:
            json.dump(config, f, indent=1)
            f.write("\n")
        if source is not None:
            shutil.copyfile(source, os.path.join(tmp, TOKENIZER))
        with deferred_signals():      # a stop signal between the two renames would leave no folder at all
            if os.path.exists(folder):
                os.replace(folder, old)
            os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return folder


def export(ckpt, out, weights="ema"):
    """Any checkpoint cli.load_model reads (train.py / distillation/distill.py ckpt.pt, duo:PATH, a model folder) -> a model
    folder at `out` with its EMA weights (weights="ema"; the live ones when it has no EMA) or its live ones
    (weights="raw"). -> (folder, the weights written: "ema" | "raw")."""
    from plumbing.cli import UsageError
    from plumbing.checkpoint import load_model
    if weights not in ("ema", "raw"):
        raise UsageError(f"--weights must be ema or raw, got {weights!r}")
    model, info = load_model(str(ckpt), "cpu", use_ema=weights == "ema")
    used = "ema" if weights == "ema" and (info.get("ema") is not None or info.get("used_ema")) else "raw"
    return save_folder(out, model.state_dict(), folder_config(info, used)), used


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
        return snapshot_download(repo_id, revision=revision, allow_patterns=[WEIGHTS, CONFIG, TOKENIZER])
    except Exception as e:
        raise ValueError(f"{repo_id} is not a local folder or checkpoint, and not a hub repository that could be "
                         f"downloaded ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None


def push_to_hub(folder, repo_id, private=False, token=None, commit_message="Upload sddlm model"):
    """Upload a model folder to the Hugging Face hub as the repository repo_id (created if absent) -> the
    commit info huggingface_hub returns. Only the folder's own files travel (weights, config, tokenizer)."""
    if not is_model_folder(folder):
        raise ValueError(f"{folder} is not an sddlm model folder (export one with python hub/pretrained.py)")
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise ValueError("push_to_hub needs huggingface_hub (pip install huggingface_hub)") from None
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    return api.upload_folder(folder_path=folder, repo_id=repo_id, commit_message=commit_message,
                             allow_patterns=[WEIGHTS, CONFIG, TOKENIZER])


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

    def save_pretrained(self, folder):
        """Write this model as a model folder (its loaded weights; the tokenizer file travels with it)."""
        weights = "ema" if self.ckpt.get("ema") is not None or self.ckpt.get("used_ema") else "raw"
        return save_folder(folder, self.model.state_dict(), folder_config(self.ckpt, weights))

    def push_to_hub(self, repo_id, private=False, token=None):
        """save_pretrained into a temporary folder, then upload it (push_to_hub)."""
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            folder = self.save_pretrained(os.path.join(tmp, "model"))
            return push_to_hub(folder, repo_id, private=private, token=token)

    def generate(self, num_samples=1, steps=128, seq_len=None, prompt=None, seed=0, **sampler):
        """num_samples texts from the default sampler: the config's noise schedule and final step (an AR model:
        one token per step from BOS). prompt: a clean prefix. sampler: more of sample.generate's keywords
        (top_p, cfg_w, t_end, final_step). -> list of str."""
        from sample import default_final_step, generate, generate_ar
        seq_len = seq_len or self.model.config.block_size
        prompt_ids = self.tokenizer.encode(prompt) if prompt else None
        g = torch.Generator(device=self.device).manual_seed(seed)
        if self.model.config.causal:
            ids = generate_ar(self.model, num_samples, seq_len, bos_id=None if prompt_ids else self.tokenizer.bos_id,
                              prompt_ids=prompt_ids, top_p=sampler.get("top_p", 1.0), generator=g,
                              show_progress=False)
        else:
            sampler.setdefault("final_step", self.ckpt.get("final_step") or default_final_step(self.ckpt))
            ids = generate(self.model, num_samples, seq_len, self.model.config.vocab_size, steps,
                           alpha_schedule=(self.ckpt.get("train_config") or {}).get("noise_schedule") or "loglinear",
                           prompt_ids=prompt_ids, generator=g, show_progress=False, **sampler)
        return [self.tokenizer.decode(row) for row in ids.tolist()]

    def score(self, texts, mc_draws=16, seed=0):
        """Each text's NELBO (nats per token, an upper bound on -log p(x) / L; exact for an AR model), averaged
        over mc_draws noise draws -> list of dict(nll, ppl, tokens), as eval_ppl.nelbo_ppl scores data."""
        from eval_ppl import nelbo_ppl
        out = []
        g = torch.Generator(device=self.device).manual_seed(seed)
        for text in ([texts] if isinstance(texts, str) else texts):
            ids = self.tokenizer.encode(text)
            if not 1 <= len(ids) <= self.model.config.block_size:
                raise ValueError(f"a text of {len(ids)} tokens; the model scores 1 to {self.model.config.block_size}")
            rows = 1 if self.model.config.causal else mc_draws    # one batch: t stratified over the draws
            x0 = torch.tensor([ids] * rows, device=self.device)
            r = nelbo_ppl(self.model, [x0], self.model.config.vocab_size, generator=g, device=self.device,
                          show_progress=False)
            out.append(dict(nll=r["nll"], ppl=r["ppl"], tokens=len(ids)))
        return out


# -----------------------------------------------------------------------------------------------

@dataclass
class ExportConfig:
    ckpt: str = "out/ckpt.pt"        # a train.py / distillation/distill.py checkpoint, duo:PATH, or a model folder
    out: str = ""                    # the model folder to write ("" = model/ beside the checkpoint)
    weights: str = "ema"             # ema | raw (the live weights)


def main(argv=None):
    from plumbing.cli import parse_flags
    from plumbing.files import check_writable, refuse_overwrite
    cfg = parse_flags(ExportConfig, argv, description="Export a checkpoint as a model folder (safetensors).")
    out = cfg.out or os.path.join(os.path.dirname(os.path.abspath(cfg.ckpt)), "model")
    refuse_overwrite({"--out": out}, {"--ckpt": cfg.ckpt})
    check_writable(out, "--out", folder=True)
    folder, used = export(cfg.ckpt, out, cfg.weights)
    note = " (the checkpoint has no EMA)" if used != cfg.weights else ""
    print(f"wrote {folder}: {used} weights{note}, " + ", ".join(sorted(os.listdir(folder))))
    return 0


if __name__ == "__main__":
    from plumbing.cli import run_cli
    run_cli(main, ValueError)
