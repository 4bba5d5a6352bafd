"""Every fast path against the plain path it replaces: the chunked float32 log-sum-exp on bf16 logits, the SDDLM
losses on bf16 logits, bf16 autocast, torch.compile, seeded determinism of the training step, and bench/bench.py itself (its FLOP formula against torch's FLOP counter, and an end-to-end run).
Tolerances are derived where they are used (tests/conftest.py): the bf16 ones from one rounding to 8 significant
bits, the float32 ones from the sums they take (a V-term sum errs by <= (V + a few) u, in any order)."""
import dataclasses
import gc
import json
import math
import shutil
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bench import bench
import curriculum.gaussian as curriculum
import diffusion
from kernels import gumbel
import losses
from kernels import fused_head
from model import ModelConfig, build_model
from plumbing.distributed import Env
from plumbing.run import Run
import train
from diffusion import loss_terms, token_mean
from train import TrainConfig, model_config_for
from conftest import reduction_tol, unit_roundoff
from test_losses import usdm_sizes

BF16_U = 2.0 ** -8      # unit roundoff of bf16 (8 significant bits): one rounding errs by at most this, relatively
U32, U64 = unit_roundoff(torch.float32), unit_roundoff(torch.float64)


def lse_tol(V):
    """A float32 log-sum-exp of V values: the sum of exp(z - max) (each <= (1 + |z - max|) U32 off, |z - max| <= 12
    where a term is not negligible) errs by <= (V + 13) U32 relative in any order, so its log by that absolutely;
    the final max + log adds one rounding of |lse| (the caller's rtol)."""
    return (V + 13) * U32
SMALL = dict(preset="tiny", block_size=16, batch_size=4, n_layer=2, n_head=2, n_embd=32)


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py


def compiler_missing():
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this platform"
    if not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        return "no C++ compiler for TorchInductor's CPU backend"
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":     # its generated C++ uses at::vec, undeclared there
        return "TorchInductor's C++ does not build under ATEN_CPU_CAPABILITY=default (torch 2.13)"
    return None


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


@pytest.mark.numerics
@pytest.mark.parametrize("name", list(LOSS_CALLS))
def test_every_loss_on_bf16_logits_matches_float64(name):
    logits, x0, xt, neg, alpha_t, upstream = loss_case()
    bf = logits.clone().requires_grad_(True)
    f64 = logits.double().requires_grad_(True)
    call = LOSS_CALLS[name]
    low, ref = call(bf, x0, xt, neg, alpha_t), call(f64, x0, xt, neg, alpha_t.double())
    assert low.dtype == torch.float32
    # the inputs are exact in both; only float32 accumulation separates the values: log p = z - lse within
    # lse_tol(V) + 2 U32 |lse| (|lse| <= 40), V1 / V2 subtract two such; the NELBO within its rounding of the
    # sizes of its terms (test_losses.usdm_sizes), ~3V + 10 roundings
    if name == "duo":
        tol = 2 * (3 * 1000 + 10) * U32 * usdm_sizes(f64.detach(), x0, xt, alpha_t.double(), -(1 - 1e-3))
        assert ((low.double() - ref.detach()).abs() <= tol).all()
    else:
        torch.testing.assert_close(low.double(), ref.detach(), rtol=0, atol=2 * (lse_tol(1000) + 80 * U32))
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


@pytest.mark.numerics
def test_sddlm_target_logit_gradient_is_rounded_once_in_bf16():
    """At p(x0) ~ 0.9-0.99 (a model that is learning) the target entry p - 1 of the gradient is formed in float32
    and rounded once to bf16; a gather plus a separate log-sum-exp would round it twice (~13% error at p = 0.9)."""
    logits, x0 = confident_case()
    p = torch.softmax(logits.double(), -1)
    assert 0.9 < p.gather(-1, x0[..., None]).min() and p.gather(-1, x0[..., None]).max() < 0.995
    bf = logits.clone().requires_grad_(True)
    g, = torch.autograd.grad(losses.naive_denoising_loss(bf, x0).sum(), bf)
    ref = p - F.one_hot(x0, logits.shape[-1]).double()
    # float32 p (V = 512: <= (V + 13) U32 = 3.1e-5 relative) minus 1 magnifies by p / (1 - p) <= 200 (6.3e-3),
    # then one bf16 rounding (3.9e-3): <= 1.02e-2 < 4 BF16_U = 1.6e-2; a second rounding would err by ~13%
    assert target_grad_error(g, ref, x0) <= 4 * BF16_U


