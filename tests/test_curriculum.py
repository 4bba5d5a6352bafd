"""curriculum/gaussian.py's fast paths against their plain versions (issue 29, item 5): Floyd's algorithm drawn at
once against Floyd's loop on the same draws, and its law; the curriculum's soft-token embedding in the autocast
dtype against float32."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import curriculum.gaussian as curriculum
import diffusion
from curriculum.gaussian import SoftTokens, _distinct_uniform
from model import ModelConfig, build_model
from conftest import small_model

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py


def floyd_loop(t, n):
    """Floyd's algorithm one index at a time (the plain version): for j = n-k..n-1 take t_j, or j when t_j is
    already in the set. t (rows, k), t[:, i] in [0, n-k+i] -> (rows, k) in drawing order."""
    rows, k = t.shape
    picked = torch.empty_like(t)
    for r in range(rows):
        chosen = []
        for i, j in enumerate(range(n - k, n)):
            chosen.append(j if int(t[r, i]) in chosen else int(t[r, i]))
        picked[r] = torch.tensor(chosen)
    return picked


@pytest.mark.parametrize("n,k", [(40, 32), (33, 32), (8, 8), (6, 3), (1000, 32), (5, 1)])
def test_distinct_uniform_is_floyds_algorithm_on_the_same_draws(n, k):
    """The pointer-jumping resolution gives Floyd's picks exactly, in collision-heavy cases (k close to n, where
    chains of taken j's are long) and light ones; then the same random order."""
    rows = 3000
    got = _distinct_uniform(n, k, rows, torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    t = torch.randint(0, 1 << 62, (rows, k), generator=g) % torch.arange(n - k + 1, n + 1)
    order = torch.rand(rows, k, generator=g, dtype=torch.float64).argsort(-1)
    assert torch.equal(got, floyd_loop(t, n).gather(-1, order))
    assert all(len(set(row)) == k for row in got.tolist()) and got.min() >= 0 and got.max() < n


@pytest.mark.parametrize("n,k", [(6, 3), (4, 4), (7, 2)])
def test_distinct_uniform_draws_every_tuple_equally_often(n, k):
    """Chi-square over all n! / (n - k)! ordered k-tuples of distinct values: uniform."""
    rows = 60000
    got = _distinct_uniform(n, k, rows, torch.Generator().manual_seed(1))
    cells = {tup: c for c, tup in enumerate(itertools.permutations(range(n), k))}
    counts = torch.bincount(torch.tensor([cells[tuple(r)] for r in got.tolist()]), minlength=len(cells)).double()
    expected = rows / len(cells)
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(cells) - 1
    assert stat < df * (1 - 2 / (9 * df) + 4.5 * math.sqrt(2 / (9 * df))) ** 3, stat


def test_distinct_uniform_is_deterministic_per_generator():
    a, b = (_distinct_uniform(50257, 32, 64, torch.Generator().manual_seed(3)) for _ in range(2))
    c = _distinct_uniform(50257, 32, 64, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def embedding_of(model, x):
    """The residual stream entering the first block: the model's embedding of its input."""
    seen = []
    handle = model.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    try:
        model(x, torch.full((x[0].shape[0],), 0.5))
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.numerics
def test_soft_embedding_runs_in_autocast_dtype_exact_in_float32():
    """The curriculum's soft tokens (k rows of E per position) are summed in float32 without autocast, exactly as
    F.embedding_bag on float32; under bf16 autocast in bf16 (exactly embedding_bag on bf16 E and weights), handed on
    as float32, equal to the float32 sum within bf16 rounding."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=300, block_size=16, n_layer=1, n_head=2, n_embd=32, cond_dim=8)).eval()
    g = torch.Generator().manual_seed(2)
    x0 = torch.randint(0, 300, (2, 16), generator=g)
    _, soft = curriculum.curriculum_input(x0, torch.full((2, 1), -3.0), 300, 1e-3, g)
    x = SoftTokens(soft.ids, torch.softmax(torch.randn(soft.probs.shape, generator=g), -1))   # several weights count
    E = model.wte.weight.detach()
    flat_ids, flat_w = x.ids.reshape(32, -1), x.probs.reshape(32, -1)
    exact32 = F.embedding_bag(flat_ids, E, per_sample_weights=flat_w, mode="sum").view(2, 16, -1)
    assert torch.equal(embedding_of(model, tuple(x)), exact32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = embedding_of(model, tuple(x))
    bf16 = F.embedding_bag(flat_ids, E.bfloat16(), per_sample_weights=flat_w.bfloat16(), mode="sum").view(2, 16, -1)
    assert h.dtype == torch.float32 and torch.equal(h, bf16.float())
    # E and the weights rounded to bf16 (2^-8 each: a product within ~2^-7 of itself), summed in float32, the sum rounded
    # to bf16 (2^-8 of it): the weights are probabilities, so the products' sizes sum to <= max |E|
    torch.testing.assert_close(h, exact32, rtol=2 ** -8, atol=(2 ** -7 + 2 ** -14) * float(E.abs().max()))


# -----------------------------------------------------------------------------
# the curriculum's top-k input trains the embedding as the dense soft input does

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
