"""kernels/fused_head.py against losses.py: every loss given a Head equals the same loss on the logits the Head
stands for (values, and the gradients of hidden, W and b), in float64 and bf16, for chunks of rows that split the
sequences and for kept and recomputed logits; kept logits save one output-layer product of four (FLOPs counted by
torch's counter); W's gradient is summed over chunks in float32; the memory probe picks keep or recompute."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import diffusion
import losses
import plumbing.memory
from plumbing.cli import ConfigError
from plumbing.distributed import Env
from plumbing.flags import check_train_flags
import train
from kernels import fused_head, gumbel
from kernels.fused_head import Head
from conftest import compiler_missing, unit_roundoff
from test_losses import loss_case, lse_tol, usdm_sizes

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py

BF16_U = 2.0 ** -8      # unit roundoff of bf16
U32, U64 = unit_roundoff(torch.float32), unit_roundoff(torch.float64)
V, V_PAD, B, L, D = 61, 64, 2, 24, 16
ALPHA = torch.tensor([[0.3], [0.8]])
# float64, Head vs plain logits: the logits' d = 16 products in other blocks, V-term sums (3V + 10 for the NELBO),
# W's and b's sums over the 48 rows in other chunks: < 250 roundings per entry, of terms no larger than 120 (the
# losses <= 45, the NELBO's term sizes (usdm_sizes) <= 116, the gradients <= 21): <= 2 * 250 * 120 * U64 = 6.7e-12
F64_TOL = 2 * 250 * 120 * U64


def case(dtype, seed=9, d=D, v_pad=V_PAD):
    """hidden (B, L, d), an output layer (W, b) with v_pad - V padding rows, tokens and upstream gradients."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    weight = (torch.randn(v_pad, d, generator=g, dtype=torch.float64) / 2).to(dtype).requires_grad_(True)
    bias = torch.randn(v_pad, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    x0, xt, neg = (torch.randint(0, V, (B, L), generator=g) for _ in range(3))
    return hidden, weight, bias, x0, xt, neg, torch.randn(B, L, generator=g, dtype=torch.float64)


PLAIN = {   # losses.py on logits (B, L, V) ...
    "naive": lambda z, x0, xt, neg: losses.naive_denoising_loss(z, x0),
    "sddlm": lambda z, x0, xt, neg: losses.sddlm_loss(z, x0, xt),
    "sddlm_v1": lambda z, x0, xt, neg: losses.sddlm_v1_loss(z, x0, xt, neg=neg),
    "sddlm_v2": lambda z, x0, xt, neg: losses.sddlm_v2_loss(z, x0, xt),
    "ar": lambda z, x0, xt, neg: F.pad(losses.ar_loss(z, x0), (0, 1)),
    "duo": lambda z, x0, xt, neg: losses.usdm_nelbo_loss(z, x0, xt, ALPHA, -0.999),
}
FUSED = {**PLAIN,  # ... and given a Head: the same functions, Duo's NELBO by its chunked twin
         "duo": lambda head, x0, xt, neg: fused_head.usdm_nelbo_loss_lean(head, x0, xt, ALPHA, -0.999,
                                                                          chunk_elems=head.chunk_elems)}
CHUNK_ROWS = [1, 5, 24, 48]   # 5: chunks straddle the two sequences (ragged last); 24: a sequence; 48: all rows


def values_and_grads(out, upstream, params):
    return (out.detach(),) + torch.autograd.grad((out * upstream.to(out.dtype)).sum(), params)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("rows", CHUNK_ROWS)
@pytest.mark.parametrize("name", list(PLAIN))
def test_every_loss_on_a_head_equals_it_on_the_logits_in_float64(name, rows, keep):
    hidden, weight, bias, x0, xt, neg, up = case(torch.float64)
    params = (hidden, weight, bias)
    ref = values_and_grads(PLAIN[name](F.linear(hidden, weight, bias)[..., :V], x0, xt, neg), up, params)
    head = Head(hidden, weight, bias, V, keep_logits=keep, chunk_elems=rows * V_PAD)
    got = values_and_grads(FUSED[name](head, x0, xt, neg), up, params)
    for a, b, what in zip(got, ref, ("loss", "hidden", "W", "b")):
        assert a.dtype == b.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0, atol=F64_TOL, msg=what)
    assert (got[2][V:] == 0).all() and (got[3][V:] == 0).all()         # the padding rows are never scored


