"""Every fast path against the plain path it replaces: the chunked float32 log-sum-exp on bf16 logits, the SDDLM
losses on bf16 logits, bf16 autocast, torch.compile, seeded determinism of the training step, and bench.py itself (its FLOP formula against torch's FLOP counter, and an end-to-end run).
Tolerances are stated where they are used; the bf16 ones follow from one rounding to 8 significant bits."""
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import bench
import diffusion
import losses
from model import ModelConfig, build_model
import train
from train import TrainConfig, loss_terms, model_config_for, token_mean

BF16_U = 2.0 ** -8      # unit roundoff of bf16 (8 significant bits): one rounding errs by at most this, relatively
SMALL = dict(preset="tiny", block_size=16, batch_size=4, n_layer=2, n_head=2, n_embd=32)


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py


def small_model(loss="sddlm", vocab_size=61, seed=0, perturb=0.05, **overrides):
    """A 2-layer DiT (or its causal twin for 'ar') from train.py's config path, with the zero-initialised
    output and adaLN layers perturbed so that every parameter gets a gradient."""
    tcfg = TrainConfig(**{**SMALL, "loss": loss, **overrides})
    torch.manual_seed(seed)
    model = build_model(model_config_for(tcfg, vocab_size))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(perturb * torch.randn_like(p))
    return model, tcfg


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# -----------------------------------------------------------------------------
# logsumexp_fp32: chunked float32 log-sum-exp of bf16 logits

def lse_case():
    """30 rows of V = 257 bf16 logits: moderate rows, a row with masked (-inf) entries, a row of large logits
    (exp overflows float32 without the max shift)."""
    g = torch.Generator().manual_seed(3)
    x = 3 * torch.randn(5, 6, 257, generator=g)
    x[0, 0, :40] = float("-inf")
    x[1, 1] *= 40
    return x.bfloat16()


@pytest.mark.parametrize("chunk_rows", [1, 4, 7, 30, 64])  # 4 and 7 leave a ragged last chunk; 64 > 30 rows
def test_logsumexp_fp32_matches_float64_logsumexp_for_every_chunk_size(chunk_rows):
    x = lse_case().requires_grad_(True)
    lse = losses.logsumexp_fp32(x, chunk_elems=chunk_rows * x.shape[-1])
    x64 = x.detach().double().requires_grad_(True)
    ref = torch.logsumexp(x64, -1)
    assert lse.dtype == torch.float32 and lse.shape == (5, 6)
    torch.testing.assert_close(lse.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(lse, losses.logsumexp_fp32(x.detach(), chunk_elems=x.numel()))  # chunking changes no bit
    w = torch.randn(5, 6, generator=torch.Generator().manual_seed(4))
    grad, = torch.autograd.grad((lse * w).sum(), x)
    ref_grad, = torch.autograd.grad((ref * w.double()).sum(), x64)      # softmax(x) * w
    assert grad.dtype == torch.bfloat16
    # each entry is one float32 product rounded once to bf16: relative error <= u (+ float32 exp error)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1.01 * BF16_U, atol=1e-30)
    assert (grad[0, 0, :40] == 0).all()


def test_logsumexp_fp32_saves_only_the_bf16_logits_and_one_float_per_row():
    x = lse_case().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        losses.logsumexp_fp32(x, chunk_elems=4 * x.shape[-1])
    assert sorted((str(t.dtype), t.numel()) for t in saved) == [("torch.bfloat16", x.numel()), ("torch.float32", 30)]


# -----------------------------------------------------------------------------
# the objectives on bf16 logits vs float64 logits holding the same rounded values

def loss_case(V=1000, B=2, L=48, seed=5):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(B, L, V, generator=g)).bfloat16()
    x0 = torch.randint(0, V, (B, L), generator=g)
    alpha_t = torch.tensor([[0.3], [0.8]])
    xt = diffusion.sample_xt(x0, alpha_t, V, g)
    neg = torch.randint(0, V, (B, L), generator=g)
    upstream = torch.randn(B, L, generator=g)
    return logits, x0, xt, neg, alpha_t, upstream


LOSS_CALLS = {
    "naive": lambda z, x0, xt, neg, a: losses.naive_denoising_loss(z, x0),
    "sddlm": lambda z, x0, xt, neg, a: losses.sddlm_loss(z, x0, xt),
    "sddlm_v1": lambda z, x0, xt, neg, a: losses.sddlm_v1_loss(z, x0, xt, neg=neg),
    "sddlm_v2": lambda z, x0, xt, neg, a: losses.sddlm_v2_loss(z, x0, xt),
    "duo": lambda z, x0, xt, neg, a: losses.usdm_nelbo_loss(z, x0, xt, a, -(1 - 1e-3)),
    "ar": lambda z, x0, xt, neg, a: F.pad(losses.ar_loss(z, x0), (0, 1)),
}


