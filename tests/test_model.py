"""Tests for model.py: each checks the network against an independent computation (counts by hand, float64 references)."""

import math
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

from model import (PRESETS, SMDM_LADDER, DiffusionTransformer, ModelConfig, apply_rope, build_model, rope_cos_sin,
                   timestep_embedding)
from trained.checkpoint import load_checkpoint

TINY = dict(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32, cond_dim=16)
# FORWARD64: a float64 forward of TINY (random_model: weights ~0.3, activations and logits <= 30) against another
# float64 route to the same numbers: < 1000 roundings along a logit's path (d = 32, 4d, L <= 16, V = 50 sums over
# 2 blocks), each of values <= 30: <= 2 * 1000 * 30 * 1.1e-16 = 6.7e-12; a wrong op moves a logit by >= 1e-3.
FORWARD64 = dict(rtol=0, atol=1e-11)
TINY_LLAMA = dict(TINY, arch="llama", time_cond=False, mlp_hidden=48)


def meta_model(**overrides):
    with torch.device("meta"):
        return DiffusionTransformer(ModelConfig(**overrides))


def random_model(seed=0, **overrides):
    """float64 model with every weight perturbed, so zero-initialised adaLN / output layers are active."""
    torch.manual_seed(seed)
    model = DiffusionTransformer(ModelConfig(**overrides)).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


# -----------------------------------------------------------------------------
# parameter counts

def dit_params_by_hand(K, d, n_layer, cond, time_cond=True):
    block = 2 * d + 3 * d * d + d * d + (d * 4 * d + 4 * d) + (4 * d * d + d)  # 2 norms, qkv, out, MLP
    block += (cond * 6 * d + 6 * d) if time_cond else 0  # adaLN
    sigma_map = (256 * cond + cond) + (cond * cond + cond) if time_cond else 0
    final = d + ((cond * 2 * d + 2 * d) if time_cond else 0) + (d * K + K)
    return K * d + sigma_map + n_layer * block + final


def test_dit_small_matches_duo_parameter_count():
    model = meta_model(**PRESETS["small"])
    assert model.num_params() == 169_627_218 == dit_params_by_hand(50258, 768, 12, 128)  # Duo spec §4
    assert model.num_params(non_embedding=True) == 92_380_672  # "92.38M"
    assert meta_model(**dict(PRESETS["small"], vocab_size=30522)).num_params() == 139_292_986
    ar = dict(PRESETS["small"], time_cond=False, causal=True)
    assert meta_model(**ar).num_params() == 162_246_482 == dit_params_by_hand(50258, 768, 12, 128, time_cond=False)
    assert meta_model(**dict(ar, vocab_size=30522)).num_params() == 131_912_250


def smdm_non_embedding(n_layer, d, d_ff):
    return n_layer * (4 * d * d + 3 * d * d_ff + 2 * d) + d


def test_large_matches_smdm_1028M():
    model = meta_model(**PRESETS["large"])
    assert model.num_params(non_embedding=True) == 1_027_677_952 == smdm_non_embedding(20, 1792, 7168)
    # SMDM total has 32001 input rows (the [MASK] row); uniform-state has none
    assert model.num_params() == 1_027_677_952 + 32001 * 1792 + 32000 * 1792 - 1792


SPEC_NON_EMB_MILLIONS = {"6M": 6.29, "75M": 75.39, "170M": 169.90, "472M": 471.91, "1028M": 1027.68, "2121M": 2121.39}


@pytest.mark.parametrize("entry", SMDM_LADDER, ids=[e[0] for e in SMDM_LADDER])
def test_smdm_ladder_counts(entry):
    name, n_layer, n_head, d, d_ff = entry
    model = meta_model(**PRESETS[f"llama_{name}"])
    non_emb = model.num_params(non_embedding=True)
    assert non_emb == smdm_non_embedding(n_layer, d, d_ff)
    assert round(non_emb / 1e6) == int(name[:-1])  # the name is the non-embedding size
    if name in SPEC_NON_EMB_MILLIONS:
        assert round(non_emb / 1e6, 2) == SPEC_NON_EMB_MILLIONS[name]
    assert model.num_params() == non_emb + 2 * 32000 * d


