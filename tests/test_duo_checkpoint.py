"""Duo's released checkpoints load into model.py's DiT through trained.duo.DUO_KEYS: a state dict fabricated with Duo's
parameter names, order and shapes (s-sahoo/duo models/dit.py: DIT, DDiTBlock, DDiTFinalLayer; the AR baseline's
DDiTBlockCausal) gives the logits of an independent float64 forward written here from those tensors by their
Duo names; the Lightning EMA ("shadow_params") is used when asked; anything unknown is refused."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from plumbing.cli import UsageError
from trained import duo
from trained.checkpoint import load_model

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root


def duo_backbone(K=40, d=32, n_blocks=2, cond=16, causal=False, seed=0):
    """Duo's DIT state dict in its registration order (the order of backbone.parameters(), which its EMA follows),
    random float32 values (adaLN not zero, so the modulation matters), plus the RoPE buffer."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, s=0.3: (torch.randn(*shape, generator=g) * s)
    sd = {"vocab_embed.embedding": r(K, d, s=1.0)}
    if not causal:
        sd.update({"sigma_map.mlp.0.weight": r(cond, 256, s=0.1), "sigma_map.mlp.0.bias": r(cond),
                   "sigma_map.mlp.2.weight": r(cond, cond), "sigma_map.mlp.2.bias": r(cond)})
    sd["rotary_emb.inv_freq"] = 1.0 / 10000 ** (torch.arange(0, d // 2, 2).float() / (d // 2))
    for i in range(n_blocks):
        b = f"blocks.{i}."
        sd.update({b + "norm1.weight": 1 + r(d), b + "attn_qkv.weight": r(3 * d, d), b + "attn_out.weight": r(d, d),
                   b + "norm2.weight": 1 + r(d), b + "mlp.0.weight": r(4 * d, d), b + "mlp.0.bias": r(4 * d),
                   b + "mlp.2.weight": r(d, 4 * d, s=0.1), b + "mlp.2.bias": r(d)})
        if not causal:
            sd.update({b + "adaLN_modulation.weight": r(6 * d, cond), b + "adaLN_modulation.bias": r(6 * d)})
    sd.update({"output_layer.norm_final.weight": 1 + r(d), "output_layer.linear.weight": r(K, d),
               "output_layer.linear.bias": r(K)})
    if not causal:
        sd.update({"output_layer.adaLN_modulation.weight": r(2 * d, cond),
                   "output_layer.adaLN_modulation.bias": r(2 * d)})
    return sd


# Our model in float64 against reference_forward (the same weights, the same equations written out): along a
# logit's path < 2000 roundings (d = 32, 4d, 128-wide time MLP, L <= 16 attention sums over 2 blocks) of values
# <= 20 (logits and activations here): the two differ by <= 2 * 2000 * 20 * 1.1e-16 = 8.9e-12; a different
# equation (a norm's eps, RoPE's pairing, GELU's form) moves a logit by >= 1e-4.
DUO64 = dict(rtol=0, atol=1e-11)


def reference_forward(sd, x, sigma, n_head, causal=False):
    """Duo's DIT forward, written from its equations in float64 by Duo's parameter names: embedding; c =
    SiLU(MLP(sinusoid(sigma))); per block adaLN-Zero (shift, scale, gate for attention then MLP) around bias-free
    LayerNorms, attention with rotate-half RoPE on q and k and explicit softmax; final LayerNorm, modulation,
    linear. -> logits (B, L, K) float64."""
    w = {k: v.double() for k, v in sd.items()}
    B, L = x.shape
    d = w["vocab_embed.embedding"].shape[1]
    hd = d // n_head

    def norm(h, weight):
        mu = h.mean(-1, keepdim=True)
        var = ((h - mu) ** 2).mean(-1, keepdim=True)
        return (h - mu) / torch.sqrt(var + 1e-5) * weight

    def lin(h, name, bias=True):
        return h @ w[name + ".weight"].T + (w[name + ".bias"] if bias else 0)

    silu = lambda z: z / (1 + torch.exp(-z))
    gelu = lambda z: 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))
    h = w["vocab_embed.embedding"][x]
    c = None
    if not causal:
        freqs = torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float64) / 128)
        args = sigma.double()[:, None] * freqs[None]
        temb = torch.cat([torch.cos(args), torch.sin(args)], -1)
        c = silu(lin(silu(lin(temb, "sigma_map.mlp.0")), "sigma_map.mlp.2"))
    theta = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angle = torch.arange(L, dtype=torch.float64)[:, None] * theta[None]
    cos, sin = torch.cos(angle), torch.sin(angle)                     # (L, hd / 2)

    def rope(q):                                                      # pairs (j, j + hd/2) rotated by angle j
        q1, q2 = q[..., :hd // 2], q[..., hd // 2:]
        return torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], -1)
    i = 0
    while f"blocks.{i}.norm1.weight" in w:
        b = f"blocks.{i}."
        if causal:
            mods = [torch.zeros(B, 1, d, dtype=torch.float64)] * 2 + [torch.ones(B, 1, d, dtype=torch.float64)]
            mods = mods * 2
        else:
            mods = [m[:, None] for m in lin(c, b + "adaLN_modulation").chunk(6, -1)]
        shift1, scale1, gate1, shift2, scale2, gate2 = mods
        a = norm(h, w[b + "norm1.weight"]) * (1 + scale1) + shift1
        qkv = lin(a, b + "attn_qkv", bias=False).view(B, L, 3, n_head, hd)
        q, k, v = (qkv[:, :, j].transpose(1, 2) for j in range(3))    # (B, H, L, hd)
        scores = rope(q) @ rope(k).transpose(-1, -2) / math.sqrt(hd)
        if causal:
            scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
        att = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, L, d)
        h = h + gate1 * lin(att, b + "attn_out", bias=False)
        m = norm(h, w[b + "norm2.weight"]) * (1 + scale2) + shift2
        h = h + gate2 * lin(gelu(lin(m, b + "mlp.0")), b + "mlp.2")
        i += 1
    h = norm(h, w["output_layer.norm_final.weight"])
    if not causal:
        shift, scale = lin(c, "output_layer.adaLN_modulation").chunk(2, -1)
        h = h * (1 + scale[:, None]) + shift[:, None]
    return lin(h, "output_layer.linear")


