"""Generation longer than the model's context (sample.generate_long, generate_ar's sliding window): the windows by
hand, the held context equal to the previous output at every window boundary, the one-block sampler unchanged
within the block, seeds, the composition with CFG, Psi and nucleus, a periodic corpus continued across the
boundaries (by its exact denoiser; by a tiny model trained here, slow), and the command line and the Python API."""
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import sample
from sample import Psi, generate, generate_ar, generate_long, long_windows
from test_sample import Recorder, gen, random_model, tiny_ckpt  # noqa: F401  (tiny_ckpt: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py


def test_long_windows_by_hand():
    """Block 12, stride 6: the first window fills the block after the prompt, then 6 new tokens after 6 held
    ones, the last window draws what is left after a longer held context; a prompt longer than a block leaves
    its last block - stride tokens to the first window."""
    assert long_windows(0, 40, 12, 6) == [(0, 12), (6, 6), (6, 6), (6, 6), (6, 6), (8, 4)]
    assert long_windows(3, 40, 12, 6) == [(3, 9), (6, 6), (6, 6), (6, 6), (6, 6), (8, 4)]
    assert long_windows(10, 13, 12, 6) == [(10, 2), (11, 1)]
    assert long_windows(20, 25, 12, 6) == [(7, 5)]
    assert long_windows(0, 24, 12, 12) == [(0, 12), (0, 12)]          # stride = block: independent blocks
    for P, n, L, s in [(0, 100, 16, 1), (5, 77, 16, 7), (30, 200, 32, 32), (31, 33, 32, 16)]:
        w = long_windows(P, n, L, s)
        assert all(held + new == L and new >= 1 for held, new in w)
        assert P + sum(new for _, new in w) == n
        assert all(held >= L - s for held, _ in w[1:])


def windows_of(monkeypatch):
    """Record every one-block sampler call generate_long makes: (prompt_ids, output)."""
    calls, one_block = [], sample.generate

    def recording(*args, **kwargs):
        out = one_block(*args, **kwargs)
        calls.append((kwargs.get("prompt_ids"), out.clone()))
        return out
    monkeypatch.setattr(sample, "generate", recording)
    return calls


@pytest.mark.parametrize("P,n_windows", [(3, 7), (20, 5)])       # a prompt within the first block, and longer
def test_held_context_is_the_previous_output_at_every_boundary(monkeypatch, P, n_windows):
    """Each window's prompt is the last `held` tokens of what was written before it (the prompt's, then the
    samples'), the network sees them clean in every step of the window, the window's output keeps them, and what
    it draws after them is what the text gets; every forward is one whole block."""
    calls = windows_of(monkeypatch)
    rec = Recorder(random_model())
    prompt = torch.randint(0, 11, (2, P), generator=gen(9))
    B, L, n, stride, steps = 2, 12, 41, 5, 3
    x = generate_long(rec, B, n, 11, steps, block_size=L, stride=stride, prompt_ids=prompt, generator=gen(0),
                      show_progress=False)
    windows = long_windows(P, n, L, stride)
    assert x.shape == (B, n) and torch.equal(x[:, :P], prompt) and len(calls) == len(windows) == n_windows
    assert {xt.shape for xt, _ in rec.calls} == {(B, L)} and len(rec.calls) == len(windows) * (steps + 1)
    written = P
    for k, ((held, new), (held_ids, out)) in enumerate(zip(windows, calls)):
        assert torch.equal(held_ids, x[:, written - held:written])                 # the previous output
        assert torch.equal(out[:, :held], held_ids) and torch.equal(out[:, held:], x[:, written:written + new])
        assert all(torch.equal(xt[:, :held], held_ids) for xt, _ in rec.calls[k * (steps + 1):(k + 1) * (steps + 1)])
        written += new
    assert written == n


@pytest.mark.parametrize("kwargs", [{}, dict(prompt_ids=torch.tensor([2, 7]), cfg_w=1.1, top_p=0.9),
                                    dict(psi=Psi(("max_capped",), (0.3,)), final_step="greedy")])
def test_within_the_block_it_is_the_block_sampler_bit_for_bit(kwargs):
    """seq_len <= block_size: the same tokens as sample.generate (as before long generation existed), whatever
    the stride."""
    model = random_model()
    before = generate(model, 3, 12, 11, 5, generator=gen(4), show_progress=False, **kwargs)
    for stride in (0, 1, 12):
        assert torch.equal(generate_long(model, 3, 12, 11, 5, stride=stride, generator=gen(4), show_progress=False,
                                         **kwargs), before)
    short = generate(model, 3, 7, 11, 5, generator=gen(4), show_progress=False, **kwargs)
    assert torch.equal(generate_long(model, 3, 7, 11, 5, generator=gen(4), show_progress=False, **kwargs), short)