def test_tiny_preset_is_cpu_sized():
    assert 1e6 <= meta_model(**PRESETS["tiny"]).num_params() <= 2e6


# -----------------------------------------------------------------------------
# RoPE, time embedding, attention

def rope_complex(x, positions, base=10000.0):
    """Reference RoPE: pair (x_i, x_{i+h/2}) as a complex number, multiplied by exp(j m theta_i)."""
    half = x.shape[-1] // 2
    theta = base ** (-2 * torch.arange(half, dtype=torch.float64) / x.shape[-1])
    z = torch.complex(x[..., :half], x[..., half:]) * torch.exp(1j * positions.double()[:, None] * theta)
    return torch.cat([z.real, z.imag], dim=-1)


def test_rope_matches_complex_rotation_and_is_identity_at_zero():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 16, dtype=torch.float64)
    positions = torch.arange(7)
    cos, sin = rope_cos_sin(positions, 16, dtype=torch.float64)
    # float64, a rotation of pairs <= 4 in size: <= 4 roundings each (U64 = 1.1e-16): <= 2e-15
    torch.testing.assert_close(apply_rope(x, cos, sin), rope_complex(x, positions), rtol=0, atol=1e-12)
    cos0, sin0 = rope_cos_sin(torch.zeros(7), 16, dtype=torch.float64)
    assert torch.equal(apply_rope(x, cos0, sin0), x)


def test_rope_inner_product_depends_only_on_relative_position():
    torch.manual_seed(0)
    q, k = torch.randn(2, 64, dtype=torch.float64)

    def score(m, n):
        cq, sq = rope_cos_sin(torch.tensor([m]), 64, dtype=torch.float64)
        ck, sk = rope_cos_sin(torch.tensor([n]), 64, dtype=torch.float64)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    # angles m theta up to 2047 rad, rounded by <= 2047 U64 = 2.3e-13 each (cos/sin move as much), times
    # sum |q_i k_i| over the 32 pairs (~41 for unit normals), both scores: <= 2 * 2.3e-13 * 41 = 1.9e-11
    for m, n, shift in [(3, 1, 5), (0, 9, 100), (17, 17, 1000), (2047, 5, -2000)]:
        torch.testing.assert_close(score(m, n), score(m + shift, n + shift), rtol=0, atol=1e-10)
    assert not torch.allclose(score(3, 1), score(1, 3))  # but does depend on m - n


