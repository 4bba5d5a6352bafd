"""trained/fields.py: a checkpoint's or model folder's config checked as its flags are, naming file and field."""
import pytest

from conftest import case, check_last, edit_checkpoint, edit_folder, run_batches


@pytest.mark.slow
def test_configs_on_disk_are_checked_as_flags_naming_field(run_ema, tmp_path):
    t = tmp_path

    def model_config(**fields):
        return lambda ck: ck["model_config"].update(fields)
    head0 = edit_checkpoint(run_ema.ckpt, t / "n_head0.pt", model_config(n_head=0))
    neg = edit_checkpoint(run_ema.ckpt, t / "n_embd_neg.pt", model_config(n_embd=-64))
    schedule = edit_checkpoint(run_ema.ckpt, t / "schedule.pt",
                               lambda ck: ck["train_config"].update(noise_schedule="x"))
    folder = lambda name, **fields: edit_folder(run_ema.model, t / name, lambda c: c.update(fields))
    f_head0, f_tok = folder("f_head0", n_head=0), folder("f_tok", tokenizer="abc")
    f_layers, f_str = folder("f_layers", n_layer=10 ** 9), folder("f_str", n_head="2")
    f_objective = folder("f_objective", objective="nope")
    broken = edit_folder(run_ema.model, t / "broken", edit_bytes=lambda d: (d / "config.json").write_text('{"format":'))
    duo = t / "duo"
    duo.mkdir()
    (duo / "config.json").write_text("{not json")
    (duo / "model.safetensors").write_bytes(b"")
    samp = lambda ckpt: ["sample.py", "--ckpt", ckpt, "--num_samples", "1", "--steps", "2", "--out", ""]
    cases = [
        case(*samp(head0), cwd=t, expect=f"{head0}: model_config.n_head must be an int >= 1, got 0"),
        case("eval_ppl.py", "--ckpt", head0, cwd=t, expect=f"{head0}: model_config.n_head must be an int >= 1"),
        case("hub/pretrained.py", "--ckpt", head0, "--out", t / "exported", cwd=t, expect="model_config.n_head must be"),
        case("distillation/distill.py", "--init", head0, "--out_dir", t / "dcd", cwd=t,
             expect="model_config.n_head must be an int >= 1"),
        case("eval_ppl.py", "--ckpt", neg, cwd=t, expect=f"{neg}: model_config.n_embd must be an int >= 2, got -64"),
        case(*samp(schedule), cwd=t, expect=f"{schedule}: its field train_config.noise_schedule holds 'x'"),
        case(*samp(f_head0), cwd=t, expect=f"{f_head0}/config.json: n_head must be an int >= 1, got 0"),
        case("eval_ppl.py", "--ckpt", f_head0, cwd=t, expect=f"{f_head0}/config.json: n_head must be"),
        case(*samp(f_tok), cwd=t, expect=f"{f_tok}/config.json: its field tokenizer holds 'abc'"),
        case(*samp(f_str), cwd=t, expect=f"{f_str}/config.json: n_head must be an int >= 1, got '2'"),
        case(*samp(f_objective), cwd=t, expect=f"{f_objective}/config.json: its field objective holds 'nope'"),
        case(*samp(broken), cwd=t, expect=f"{broken}/config.json is not valid JSON"),
        case(*samp(f_layers), cwd=t, expect=f"{f_layers}/config.json: the weights (model.safetensors) do not fit its "
                                            f"n_layer 1000000000"),
        case(*samp(f"duo:{duo}"), cwd=t, expect=f"{duo}/config.json is not valid JSON"),
    ]
    check_last(run_batches(cases))
    assert not (t / "exported").exists() and not (t / "dcd").exists()
