"""
The denoiser: a bidirectional Transformer that maps a noisy sequence x_t (token ids, or probability
vectors during the curriculum) and its noise level sigma = -log(alpha_t) to logits over the clean token.

Two architectures share one class:
  arch="dit"   Duo's DiT (adaLN-Zero time conditioning, bias-free LayerNorm, GELU MLP, zero-init output).
  arch="llama" SMDM's LLaMA-style encoder (RMSNorm, SwiGLU, no time input, untied head).
time_cond=False gives a DiT without the sigma MLP and adaLN; with causal=True it is the AR baseline.
Loading checkpoints (this repo's and Duo's released ones) is trained/checkpoint.py and trained/duo.py.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.fused_head import Head


@dataclass
class ModelConfig:
    vocab_size: int = 50258  # K: set from the tokenizer at train time
    block_size: int = 1024  # training sequence length (RoPE needs no position table)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    cond_dim: int = 128  # width of the adaLN conditioning vector c (dit only)
    arch: str = "dit"  # "dit" | "llama"
    time_cond: bool = True  # condition on sigma via adaLN (dit only)
    causal: bool = False  # causal attention: the AR baseline
    dropout: float = 0.0  # on the attention and MLP residual branches (train.py sets it from --dropout)
    mlp_hidden: int = None  # default 4 * n_embd
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    vocab_multiple: int = 1  # pad the output layer to a multiple of this (its padding logits are never returned)

    def __post_init__(self):
        """Every field of its type and in its range, however the config was made (flags, a checkpoint, a model
        folder's config.json): else ValueError, its message starting with the field's name."""
        if self.mlp_hidden is None:
            self.mlp_hidden = 4 * self.n_embd
        for name, kind in (("arch", str), ("time_cond", bool), ("causal", bool)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        for name, low in (("vocab_size", 2), ("block_size", 1), ("n_layer", 1), ("n_head", 1), ("n_embd", 2),
                          ("cond_dim", 1), ("mlp_hidden", 1), ("vocab_multiple", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        for name, low, high in (("dropout", 0.0, 1.0), ("rope_base", 0.0, math.inf), ("norm_eps", 0.0, math.inf)):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or not (low <= value < high if name == "dropout" else low < value < high):
                raise ValueError(f"{name} must be a finite number in {'[' if name == 'dropout' else '('}{low:g}, "
                                 f"{high:g}), got {value!r}")
        if self.arch not in ("dit", "llama"):
            raise ValueError(f"arch must be 'dit' or 'llama', got {self.arch!r}")
        if self.arch == "llama" and self.time_cond:
            raise ValueError("arch='llama' has no time input (as in SMDM): set time_cond=False")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd={self.n_embd} must split into n_head={self.n_head} heads of even size")

    @property
    def padded_vocab_size(self):
        """Rows of the output layer: vocab_size rounded up to vocab_multiple (matrix products on GPUs run fastest
        on multiples of 64/128). The extra rows are masked: never returned, sampled or scored."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple


# -----------------------------------------------------------------------------
# presets: plain dicts of ModelConfig overrides

PRESETS = {
    # the CPU demo's model (train.py's tiny preset)
    "tiny": dict(arch="dit", vocab_size=2048, block_size=128, n_layer=4, n_head=4, n_embd=96, cond_dim=64),
    # Duo DiT-small: 169,627,218 params at K=50258; output layer padded to 50304 rows (masked padding, not counted
    # as parameters). Dropout is the training recipe's (train.py --dropout; its preset small: 0.1, as Duo)
    "small": dict(arch="dit", vocab_size=50258, block_size=1024, n_layer=12, n_head=12, n_embd=768, cond_dim=128,
                  vocab_multiple=128),
    "medium": dict(arch="dit", vocab_size=50258, block_size=1024, n_layer=24, n_head=16, n_embd=1024, cond_dim=128,
                   vocab_multiple=128),
}
# the paper's two small-model experiments: DiT-small on OpenWebText (GPT-2 + [PAD]) and on LM1B (bert-base-uncased,
# 139,292,986 params at K = 30522)
PRESETS["owt"] = PRESETS["small"]
PRESETS["lm1b"] = dict(PRESETS["small"], vocab_size=30522, block_size=128)

# SMDM's Diff_LLaMA ladder: (name = non-embedding millions, n_layer, n_head, n_embd, d_ff).
# SMDM's input embedding has a 32001st row for [MASK]; uniform-state diffusion has no mask token,
# so ours has K = 32000 rows in and out: total = SMDM total - n_embd, non-embedding counts identical.
SMDM_LADDER = [
    ("6M", 6, 4, 256, 1024), ("19M", 8, 6, 384, 1536), ("34M", 8, 8, 512, 2048),
    ("48M", 9, 9, 576, 2304), ("66M", 10, 10, 640, 2560), ("75M", 16, 8, 640, 1600),
    ("85M", 13, 10, 640, 2560), ("113M", 12, 12, 768, 3072), ("142M", 15, 12, 768, 3072),
    ("170M", 18, 12, 768, 3072), ("180M", 14, 14, 896, 3584), ("206M", 16, 14, 896, 3584),
    ("231M", 18, 14, 896, 3584), ("268M", 16, 16, 1024, 4096), ("302M", 18, 16, 1024, 4096),
    ("336M", 20, 16, 1024, 4096), ("472M", 18, 10, 1280, 5120), ("551M", 21, 10, 1280, 5120),
    ("571M", 18, 11, 1408, 5632), ("629M", 24, 10, 1280, 5120), ("666M", 21, 11, 1408, 5632),
    ("717M", 19, 12, 1536, 6144), ("761M", 24, 11, 1408, 5632), ("831M", 22, 12, 1536, 6144),
    ("944M", 25, 12, 1536, 6144), ("1028M", 20, 14, 1792, 7168), ("1233M", 24, 14, 1792, 7168),
    ("1476M", 22, 16, 2048, 8192), ("1678M", 25, 16, 2048, 8192), ("2121M", 28, 17, 2176, 8704),
]
PRESETS.update({f"llama_{name}": dict(arch="llama", time_cond=False, vocab_size=32000, block_size=2048,
                                      n_layer=n_layer, n_head=n_head, n_embd=n_embd, mlp_hidden=d_ff,
                                      vocab_multiple=128)
                for name, n_layer, n_head, n_embd, d_ff in SMDM_LADDER})
PRESETS["large"] = PRESETS["llama_1028M"]  # the SMDM "1.1B" model


# -----------------------------------------------------------------------------
# positional and time encodings

def rope_cos_sin(positions, head_dim, base=10000.0, dtype=torch.float32):
    """positions (L,) -> cos, sin (L, head_dim), rotate-half layout: angle m*theta_i, theta_i = base^(-2i/head_dim)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=dtype) / head_dim)
    angles = positions.to(dtype)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x (..., L, head_dim), cos/sin (L, head_dim) -> x with pair (i, i + head_dim/2) rotated by angle m*theta_i
    (GPT-NeoX's rotate-half)."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


def timestep_embedding(sigma, dim=256, max_period=10000.0):
    """sigma (B,) -> (B, dim) features [cos(sigma f_i), sin(sigma f_i)], f_i = exp(-ln(max_period) i / (dim/2))."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=sigma.device, dtype=sigma.dtype) / half)
    args = sigma[:, None] * freqs[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def modulate(x, shift, scale):
    return x * (1 + scale) + shift


def compute_dtype(x):
    """The dtype a matrix product of x runs in: the autocast dtype when autocast is on, else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def norm_modulate(norm, x, shift=None, scale=None):
    """norm(x), adaLN-modulated when shift/scale are given, computed in at least float32 (as Duo) and rounded
    ONCE to the dtype of the matrix product that consumes it: the rounding autocast applies at that product
    anyway, so the values are unchanged, but no float32 copy of the normalised activations is kept for it."""
    y = norm(x)
    if shift is not None:
        y = modulate(y, shift, scale)
    return y.to(compute_dtype(x))


# -----------------------------------------------------------------------------
# layers

class LayerNorm(nn.Module):
    """LayerNorm with a learnable scale and no bias (Duo), computed in at least float32."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = torch.promote_types(x.dtype, torch.float32)
        y = F.layer_norm(x.to(dtype), (x.shape[-1],), eps=self.eps) * self.weight.to(dtype)
        return y.to(x.dtype)


class RMSNorm(LayerNorm):
    """y = w * x / sqrt(mean(x^2) + eps) (SMDM), computed in at least float32."""

    def forward(self, x):
        dtype = torch.promote_types(x.dtype, torch.float32)
        x32 = x.to(dtype)
        y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight.to(dtype)
        return y.to(x.dtype)


class Attention(nn.Module):
    """Multi-head self-attention with RoPE on q and k; bidirectional unless config.causal."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.causal = config.n_head, config.causal
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, cos, sin):
        """x (B, L, d), cos/sin (L, head_dim) -> (B, L, d)"""
        B, L, d = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (B, H, L, head_dim)
        return self.proj(y.transpose(1, 2).reshape(B, L, d))


class GeluMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.mlp_hidden)
        self.out = nn.Linear(config.mlp_hidden, config.n_embd)

    def forward(self, x):
        return self.out(F.gelu(self.fc(x), approximate="tanh"))


class SwiGLU(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.w2 = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.w3 = nn.Linear(config.mlp_hidden, config.n_embd, bias=False)

    def forward(self, x):
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


class Block(nn.Module):
    """Pre-norm Transformer block; with time_cond, adaLN-Zero: shift/scale the norms, gate the branches by c."""

    def __init__(self, config):
        super().__init__()
        Norm, MLP = (LayerNorm, GeluMLP) if config.arch == "dit" else (RMSNorm, SwiGLU)
        self.norm1 = Norm(config.n_embd, config.norm_eps)
        self.attn = Attention(config)
        self.norm2 = Norm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)
        self.adaLN = nn.Linear(config.cond_dim, 6 * config.n_embd) if config.time_cond else None

    def forward(self, x, cos, sin, c=None):
        """x (B, L, d), c (B, cond_dim) or None -> (B, L, d)"""
        if self.adaLN is None:
            x = x + self.dropout(self.attn(norm_modulate(self.norm1, x), cos, sin))
            return x + self.dropout(self.mlp(norm_modulate(self.norm2, x)))
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN(c)[:, None].chunk(6, dim=2)
        x = x + gate1 * self.dropout(self.attn(norm_modulate(self.norm1, x, shift1, scale1), cos, sin))
        return x + gate2 * self.dropout(self.mlp(norm_modulate(self.norm2, x, shift2, scale2)))


# -----------------------------------------------------------------------------
# the model

class DiffusionTransformer(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        d, dit = config.n_embd, config.arch == "dit"
        self.wte = nn.Embedding(config.vocab_size, d)  # E (K, d); soft inputs use x @ E
        if config.time_cond:
            self.sigma_map = nn.Sequential(nn.Linear(256, config.cond_dim), nn.SiLU(),
                                           nn.Linear(config.cond_dim, config.cond_dim))
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.norm_f = LayerNorm(d, config.norm_eps) if dit else RMSNorm(d, config.norm_eps)
        self.adaLN_f = nn.Linear(config.cond_dim, 2 * d) if config.time_cond else None
        self.lm_head = nn.Linear(d, config.padded_vocab_size, bias=dit)
        # RoPE tables for positions < block_size, built once (not per forward); not saved in checkpoints
        cos, sin = rope_cos_sin(torch.arange(config.block_size), d // config.n_head, config.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self):
        config = self.config
        if config.arch == "dit":
            # Duo: nn.Linear defaults, E like nn.Linear, adaLN and output zero (identity blocks, uniform output)
            nn.init.kaiming_uniform_(self.wte.weight, a=math.sqrt(5))
            zeroed = [self.lm_head] + ([self.adaLN_f] + [b.adaLN for b in self.blocks] if config.time_cond else [])
            for layer in zeroed:
                nn.init.zeros_(layer.weight)
                if layer.bias is not None:
                    nn.init.zeros_(layer.bias)
        else:
            # SMDM: N(0, sqrt(2/(5d))), residual output projections N(0, 1/(sqrt(d) n_layer))
            std = math.sqrt(2.0 / (5 * config.n_embd))
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, mean=0.0, std=std)
            for block in self.blocks:
                for weight in (block.attn.proj.weight, block.mlp.w3.weight):
                    nn.init.normal_(weight, mean=0.0, std=1.0 / (math.sqrt(config.n_embd) * config.n_layer))
            nn.init.zeros_(self.lm_head.weight[config.vocab_size:])

    def num_params(self, non_embedding=False):
        """Total parameter count (the output layer's padding rows are not parameters of the model: they are
        never used); non_embedding drops the input embedding and the output projection."""
        padding = (self.config.padded_vocab_size - self.config.vocab_size) * (
            self.config.n_embd + (self.lm_head.bias is not None))
        n = sum(p.numel() for p in self.parameters()) - padding
        if non_embedding:
            n -= self.wte.weight.numel() + sum(p.numel() for p in self.lm_head.parameters()) - padding
        return n

    def rope(self, L, dtype, device):
        """cos, sin (L, head_dim) in `dtype`: the cached float32 tables when they fit, else computed (a float64
        model converts its buffers to float64, but their values stay float32's, so it computes its own)."""
        if L <= self.rope_cos.shape[0] and self.rope_cos.dtype == dtype == torch.float32:
            return self.rope_cos[:L], self.rope_sin[:L]
        return rope_cos_sin(torch.arange(L, device=device), self.config.n_embd // self.config.n_head,
                            self.config.rope_base, dtype=dtype)

    def forward(self, x, sigma=None, return_head=False, keep_logits=True):
        """x: (B, L) token ids, (B, L, V) probabilities, or (ids, probs) each (B, L, k): probabilities given on k
        tokens per position (zero elsewhere); sigma: (B,) noise level -log(alpha_t).
        -> logits (B, L, V), or with return_head a kernels.fused_head.Head (the final hidden state and the output
        layer, in the dtype the logits would be computed in; keep_logits: its chunks' logits kept for backward, else
        recomputed) for the losses that never build the logits."""
        config = self.config
        B, L = (x[0] if isinstance(x, tuple) else x).shape[:2]
        E = self.wte.weight
        # embedding and sigma MLP in full precision, the blocks under the caller's autocast (as in Duo); the
        # curriculum's soft tokens (k rows of E per position: k times a lookup's reads) are summed in the autocast
        # dtype, then the residual stream goes on in full precision
        bag_dtype = compute_dtype(E)
        with torch.autocast(device_type=E.device.type, enabled=False):
            if isinstance(x, tuple):
                ids, probs = x
                h = F.embedding_bag(ids.reshape(B * L, -1), E.to(bag_dtype), mode="sum",
                                    per_sample_weights=probs.reshape(B * L, -1).to(bag_dtype))
                h = h.view(B, L, -1).to(E.dtype)
            elif x.is_floating_point():
                if x.shape[-1] != config.vocab_size:
                    raise ValueError(f"soft input has {x.shape[-1]} classes, model vocab_size is {config.vocab_size}")
                h = x.to(E.dtype) @ E
            else:
                h = self.wte(x)
            c = None
            if config.time_cond:
                if sigma is None:
                    raise ValueError("time_cond=True: forward needs sigma = -log(alpha_t), shape (B,)")
                sigma = torch.as_tensor(sigma, dtype=E.dtype, device=E.device).reshape(-1).expand(B)
                c = F.silu(self.sigma_map(timestep_embedding(sigma)))
        cos, sin = self.rope(L, torch.promote_types(E.dtype, torch.float32), E.device)
        for block in self.blocks:
            h = block(h, cos, sin, c)
        shift = scale = None
        if c is not None:
            shift, scale = self.adaLN_f(c)[:, None].chunk(2, dim=2)
        h = norm_modulate(self.norm_f, h, shift, scale)
        V, W, b = config.vocab_size, self.lm_head.weight, self.lm_head.bias
        if return_head:
            return Head(h, W.to(h.dtype), None if b is None else b.to(h.dtype), V, keep_logits=keep_logits)
        logits = self.lm_head(h)
        return logits if logits.shape[-1] == V else logits[..., :V]


def build_model(config):
    """ModelConfig (or a dict of its fields) -> DiffusionTransformer"""
    return DiffusionTransformer(config if isinstance(config, ModelConfig) else ModelConfig(**config))


# -----------------------------------------------------------------------------

if __name__ == "__main__":
    print("| preset | arch | layers | width | heads | vocab | params | non-embedding |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, overrides in PRESETS.items():
        config = ModelConfig(**overrides)
        with torch.device("meta"):  # shapes only, no memory
            model = DiffusionTransformer(config)
        print(f"| {name} | {config.arch} | {config.n_layer} | {config.n_embd} | {config.n_head} | {config.vocab_size} "
              f"| {model.num_params():,} | {model.num_params(non_embedding=True):,} |")