@pytest.mark.numerics
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("rows", [5, 48])
@pytest.mark.parametrize("name", list(PLAIN))
def test_every_loss_on_a_bf16_head_equals_it_on_the_bf16_logits(name, rows, keep):
    """The chunk logits are the plain route's bf16 numbers: values agree to float32 rounding; the gradients of
    hidden, W and b within a few bf16 roundings (W's and b's summed in float32, rounded once at the end)."""
    hidden, weight, bias, x0, xt, neg, up = case(torch.bfloat16)
    params = (hidden, weight, bias)
    ref = values_and_grads(PLAIN[name](F.linear(hidden, weight, bias)[..., :V], x0, xt, neg), up, params)
    head = Head(hidden, weight, bias, V, keep_logits=keep, chunk_elems=rows * V_PAD)
    got = values_and_grads(FUSED[name](head, x0, xt, neg), up, params)
    assert got[0].dtype == ref[0].dtype == torch.float32
    # the same bf16 logits, float32 sums in other orders: log p = z - lse within (V + 13) U32 + 2 U32 |lse| (|lse|
    # <= 40), V1 / V2 two of those; the NELBO 2 (3V + 10) U32 of the sizes of its terms
    sizes = 80 + V + 13 if name != "duo" else usdm_sizes(F.linear(hidden, weight, bias)[..., :V].detach().double(),
                                                           x0, xt, ALPHA, -0.999).max().item() * (3 * V + 10)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=2 * sizes * U32)
    for a, b, what in zip(got[1:], ref[1:], ("hidden", "W", "b")):
        assert a.dtype == b.dtype == torch.bfloat16
        # the logits' gradient is rounded to bf16 (<= 4 roundings of terms <= its largest entry), W's and b's row
        # sums end in one more rounding in both routes: <= 8 BF16_U of the largest entry
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=8 * BF16_U * b.abs().max().item(), msg=what)


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["sddlm_v1", "duo"])
def test_kept_and_recomputed_logits_give_the_same_bits(name, dtype):
    hidden, weight, bias, x0, xt, neg, up = case(dtype)
    out = [values_and_grads(FUSED[name](Head(hidden, weight, bias, V, keep_logits=keep, chunk_elems=5 * V_PAD),
                                              x0, xt, neg), up, (hidden, weight, bias)) for keep in (True, False)]
    for a, b in zip(*out):      # the recomputed chunk is the same F.linear on the same chunk, in this process
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["sddlm_v1", "duo"])
def test_kept_logits_cost_three_products_and_recomputed_four(name):
    """Per step the output layer costs 2 N d V_pad FLOPs a product: forward, and in backward the gradients of
    hidden and of W; recomputing the logits in backward adds a fourth. Counted by torch's FLOP counter over
    forward and backward: exact integers, the output layer's and nothing else's (the loss has no matmul)."""
    d, v_pad = 64, 512
    hidden, weight, bias, x0, xt, neg, up = case(torch.float32, d=d, v_pad=v_pad)
    product = 2 * B * L * d * v_pad
    for keep, products in ((True, 3), (False, 4)):
        head = Head(hidden, weight, bias, V, keep_logits=keep, chunk_elems=8 * v_pad)     # 6 chunks
        with FlopCounterMode(display=False) as counter:
            values_and_grads(FUSED[name](head, x0, xt, neg), up, (hidden, weight, bias))
        assert counter.get_total_flops() == products * product, (keep, counter.get_total_flops())


@pytest.mark.parametrize("name", ["sddlm_v1", "duo"])
def test_logits_are_kept_only_for_a_backward(name, monkeypatch):
    """With keep_logits every chunk's logits stay alive through forward when a gradient is wanted; in evaluation
    (no gradient) each chunk's logits are freed before the next chunk's are made."""
    import types
    import weakref
    hidden, weight, bias, x0, xt, neg, _ = case(torch.float32)
    made, alive = [], []

    def linear(*args):
        alive.append(sum(r() is not None for r in made))      # earlier chunks' logits still held at this call
        z = F.linear(*args)
        made.append(weakref.ref(z))
        return z

    monkeypatch.setattr(fused_head, "F", types.SimpleNamespace(linear=linear))
    head = Head(hidden, weight, bias, V, keep_logits=True, chunk_elems=8 * V_PAD)     # 6 chunks
    with torch.no_grad():
        FUSED[name](head, x0, xt, neg)
    assert len(made) == 6 and max(alive) <= 1
    made.clear(), alive.clear()
    FUSED[name](head, x0, xt, neg)
    assert alive == [0, 1, 2, 3, 4, 5]


@pytest.mark.numerics
def test_w_gradient_is_summed_over_chunks_in_float32():
    """bf16 Head in 48 one-row chunks: W's gradient is the one-chunk gradient up to one final bf16 rounding (each
    chunk's product added to a float32 sum, not first rounded to bf16)."""
    hidden, weight, bias, x0, xt, neg, up = case(torch.bfloat16, v_pad=V_PAD)
    grads = [torch.autograd.grad((losses.sddlm_v1_loss(Head(hidden, weight, bias, V, chunk_elems=rows * V_PAD), x0,
                                                       xt, neg=neg) * up.float()).sum(), weight)[0].double()
             for rows in (1, 48)]
    ulp = BF16_U * 2 * grads[1].abs()          # the spacing of bf16 numbers at each entry (at most)
    assert ((grads[0] - grads[1]).abs() <= ulp).all()
    # float32 sums of the 48 rows in two orders differ by <= 2 * 48 U32 = 5.7e-6 relative: an entry rounds to
    # another bf16 only within that of a rounding boundary, a chance <= 5.7e-6 / 2^-8 = 1.5e-3 (rounding each
    # chunk's product to bf16 first would move most entries)
    assert (grads[0] != grads[1]).float().mean() < 0.05