def test_a_seed_gives_the_same_long_text_another_seed_another():
    model = random_model()
    run = lambda seed, **kw: generate_long(model, 2, 30, 11, 4, stride=4, generator=gen(seed), show_progress=False,
                                           **kw)
    assert torch.equal(run(3), run(3)) and not torch.equal(run(3), run(4))
    guided = dict(prompt_ids=torch.tensor([1, 2]), cfg_w=1.1, top_p=0.8, psi=Psi(("eta",), (0.5,)))
    assert torch.equal(run(3, **guided), run(3, **guided)) and not torch.equal(run(3, **guided), run(4, **guided))


def test_cfg_guides_every_window_holding_tokens_against_random():
    """Without a prompt the first window holds nothing and runs one branch; every later window runs both branches
    in one forward, the unconditional one with the held positions replaced by random tokens (the same draw in
    every window, as one run of the one-block sampler) and the drawn positions as the conditional branch's."""
    rec = Recorder(random_model())
    B, L, steps = 2, 12, 3
    generate_long(rec, B, 30, 11, steps, block_size=L, stride=4, cfg_w=1.5, generator=gen(0), show_progress=False)
    windows = long_windows(0, 30, L, 4)
    per_window = [rec.calls[k * (steps + 1):(k + 1) * (steps + 1)] for k in range(len(windows))]
    assert all(xt.shape[0] == B for xt, _ in per_window[0])
    nulls = []
    for (held, _), calls in zip(windows[1:], per_window[1:]):
        for xt, _ in calls:
            cond, uncond = xt[:B], xt[B:]
            assert xt.shape[0] == 2 * B and torch.equal(uncond[:, held:], cond[:, held:])
            nulls.append(uncond[:, :held])
    assert all(torch.equal(n[:, :8], nulls[0][:, :8]) for n in nulls)      # one draw: 8 held, the last 10


def test_psi_with_kappa_one_is_ancestral_past_the_block_too():
    model = random_model()
    run = lambda **kw: generate_long(model, 2, 29, 11, 4, stride=5, prompt_ids=torch.tensor([3]), top_p=0.9,
                                     generator=gen(1), show_progress=False, **kw)
    assert torch.equal(run(psi=Psi(("eta",), (1.0,))), run())
    assert not torch.equal(run(psi=Psi(("eta",), (0.5,))), run())


def test_bad_stride_and_prompt_are_one_line_errors():
    model = random_model()
    for stride in (-1, 13):
        with pytest.raises(sample.UsageError, match=r"--stride must be in \[1, 12\]"):
            generate_long(model, 1, 30, 11, 2, stride=stride, show_progress=False)
    with pytest.raises(ValueError, match="prompt_ids"):
        generate_long(model, 1, 30, 11, 2, prompt_ids=torch.zeros(30, dtype=torch.long), show_progress=False)


# -----------------------------------------------------------------------------------------------
# a periodic corpus whose period (24) exceeds the block (16): only the held context says how it goes on

V_PERIOD, BLOCK = 24, 16


def counting_corpus(n, generator):
    """n blocks of the sequence 0, 1, ..., 23, 0, 1, ... from uniformly random starts. -> (n, BLOCK)."""
    start = torch.randint(0, V_PERIOD, (n, 1), generator=generator)
    return (start + torch.arange(BLOCK)) % V_PERIOD


def breaks(x):
    """Positions l >= 1 where x does not go on as the corpus does (x_l != x_(l-1) + 1 mod 24), per row."""
    return ((x[:, 1:] - x[:, :-1]) % V_PERIOD != 1).sum(-1)


def exact_denoiser(x, sigma):
    """The corpus's own x_theta: p(x0^l | x_t) by Bayes' rule over the 24 starts c (uniform prior), the likelihood
    q_t(x_t^l | x0^l = c + l) = alpha 1[x_t^l = c + l] + (1 - alpha) / 24 of every position (Eq. discrete_marginal);
    as logits (log-probabilities)."""
    alpha = torch.exp(-sigma.double())[:, None, None]
    B, L = x.shape
    x0_of_start = (torch.arange(V_PERIOD)[:, None] + torch.arange(L)) % V_PERIOD           # (c, l)
    lik = alpha * (x[:, None, :] == x0_of_start).double() + (1 - alpha) / V_PERIOD          # (B, c, l)
    post = torch.softmax(lik.log().sum(-1), -1)                                             # (B, c)
    probs = torch.einsum("bc,clv->blv", post, F.one_hot(x0_of_start, V_PERIOD).double())
    return probs.clamp_min(1e-300).log()