def test_timestep_embedding_formula():
    sigma = torch.tensor([0.0, 0.7, 6.9], dtype=torch.float64)
    emb = timestep_embedding(sigma)
    for b, s in enumerate(sigma.tolist()):
        for i in (0, 1, 64, 127):
            f = math.exp(-math.log(1e4) * i / 128)
            # float64 cos / sin of arguments <= 6.9: the argument's rounding (<= 3 U64 * 6.9) and the function's
            # own (<= 1 U64): <= 2.6e-15
            assert emb[b, i].item() == pytest.approx(math.cos(s * f), abs=1e-12)
            assert emb[b, 128 + i].item() == pytest.approx(math.sin(s * f), abs=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_handwritten_softmax(causal):
    model = random_model(**dict(TINY, causal=causal))
    attn, H, L, d = model.blocks[0].attn, 2, 9, 32
    x = torch.randn(3, L, d, dtype=torch.float64)
    q, k, v = (x @ attn.qkv.weight.T).split(d, dim=-1)  # rows of qkv are [all q; all k; all v]
    heads = lambda t: t.view(3, L, H, d // H).transpose(1, 2)  # (B, H, L, hd)
    q, k, v = heads(q), heads(k), heads(v)
    positions = torch.arange(L)
    q, k = rope_complex(q, positions), rope_complex(k, positions)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d // H)
    if causal:
        scores = scores.masked_fill(torch.ones(L, L).triu(1).bool(), float("-inf"))
    y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(3, L, d) @ attn.proj.weight.T
    cos, sin = rope_cos_sin(positions, d // H, dtype=torch.float64)
    # float64: qkv (d = 32), scores (16), softmax (L = 9), @ v (9), proj (32): < 150 roundings of values <= 10
    # (scores and outputs here): <= 2 * 150 * 10 * U64 = 3.3e-13
    torch.testing.assert_close(attn(x, cos, sin), y, rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch", ["dit", "llama"])
def test_causal_mask_hides_the_future(arch):
    base = TINY if arch == "dit" else TINY_LLAMA
    x = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    x2 = x.clone()
    j = 6
    x2[:, j] = (x[:, j] + 1) % 50
    sigma = torch.tensor([0.5, 1.5], dtype=torch.float64)
    for causal in (True, False):
        model = random_model(**dict(base, causal=causal))
        out, out2 = model(x, sigma), model(x2, sigma)
        earlier_changed = (out[:, :j] - out2[:, :j]).abs().max().item()
        later_changed = (out[:, j:] - out2[:, j:]).abs().amax(dim=(0, 2))
        # causal: exactly 0 (the masked weights are exactly 0, and 0 x a finite value is 0); else one token moves
        # every output by O(1e-4 .. 10) (measured), far above float64 rounding (FORWARD64)
        if causal:
            assert earlier_changed < 1e-12
        else:
            assert earlier_changed > 1e-6
        assert (later_changed > 1e-6).all()  # position j and everything after it sees the change


# -----------------------------------------------------------------------------
# conditioning, soft input, init, precision

def test_init_predicts_uniform_and_adaln_conditions_on_sigma():
    torch.manual_seed(0)
    model = DiffusionTransformer(ModelConfig(**TINY)).double()
    x = torch.randint(0, 50, (2, 10))
    logits = model(x, torch.tensor([0.1, 3.0]))
    assert torch.equal(logits, torch.zeros(2, 10, 50, dtype=torch.float64))  # softmax = uniform over K
    with torch.no_grad():  # output layer active, adaLN still zero: blocks are identity, sigma has no effect
        model.lm_head.weight.normal_()
    torch.testing.assert_close(model(x, torch.full((2,), 0.1)), model(x, torch.full((2,), 5.0)), rtol=0, atol=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN" in name:
                p.normal_(0, 0.2)
    a, b = model(x, torch.full((2,), 0.1)), model(x, torch.full((2,), 5.0))
    assert (a - b).abs().max() > 1e-2
    torch.testing.assert_close(model(x, torch.full((2, 1), 0.1)), a, **FORWARD64)  # (B, 1) sigma broadcasts like (B,)
    with pytest.raises(ValueError, match="sigma"):
        model(x)


def test_time_cond_off_ignores_sigma():
    model = random_model(**dict(TINY, time_cond=False))
    x = torch.randint(0, 50, (2, 8))
    # exactly: sigma is never read, and the same ops run on the same values in this process
    torch.testing.assert_close(model(x), model(x, torch.tensor([0.1, 4.0])), rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["dit", "llama"])
def test_one_hot_soft_input_equals_token_ids(arch):
    model = random_model(**(TINY if arch == "dit" else TINY_LLAMA))
    x = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.2, 1.0, 4.0], dtype=torch.float64)
    one_hot = F.one_hot(x, 50).double()
    torch.testing.assert_close(model(one_hot, sigma), model(x, sigma), **FORWARD64)
    # a mixture of two tokens embeds to the mixture of their embeddings: a 50-term float64 product with two
    # nonzero terms <= 1: <= 4 U64
    mix = 0.25 * one_hot + 0.75 * F.one_hot((x + 1) % 50, 50).double()
    h = 0.25 * model.wte(x) + 0.75 * model.wte((x + 1) % 50)
    torch.testing.assert_close(mix @ model.wte.weight, h, rtol=0, atol=1e-15)


def test_init_distributions_match_specs():
    torch.manual_seed(0)
    dit = DiffusionTransformer(ModelConfig(**dict(TINY, vocab_size=2000, n_embd=256, n_head=4)))
    bound = 1 / math.sqrt(256)  # kaiming_uniform(a=sqrt(5)) on (K, d): U(-1/sqrt(d), 1/sqrt(d))
    # the largest of 512,000 uniform draws falls below 0.99 of the bound with probability 0.99^512000 ~ 0
    assert dit.wte.weight.abs().max() <= bound and dit.wte.weight.abs().max() > 0.99 * bound
    assert torch.equal(dit.lm_head.bias, torch.zeros(2000))
    llama = DiffusionTransformer(ModelConfig(**dict(TINY_LLAMA, vocab_size=2000, n_embd=256, n_head=4, n_layer=4)))
    # a normal sample's standard deviation has relative standard error 1 / sqrt(2 n): within 4.5 of them
    std_is = lambda w, std: w.std().item() == pytest.approx(std, rel=4.5 / math.sqrt(2 * w.numel()))
    assert std_is(llama.wte.weight, math.sqrt(2 / (5 * 256)))
    assert std_is(llama.blocks[0].mlp.w1.weight, math.sqrt(2 / (5 * 256)))
    assert std_is(llama.blocks[1].attn.proj.weight, 1 / (16 * 4))
    assert std_is(llama.blocks[1].mlp.w3.weight, 1 / (16 * 4))
    assert llama.lm_head.bias is None


@pytest.mark.numerics
@pytest.mark.parametrize("arch", ["dit", "llama"])
def test_bf16_autocast_close_to_float32(arch):
    torch.manual_seed(0)
    model = DiffusionTransformer(ModelConfig(**(TINY if arch == "dit" else TINY_LLAMA))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x, sigma = torch.randint(0, 50, (2, 16)), torch.tensor([0.3, 2.0])
    ref = model(x, sigma)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        low = model(x, sigma)
        soft = model(F.softmax(torch.randn(2, 16, 50), dim=-1), sigma)
    assert low.dtype == torch.bfloat16 and torch.isfinite(soft).all()
    # autocast rounds each matmul's inputs and output to bf16 (3 roundings of 2^-8; ~10 matmuls on a logit's
    # path): independent errors ~sqrt(30) 2^-8 = 2.1e-2 of the logits' size (measured 0.4% dit, 1.3% llama), a
    # worst case of 30 2^-8 = 12%; 5% of the largest logit
    assert (low.float() - ref).abs().max() < 0.05 * ref.abs().max()


# -----------------------------------------------------------------------------
# checkpoints

def test_load_checkpoint_round_trip_and_ema(tmp_path):
    config = ModelConfig(**TINY)
    model, ema = build_model(config).eval(), build_model(asdict(config)).eval()
    with torch.no_grad():
        for p, q in zip(model.parameters(), ema.parameters()):
            p.add_(0.1 * torch.randn_like(p))
            q.add_(0.1 * torch.randn_like(q))
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "optimizer": None,
                "model_config": asdict(config), "train_config": {}, "meta": {"vocab_size": 50},
                "step": 7, "data_state": None, "rng": None}, path)
    x, sigma = torch.randint(0, 50, (2, 8)), torch.tensor([0.5, 2.0])
    loaded, ckpt = load_checkpoint(path, use_ema=True)
    assert ckpt["step"] == 7 and not loaded.training
    torch.testing.assert_close(loaded(x, sigma), ema(x, sigma), rtol=0, atol=0)    # the same weights and kernels
    loaded, _ = load_checkpoint(str(path), use_ema=False)
    torch.testing.assert_close(loaded(x, sigma), model(x, sigma), rtol=0, atol=0)


def test_load_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="could not read"):
        load_checkpoint(tmp_path / "junk.pt")
    torch.save({"weights": {}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not an sddlm checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    torch.save({"model": {}, "model_config": asdict(ModelConfig(**TINY))}, tmp_path / "empty.pt")
    with pytest.raises(ValueError, match="do not fit"):
        load_checkpoint(tmp_path / "empty.pt")


def test_config_validation():
    with pytest.raises(ValueError, match="arch"):
        ModelConfig(arch="gpt")
    with pytest.raises(ValueError, match="time_cond=False"):
        ModelConfig(arch="llama")
    with pytest.raises(ValueError, match="n_head"):
        ModelConfig(n_embd=100, n_head=3)


# -----------------------------------------------------------------------------
# the fast paths of the model: padded output layer, the Head output, cached RoPE tables, one rounding of the norms

def padded_twin(model, multiple):
    """model's weights in a model whose output layer is padded to `multiple` (random padding rows)."""
    config = ModelConfig(**{**asdict(model.config), "vocab_multiple": multiple})
    twin = DiffusionTransformer(config).to(model.lm_head.weight.dtype).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("lm_head")}
    V = model.config.vocab_size
    with torch.no_grad():
        twin.load_state_dict(state, strict=False)
        twin.lm_head.weight.normal_()                  # padding rows that would win every argmax if not masked
        twin.lm_head.weight[:V] = model.lm_head.weight
        twin.lm_head.bias.fill_(100.0)
        twin.lm_head.bias[:V] = model.lm_head.bias
    return twin


def test_padded_output_layer_returns_and_scores_only_the_vocab():
    """V = 50 padded to 64: the logits are the same 50 columns (the padding never reaches a caller), the Head
    scores the same numbers, and the padding rows get no gradient; the padding is not counted as parameters."""
    import losses
    model = random_model(**TINY)
    twin = padded_twin(model, 64)
    assert twin.lm_head.weight.shape == (64, 32) and twin.config.padded_vocab_size == 64
    assert twin.num_params() == model.num_params()
    assert twin.num_params(non_embedding=True) == model.num_params(non_embedding=True)
    x, sigma = torch.randint(0, 50, (2, 9)), torch.tensor([0.3, 1.5], dtype=torch.float64)
    ref = model(x, sigma)
    torch.testing.assert_close(twin(x, sigma), ref, **FORWARD64)
    head = twin(x, sigma, return_head=True)
    assert head.vocab_size == 50 and head.weight.shape[0] == 64
    loss = losses.sddlm_v1_loss(head, x, (x + 1) % 50, neg=(x + 3) % 50).sum()
    # 18 token losses, each two log-probabilities of logits within FORWARD64: <= 18 * 2 * 2 * 1e-11 = 7.2e-10
    torch.testing.assert_close(loss, losses.sddlm_v1_loss(ref, x, (x + 1) % 50, neg=(x + 3) % 50).sum(), rtol=0,
                               atol=1e-9)
    loss.backward()
    assert torch.equal(twin.lm_head.weight.grad[50:], torch.zeros(14, 32, dtype=torch.float64))
    assert torch.equal(twin.lm_head.bias.grad[50:], torch.zeros(14, dtype=torch.float64))


@pytest.mark.numerics
def test_checkpoints_from_before_padding_give_identical_outputs(tmp_path):
    """A model_config without vocab_multiple (written before it existed) loads unpadded, bit for bit."""
    config = asdict(ModelConfig(**TINY))
    del config["vocab_multiple"]
    model = random_model(**TINY).float()
    path = tmp_path / "old.pt"
    torch.save({"model": model.state_dict(), "model_config": config}, path)
    loaded, _ = load_checkpoint(path)
    assert loaded.config.vocab_multiple == 1 and loaded.lm_head.weight.shape[0] == 50
    x, sigma = torch.randint(0, 50, (2, 9)), torch.tensor([0.3, 1.5])
    assert torch.equal(loaded(x, sigma), model.eval()(x, sigma))    # the same weights and kernels, in this process


def test_presets_pad_the_gpt2_vocabulary_to_a_multiple_of_128():
    assert ModelConfig(**PRESETS["small"]).padded_vocab_size == 50304
    assert all(ModelConfig(**p).padded_vocab_size % 128 == 0 for n, p in PRESETS.items() if n != "tiny")
    with pytest.raises(ValueError, match="vocab_multiple"):
        ModelConfig(**dict(TINY, vocab_multiple=0))


def test_rope_tables_are_unsaved_buffers_equal_to_fresh_ones():
    model = DiffusionTransformer(ModelConfig(**TINY))
    cos, sin = model.rope(10, torch.float32, torch.device("cpu"))
    ref = rope_cos_sin(torch.arange(10), 16, 10000.0)
    assert torch.equal(cos, ref[0]) and torch.equal(sin, ref[1])
    assert cos.data_ptr() == model.rope_cos.data_ptr()                # a view of the buffer, not a new table
    assert not any(k.startswith("rope") for k in model.state_dict())
    model.double()     # float64 models compute their tables in float64, not from the float32 ones
    cos64, _ = model.rope(10, torch.float64, torch.device("cpu"))
    assert torch.equal(cos64, rope_cos_sin(torch.arange(10), 16, 10000.0, dtype=torch.float64)[0])
    long_cos, _ = model.rope(20, torch.float32, torch.device("cpu"))   # beyond block_size: computed
    assert torch.equal(long_cos, rope_cos_sin(torch.arange(20), 16, 10000.0)[0])


@pytest.mark.numerics
@pytest.mark.parametrize("arch", ["dit", "llama"])
def test_head_output_gives_the_models_logits(arch):
    model = random_model(**(TINY if arch == "dit" else TINY_LLAMA)).float()
    x, sigma = torch.randint(0, 50, (2, 9)), torch.tensor([0.3, 1.5])
    for ctx in (torch.autocast("cpu", enabled=False), torch.autocast("cpu", dtype=torch.bfloat16)):
        with ctx:
            logits, head = model(x, sigma), model(x, sigma, return_head=True)
        assert head.hidden.dtype == head.weight.dtype == logits.dtype
        assert torch.equal(F.linear(head.hidden, head.weight, head.bias), logits)     # the same op, same values


@pytest.mark.numerics
def test_norm_output_is_rounded_once_to_the_matmul_dtype():
    """Under bf16 autocast the adaLN-modulated norm goes to bf16 once: bit for bit what autocast made of the
    float32 value at the next matrix product; its gradient within bf16 rounding of the float32 one."""
    from model import LayerNorm, modulate, norm_modulate
    torch.manual_seed(0)
    norm = LayerNorm(32, 1e-5)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(32))
    x = torch.randn(2, 5, 32, requires_grad=True)
    shift, scale = 0.1 * torch.randn(2, 1, 32), 0.1 * torch.randn(2, 1, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm_modulate(norm, x, shift, scale)
    ref = modulate(norm(x), shift, scale)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref.bfloat16())
    w = torch.randn(2, 5, 32)
    g, = torch.autograd.grad((y.float() * w).sum(), x)
    g_ref, = torch.autograd.grad((ref * w).sum(), x)
    # the incoming gradient is rounded to bf16 (2^-8), then the norm's backward sums d = 32 products of it with the
    # float32 normalised values (mean terms cancel), a few more roundings: <= 4 * 2^-8 of the largest entry
    torch.testing.assert_close(g, g_ref, rtol=0, atol=4 * 2 ** -8 * g_ref.abs().max().item())


def test_top_k_soft_input_embeds_like_the_dense_probabilities():
    """(ids, probs) on k tokens per position (the curriculum's input) = the dense probability vector @ E."""
    model = random_model(**TINY)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(50, generator=g)[:4] for _ in range(18)]).view(2, 9, 4)
    probs = torch.softmax(torch.randn(2, 9, 4, generator=g, dtype=torch.float64), -1)
    dense = torch.zeros(2, 9, 50, dtype=torch.float64).scatter_(-1, ids, probs)
    sigma = torch.tensor([0.3, 1.5], dtype=torch.float64)
    torch.testing.assert_close(model((ids, probs), sigma), model(dense, sigma), **FORWARD64)