def test_a_head_stands_for_its_logits_shape_slices_and_negatives():
    """losses.py sees a Head as logits: .shape is (B, L, V) (not the padded width), positions slice the hidden
    states, and SDDLM-V1's random negatives are drawn from V with the same generator as for the logits."""
    hidden, weight, bias, x0, xt, neg, _ = case(torch.float64)
    logits = F.linear(hidden, weight, bias)[..., :V]
    head = Head(hidden, weight, bias, V)
    assert head.shape == logits.shape == (B, L, V)
    assert torch.equal(head[:, 3:7].hidden, hidden[:, 3:7]) and head[:, 3:7].shape == logits[:, 3:7].shape
    draw = lambda z: losses.sddlm_v1_loss(z, x0, xt, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(draw(head), draw(logits), rtol=0, atol=F64_TOL)      # float64, as above


def test_training_uses_the_fused_head_on_cuda_and_logits_on_cpu():
    assert fused_head.fused_head_wanted("auto", "cuda") and not fused_head.fused_head_wanted("auto", "cpu")
    assert fused_head.fused_head_wanted("fused", "cpu") and fused_head.fused_head_wanted("fused_recompute", "cpu")
    assert not fused_head.fused_head_wanted("plain", "cuda")
    with pytest.raises(ConfigError, match="unknown --head 'lean'; choose from auto, plain, fused, "
                                                "fused_recompute"):
        check_train_flags(train.TrainConfig(head="lean"), 1, train.TRAIN_CHOICES, train.TRAIN_RANGES)


# -----------------------------------------------------------------------------------------------
# the memory probe picks: kept logits where they fit, recomputed where only that fits (CUDA stood in for)

def probe_stand_in(monkeypatch, fits):
    """plumbing.memory's probe answering fits(micro-batch, --head) on 2 ranks of a 79.2 GiB GPU; records the asks."""
    asked = []
    monkeypatch.setattr(plumbing.memory, "_probe_fits", lambda run_, cfg, env, micro, model, loss:
                        asked.append((micro, cfg.head)) or fits(micro, cfg.head))
    monkeypatch.setattr(plumbing.memory, "_gpu_gib", lambda env: "79.2 GiB")
    return Env(torch.device("cuda"), world_size=2), asked


def fit(cfg, env):
    """The probe as train.py runs it: the fused head's fallback only for an objective it computes."""
    plumbing.memory.fit_micro_batch(None, cfg, env, fusable=not diffusion.OBJECTIVES[cfg.loss].full_logits)


def test_the_probe_keeps_the_logits_where_they_fit(monkeypatch, capsys):
    env, asked = probe_stand_in(monkeypatch, lambda micro, head: micro <= 64)
    cfg = train.TrainConfig(batch_size=128, loss="sddlm_v1")
    fit(cfg, env)
    assert (cfg.head, cfg.grad_accum, asked) == ("auto", 1, [(64, "auto")]) and capsys.readouterr().out == ""


def test_the_probe_recomputes_the_logits_where_only_that_fits(monkeypatch, capsys):
    fits = lambda micro, head: micro <= (64 if head == "fused_recompute" else 32)
    env, asked = probe_stand_in(monkeypatch, fits)
    cfg = train.TrainConfig(batch_size=128, loss="sddlm_v1")
    fit(cfg, env)
    assert (cfg.head, cfg.grad_accum, asked) == ("fused_recompute", 1, [(64, "auto"), (64, "fused_recompute")])
    assert "micro-batch 64 fits in GPU memory (79.2 GiB) with the fused head recomputing its logits in backward: " \
           "--head fused_recompute" in capsys.readouterr().out
    # neither fits at 64: a smaller micro-batch with the logits kept comes first
    env, asked = probe_stand_in(monkeypatch, lambda micro, head: micro <= 32)
    cfg = train.TrainConfig(batch_size=128, loss="sddlm_v1")
    fit(cfg, env)
    assert (cfg.head, cfg.grad_accum, asked) == ("auto", 2, [(64, "auto"), (64, "fused_recompute"), (32, "auto")])


@pytest.mark.parametrize("loss,head", [("duo", "auto"), ("sddlm", "fused"), ("sddlm", "plain")])
def test_the_probe_leaves_the_head_as_given_or_without_a_head(loss, head, monkeypatch):
    """Duo's reference NELBO takes the full logits; a --head given explicitly is kept: only the micro-batch moves."""
    env, asked = probe_stand_in(monkeypatch, lambda micro, head: micro <= 32)
    cfg = train.TrainConfig(batch_size=128, loss=loss, head=head)
    fit(cfg, env)
    assert (cfg.head, cfg.grad_accum, asked) == (head, 2, [(64, head), (32, head)])


# -----------------------------------------------------------------------------
# the output layer fused with the loss (Head) against logits computed in full, and its compiled kernels

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
    """On CUDA each chunk's pass over the vocabulary is torch.compile'd into one kernel (fused_head.fused); here the
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
    monkeypatch.setattr(fused_head, "fused", lambda fn, like: compiled.setdefault(fn, torch.compile(fn, dynamic=True)))
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