def lightning_ckpt(sd, ema_offset=0.05):
    """Duo's Lightning checkpoint: state_dict with backbone.* keys (plus another module's), and its EMA as
    shadow_params in backbone.parameters() order (the parameters, not the RoPE buffer), shifted from the weights."""
    params = [v for k, v in sd.items() if k != "rotary_emb.inv_freq"]
    return {"state_dict": {**{"backbone." + k: v for k, v in sd.items()}, "noise.dummy": torch.zeros(1)},
            "ema": {"decay": 0.9999, "num_updates": 10, "shadow_params": [p + ema_offset for p in params]},
            "global_step": 1234}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("use_ema", [True, False])
def test_duo_checkpoint_forward_equals_duo_equations_in_float64(tmp_path, one_thread, causal, use_ema):
    sd = duo_backbone(causal=causal)
    ckpt = lightning_ckpt(sd)
    torch.save(ckpt, tmp_path / "duo.ckpt")
    model, info = duo.load_duo_checkpoint(str(tmp_path / "duo.ckpt"), use_ema=use_ema, n_head=2, block_size=16)
    assert info["step"] == 1234 and info["used_ema"] == use_ema and model.config.causal == causal
    assert (model.config.vocab_size, model.config.n_embd, model.config.n_layer) == (40, 32, 2)
    weights = sd
    if use_ema:
        shadow = iter(ckpt["ema"]["shadow_params"])
        weights = {k: (v if k == "rotary_emb.inv_freq" else next(shadow)) for k, v in sd.items()}
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 40, (3, 16), generator=g)
    sigma = torch.rand(3, generator=g) * 3
    ours = model.double()(x, None if causal else sigma)
    ref = reference_forward(weights, x, sigma, n_head=2, causal=causal)
    torch.testing.assert_close(ours, ref, **DUO64)
    assert ref.std() > 0.1                  # the test sees real logits, not a zero-initialised head
    if not causal:                          # and the time input matters (by far more than DUO64)
        assert not torch.allclose(ref, reference_forward(weights, x, sigma + 1, n_head=2), **DUO64)