def test_exact_denoiser_continues_a_periodic_text_at_boundaries():
    """With the corpus's exact denoiser and a 3-token prompt, 100 tokens in windows of 16 (stride 6) are the
    corpus's sequence exactly: every window's new tokens follow its held ones. At t_end the held clean tokens
    make x_theta one-hot at the right continuation and the final ancestral step lands on it (Eq. reverse with
    alpha_s = 1 keeps no token x_theta excludes), so any break is a fault of the windows. The control, stride 16
    (nothing held), restarts at a random point of the period at each boundary: 14 boundaries, each continuing by
    chance with probability 1/24."""
    prompt = torch.tensor([[5, 6, 7], [20, 21, 22]])
    run = lambda stride: generate_long(exact_denoiser, 2, 100, V_PERIOD, 8, block_size=BLOCK, stride=stride,
                                       prompt_ids=prompt, generator=gen(0), show_progress=False)
    x = run(6)
    assert torch.equal(x, (prompt[:, :1] + torch.arange(100)) % V_PERIOD)
    assert (breaks(run(BLOCK)) >= 3).all()


@pytest.mark.slow
def test_a_trained_model_continues_a_periodic_corpus_past_blocks():
    """A 2-layer DiT of width 32 trained here on the counting corpus (Duo's NELBO, 1000 steps of 64 random blocks
    at lr 1e-2; 40-90 s on 2 busy CPU cores); 8 samples of 48 tokens after an 8-token prompt, 16 steps a window,
    greedy final step. Stride 8 (8 held tokens in every window): the tokens drawn right after the 4 window
    boundaries continue the corpus (measured: 1 break in 32; a bound of 8 leaves room for another CPU's training
    run). Stride 16 (independent blocks after the prompt's window) continues it at its 2 boundaries only by chance,
    1/24 each, so 8 or more of its 16 breaking is certain but for a chance of order 1e-9: the check can fail."""
    import diffusion
    import losses
    from model import ModelConfig, build_model
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=V_PERIOD, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32,
                                    cond_dim=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = gen(0)
    for _ in range(1000):
        x0 = counting_corpus(64, g)
        alpha, dalpha = diffusion.log_linear_schedule(diffusion.sample_t(64, g))
        xt = diffusion.sample_xt(x0, alpha[:, None], V_PERIOD, g)
        loss = losses.usdm_nelbo_loss(model(xt, diffusion.sigma_from_alpha(alpha)), x0, xt, alpha[:, None],
                                      dalpha[:, None]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    prompt = counting_corpus(8, gen(1))[:, :8]
    run = lambda stride: generate_long(model, 8, 48, V_PERIOD, 16, stride=stride, prompt_ids=prompt,
                                       final_step="greedy", generator=gen(2), show_progress=False)
    broken_at = lambda x, at: int(((x[:, at] - x[:, [p - 1 for p in at]]) % V_PERIOD != 1).sum())
    held = run(8)
    assert torch.equal(held[:, :8], prompt)
    assert broken_at(held, [16, 24, 32, 40]) <= 8                # of 32
    assert broken_at(run(16), [16, 32]) >= 8                     # of 16


# -----------------------------------------------------------------------------------------------
# the autoregressive baseline: a sliding window of its context

def test_ar_sampler_slides_a_window_of_its_block_past_it():
    """An oracle whose next token depends on the OLDEST token it is shown (first + length of its input): past
    the block the expected sequence follows only with a window of exactly block_size tokens, worked out here."""
    V, L = 97, 5
    seen = []

    def oracle(x):
        seen.append(x.shape[1])
        nxt = (x[:, 0] + x.shape[1]) % V
        return 40.0 * F.one_hot(nxt, V).float()[:, None, :].expand(-1, x.shape[1], -1)
    x = generate_ar(oracle, 1, 12, bos_id=1, block_size=L, generator=gen(0), show_progress=False)
    expected = [1]
    while len(expected) < 12:
        window = expected[-L:]
        expected.append((window[0] + len(window)) % V)
    assert x.tolist() == [expected] and max(seen) == L
    model = random_model(causal=True, time_cond=False)            # a real model: its own block_size (12)
    y = generate_ar(model, 2, 30, bos_id=1, generator=gen(0), show_progress=False)
    assert y.shape == (2, 30) and torch.equal(generate_ar(model, 2, 30, bos_id=1, generator=gen(0),
                                                          show_progress=False), y)


# -----------------------------------------------------------------------------------------------
# the command line and the Python API

def test_cli_samples_past_the_block_with_prompt_cfg_and_nucleus(tiny_ckpt, tmp_path):
    """block_size 32, 80 tokens in windows of 16 new ones: the prompt kept, the settings recorded, a seed gives the
    same samples, batches of 2 the same samples as one batch of 3 (one generator runs through them)."""
    ckpt, tok = tiny_ckpt
    base = ["--ckpt", ckpt, "--prompt", "The", "--num_samples", 3, "--steps", 3, "--seq_len", 80, "--cfg_w", 1.1,
            "--top_p", 0.9]
    for name, extra in (("a", ["--batch_size", 2]), ("b", ["--batch_size", 2]), ("c", ["--stride", 8])):
        assert sample.main([str(a) for a in base + extra + ["--out", tmp_path / f"{name}.jsonl"]]) == 0
    rec = {name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
           for name in "abc"}
    prompt = [tok.bos_id] + tok.encode("The")
    assert all(len(r["ids"]) == 80 and r["ids"][:len(prompt)] == prompt for r in rec["a"] + rec["c"])
    s = rec["a"][0]["settings"]
    assert (s["seq_len"], s["block_size"], s["stride"], s["windows"]) == (80, 32, 16, 4)
    assert rec["c"][0]["settings"]["windows"] == 7
    assert [r["ids"] for r in rec["a"]] == [r["ids"] for r in rec["b"]] != [r["ids"] for r in rec["c"]]


def test_cli_refuses_a_bad_stride_in_one_line(tiny_ckpt):
    for stride in ("33", "-2"):
        with pytest.raises(sample.UsageError, match=r"--stride must be in \[1, 32\]"):
            sample.main(["--ckpt", str(tiny_ckpt[0]), "--seq_len", "80", "--stride", stride, "--out", ""])


def test_python_api_generates_past_the_block(tiny_ckpt):
    from hub.pretrained import SDDLM
    ckpt, tok = tiny_ckpt
    lm = SDDLM.from_pretrained(ckpt)
    texts = lm.generate(2, steps=2, length=70, stride=10, seed=3)
    ids = generate_long(lm.model, 2, 70, tok.vocab_size, 2, stride=10, final_step="ancestral", generator=gen(3),
                        show_progress=False)
    assert ids.shape == (2, 70) and texts == [tok.decode(row) for row in ids.tolist()]
    assert lm.generate(2, steps=2, seq_len=70, stride=10, seed=3) == texts        # sample.py's name for it
    with pytest.raises(ValueError, match="name the same thing"):
        lm.generate(1, length=70, seq_len=60)


def test_python_api_refuses_bad_sizes_with_a_value_error(tiny_ckpt):
    """generate's num_samples and length, score's mc_draws: an integer >= 1, else a ValueError naming the keyword
    (not torch's error from deep inside, nor a silent default); a length whose tokens cannot fit in any machine's
    memory (10^15 tokens at >= 24 bytes each) is refused before a window is drawn."""
    from hub.pretrained import SDDLM
    lm = SDDLM.from_pretrained(tiny_ckpt[0])
    for n in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"num_samples must be an integer >= 1, got {n!r}"):
            lm.generate(n, steps=2)
    for length in (0, -5, 40.5):
        with pytest.raises(ValueError, match=rf"length must be an integer >= 1, got {length!r}"):
            lm.generate(1, steps=2, length=length)
    with pytest.raises(ValueError, match=r"seq_len must be an integer >= 1, got 0"):
        lm.generate(1, steps=2, seq_len=0)
    with pytest.raises(ValueError, match=r"num_samples 1 x length 1000000000000000: .* need at least .* lower length"):
        lm.generate(1, steps=2, length=10 ** 15)
    with pytest.raises(ValueError, match=r"the prompt is \d+ tokens, not shorter than length=5: give a length above"):
        lm.generate(1, steps=2, length=5, prompt="The the the the the the the the")
    for draws in (0, -4, float("nan"), 2.0):
        with pytest.raises(ValueError, match=r"mc_draws must be an integer >= 1"):
            lm.score("The", mc_draws=draws)


def test_cli_refuses_a_length_past_the_machine_in_one_line(tiny_ckpt):
    """sample.py --seq_len 10^15 (or a --num_samples as large): one `error:` line naming the flags, exit code 2, at
    the start. Run under an 8 GiB address-space limit, so that the code before the check (which built the windows'
    list, then drew them for ever) fails here within that limit rather than taking the machine's memory."""
    import resource
    import subprocess

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
    for flags, named in ((["--num_samples", "1", "--seq_len", str(10 ** 15)], "--batch_size 1 x --seq_len 10000"),
                         (["--num_samples", str(10 ** 15), "--seq_len", "40"], "--batch_size 1000000000000000 x")):
        proc = subprocess.run([sys.executable, "sample.py", "--ckpt", str(tiny_ckpt[0]), "--out", "", "--steps", "2",
                               *flags], cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              env=dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1"), preexec_fn=limit,
                              capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and lines[-1].startswith(f"error: {named}") and "lower --seq_len" in lines[-1], \
            proc.stderr
        assert "Traceback" not in proc.stderr and not proc.stdout.strip()
