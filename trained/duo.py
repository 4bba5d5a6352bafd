"""Duo's released checkpoints (s-sahoo/duo, models/dit.py DIT) in model.py's DiT, to check this repo's NELBO and
Gen PPL pipeline against Duo's published numbers. The two networks compute the same function (adaLN-Zero blocks,
bias-free LayerNorm, rotate-half RoPE, tanh GELU, biased output layer); only the parameter names differ."""
import json
import os
import re
from dataclasses import asdict

import torch

from plumbing.cli import first_line
from plumbing.integrity import check_weights, check_zip
from trained.fields import built_model, check_values, checked_model_config, int_from


DUO_KEYS = [   # (Duo's name after its "backbone." prefix, ours): regular expressions, in order
    (r"vocab_embed\.embedding", r"wte.weight"),
    (r"sigma_map\.mlp\.(0|2)\.(weight|bias)", r"sigma_map.\1.\2"),
    (r"blocks\.(\d+)\.norm(1|2)\.weight", r"blocks.\1.norm\2.weight"),
    (r"blocks\.(\d+)\.attn_qkv\.weight", r"blocks.\1.attn.qkv.weight"),        # (3d, d): [q; k; v], heads inside
    (r"blocks\.(\d+)\.attn_out\.weight", r"blocks.\1.attn.proj.weight"),
    (r"blocks\.(\d+)\.mlp\.0\.(weight|bias)", r"blocks.\1.mlp.fc.\2"),
    (r"blocks\.(\d+)\.mlp\.2\.(weight|bias)", r"blocks.\1.mlp.out.\2"),
    (r"blocks\.(\d+)\.adaLN_modulation\.(weight|bias)", r"blocks.\1.adaLN.\2"),  # [shift, scale, gate] x (attn, mlp)
    (r"output_layer\.norm_final\.weight", r"norm_f.weight"),
    (r"output_layer\.adaLN_modulation\.(weight|bias)", r"adaLN_f.\1"),            # [shift, scale]
    (r"output_layer\.linear\.(weight|bias)", r"lm_head.\1"),
]
DUO_BUFFERS = ("rotary_emb.inv_freq",)   # recomputed here from rope_base


def duo_key(name):
    """One of Duo's backbone parameter names (without "backbone.") -> ours, None for a buffer we recompute.
    Raises ValueError for a name outside the map, so nothing is dropped silently."""
    if name in DUO_BUFFERS:
        return None
    for pattern, ours in DUO_KEYS:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, ours, name)
    raise ValueError(f"unexpected parameter {name!r} in a Duo checkpoint (not in trained.duo.DUO_KEYS)")


def duo_state_dict(state, ema_params=None):
    """Duo's DIT state dict (keys with or without the "backbone." prefix of its Lightning module; other
    modules' keys are ignored) -> (our state dict, our ModelConfig fields read from the shapes).
    ema_params: the "shadow_params" list of a Lightning checkpoint's "ema" entry (Duo's EMA over
    backbone.parameters(), in registration order = the order of the parameter keys), used instead of the weights."""
    prefix = "backbone." if any(k.startswith("backbone.") for k in state) else ""
    names = [k[len(prefix):] for k in state if k.startswith(prefix)]
    params = [(k, duo_key(k)) for k in names if duo_key(k) is not None]
    values = [state[prefix + k] for k, _ in params]
    if ema_params is not None:
        if len(ema_params) != len(params) or any(e.shape != v.shape for e, v in zip(ema_params, values)):
            raise ValueError(f"the EMA has {len(ema_params)} tensors that do not match the {len(params)} backbone "
                             f"parameters in order and shape")
        values = list(ema_params)
    ours = {o: v for (_, o), v in zip(params, values)}
    if "wte.weight" not in ours:
        raise ValueError("not a Duo DIT state dict: no vocab_embed.embedding")
    K, d = ours["wte.weight"].shape
    time_cond = "sigma_map.0.weight" in ours     # Duo's AR baseline (DDiTBlockCausal) has no sigma map or adaLN
    fields = dict(arch="dit", vocab_size=K, n_embd=d, n_layer=1 + max(int(o.split(".")[1]) for o in ours
                                                                      if o.startswith("blocks.")),
                  mlp_hidden=ours["blocks.0.mlp.fc.weight"].shape[0], time_cond=time_cond, causal=not time_cond)
    if time_cond:
        fields["cond_dim"] = ours["sigma_map.0.weight"].shape[0]
    return {k: v.float() for k, v in ours.items()}, fields


