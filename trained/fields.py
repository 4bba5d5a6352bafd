"""The records a trained model carries (a checkpoint's dict, a model folder's config.json, Duo's config) checked as
their flags would be: each field of the type its writer gave it, the model config one this model.py builds, the
objective, schedule and sizes ones the readers know. Each failure is one line naming the file and the field."""
from dataclasses import fields

import diffusion
from model import ModelConfig, build_model
from plumbing.cli import ConfigError
from plumbing.integrity import (CHECKPOINT_FIX, check_dataclass_fields, check_state_fits, check_tensors, expect, fits,
                                is_int)
from plumbing.memory import check_model_memory

# the train_config fields that readers of a checkpoint use (resume checks, samplers, distillation/distill.py)
TRAIN_CONFIG_TYPES = {"loss": "str", "noise_schedule": "str", "tokenizer": "str", "dataset": "str", "data_dir": "str",
                      "batch_size": "int", "block_size": "int", "max_iters": "int", "wrap": "bool"}


def check_checkpoint_fields(ckpt, path, error=ConfigError):
    """A checkpoint dict (train.py / distillation/distill.py) has its fields in the types save() writes, its
    model_config one this model.py builds. Otherwise `error` (a UsageError: one line naming the field)."""
    expect(isinstance(ckpt, dict), path, "(the whole file)", ckpt, "a dict", error)
    if "model" in ckpt:
        check_tensors(ckpt["model"], path, "model", error)
    for name in ("ema", "teacher"):
        if ckpt.get(name) is not None:
            check_tensors(ckpt[name], path, name, error)
    if "model_config" in ckpt:
        expect(isinstance(ckpt["model_config"], dict), path, "model_config", ckpt["model_config"], "a dict", error)
        check_dataclass_fields(ckpt["model_config"], ModelConfig, path, "model_config", error)
        checked_model_config(ckpt["model_config"], path, "model_config.", error=error)
    if ckpt.get("train_config") is not None:
        config = ckpt["train_config"]
        expect(isinstance(config, dict), path, "train_config", config, "a dict", error)
        check_train_config_values(config, path, "train_config.", error)
    a_dict, a_str = (lambda v: isinstance(v, dict), "a dict"), (lambda v: isinstance(v, str), "a string")
    check_values(ckpt, dict.fromkeys(("meta", "optimizer", "distill_config", "distilled_from"), a_dict), path, "",
                 error)
    meta = {"vocab_size": int_from(1), "bos_id": int_from(0), "eos_id": int_from(0), "pad_id": int_from(0),
            "block_size": int_from(1), "tokenizer": a_str, "tokenizer_sha256": a_str, "data_key": a_dict}
    check_values(ckpt.get("meta") or {}, meta, path, "meta.", error)
    check_values(ckpt, {"step": int_from(0), "n_ema": int_from(0)}, path, "", error)


def int_from(low):
    """check_values' check of an int >= low."""
    return lambda v: is_int(v) and v >= low, f"an int >= {low}"


def check_values(record, checks, path, prefix, error=ConfigError, fix=CHECKPOINT_FIX):
    """Each field of record that checks names ({field: (ok(value), wanted)}) and that is not None passes ok, else
    `error` naming the file and the field (prefix: how the file nests record)."""
    for k, (ok, wanted) in checks.items():
        if record.get(k) is not None:
            expect(ok(record[k]), path, prefix + k, record[k], wanted, error, fix)


def checked_model_config(config, path, prefix="model_config.", error=ConfigError, fix="use another checkpoint"):
    """A model config read from disk (a checkpoint's model_config, a model folder's config.json, Duo's) -> ModelConfig,
    validated as the same flags are on the command line (ModelConfig.__post_init__: types, ranges, heads that split
    the width). A field it does not know or a bad value -> `error` naming the file and the field (prefix: how the
    file nests it, "model_config." in a checkpoint, "" in a flat config.json)."""
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise error(f"{path}: its {prefix.rstrip('.') or 'model config'} has keys this model.py does not know: "
                    f"{', '.join(unknown)} (written by other code or another version); {fix}")
    try:
        return ModelConfig(**config)
    except (TypeError, ValueError) as e:
        raise error(f"{path}: {prefix}{e}; the file was damaged or edited: {fix}") from None


def check_train_config_values(config, path, prefix, error=ConfigError, fix=CHECKPOINT_FIX):
    """The fields readers use (TRAIN_CONFIG_TYPES) of their types, and the values they act on checked as their flags
    are: the objective (train.py --loss), the noise schedule (--noise_schedule), the sizes (--block_size,
    --batch_size, --max_iters >= 1)."""
    types = {k: (lambda v, kind=kind: fits(v, kind), kind) for k, kind in TRAIN_CONFIG_TYPES.items()}
    checks = {"loss": (lambda v: v in diffusion.OBJECTIVES, f"one of {', '.join(diffusion.OBJECTIVES)}"),
              "noise_schedule": (lambda v: v in diffusion.SCHEDULES, f"one of {', '.join(diffusion.SCHEDULES)}"),
              "block_size": int_from(2), "batch_size": int_from(1), "max_iters": int_from(1)}
    for table in (types, checks):
        check_values(config, table, path, prefix, error, fix)


def built_model(mcfg, device, where, path, sets, use, fix="use another checkpoint"):
    """The loaders' last step (a checkpoint, a model folder, Duo's): a model of mcfg once it fits the memory there is
    (where: how messages name the config, before the field) and every weight set of the file (sets: {name: state})
    has its names and shapes, with sets[use] loaded -> the model in eval mode on device."""
    check_model_memory(mcfg, device, lambda field: f"{where}{field}")
    model = build_model(mcfg)
    for name, state in sets.items():
        check_state_fits(model.state_dict(), state, path, name, fix)
    model.load_state_dict(sets[use])
    return model.to(device).eval()
