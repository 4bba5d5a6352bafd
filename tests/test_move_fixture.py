"""The tiny preset reproduces, from the same seed, recorded numbers exactly: the losses of a few training steps
(curriculum and plain, every kind of objective), the weights and EMA weights they leave, and an ancestral sample.
Any change of behaviour in the step, the model or the sampler shows here. Regenerate (only after a deliberate
change of behaviour) with `python tests/test_move_fixture.py`."""
import os

import torch

import train
from sample import generate

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "move_fixture.pt")
LOSSES = ("sddlm", "sddlm_v1", "duo", "ar")


def record():
    """Three steps per objective of a 2-layer tiny model on seeded random tokens (one process, CPU, float32),
    the first under Duo's curriculum for the diffusion objectives; then 8 ancestral steps from the EMA weights."""
    torch.set_num_threads(1)
    out = {}
    for loss in LOSSES:
        cfg = train.TrainConfig(loss=loss, n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=4,
                                grad_accum=2, warmup_iters=2, lr=1e-2, ema=0.9, device="cpu", dtype="float32",
                                curriculum_iters=0 if loss == "ar" else 1, seed=3)
        env = train.Env(torch.device("cpu"))
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
    assert list(now) == list(saved)
    for loss in LOSSES:
        a, b = now[loss], saved[loss]
        assert torch.equal(a["losses"], b["losses"]), (loss, a["losses"], b["losses"])
        assert a["n_ema"] == b["n_ema"] == 3
        assert list(a["first"]) == list(b["first"])
        for k in b["first"]:
            assert torch.equal(a["first"][k], b["first"][k]), (loss, k)
        assert all(torch.equal(x, y) for x, y in zip(a["ema"], b["ema"])) and len(a["ema"]) == 3
    assert torch.equal(now["sddlm"]["sample"], saved["sddlm"]["sample"])


if __name__ == "__main__":
    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    torch.save(record(), FIXTURE)
    print(f"wrote {FIXTURE}")