def load_duo_checkpoint(spec, device="cpu", use_ema=True, n_head=None, block_size=None):
    """A Duo checkpoint -> (model in eval mode, a checkpoint dict as train.py writes: meta, train_config, step).
    spec: a Lightning .ckpt (dict with "state_dict" of backbone.* keys, and "ema"), a .safetensors / .bin / .pt
    state dict, a folder holding one (with Duo's Hugging Face config.json), or a Hugging Face hub name
    (s-sahoo/duo, s-sahoo/duo-distilled; needs huggingface_hub and the network). Not in the tensors and so set
    here: n_head, block_size (the arguments, else Duo's config.json, else Duo's defaults), the tokenizer (by the
    vocabulary size) and the log-linear schedule Duo trains with. Only load trusted files (.ckpt and .pt unpickle)."""
    path, extra = spec, {}
    if not os.path.exists(path) and (os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1):
        raise ValueError(f"duo:{spec}: no such file or folder (a hub name is duo:USER/NAME)")  # a path, not a name
    if not os.path.exists(path):
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise ValueError(f"duo:{spec} is not a local file or folder, and loading it from the Hugging Face hub "
                             f"needs huggingface_hub (pip install huggingface_hub)") from None
        try:
            path = snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.bin"])
        except Exception as e:
            raise ValueError(f"duo:{spec}: could not download it ({type(e).__name__}: {first_line(e)})") from None
    if os.path.isdir(path):
        config_path = os.path.join(path, "config.json")
        if os.path.isfile(config_path):
            try:
                with open(config_path, encoding="utf-8") as f:
                    extra = json.load(f)
            except (UnicodeDecodeError, ValueError) as e:
                raise ValueError(f"{config_path} is not valid JSON ({e}); restore Duo's config.json") from None
            check_values(extra if isinstance(extra, dict) else {}, dict.fromkeys(("n_heads", "model_length"),
                         int_from(1)), config_path, "", ValueError, "restore Duo's config.json")  # the two read here
        files = [f for f in ("model.safetensors", "pytorch_model.bin") if os.path.isfile(os.path.join(path, f))]
        if not files:
            raise ValueError(f"duo:{spec}: no model.safetensors or pytorch_model.bin in {path}")
        path = os.path.join(path, files[0])
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        raw = {"state_dict": load_file(path)}
    else:
        try:
            with open(path, "rb") as f:
                check_zip(f, path)              # torch.load checks no CRC
                f.seek(0)
                raw = torch.load(f, map_location="cpu", weights_only=False)
        except Exception as e:
            raise ValueError(f"could not read Duo checkpoint {path}: {type(e).__name__}: {first_line(e)}") from None
    state = raw.get("state_dict", raw) if isinstance(raw, dict) else None
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise ValueError(f"{path} holds no state dict of tensors")
    ema = (raw.get("ema") or {}).get("shadow_params") if use_ema else None
    ours, fields = duo_state_dict(state, ema)
    check_weights(ours, path, "weights", fix="use another copy of the checkpoint")   # floating-point and finite
    d, K = fields["n_embd"], fields["vocab_size"]
    fields["n_head"] = n_head or extra.get("n_heads") or max(1, d // 64)         # Duo's head size: 64
    fields["block_size"] = block_size or extra.get("model_length") or (128 if K == 30522 else 1024)   # LM1B: 128
    mcfg = checked_model_config(fields, f"duo:{spec}", "")
    model = built_model(mcfg, device, f"duo:{spec}: ", f"duo:{spec}", {"": ours}, "")
    tokenizer = {50258: "gpt2", 30522: "hf:bert-base-uncased"}.get(K)    # gpt2: our GPT-2 BPE + [PAD], Duo's ids
    ckpt = {"model_config": asdict(model.config), "meta": {"tokenizer": tokenizer} if tokenizer else {},
            "train_config": {"noise_schedule": "loglinear", "loss": "ar" if fields["causal"] else "duo"},
            "step": raw.get("global_step"), "source": f"duo:{spec}", "used_ema": ema is not None}
    return model, ckpt