@pytest.mark.parametrize("name", list(LOSS_CALLS))
def test_every_loss_on_bf16_logits_matches_float64_on_the_same_values(name):
    logits, x0, xt, neg, alpha_t, upstream = loss_case()
    bf = logits.clone().requires_grad_(True)
    f64 = logits.double().requires_grad_(True)
    call = LOSS_CALLS[name]
    low, ref = call(bf, x0, xt, neg, alpha_t), call(f64, x0, xt, neg, alpha_t.double())
    assert low.dtype == torch.float32
    # the inputs are exact in both; only float32 accumulation separates the values
    torch.testing.assert_close(low.double(), ref.detach(), rtol=2e-5, atol=2e-5)
    g_low, = torch.autograd.grad((low * upstream).sum(), bf)
    g_ref, = torch.autograd.grad((ref * upstream.double()).sum(), f64)
    # d loss / d logit_v = w (p_v - [v = target]) (a difference of two such terms for V1/V2): autograd adds
    # the bf16-rounded parts (w p_v from the log-sum-exp, -w from each gather) in bf16, <= 4 roundings of
    # numbers <= |w|; the NELBO is float32 throughout and rounded once at the end
    bound = BF16_U * (g_ref.abs().max().item() if name == "duo" else 4 * upstream.abs().max().item())
    torch.testing.assert_close(g_low.double(), g_ref, rtol=0, atol=bound)