@pytest.mark.parametrize("name", ["naive", "sddlm", "sddlm_v1", "sddlm_v2", "ar"])
def test_sddlm_family_keeps_no_float32_vocab_tensor_for_backward(name):
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
# the output layer fused with the loss (kernels/fused_head.py's Head) against logits computed in full

def head_case(dtype, V=61, V_pad=64, B=2, L=24, d=16, seed=9):
    """A Head (hidden, W, b) with padding rows, tokens, and the plain logits F.linear(h, W, b)[..., :V]."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    weight = (torch.randn(V_pad, d, generator=g, dtype=torch.float64) / 2).to(dtype).requires_grad_(True)
    bias = torch.randn(V_pad, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    x0, xt, neg = (torch.randint(0, V, (B, L), generator=g) for _ in range(3))
    return hidden, weight, bias, x0, xt, neg, torch.randn(B, L, generator=g)


HEAD_LOSSES = {
    "naive": lambda z, x0, xt, neg: losses.naive_denoising_loss(z, x0),
    "sddlm": lambda z, x0, xt, neg: losses.sddlm_loss(z, x0, xt),
    "sddlm_v1": lambda z, x0, xt, neg: losses.sddlm_v1_loss(z, x0, xt, neg=neg),
    "sddlm_v2": lambda z, x0, xt, neg: losses.sddlm_v2_loss(z, x0, xt),
    "ar": lambda z, x0, xt, neg: F.pad(losses.ar_loss(z, x0), (0, 1)),
    "duo_lean": lambda z, x0, xt, neg: fused_head.usdm_nelbo_loss_lean(z, x0, xt, torch.tensor([[0.3], [0.8]]), -0.999,
                                                                   chunk_elems=7 * 64),
}


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", list(HEAD_LOSSES))
def test_loss_on_a_head_equals_the_loss_on_its_logits(name, dtype):
    """Given the output layer and its input (with padding columns; duo_lean in row chunks of 7), each loss
    returns the values and gradients (hidden, W, b) of the same loss on the logits F.linear(h, W, b)[..., :V].
    float64: to rounding. bf16: the chunk logits are the same bf16 numbers, so values agree to float32 rounding;
    the gradients of W and b are summed over chunks in float32 (the plain route rounds once at the end), within
    a few bf16 roundings."""
    hidden, weight, bias, x0, xt, neg, upstream = head_case(dtype)
    call = HEAD_LOSSES[name]
    ref = call(F.linear(hidden, weight, bias)[..., :61], x0, xt, neg)
    got = call(fused_head.Head(hidden, weight, bias, 61), x0, xt, neg)
    g_ref = torch.autograd.grad((ref * upstream).sum(), (hidden, weight, bias))
    g_got = torch.autograd.grad((got * upstream).sum(), (hidden, weight, bias))
    # values: float64, the logits' d = 16 products in other blocks and a V-term sum (< 100 roundings of values
    # <= 45): <= 2 * 100 * 45 * U64 = 1e-12; bf16, the same bf16 logits and float32 sums: as the test above, for
    # V = 61; duo_lean: 2 (3V + 10) u of the sizes of its terms (usdm_sizes)
    u = U64 if dtype == torch.float64 else U32
    if name == "duo_lean":
        logits = F.linear(hidden, weight, bias)[..., :61].detach().double()
        tol = 2 * (3 * 61 + 10) * u * usdm_sizes(logits, x0, xt, torch.tensor([[0.3], [0.8]]), -0.999)
        assert ((got.double() - ref.double()).abs() <= tol).all()
    else:
        torch.testing.assert_close(got.double(), ref.double(), rtol=0,
                                   atol=1e-12 if dtype == torch.float64 else 2 * (lse_tol(61) + 80 * U32))
    for a, b, what in zip(g_got, g_ref, ("hidden", "W", "b")):
        assert a.dtype == b.dtype
        # float64: sums over <= B L = 48 rows and V_pad = 64 columns: reduction_tol(112) of the largest entry's
        # size (1e-13 here) is far below 1e-12. bf16: the logits' gradient is rounded to bf16 (<= 4 roundings, as
        # in the test above) and W's and b's sums over rows are rounded once at the end of float32 sums in both
        # routes, <= 2 more each side: 8 BF16_U of the largest entry
        bound = 1e-12 if dtype == torch.float64 else 8 * BF16_U * b.abs().max().item()
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=bound, msg=what)
    assert g_got[1][61:].abs().max() == 0 and g_got[2][61:].abs().max() == 0     # padding: no gradient


def test_head_log_probs_in_row_chunks_equal_one_chunk():
    hidden, weight, bias, x0, xt, neg, upstream = head_case(torch.float64)
    head = fused_head.Head(hidden, weight, bias, 61)
    one = head.log_probs(x0, neg)
    many = dataclasses.replace(head, chunk_elems=5 * 64).log_probs(x0, neg)   # 5 rows a chunk: 10 chunks, ragged last
    # float64, the same per-row ops; only the matmuls' blocking may differ: d = 16 products and a 61-term sum,
    # < 80 roundings of values <= 12 (|h| |W| and |log p| here): <= 2 * 80 * 12 * U64 = 2.1e-13
    for a, b in zip(one, many):
        torch.testing.assert_close(a, b, rtol=0, atol=4e-13)
    g_one = torch.autograd.grad((one[0] * upstream + one[1]).sum(), (hidden, weight, bias))
    g_many = torch.autograd.grad((many[0] * upstream + many[1]).sum(), (hidden, weight, bias))
    for a, b in zip(g_one, g_many):       # W and b: sums over the 48 rows in 10 chunks, terms <= 10: 1e-13
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["log_probs", "duo_lean"])
def test_losses_on_a_head_keep_no_vocab_tensor_for_backward(name):
    """The point of the Head: with the logits in several chunks and keep_logits off nothing of (B, L, V) size is
    kept for backward (only hidden, W, b and per-row values); with keep_logits on, or logits that fit in one
    chunk, exactly the chunks' logits are kept, in the Head's dtype (no float32 copy)."""
    hidden, weight, bias, x0, xt, neg, _ = head_case(torch.bfloat16, V=2000, V_pad=2048, L=64)
    call = {"log_probs": lambda head: head.log_probs(x0, neg),
            "duo_lean": lambda head: fused_head.usdm_nelbo_loss_lean(head, x0, xt, 0.3, -0.999,
                                                                     chunk_elems=head.chunk_elems)}[name]
    for chunk, keep, kept in ((20 * 2048, False, []), (20 * 2048, True, [(20, 2048)] * 6 + [(8, 2048)]),
                              (1 << 27, False, [(128, 2048)])):
        saved = []

        def pack(t):
            if t.dim() == 2 and t.shape[-1] == 2048:
                saved.append((t.dtype, tuple(t.shape)))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            call(fused_head.Head(hidden, weight, bias, 2000, keep_logits=keep, chunk_elems=chunk))
        assert saved == [(torch.bfloat16, s) for s in kept], (chunk, keep)


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_lean_nelbo_equals_the_plain_nelbo_on_logits(dtype):
    """usdm_nelbo_loss_lean = usdm_nelbo_loss in row chunks (3 rows, ragged last): values and the logits' gradient
    to float32 rounding (float64: exactly the same arithmetic per row), for per-sequence and scalar alphas."""
    logits, x0, xt, neg, alpha_t, upstream = loss_case(V=300)
    logits = logits.to(dtype).requires_grad_(True)
    for a, da in ((alpha_t, torch.tensor([[-0.999], [-0.5]])), (0.42, -1.0)):
        ref = losses.usdm_nelbo_loss(logits, x0, xt, a, da)
        lean = fused_head.usdm_nelbo_loss_lean(logits, x0, xt, a, da, chunk_elems=3 * 300)
        assert lean.dtype == ref.dtype
        # the same formula per row, in row chunks: each route errs from the exact value by <= 2 (3V + 10) u of the
        # sizes of its terms (usdm_sizes), in float32 for bf16 logits
        u = U64 if dtype == torch.float64 else U32
        tol = 2 * (3 * 300 + 10) * u * usdm_sizes(logits.detach().double(), x0, xt, a, da)
        assert ((lean.double() - ref.double()).abs() <= tol).all()
        g_ref, = torch.autograd.grad((ref * upstream).sum(), logits)
        g_lean, = torch.autograd.grad((lean * upstream).sum(), logits)
        # gradients (each entry w (dloss/dz), ~3V + 10 roundings relative to the largest entry's size); bf16: each
        # route rounds its float32 entry once, so they differ by <= 1 bf16 ulp = 2 BF16_U of the entry
        u = 2 * BF16_U if dtype == torch.bfloat16 else 2 * (3 * 300 + 10) * u
        torch.testing.assert_close(g_lean.double(), g_ref.double(), rtol=0, atol=u * g_ref.abs().max().item())


def test_lean_nelbo_keeps_only_the_logits_for_backward():
    logits, x0, xt, neg, alpha_t, _ = loss_case(V=2000, L=64)
    logits.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fused_head.usdm_nelbo_loss_lean(logits, x0, xt, alpha_t, -0.999)
    big = [t for t in saved if t.numel() >= logits.shape[0] * logits.shape[1] * 100]
    assert len(big) == 1 and big[0].untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()


@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.skipif(compiler_missing() is not None, reason=str(compiler_missing()))
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_vocabulary_kernels_equal_the_eager_ones(monkeypatch):
    """On CUDA each chunk's pass over the vocabulary is torch.compile'd into one kernel (fused_head._fused); here the
    same compilation runs on the CPU (TorchInductor's C++ backend) and must give the eager numbers: values and
    gradients of the SDDLM losses and the lean NELBO on bf16 logits and on a bf16 Head, and the sampler's
    log-sum-exps of blocks of the vocabulary."""
    hidden, weight, bias, x0, xt, neg, upstream = head_case(torch.bfloat16)
    logits = F.linear(hidden, weight, bias)[..., :61].detach().requires_grad_(True)

    def run():
        out = {}
        for name, z in (("logits", logits), ("head", fused_head.Head(hidden, weight, bias, 61))):
            loss = losses.sddlm_v1_loss(z, x0, xt, neg=neg, eps=0.01)
            out[name] = (loss, *torch.autograd.grad((loss * upstream).sum(), (logits,) if name == "logits" else
                                                    (hidden, weight, bias)))
            nelbo = fused_head.usdm_nelbo_loss_lean(z, x0, xt, 0.3, -0.999, chunk_elems=7 * 64)
            out[name + " nelbo"] = (nelbo, *torch.autograd.grad((nelbo * upstream).sum(), (
                logits,) if name == "logits" else (hidden, weight, bias)))
        out["block lse"] = (gumbel.block_logsumexp(logits.detach(), 16, chunk_elems=7 * 61),)
        return out

    eager = run()
    nelbo_sizes = usdm_sizes(logits.detach().double(), x0, xt, torch.tensor(0.3), -0.999).max().item()
    compiled = {}
    monkeypatch.setattr(fused_head, "_fused", lambda fn, like: compiled.setdefault(fn, torch.compile(fn, dynamic=True)))
    got = run()
    assert len(compiled) == 4
    for key in eager:
        for a, b in zip(got[key], eager[key]):
            # Inductor sums in its own order: float32 values within 2 (V + 13 + 80) U32 (V = 61; the NELBO: 2 (3V
            # + 10) U32 of its terms' sizes); a bf16 output is one rounding of such a float32: <= 1 ulp (2 BF16_U)
            # apart wherever the two float32 values straddle a rounding boundary
            f32 = 2 * (3 * 61 + 10) * U32 * nelbo_sizes if "nelbo" in key else 2 * (lse_tol(61) + 80 * U32)
            tol = dict(rtol=2 * BF16_U, atol=f32) if a.dtype == torch.bfloat16 else dict(rtol=0, atol=f32)
            torch.testing.assert_close(a.double(), b.double(), **tol, msg=key)


# -----------------------------------------------------------------------------
# the training step: the Head route against the full logits, and the curriculum's top-k input

@pytest.mark.numerics
@pytest.mark.parametrize("name", ["sddlm_v1", "ar", "duo_lean"])
@pytest.mark.parametrize("autocast", [False, True])
def test_training_loss_on_the_head_equals_the_loss_on_the_logits(name, autocast):
    """--head fused gives the objectives a Head (kept or recomputed logits); the loss and every parameter
    gradient equal the same objective on the model's logits, --head plain (float64, or bf16 autocast within bf16
    rounding)."""
    model, tcfg = small_model(name, vocab_size=61, vocab_multiple=16)
    model = model if autocast else model.double()
    x0 = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(1))
    t = diffusion.sample_t(4, torch.Generator().manual_seed(2))
    out = {}
    for route in ("fused", "fused_recompute", "plain"):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            per_token, output = loss_terms(model, dataclasses.replace(tcfg, head=route), x0, t, 0,
                                           torch.Generator().manual_seed(3))
            loss = token_mean(per_token, None)
        assert isinstance(output, torch.Tensor) == (route == "plain")
        loss.backward()
        out[route] = (loss.detach().double(), grads(model).double())
    l_l, g_l = out["plain"]
    for route in ("fused", "fused_recompute"):
        l_h, g_h = out[route]
        if autocast:
            # the same bf16 logits; the loss is float32 sums of V = 64 terms: 2 (V + 13 + 80) U32 = 1.9e-5 relative
            assert abs(l_h - l_l) < 1e-4 * abs(l_l)
            # the logits' gradient and W's are rounded to bf16 at different points (per chunk / once): <= 4
            # roundings per entry, then bf16 matmuls backward through the blocks (inputs rounded again): in norm
            # <= ~5 BF16_U = 2e-2 (measured 3e-4)
            assert (g_h - g_l).norm() < 2e-2 * g_l.norm()
        else:
            # float64: the loss a sum of 64 token terms and V-term sums (< 200 roundings of values <= 10): 4e-13;
            # each gradient entry sums <= 64 token terms through 2 blocks (< 1000 roundings of the terms' sizes,
            # <= the loss's 10): <= 2 * 1000 * 10 * U64 = 2.2e-12, inside atol 1e-11
            torch.testing.assert_close(l_h, l_l, rtol=0, atol=1e-12)
            torch.testing.assert_close(g_h, g_l, rtol=0, atol=1e-11)


def test_curriculum_step_trains_embedding_through_top_k_input():
    """During the curriculum the model gets curriculum.SoftTokens and the loss reaches E through them exactly
    as through the dense soft input (float64, same draws)."""
    model, tcfg = small_model("sddlm", vocab_size=64, curriculum_iters=10)
    model = model.double()
    x0 = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    t = diffusion.sample_t(4, torch.Generator().manual_seed(2))
    c = diffusion.corrupt(tcfg, x0, t, 0, 64, torch.Generator().manual_seed(3), diffusion.draw_noise(4, 16, 64, None, "cpu"))
    assert isinstance(c.net_in, curriculum.SoftTokens)
    dense = torch.zeros(4, 16, 64, dtype=torch.float64).scatter_(-1, c.net_in.ids, c.net_in.probs.double())
    sigma = diffusion.sigma_from_alpha(c.alpha_t.squeeze(-1))
    result = []
    for net_in in (c.net_in, dense):
        model.zero_grad()
        diffusion.OBJECTIVES["sddlm"](model(net_in, sigma, return_head=True), c, 0.0).mean().backward()
        result.append(model.wte.weight.grad.clone())
    assert result[0].abs().max() > 0
    # float64: E's gradient through a k = 32 weighted sum vs a dense V = 64 product (zeros elsewhere), then the
    # same network: < 1000 roundings of values <= 0.1 (measured max |grad|): 2 * 1000 * 0.1 * U64 = 2.2e-14
    torch.testing.assert_close(result[0], result[1], rtol=0, atol=1e-13)


# -----------------------------------------------------------------------------
# the sampler holds no float64 tensor over the vocabulary, also with CFG and top-p

def test_sampler_builds_no_float64_vocab_tensor_with_cfg_top_p(monkeypatch):
    """Every tensor any op of sample.generate returns is watched: float64 appears only for per-token values,
    never (B, L, V) nor (B, L, blocks of V); with CFG and nucleus filtering too."""
    monkeypatch.setattr(gumbel, "GUMBEL_BLOCK", 8)        # V = 61 in 8 blocks
    from torch.utils._python_dispatch import TorchDispatchMode
    from sample import generate

    class Watch(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                    self.largest = max(self.largest, t.numel())
            return out

    model, _ = small_model("sddlm", vocab_size=61)
    B, L = 3, 16
    for kw in (dict(), dict(cfg_w=1.5, prompt_ids=[1, 2, 3], top_p=0.9)):
        with Watch() as watch:
            x = generate(model, B, L, 61, 4, generator=torch.Generator().manual_seed(0), show_progress=False, **kw)
        assert x.shape == (B, L) and x.max() < 61
        assert 0 < watch.largest <= 2 * B * L, kw       # per-token scalars (the CFG batch is 2B)


# -----------------------------------------------------------------------------
# the model's fast kernels: bf16 autocast for training, SDPA's CPU kernels
# (test_model.py checks the bf16 forward and SDPA in float64 against hand-written attention)

@pytest.mark.numerics
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
    # autocast rounds each matmul's inputs and output to bf16 (3 BF16_U per matmul, ~10 matmuls on a token's path):
    # a token's loss moves by ~sqrt(30) BF16_U = 2e-2 relative, independently across the 64 tokens: the mean
    # by ~3e-3 (measured 2.5e-3), 1e-2 = 4 of those; a gradient entry, a sum over tokens of such products, by
    # <= ~sqrt(2 x 30) BF16_U = 3e-2 in norm, 5e-2 (measured 5e-3); cosine > 0.998 is a relative error < 6.3e-2
    assert abs(l16 - l32) < 1e-2 * abs(l32)
    assert (g16 - g32).norm() < 5e-2 * g32.norm()
    assert F.cosine_similarity(g16, g32, dim=0) > 0.998


# -----------------------------------------------------------------------------
# torch.compile on CPU

@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.skipif(compiler_missing() is not None, reason=str(compiler_missing()))
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
@pytest.mark.parametrize("name,curriculum", [("sddlm_v1", 0), ("duo", 0), ("sddlm", 10)])
def test_compile_matches_eager_logits_and_training_gradients(name, curriculum):
    """The compiled model (the Head output, the full logits for 'duo', the curriculum's top-k input) gives the
    eager logits, losses and gradients; under bf16 autocast too."""
    model, tcfg = small_model(name, n_layer=1, vocab_size=61, vocab_multiple=16, curriculum_iters=curriculum,
                              head="fused")
    compiled = torch.compile(model)
    x0 = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(1))
    t = diffusion.sample_t(4, torch.Generator().manual_seed(2))
    for autocast in (False, True):
        out = {}
        for kind, m in (("eager", model), ("compiled", compiled)):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss, output = loss_terms(m, tcfg, x0, t, 0, torch.Generator().manual_seed(3))
            token_mean(loss, None).backward()
            logits = output if isinstance(output, torch.Tensor) else F.linear(output.hidden, output.weight,
                                                                              output.bias)[..., :61]
            out[kind] = (logits.detach().float(), loss.detach(), grads(model))
        # eager vs Inductor's fused float32 kernels (sums reordered: d = 32, V = 64, B L = 64 terms, < 200
        # roundings of values <= 10 in a loss or logit): <= 2 * 200 * 10 * U32 ~ 2.4e-4 worst case, 1e-5 holds the
        # measured; bf16 autocast: the same matmuls round inputs and outputs to bf16 in either order (a few
        # BF16_U = 1.2e-2 relative, on values <= 2 in size)
        tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["compiled"][0], out["eager"][0], **tol)
        torch.testing.assert_close(out["compiled"][1], out["eager"][1], **tol)
        gap = (out["compiled"][2] - out["eager"][2]).norm() / out["eager"][2].norm()
        assert gap < (2e-2 if autocast else 1e-5), gap


# -----------------------------------------------------------------------------
# the full training step: finite and reproducible from its seeds

@pytest.mark.parametrize("name", list(diffusion.OBJECTIVES))
def test_training_step_is_finite_and_identical_for_same_seeds(name):
    """train.train_step (the step train.py and bench/bench.py run): only its explicit generators may matter."""
    runs = []
    for global_seed in (100, 200):  # dropout is 0, so the global seed must change nothing
        model, tcfg = small_model(name, perturb=0.0)
        gen = torch.Generator().manual_seed(7)
        run = Run(model, model, *train.make_optimizer(model, tcfg, torch.device("cpu")), loader=None,
                        gen_shared=gen, gen_local=gen)
        torch.manual_seed(global_seed)
        step_losses = []
        for it in range(2):
            x0 = torch.randint(0, 61, (4, 16), generator=gen)
            step_losses.append(train.train_step(run, tcfg, Env(torch.device("cpu")), x0))
        ema = run.ema
        runs.append((torch.stack(step_losses), [p.detach().clone() for p in model.parameters()], ema))
    (losses_a, params_a, ema_a), (losses_b, params_b, ema_b) = runs
    assert torch.isfinite(losses_a).all()
    # bit for bit: the same process, shapes and thread count (one_thread), deterministic CPU kernels
    assert torch.equal(losses_a, losses_b)
    assert all(torch.equal(a, b) for a, b in zip(params_a + ema_a, params_b + ema_b))
    assert any(not torch.equal(a, e) for a, e in zip(params_a, ema_a))  # the step did move the weights


# -----------------------------------------------------------------------------
# bench/bench.py

def test_bench_flop_formula_matches_torch_flop_counter():
    """6 N T + 12 n_layer L d T + 6 d V T against every matmul of a forward + backward, counted by torch
    (the math SDPA backend so the attention matmuls are visible); the only gap is the per-sequence adaLN."""
    model = build_model(ModelConfig(vocab_size=300, block_size=64, n_layer=3, n_head=4, n_embd=64, cond_dim=32))
    x = torch.randint(0, 300, (2, 64))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, torch.full((2,), 0.5)).sum().backward()
    # counted FLOPs are exact integers; the formula counts the adaLN (3 layers x 32 x 384) and time-MLP weights
    # per token, their matmuls run per sequence: a 0.4% gap at these shapes (measured 1.0039), inside 1%
    assert counter.get_total_flops() / bench.model_flops_per_step(model, 2, 64) == pytest.approx(1, abs=0.01)


def test_bench_runs_end_to_end_and_reports_every_loss(capsys):
    argv = ["--preset", "tiny", "--block_size", "16", "--batch_size", "2", "--n_layer", "2", "--repeats", "2",
            "--warmup", "1", "--sample_steps", "2", "--head_chunks", "8", "--long_blocks", "4", "--json"]
    assert bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["losses"]) == bench.ALL_LOSSES.split(",") + ["sddlm+curriculum"]
    table = bench.markdown(out)
    assert out["losses"]["sddlm+curriculum"]["step_vs_plain"] > 0 and "| sddlm+curriculum step / sddlm step | " in \
        table and f"| sampler time / its forwards' time | {1 + out['sampler']['overhead']:.3f} (" in table
    for name, r in out["losses"].items():
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["act_bytes"] > 0 and len(r["step_ms_all"]) == 2, name
        assert 0 < r["mfu"] and r["peak_mem_bytes"] is None, name      # CPU: no peak memory, never a guess
    assert out["losses"]["duo"]["step_vs_duo"] == 1.0
    assert out["losses"]["duo"]["act_bytes"] > out["losses"]["sddlm"]["act_bytes"]   # the (B, L, V) float32
    assert out["sampler"]["nfe"] == 3 and math.isfinite(out["sampler"]["overhead"])  # 2 steps + the final one
    assert out["sampler"]["psi_vs_ancestral"] > 0 and math.isfinite(out["sampler"]["psi_overhead"])
    table = bench.markdown(out)
    assert all(f"| {name} |" in table for name in out["losses"]) and "n/a" in table and "(psi, kappa = 0.9)" in table
    head = out["head"]                      # the fused head: 3 output-layer products with kept logits, else 4
    assert head["kept"]["products"] == 3 and head["chunks"] == 8       # counted matmul FLOPs: exact integers
    assert head["recomputed"]["products"] == 4 and head["kept"]["ms"] > 0
    assert "| kept logits | " in table and "| recomputed logits | " in table and "kept / recomputed time: " in table
    assert out["memory_baseline"] is None and out["memory_left"] == {} and "memory" not in table   # CPU: no check
    assert "\n\nmemory: every table, and every row after the first round, ended with memory_allocated where it " \
           "started (1.5 MiB before the first table)" in bench.markdown({**out, "memory_baseline": 1536 * 1024})
    assert "\n\nmemory NOT released (later rows ran with less): sddlm act left 0.0 MiB (4,000 bytes) allocated; " \
           "training rows left 2.0 MiB (2,097,152 bytes) allocated" in \
        bench.markdown({**out, "memory_left": {"sddlm act": 4000, "training rows": 2 ** 21}})
    long = out["long"]                      # 64 tokens in windows of 16: 4, 1 + 48/8 and 1 + 48/4 sampler calls
    assert [(r["stride"], r["windows"], r["predicted"]) for r in long["rows"]] == [(16, 4, 1.0), (8, 7, 1.75),
                                                                                  (4, 13, 3.25)]
    assert long["seq_len"] == 64 and all(r["ms_per_token"] > 0 and r["vs_block"] > 0 for r in long["rows"])
    assert "| sample.generate_long | 8 | 7 | " in table


def test_bench_rejects_bad_flags_in_one_line():
    with pytest.raises(bench.UsageError, match="--losses"):
        bench.parse_args(["--losses", "sddlm,elbo"])
    with pytest.raises(bench.UsageError, match="--preset"):
        bench.parse_args(["--preset", "huge"])
    with pytest.raises(bench.UsageError, match="unknown --head 'lean'; choose from auto, plain, fused, fused_recompute"):
        bench.parse_args(["--head", "lean"])
    assert bench.train_config_for(bench.parse_args(["--head", "fused_recompute"]), "sddlm").head == "fused_recompute"
    assert bench.parse_args(["--json", "--compile"]).json is True


def test_bench_prints_n_a_for_what_does_not_fit(monkeypatch, capsys):
    """A row whose step, or a measurement whose tensors, run out of memory reads 'n/a (out of memory)'; the other
    rows, the sampler, the fused head and the reason still come out. What the failed step held -- a tensor in its
    frame (the traceback holds it) and one in a reference cycle -- is gone before the next row starts: Python's
    automatic collection is off here, so nothing but bench frees the cycle."""
    real_step, real_saved = bench.train_step, bench.saved_activation_bytes
    refs, starts = [], []

    def step(run, tcfg, env, x0):
        starts.append([r() is not None for r in refs])
        if tcfg.loss == "duo":
            held = torch.ones(1 << 16)
            cycle = [torch.ones(1 << 16)]
            cycle.append(cycle)
            refs.extend([weakref.ref(held), weakref.ref(cycle[0])])
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.27 GiB. GPU 0 has a total "
                                         "capacity of 79.19 GiB of which 1.20 GiB is free.")
        return real_step(run, tcfg, env, x0)

    def saved(fn, params):
        starts.append([r() is not None for r in refs])
        if saved.calls == 0:
            saved.calls += 1
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1000 bytes")
        return real_saved(fn, params)
    saved.calls = 0
    monkeypatch.setattr(bench, "train_step", step)
    monkeypatch.setattr(bench, "saved_activation_bytes", saved)
    argv = ["--preset", "tiny", "--block_size", "16", "--batch_size", "2", "--n_layer", "1", "--repeats", "1",
            "--warmup", "0", "--sample_steps", "1", "--losses", "duo,sddlm,ar", "--curriculum", "", "--head_chunks", "2"]
    gc.collect()
    gc.disable()
    try:
        assert bench.main(argv) == 0
    finally:
        gc.enable()
    table = capsys.readouterr().out
    assert len(refs) == 2 and len(starts) > 3 and all(alive == [False, False] for alive in starts[1:]), starts
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert rows["duo"].startswith("| duo | n/a (out of memory) | n/a | ") and rows["duo"].count("n/a") == 10
    assert "| sddlm | " in table and "| ar | " in table and "(out of memory)" not in rows["ar"]
    assert " n/a (out of memory) | " in rows["sddlm"]       # its act MiB measurement did not fit
    assert "duo step: CUDA out of memory (tried to allocate 12.27 GiB; 1.20 GiB of 79.19 GiB free)" in table
    assert "sddlm act: CPU out of memory" in table and "| sample.generate (ancestral) | " in table
    assert "| kept logits | " in table
