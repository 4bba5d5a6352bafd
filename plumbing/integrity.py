"""What a script checks before it trusts what it reads: a checkpoint's fields have the types its writer gave them,
its weights are finite, the tokenizer is the one its ids came from; and the rule by which a training loss counts
as diverged. Each failure is one line naming the field or file and the fix."""
import math
import os
import statistics
from collections import deque
from dataclasses import fields

import torch

from plumbing.cli import ConfigError, UsageError

# -----------------------------------------------------------------------------------------------
# checkpoint fields


def _type_name(value):
    return "None" if value is None else type(value).__name__


def _expect(ok, path, field, value, wanted, error=ConfigError):
    if not ok:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise error(f"{path}: its field {field} holds {shown} ({_type_name(value)}), not {wanted}; the checkpoint "
                    f"was damaged or written by other code: use another checkpoint")


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _fits(value, annotation):
    """value has the type a dataclass field declares (int: not a bool; float: int or float; None where the
    default is None)."""
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if kind == "int":
        return _is_int(value)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    return True


def _check_dataclass_fields(config, cls, path, name, error):
    """Every key of `config` that is a field of `cls` has that field's type (unknown keys are the caller's)."""
    for f in fields(cls):
        if f.name in config and not (config[f.name] is None and f.default is None):
            _expect(_fits(config[f.name], f.type), path, f"{name}.{f.name}", config[f.name], f.type if
                    isinstance(f.type, str) else f.type.__name__, error)


def _check_tensors(state, path, name, error):
    _expect(isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                            for k, v in state.items()), path, name, state,
            "a dict of named tensors", error)


# the train_config fields that readers of a checkpoint use (resume checks, samplers, distillation/distill.py)
TRAIN_CONFIG_TYPES = {"loss": "str", "noise_schedule": "str", "tokenizer": "str", "dataset": "str", "data_dir": "str",
                      "batch_size": "int", "block_size": "int", "max_iters": "int", "wrap": "bool"}


def check_checkpoint_fields(ckpt, path, error=ConfigError):
    """A checkpoint dict (train.py / distillation/distill.py) has its fields in the types save() writes: model (and ema, teacher)
    dicts of tensors, model_config a dict whose known fields have ModelConfig's types, train_config a dict (the fields
    readers use, TRAIN_CONFIG_TYPES, typed), meta a dict (vocab_size and the special ids ints, the tokenizer a
    string), step and n_ema ints >= 0.
    Otherwise `error` (a UsageError: one line naming the field)."""
    from model import ModelConfig
    _expect(isinstance(ckpt, dict), path, "(the whole file)", ckpt, "a dict", error)
    if "model" in ckpt:
        _check_tensors(ckpt["model"], path, "model", error)
    for name in ("ema", "teacher"):
        if ckpt.get(name) is not None:
            _check_tensors(ckpt[name], path, name, error)
    if "model_config" in ckpt:
        _expect(isinstance(ckpt["model_config"], dict), path, "model_config", ckpt["model_config"], "a dict", error)
        _check_dataclass_fields(ckpt["model_config"], ModelConfig, path, "model_config", error)
    if ckpt.get("train_config") is not None:
        config = ckpt["train_config"]
        _expect(isinstance(config, dict), path, "train_config", config, "a dict", error)
        for k, kind in TRAIN_CONFIG_TYPES.items():
            if config.get(k) is not None:
                _expect(_fits(config[k], kind), path, f"train_config.{k}", config[k], kind, error)
    for name in ("meta", "optimizer", "distill_config", "distilled_from"):
        if ckpt.get(name) is not None:
            _expect(isinstance(ckpt[name], dict), path, name, ckpt[name], "a dict", error)
    meta = ckpt.get("meta") or {}
    for k in ("vocab_size", "bos_id", "eos_id", "pad_id", "block_size"):
        if meta.get(k) is not None:
            _expect(_is_int(meta[k]), path, f"meta.{k}", meta[k], "an int", error)
    for k in ("tokenizer", "tokenizer_sha256"):
        if meta.get(k) is not None:
            _expect(isinstance(meta[k], str), path, f"meta.{k}", meta[k], "a string", error)
    if meta.get("data_key") is not None:
        _expect(isinstance(meta["data_key"], dict), path, "meta.data_key", meta["data_key"], "a dict", error)
    for k in ("step", "n_ema"):
        if ckpt.get(k) is not None:
            _expect(_is_int(ckpt[k]) and ckpt[k] >= 0, path, k, ckpt[k], "an int >= 0", error)