def confident_case(V=512, B=4, L=32):
    """Logits whose target token has probability 0.9 to 0.99: the regime of a model that is learning."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(B, L, V, generator=g)
    x0 = torch.randint(0, V, (B, L), generator=g)
    logits.scatter_(-1, x0[..., None], 9.0 + 2 * torch.rand(B, L, 1, generator=g))
    return logits.bfloat16(), x0


def target_grad_error(grad, ref, x0):
    at = lambda t: t.gather(-1, x0[..., None]).squeeze(-1).double()
    return ((at(grad) - at(ref)).abs() / at(ref).abs()).max().item()


def test_sddlm_target_logit_gradient_is_rounded_once_in_bf16():
    """At p(x0) ~ 0.9-0.99 (a model that is learning) the target entry p - 1 of the gradient is formed in float32
    and rounded once to bf16; a gather plus a separate log-sum-exp would round it twice (~13% error at p = 0.9)."""
    logits, x0 = confident_case()
    p = torch.softmax(logits.double(), -1)
    assert 0.9 < p.gather(-1, x0[..., None]).min() and p.gather(-1, x0[..., None]).max() < 0.995
    bf = logits.clone().requires_grad_(True)
    g, = torch.autograd.grad(losses.naive_denoising_loss(bf, x0).sum(), bf)
    ref = p - F.one_hot(x0, logits.shape[-1]).double()
    assert target_grad_error(g, ref, x0) <= 4 * BF16_U


@pytest.mark.parametrize("name", ["naive", "sddlm", "sddlm_v1", "sddlm_v2", "ar"])
def test_sddlm_family_keeps_no_float32_vocabulary_sized_tensor_for_backward(name):
    logits, x0, xt, neg, alpha_t, _ = loss_case()
    big = []

    def pack(t):
        if t.dtype != torch.bfloat16 and t.numel() >= logits[0].numel():
            big.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        LOSS_CALLS[name](logits.clone().requires_grad_(True), x0, xt, neg, alpha_t)
    assert big == []


# -----------------------------------------------------------------------------
# the model's fast kernels: bf16 autocast for training, SDPA's CPU kernels
# (test_model.py checks the bf16 forward and SDPA in float64 against hand-written attention)

def test_bf16_autocast_training_gradients_are_close_to_float32():
    model, tcfg = small_model("sddlm_v1")
    x0 = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(1))
    t = diffusion.sample_t(4, torch.Generator().manual_seed(2))
    out = {}
    for name, ctx in (("f32", torch.autocast("cpu", enabled=False)), ("bf16", torch.autocast("cpu", torch.bfloat16))):
        model.zero_grad()
        with ctx:
            loss = token_mean(loss_terms(model, tcfg, x0, t, 0, torch.Generator().manual_seed(3))[0], None)
        loss.backward()
        out[name] = (loss.item(), grads(model))
    (l32, g32), (l16, g16) = out["f32"], out["bf16"]
    assert abs(l16 - l32) < 1e-2 * abs(l32)
    assert (g16 - g32).norm() < 5e-2 * g32.norm()
    assert F.cosine_similarity(g16, g32, dim=0) > 0.998


# -----------------------------------------------------------------------------
# torch.compile on CPU

def compiler_missing():
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this platform"
    if not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        return "no C++ compiler for TorchInductor's CPU backend"
    return None


@pytest.mark.slow
@pytest.mark.skipif(compiler_missing() is not None, reason=str(compiler_missing()))
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
def test_torch_compile_matches_eager_logits_and_training_gradients():
    model, tcfg = small_model("sddlm_v1", n_layer=1)
    compiled = torch.compile(model)
    x0 = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(1))
    t = diffusion.sample_t(4, torch.Generator().manual_seed(2))
    out = {}
    for name, m in (("eager", model), ("compiled", compiled)):
        model.zero_grad()
        loss, logits = loss_terms(m, tcfg, x0, t, 0, torch.Generator().manual_seed(3))
        token_mean(loss, None).backward()
        out[name] = (logits.detach(), grads(model))
    torch.testing.assert_close(out["compiled"][0], out["eager"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["compiled"][1], out["eager"][1], rtol=1e-4, atol=1e-6)


# -----------------------------------------------------------------------------
# the full training step: finite and reproducible from its seeds

@pytest.mark.parametrize("name", list(train.OBJECTIVES))
def test_training_step_is_finite_and_identical_under_the_same_seeds(name):
    """train.train_step (the step train.py and bench.py run): only its explicit generators may matter."""
    runs = []
    for global_seed in (100, 200):  # dropout is 0, so the global seed must change nothing
        model, tcfg = small_model(name, perturb=0.0)
        gen = torch.Generator().manual_seed(7)
        run = train.Run(model, model, *train.make_optimizer(model, tcfg, torch.device("cpu")), loader=None,
                        gen_shared=gen, gen_local=gen)
        torch.manual_seed(global_seed)
        step_losses = []
        for it in range(2):
            x0 = torch.randint(0, 61, (4, 16), generator=gen)
            step_losses.append(train.train_step(run, tcfg, train.Env(torch.device("cpu")), x0))
        ema = run.ema
        runs.append((torch.stack(step_losses), [p.detach().clone() for p in model.parameters()], ema))
    (losses_a, params_a, ema_a), (losses_b, params_b, ema_b) = runs
    assert torch.isfinite(losses_a).all()
    assert torch.equal(losses_a, losses_b)
    assert all(torch.equal(a, b) for a, b in zip(params_a + ema_a, params_b + ema_b))
    assert any(not torch.equal(a, e) for a, e in zip(params_a, ema_a))  # the step did move the weights


# -----------------------------------------------------------------------------
# bench.py

def test_bench_flop_formula_matches_torch_flop_counter():
    """6 N T + 12 n_layer L d T + 6 d V T against every matmul of a forward + backward, counted by torch
    (the math SDPA backend so the attention matmuls are visible); the only gap is the per-sequence adaLN."""
    model = build_model(ModelConfig(vocab_size=300, block_size=64, n_layer=3, n_head=4, n_embd=64, cond_dim=32))
    x = torch.randint(0, 300, (2, 64))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, torch.full((2,), 0.5)).sum().backward()
    assert counter.get_total_flops() / bench.model_flops_per_step(model, 2, 64) == pytest.approx(1, abs=0.01)


def test_bench_runs_end_to_end_and_reports_every_loss(capsys):
    argv = ["--preset", "tiny", "--block_size", "16", "--batch_size", "2", "--n_layer", "2", "--repeats", "2",
            "--warmup", "1", "--sample_steps", "2", "--json"]
    assert bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["losses"]) == bench.ALL_LOSSES.split(",")
    for name, r in out["losses"].items():
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["act_bytes"] > 0 and len(r["step_ms_all"]) == 2, name
        assert 0 < r["mfu"] and r["peak_mem_bytes"] is None, name      # CPU: no peak memory, never a guess
    assert out["losses"]["duo"]["step_vs_duo"] == 1.0
    assert out["losses"]["duo"]["act_bytes"] > out["losses"]["sddlm"]["act_bytes"]   # the (B, L, V) float32
    assert out["sampler"]["nfe"] == 3 and math.isfinite(out["sampler"]["overhead"])  # 2 steps + the final one
    table = bench.markdown(out)
    assert all(f"| {name} |" in table for name in out["losses"]) and "n/a" in table


def test_bench_rejects_bad_flags_in_one_line():
    with pytest.raises(bench.UsageError, match="--losses"):
        bench.parse_args(["--losses", "sddlm,elbo"])
    with pytest.raises(bench.UsageError, match="--preset"):
        bench.parse_args(["--preset", "huge"])
    assert bench.parse_args(["--json", "--compile"]).json is True
