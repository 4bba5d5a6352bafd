"""kernels/fused_head.py against losses.py: every loss given a Head equals the same loss on the logits the Head
stands for (values, and the gradients of hidden, W and b), in float64 and bf16, for chunks of rows that split the
sequences and for kept and recomputed logits; kept logits save one output-layer product of four (FLOPs counted by
torch's counter); W's gradient is summed over chunks in float32; the memory probe picks keep or recompute."""

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
from kernels import fused_head
from kernels.fused_head import Head
from conftest import unit_roundoff
from test_losses import usdm_sizes

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