def check_finite_weights(ckpt, path):
    """A checkpoint to resume holds finite weights (model, EMA): one saved after training diverged -> ConfigError
    naming the file and the first non-finite tensor."""
    for name in ("model", "ema"):
        for k, v in (ckpt.get(name) or {}).items():
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise ConfigError(f"cannot resume from {path}: its weights are not finite ({name} {k} holds NaN or "
                                  f"inf; it was saved after training diverged); resume from an earlier checkpoint "
                                  f"(ckpt_<step>.pt) or start again with a lower --lr")


# -----------------------------------------------------------------------------------------------
# the tokenizer a checkpoint's ids came from

def check_tokenizer_identity(tok, ckpt, path, fix=None):
    """The tokenizer loaded for a checkpoint is the one it was trained with: its content hash equals the recorded
    meta['tokenizer_sha256'] where both are known; its vocabulary and special ids equal the recorded ones; and it
    has no more ids than the model's vocabulary. Otherwise another tokenizer lies at the recorded path: its ids
    would decode to other text and its text encode to other ids (or to ids past the model's output rows), so
    -> UsageError naming the tokenizer's file, the checkpoint and the fix."""
    meta = ckpt.get("meta") or {}
    where = tok.spec.removeprefix("sp:") if tok.spec.startswith("sp:") else f"tokenizer {tok.spec!r}"
    fix = fix or (f"put back the tokenizer {path} was trained with (or give a model folder, which carries its own: "
                  f"python hub/pretrained.py --ckpt CKPT --out FOLDER, run where the original tokenizer is)")
    recorded = meta.get("tokenizer_sha256")
    if recorded and tok.fingerprint and tok.fingerprint != recorded:
        raise UsageError(f"{where} is not the tokenizer {path} was trained with (sha256 {tok.fingerprint[:12]}..., "
                         f"recorded {recorded[:12]}...); {fix}")
    theirs = {k: meta.get(k) for k in ("vocab_size", "bos_id", "eos_id", "pad_id")}
    ours = {"vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id}
    diff = [f"{k} {ours[k]}, recorded {v}" for k, v in theirs.items() if v is not None and ours[k] != v]
    model_vocab = (ckpt.get("model_config") or {}).get("vocab_size")
    if model_vocab is not None and tok.vocab_size > model_vocab:
        diff.append(f"vocab_size {tok.vocab_size} > the model's {model_vocab}")
    if diff:
        raise UsageError(f"{where} is not the tokenizer {path} was trained with ({'; '.join(diff)}); {fix}")


def check_data_tokenizer(data_dir, meta, ckpt=None, path=None, need_tokenizer=True):
    """Every reader of a prepared folder, before it trusts its ids: its meta.json agrees with the tokenizer it names
    (vocabulary size, special ids, the probe text's ids, content hash: an edited vocab_size is caught here), and,
    given the checkpoint (path: its name) the data is read for, that tokenizer is the checkpoint's by content
    (check_tokenizer_identity; a tokenizer of the same size with other pieces gives ids of other text).
    need_tokenizer=False: a tokenizer that cannot be loaded here (a package or the network missing) skips the first
    check, and the recorded hashes decide. -> the tokenizer (None when skipped); else UsageError / DataError (one
    line naming the folder and the fix)."""
    from data import DataError, check_tokenizer, get_tokenizer
    record = (ckpt or {}).get("meta") or {}
    ours, theirs = meta.get("tokenizer_sha256"), record.get("tokenizer_sha256")
    fix = f"give the --data_dir {path} was trained on (its config.json names it), or prepare one with its tokenizer"
    if ours and theirs and ours != theirs:
        raise UsageError(f"{data_dir} was prepared with another tokenizer ({meta.get('tokenizer')}, sha256 "
                         f"{ours[:12]}...) than {path} was trained with (sha256 {theirs[:12]}...); {fix}")
    try:
        tok = get_tokenizer(meta["tokenizer"])
    except DataError:
        if need_tokenizer:
            raise
        return None
    own = dict(vocab_size=tok.vocab_size, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)
    diff = [f"{k} {meta.get(k)!r}, its tokenizer's {v!r}" for k, v in own.items() if meta.get(k) != v]
    if not diff:
        try:
            check_tokenizer(meta, tok)         # the probe text's ids and the content hash
        except DataError:
            diff = ["the tokenizer's ids or content"]
    if diff:
        raise DataError(f"{os.path.join(data_dir, 'meta.json')} does not describe its tokenizer {meta['tokenizer']} "
                        f"({'; '.join(diff)}: edited?); delete {data_dir} to prepare it again")
    if ckpt is not None:
        check_tokenizer_identity(tok, ckpt, path, fix=f"{data_dir} was prepared with it; {fix}")
    return tok


# -----------------------------------------------------------------------------------------------
# divergence

class DivergenceRule:
    """When training counts as diverged. The loss of the first step of a process is that of sound weights (the
    initialisation, or a checkpoint that passed check_finite_weights); it starts a history of the last `window`
    logged losses (each the mean over --log_interval steps). A logged loss diverges when it is not finite, or when
    it exceeds the median of that history by more than `margin` nats per token. A validation NELBO (the bound every
    objective is evaluated by) diverges when it is not finite or exceeds log V + margin.

    The default margin is log V (V the vocabulary): a model that knows nothing, a uniform guess, scores about
    log V per token on every NLL-type objective (naive, sddlm, duo's NELBO, ar) and on the NELBO, so a rise of
    log V above the recent level means predictions became worse than knowing nothing, by as much again. Healthy
    training, however noisy, moves its logged mean by a fraction of that (a token mean over the batch, stratified
    t); an optimiser blow-up (--lr 1e30: a loss of 1e30 nats) passes it at its first logged step. The median, not
    the mean, keeps one spike in the history from raising the bar. The SDDLM-V1/V2 training losses are bounded by
    |log eps| (~13.8) per token, so their blow-up can stay under the loss bar; the NELBO bar sees it at the next
    evaluation."""

    def __init__(self, margin, log_v, window=20):
        self.margin, self.log_v, self.history = margin or log_v, log_v, deque(maxlen=window)

    def start(self, loss):
        """The first step's loss of this process (sound weights)."""
        if math.isfinite(loss):
            self.history.append(loss)

    def check(self, loss):
        """A logged loss -> None when sound (it joins the history), else the reason, in words."""
        if not math.isfinite(loss):
            return "non-finite loss"
        if self.history:
            median = statistics.median(self.history)
            if loss > median + self.margin:
                return (f"diverged loss {loss:.4g} (more than {self.margin:.3g} nats above {median:.4g}, the median "
                        f"of the {len(self.history)} before it; --diverge_margin)")
        self.history.append(loss)
        return None

    def check_metrics(self, metrics):
        """An evaluation's metrics -> None when its val_nelbo (if any) is sound, else the reason."""
        nelbo = metrics.get("val_nelbo")
        if nelbo is None:
            return None
        if not math.isfinite(nelbo):
            return "non-finite validation NELBO"
        if nelbo > self.log_v + self.margin:
            return (f"diverged validation NELBO {nelbo:.4g} (more than {self.margin:.3g} nats above log V = "
                    f"{self.log_v:.3g}, a uniform guess; --diverge_margin)")
        return None
