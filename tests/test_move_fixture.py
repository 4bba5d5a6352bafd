"""The tiny preset reproduces, from the same seed, recorded numbers exactly: the losses of a few training steps
(curriculum and plain, every kind of objective), the weights and EMA weights they leave, and an ancestral sample.
Any change of behaviour in the step, the model or the sampler shows here. Regenerate (only after a deliberate
change of behaviour) with `python tests/test_move_fixture.py`.

The fixture records the machine's kernels (torch's CPU capability and version): on kernels like the recording
machine's the check is bit for bit; on other CPUs (another vector width rounds sums in another order) every float
must be within ULPS units in the last place, so the guard stays strict for the developer and true on a fresh box."""
import os

import torch

import train
from plumbing.distributed import Env
from sample import generate

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "move_fixture.pt")
LOSSES = ("sddlm", "sddlm_v1", "duo", "ar")
ULPS = 64     # another CPU's kernels: Duo's losses were seen 1 ulp apart after three steps (AMD EPYC, AVX2 vs AVX512)


def machine():
    """What decides the float rounding of the recorded numbers: torch's CPU kernels and its version."""
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__.split("+")[0]}


def ulp_distance(a, b):
    """Units in the last place between two float32 tensors, elementwise (an order-preserving map to integers)."""
    ia, ib = (t.float().contiguous().view(torch.int32).long() for t in (a, b))
    ia, ib = (torch.where(i < 0, -(i & 0x7FFFFFFF), i) for i in (ia, ib))
    return (ia - ib).abs()


def same(a, b, exact):
    return torch.equal(a, b) if exact else (a.shape == b.shape and int(ulp_distance(a, b).max()) <= ULPS)


def record():
    """Three steps per objective of a 2-layer tiny model on seeded random tokens (one process, CPU, float32),
    the first under Duo's curriculum for the diffusion objectives; then 8 ancestral steps from the EMA weights."""
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


def test_same_seed_reproduces_the_recorded_steps_weights_and_sample():
    before = torch.get_num_threads()
    try:
        now = record()
    finally:
        torch.set_num_threads(before)
    saved = torch.load(FIXTURE, weights_only=False)
    exact = saved.pop("machine") == machine()      # the recording machine's kernels: bit for bit
    assert list(now) == list(saved)
    for loss in LOSSES:
        a, b = now[loss], saved[loss]
        assert same(a["losses"], b["losses"], exact), (loss, a["losses"], b["losses"])
        assert a["n_ema"] == b["n_ema"] == 3
        assert list(a["first"]) == list(b["first"])
        for k in b["first"]:
            assert same(a["first"][k], b["first"][k], exact), (loss, k)
        assert all(same(x, y, exact) for x, y in zip(a["ema"], b["ema"])) and len(a["ema"]) == 3
    assert torch.equal(now["sddlm"]["sample"], saved["sddlm"]["sample"])   # token ids: equal on every machine


def test_ulp_distance_counts_units_in_the_last_place():
    one = torch.tensor([1.0, -1.0, 0.0, 2.5e-8])
    nxt = torch.nextafter(one, torch.full_like(one, 10.0))
    assert ulp_distance(one, nxt).tolist() == [1, 1, 1, 1]
    assert ulp_distance(torch.tensor([-0.0]), torch.tensor([0.0])).item() == 0
    assert ulp_distance(torch.tensor([1.0]), torch.tensor([1.0 + 2 ** -20])).item() == 8
    assert same(one, nxt, exact=False) and not same(one, nxt, exact=True)
    assert not same(one, one * (1 + 2 ** -16), exact=False)


if __name__ == "__main__":
    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    torch.save({**record(), "machine": machine()}, FIXTURE)
    print(f"wrote {FIXTURE}")