def test_unknown_or_mismatched_duo_keys_are_refused(tmp_path):
    sd = duo_backbone()
    with pytest.raises(ValueError, match="blocks.0.extra.weight"):
        duo.duo_state_dict({**sd, "blocks.0.extra.weight": torch.zeros(2)})
    ckpt = lightning_ckpt(sd)
    ckpt["ema"]["shadow_params"] = ckpt["ema"]["shadow_params"][:-1]
    with pytest.raises(ValueError, match="EMA"):
        duo.duo_state_dict(ckpt["state_dict"], ckpt["ema"]["shadow_params"])
    torch.save({"state_dict": {"backbone.foo": torch.zeros(1)}}, tmp_path / "bad.ckpt")
    with pytest.raises(UsageError, match="foo"):
        load_model("duo:" + str(tmp_path / "bad.ckpt"), "cpu")
    for path in (str(tmp_path / "missing.ckpt"), "./no/such/folder"):     # a path, not a hub name: said so
        with pytest.raises(UsageError, match=f"duo:{path}: no such file or folder"):
            load_model("duo:" + path, "cpu")


def test_duo_folder_with_config_loads_through_cli_with_gpt2(tmp_path, one_thread):
    """A folder as Duo's hub exports hold it (config.json with n_heads / model_length, a flat state dict with
    backbone.* keys): load_model("duo:FOLDER") reads the head count and length there, and K = 50258 means this
    repo's GPT-2 tokenizer, whose ids are Duo's."""
    sd = duo_backbone(K=50258, d=32)
    folder = tmp_path / "hub"
    folder.mkdir()
    torch.save({"backbone." + k: v for k, v in sd.items()}, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps({"n_heads": 4, "model_length": 24}))
    model, info = load_model("duo:" + str(folder), "cpu")
    assert (model.config.n_head, model.config.block_size) == (4, 24)
    assert info["meta"] == {"tokenizer": "gpt2"} and info["train_config"]["noise_schedule"] == "loglinear"
    x = torch.randint(0, 50258, (2, 8), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.1, 2.0])
    torch.testing.assert_close(model.double()(x, sigma), reference_forward(sd, x, sigma, n_head=4), **DUO64)


@pytest.mark.slow
def test_sample_and_eval_scripts_accept_a_duo_checkpoint(tmp_path):
    sd = duo_backbone(K=50258, d=32)
    torch.save(lightning_ckpt(sd), tmp_path / "duo.ckpt")
    (tmp_path / "text.txt").write_text("The os module provides a portable way of using operating system "
                                       "dependent functionality. " * 40)
    spec = f"duo:{tmp_path / 'duo.ckpt'}"
    p = subprocess.run([sys.executable, "eval_ppl.py", "--ckpt", spec, "--metric", "zeroshot", "--dataset",
                        str(tmp_path / "text.txt"), "--seq_len", "32", "--rel_se", "0",
                        "--out", str(tmp_path / "z.json")],     # --rel_se 0: 2 rounds (the loading is what's tested)
                       cwd=HERE, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads((tmp_path / "z.json").read_text())
    assert result["ckpt"] == spec and result["results"][0]["tokens"] > 0 and result["results"][0]["ppl"] > 1
    p = subprocess.run([sys.executable, "sample.py", "--ckpt", spec, "--num_samples", "2", "--steps", "3",
                        "--seq_len", "16", "--out", str(tmp_path / "samples.jsonl")],
                       cwd=HERE, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(len(r["ids"]) == 16 and max(r["ids"]) < 50258 for r in rows)
