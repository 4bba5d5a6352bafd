"""
Model folders: a trained model as the Hugging Face ecosystem shares one, and the three-line Python API.

    from hub.pretrained import SDDLM
    lm = SDDLM.from_pretrained("out/model")       # a model folder, a train.py/distill.py checkpoint, a hub name
    print(lm.generate(2)[0], lm.score(["The os module provides"]))

train.py and distillation/distill.py write out_dir/model at the end of a run; any checkpoint exports with

    python hub/pretrained.py --ckpt out/ckpt.pt --out out/model        # --weights raw: the live weights, not the EMA

What a folder holds, how an export treats an existing folder, why not huggingface_hub's PyTorchModelHubMixin:
docs/model_folders.md. The writing is trained/export.py's, the reading trained/folder.py's.
"""
import os, sys  # noqa: E401  (run as a file, python FOLDER/SCRIPT.py: the repository root goes on the path)
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing import cli  # first: a stop signal while the imports below load is one line, exit 130
cli.stop_at_once(__name__)

import tempfile
from dataclasses import dataclass

import torch

from diffusion import default_final_step
from metrics import nelbo_ppl
from plumbing.cli import SEED_END, first_line, parse_flags, run_cli, whole
from plumbing.files import check_writable, refuse_overwrite, writing
from sample import check_sample_size, device_of, generate_ar, generate_long
from trained.checkpoint import load_model, load_tokenizer
from trained.export import export, folder_config, save_folder
from trained.folder import CARD, CONFIG, TOKENIZER, WEIGHTS, check_target, is_model_folder, is_our_card


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
                         f"downloaded ({type(e).__name__}: {first_line(e)})") from None


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
        """A model folder, a train.py / distillation/distill.py checkpoint, duo:PATH, or a hub repository id
        (downloaded with huggingface_hub) -> SDDLM. The tokenizer is the folder's own file (or the checkpoint's)."""
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
        return device_of(self.model)

    def save_pretrained(self, folder, name=None):
        """Write this model as a model folder (its loaded weights; the tokenizer file travels with it), replacing
        only what an earlier export wrote there (save_folder). name: the model's name in the card's loading lines."""
        weights = "ema" if self.ckpt.get("ema") is not None or self.ckpt.get("used_ema") else "raw"
        return writing(folder, save_folder, folder, self.model.state_dict(), folder_config(self.ckpt, weights), name,
                       self.ckpt.get("tokenizer_model"))

    def push_to_hub(self, repo_id, private=False, token=None):
        """save_pretrained into a temporary folder, then upload it (push_to_hub)."""
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
        if length is not None and seq_len is not None and length != seq_len:
            raise ValueError(f"length={length} and seq_len={seq_len} name the same thing; give one")
        name = "length" if length is not None else "seq_len"
        seq_len = next((n for n in (length, seq_len) if n is not None), self.model.config.block_size)
        check_sample_size(num_samples, seq_len, self.device, ("num_samples", name))
        prompt_ids = self.tokenizer.encode(prompt) if prompt else None
        if prompt_ids and len(prompt_ids) >= seq_len:
            raise ValueError(f"the prompt is {len(prompt_ids)} tokens, not shorter than {name}={seq_len}: give a "
                             f"{name} above it (past the block: windows of `stride` tokens) or a shorter prompt")
        g = torch.Generator(device=self.device).manual_seed(whole(seed, "seed", 0, SEED_END))
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
        over mc_draws noise draws (two rounds of mc_draws / 2 stratified times, metrics.nelbo_ppl's estimator), with
        its Monte-Carlo standard error, from the two rounds' spread: on 1 degree of freedom, so the PPL's 95% interval
        (ppl_lo, ppl_hi) is exp(nll -+ 12.7 nll_se), not 1.96 -> list of dict(nll, nll_se, ppl, ppl_se, ppl_lo,
        ppl_hi, tokens)."""
        whole(mc_draws, "mc_draws", 1), whole(seed, "seed", 0, SEED_END)
        out = []
        for text in ([texts] if isinstance(texts, str) else texts):
            ids = self.tokenizer.encode(text)
            if not 1 <= len(ids) <= self.model.config.block_size:
                raise ValueError(f"a text of {len(ids)} tokens; the model scores 1 to {self.model.config.block_size}")
            r = nelbo_ppl(self.model, [torch.tensor([ids], device=self.device)], seed=seed,
                          mc_draws=max(1, mc_draws // 2), rounds=2, device=self.device, show_progress=False)
            out.append({k: r[k] for k in ("nll", "nll_se", "ppl", "ppl_se", "ppl_lo", "ppl_hi")} | {"tokens": len(ids)})
        return out


# -----------------------------------------------------------------------------------------------

@dataclass
class ExportConfig:
    ckpt: str = "out/ckpt.pt"        # a train.py / distillation/distill.py checkpoint, duo:PATH, or a model folder
    out: str = ""                    # the model folder to write ("" = model/ beside the checkpoint); a new or empty
                                     # folder, or an earlier model folder (only its own files are replaced)
    weights: str = "ema"             # ema | raw (the live weights)


def main(argv=None):
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
    run_cli(main, ValueError)
