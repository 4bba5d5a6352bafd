"""The tiny preset reproduces, from the same seed, recorded numbers within their rounding: the losses of a few
training steps (curriculum and plain, every kind of objective), the weights and EMA weights they leave, and an
ancestral sample.
Any change of behaviour in the step, the model or the sampler shows here. Regenerate (only after a deliberate
change of behaviour) with `PYTHONPATH=. python tests/test_move_fixture.py`.

The recording is compared within the rounding error of this very computation on every machine, the recording one
included: the same torch version and CPU capability string do not fix the bits (oneDNN and MKL choose kernels by
finer CPU features; issue 42 met a 1.9e-9 .. 1.2e-7 difference on another AVX-512 CPU). That error is measured by
the recording as the distance of its float32 run from the float64 run of the same steps from the same initial
weights (tolerance below). Where bits are the claim (the same seed gives the same run), both runs are made here, on
this machine, in the test."""
import os
import pytest
import torch

import train
from plumbing.distributed import Env
from sample import generate

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "move_fixture.pt")
LOSSES = ("sddlm", "sddlm_v1", "duo", "ar")
pytestmark = pytest.mark.numerics            # CI runs it under ATEN_CPU_CAPABILITY=default too (.ci/run)


def machine():
    """Where the fixture was recorded (torch's CPU kernels and its version): a note for a reader, never a switch."""
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__.split("+")[0]}


def tolerance(rec32, rec64):
    """How far another CPU's float32 run may be from the recorded one, for one recorded tensor. Rounding moves a
    float32 result by kappa * u, kappa the computation's own sensitivity (reduction lengths, the steps taken, Adam's
    division amplifying a gradient that is small against its rounding: all of it); rec64 - rec32 is that error as the
    recording made it (the float64 run, same initial weights and draws, errs 2^29 times less). Another order of
    rounding errs as much: |now - rec| <= |now - exact| + |rec - exact| ~ 2 gaps, times 2 as one sample of a
    rounding error stands for its size; plus the initial weights, which both runs share, but another CPU's
    vectorised normal draw rounds differently (1 ulp each, carried through three small steps): 2 ulps of the largest."""
    gap = (rec32.double() - rec64.double()).abs().max().item()
    return 4 * gap + 2 * torch.finfo(torch.float32).eps * rec32.abs().max().item()


def close(a, b, b64):
    return a.shape == b.shape and (a - b).abs().max().item() <= tolerance(b, b64)


def record(dtype=torch.float32):
    """Three steps per objective of a 2-layer tiny model on seeded random tokens (one process, CPU, float32; float64:
    the same initial weights and draws, every step in float64), the first under Duo's curriculum for the diffusion
    objectives; then 8 ancestral steps from the EMA weights."""
    torch.set_num_threads(1)
    out = {}
    for loss in LOSSES:
        # head="fused": the route the fixture was recorded on. The CPU's default is now the plain logits: the same
        # bits for sddlm, sddlm_v1 and duo; ar's W gradient sums one more (zero) row there, a few ulps apart.
        cfg = train.TrainConfig(loss=loss, head="fused", n_layer=2, n_head=2, n_embd=32, block_size=16,
                                batch_size=4, grad_accum=2, warmup_iters=2, lr=1e-2, ema=0.9, device="cpu",
                                dtype="float32", curriculum_iters=0 if loss == "ar" else 1, seed=3)
        env = Env(torch.device("cpu"))
        mcfg = train.model_config_for(cfg, 64)
        run = train.build_run(cfg, mcfg, env)
        run.raw_model.to(dtype)             # in place: the optimizer (no state yet) holds the same parameters
        run.ema = [e.to(dtype) for e in run.ema]
        data = torch.Generator().manual_seed(11)
        steps = []
        for _ in range(3):
            x0 = torch.randint(0, 64, (cfg.batch_size, cfg.block_size), generator=data)
            steps.append(train.train_step(run, cfg, env, x0).clone())
        state = run.raw_model.state_dict()
        rec = {"losses": torch.stack(steps), "n_ema": run.n_ema,
               "first": {k: v.flatten()[:16].clone() for k, v in list(state.items())[:3]},
               "ema": [e.flatten()[:16].clone() for e in run.ema[:3]]}
        if loss == "sddlm":
            run.raw_model.eval()
            rec["sample"] = generate(run.raw_model, 2, 16, 64, 8, generator=torch.Generator().manual_seed(5),
                                     show_progress=False)
        out[loss] = rec
    return out


def recorded_now():
    before = torch.get_num_threads()
    try:
        return record()
    finally:
        torch.set_num_threads(before)


def test_same_seed_gives_the_same_bits_on_this_machine():
    a, b = recorded_now(), recorded_now()
    flat = lambda rec: [rec["losses"], *rec["first"].values(), *rec["ema"], rec.get("sample", torch.zeros(0))]
    for loss in LOSSES:
        assert all(torch.equal(x, y) for x, y in zip(flat(a[loss]), flat(b[loss]), strict=True)), loss


def test_steps_weights_and_sample_match_the_recording():
    now = recorded_now()
    saved = torch.load(FIXTURE, weights_only=False)
    saved.pop("machine")
    saved64 = saved.pop("float64")
    assert list(now) == list(saved) == list(saved64)
    for loss in LOSSES:
        a, b, b64 = now[loss], saved[loss], saved64[loss]
        assert close(a["losses"], b["losses"], b64["losses"]), (loss, a["losses"], b["losses"])
        assert a["n_ema"] == b["n_ema"] == 3
        assert list(a["first"]) == list(b["first"])
        for k in b["first"]:
            assert close(a["first"][k], b["first"][k], b64["first"][k]), (loss, k)
        assert len(a["ema"]) == 3 and all(close(x, y, y64) for x, y, y64 in zip(a["ema"], b["ema"], b64["ema"]))
    # token ids, equal on every machine: a draw changes only where a uniform falls within the rounding (~1e-6) of a
    # category's cumulative probability, for these 2 x 16 x 8 draws a chance of ~3e-4
    assert torch.equal(now["sddlm"]["sample"], saved["sddlm"]["sample"])


def test_the_tolerances_are_far_below_a_change_of_behaviour():
    """The tolerances are rounding-sized, far below what a changed step does: one Adam step moves every weight
    with a nonzero gradient by ~lr = 1e-2 (the first by exactly lr_1 = 5e-3 sign(g)), and a changed objective or
    input moves a loss by >= 1e-3 at these sizes."""
    saved = torch.load(FIXTURE, weights_only=False)
    saved.pop("machine")
    saved64 = saved.pop("float64")
    for loss in LOSSES:
        b, b64 = saved[loss], saved64[loss]
        assert tolerance(b["losses"], b64["losses"]) < 1e-4, loss
        for k in b["first"]:
            assert tolerance(b["first"][k], b64["first"][k]) < 1e-3, (loss, k)
        assert max(tolerance(y, y64) for y, y64 in zip(b["ema"], b64["ema"])) < 1e-3, loss


if __name__ == "__main__":
    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    torch.save({**record(), "float64": record(torch.float64), "machine": machine()}, FIXTURE)
    print(f"wrote {FIXTURE}")
