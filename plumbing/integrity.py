"""What a script checks before it trusts what it reads: a checkpoint's fields have the types and values its writer
gave them (its model config is one this model.py builds), its bytes are the ones written (the zip's CRC-32s, a model
folder's recorded sha256), its weights are floating-point and finite, the tokenizer is the one its ids came from;
and the rule by which a training loss counts as diverged. Each failure is one line naming the field or file and the
fix."""
import hashlib
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


CHECKPOINT_FIX = "the checkpoint was damaged or written by other code: use another checkpoint"


def _expect(ok, path, field, value, wanted, error=ConfigError, fix=CHECKPOINT_FIX):
    """Not ok -> error: '{path}: its field {field} holds {value} ({type}), not {wanted}; {fix}'."""
    if not ok:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise error(f"{path}: its field {field} holds {shown} ({_type_name(value)}), not {wanted}; {fix}")


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
        checked_model_config(ckpt["model_config"], path, "model_config.", error=error)
    if ckpt.get("train_config") is not None:
        config = ckpt["train_config"]
        _expect(isinstance(config, dict), path, "train_config", config, "a dict", error)
        for k, kind in TRAIN_CONFIG_TYPES.items():
            if config.get(k) is not None:
                _expect(_fits(config[k], kind), path, f"train_config.{k}", config[k], kind, error)
        check_train_config_values(config, path, "train_config.", error)
    for name in ("meta", "optimizer", "distill_config", "distilled_from"):
        if ckpt.get(name) is not None:
            _expect(isinstance(ckpt[name], dict), path, name, ckpt[name], "a dict", error)
    meta = ckpt.get("meta") or {}
    for k in ("vocab_size", "bos_id", "eos_id", "pad_id", "block_size"):
        if meta.get(k) is not None:
            _expect(_is_int(meta[k]) and meta[k] >= (1 if k in ("vocab_size", "block_size") else 0), path,
                    f"meta.{k}", meta[k], "an int >= 1" if k in ("vocab_size", "block_size") else "an int >= 0", error)
    for k in ("tokenizer", "tokenizer_sha256"):
        if meta.get(k) is not None:
            _expect(isinstance(meta[k], str), path, f"meta.{k}", meta[k], "a string", error)
    if meta.get("data_key") is not None:
        _expect(isinstance(meta["data_key"], dict), path, "meta.data_key", meta["data_key"], "a dict", error)
    for k in ("step", "n_ema"):
        if ckpt.get(k) is not None:
            _expect(_is_int(ckpt[k]) and ckpt[k] >= 0, path, k, ckpt[k], "an int >= 0", error)


def checked_model_config(config, path, prefix="model_config.", error=ConfigError, fix="use another checkpoint"):
    """A model config read from disk (a checkpoint's model_config, a model folder's config.json, Duo's) -> ModelConfig,
    validated as the same flags are on the command line (ModelConfig.__post_init__: types, ranges, heads that split
    the width). A field it does not know or a bad value -> `error` naming the file and the field (prefix: how the
    file nests it, "model_config." in a checkpoint, "" in a flat config.json)."""
    from model import ModelConfig
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
    """The values readers act on, checked as their flags are: the objective (train.py --loss), the noise schedule
    (--noise_schedule), the sizes (--block_size, --batch_size, --max_iters >= 1)."""
    import diffusion
    checks = {"loss": (lambda v: v in diffusion.OBJECTIVES, f"one of {', '.join(diffusion.OBJECTIVES)}"),
              "noise_schedule": (lambda v: v in diffusion.SCHEDULES, f"one of {', '.join(diffusion.SCHEDULES)}"),
              "block_size": (lambda v: _is_int(v) and v >= 2, "an int >= 2"),
              "batch_size": (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
              "max_iters": (lambda v: _is_int(v) and v >= 1, "an int >= 1")}
    for k, (ok, wanted) in checks.items():
        if config.get(k) is not None:
            _expect(ok(config[k]), path, prefix + k, config[k], wanted, error, fix)


def check_config_matches(mcfg, state, path, prefix, weights="its weights", fix="use another checkpoint"):
    """A model config read from disk against the weights beside it, before a model of that config is built (a
    config.json saying n_layer 10**9 over two blocks' weights would otherwise allocate them all first): the number
    of blocks (n_layer) and the embedding's shape (vocab_size x n_embd) -> ConfigError naming the field."""
    blocks = {k.split(".")[1] for k in state if k.startswith("blocks.")}
    found = {"n_layer": (mcfg.n_layer, len(blocks), "blocks")}
    wte = state.get("wte.weight")
    if wte is not None and wte.dim() == 2:
        found.update(vocab_size=(mcfg.vocab_size, wte.shape[0], "embedding rows"),
                     n_embd=(mcfg.n_embd, wte.shape[1], "embedding columns"))
    for field, (said, held, what) in found.items():
        if said != held:
            raise ConfigError(f"{path}: {weights} do not fit its {prefix}{field} {said}: they hold {held} {what}; "
                              f"the file was damaged or edited: {fix}")


# the dtypes weights are saved in (torch.save of a float32 model; bf16 / fp16 / fp64 copies load by casting)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_weights(state, path, name, error=ConfigError, fix="use another checkpoint"):
    """A dict of named weights (a model's, its EMA, a teacher's, an optimizer's moments) is floating-point, of the
    dtypes weights are saved in, and finite (one min/max pass per tensor, ~3 GB/s on CPU: torch.aminmax propagates
    NaN and shows an infinity). load_state_dict would cast integers to floats and load NaN silently -> `error`
    naming the file, the entry and `fix`."""
    for k, v in state.items():
        if v.dtype not in WEIGHT_DTYPES:
            raise error(f"{path}: its {name} {k} holds {str(v.dtype).removeprefix('torch.')} values, not weights "
                        f"(float32, bfloat16, float16); the file was damaged or written by other code; {fix}")
        if v.numel() == 0:
            continue
        low, high = torch.aminmax(v.detach())
        if not (math.isfinite(low) and math.isfinite(high)):
            raise error(f"{path}: its weights are not finite ({name} {k} holds NaN or inf: the file is damaged, or "
                        f"it was saved after training diverged); {fix}")


def check_state_fits(want, state, path, name, fix="use another checkpoint"):
    """Named weights `state` against the names and shapes `want` ({name: tensor or shape}: the model's state dict,
    or the other weight set of the same checkpoint), before load_state_dict (whose refusal names no tensor in its
    first line): a missing tensor, one the model does not have, or one of another shape -> ConfigError naming the
    file, the set and the tensor."""
    shape = lambda v: tuple(v.shape) if torch.is_tensor(v) else tuple(v)
    missing = [k for k in want if k not in state]
    extra = [k for k in state if k not in want]
    wrong = [k for k in want if k in state and shape(state[k]) != shape(want[k])]
    more = lambda names: f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    if missing:
        detail = f"lacks {missing[0]}{more(missing)}"
    elif extra:
        detail = f"holds {extra[0]}{more(extra)}, which the model has not"
    elif wrong:
        detail = (f"holds {wrong[0]} of shape {list(shape(state[wrong[0]]))}, not {list(shape(want[wrong[0]]))}"
                  f"{more(wrong)}")
    else:
        return
    raise ConfigError(f"{path}: its {name + ' ' if name else ''}weights do not fit the model: it {detail}; the file "
                      f"was damaged or edited: {fix}")


def check_finite_weights(ckpt, path):
    """A checkpoint to resume holds finite floating-point weights (model, EMA, a distillation's teacher) and optimizer
    moments: one saved after training diverged -> ConfigError naming the file and the first bad tensor."""
    fix = "resume from an earlier checkpoint (ckpt_<step>.pt) or start again with a lower --lr"
    for name in ("model", "ema", "teacher"):
        check_weights(ckpt.get(name) or {}, f"cannot resume from {path}", name, fix=fix)
    states = (ckpt.get("optimizer") or {}).get("state")
    moments = {f"state {i} {k}": v for i, state in (states.items() if isinstance(states, dict) else ())
               if isinstance(state, dict) for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
    check_weights(moments, f"cannot resume from {path}", "optimizer", fix=fix)


# -----------------------------------------------------------------------------------------------
# the bytes of a weights file

def check_zip(f, path):
    """torch.save writes a zip whose members each carry a CRC-32, which torch.load never checks: a flipped bit in a
    tensor loads silently. Each member is checked against its CRC (stored members straight from the file, memory-
    mapped, in a thread per core: zlib releases the GIL; ~1.4-2.4 GB/s on one core of this CPU) -> ValueError
    naming the member. f: the open file (binary), so that what is checked is what is loaded. A file that is no zip
    (torch's legacy format) is left to torch.load."""
    import mmap
    import struct
    import zipfile
    import zlib
    from concurrent.futures import ThreadPoolExecutor
    try:
        archive = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, OSError, ValueError):
        return
    with archive, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm, memoryview(mm) as view:
        def sound(info):
            if info.compress_type != zipfile.ZIP_STORED:
                try:
                    with archive.open(info) as member:       # zipfile checks the CRC at the member's end
                        while member.read(1 << 24):
                            pass
                    return True
                except (zipfile.BadZipFile, OSError, ValueError):
                    return False
            at = info.header_offset
            if view[at:at + 4] != b"PK\x03\x04":
                return False
            name_len, extra_len = struct.unpack("<HH", view[at + 26:at + 30])
            start = at + 30 + name_len + extra_len
            return start + info.compress_size <= len(view) and \
                zlib.crc32(view[start:start + info.compress_size]) == info.CRC
        infos = archive.infolist()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        with ThreadPoolExecutor(max(1, min(8, cores))) as pool:
            verdicts = list(pool.map(sound, infos))
    for info, ok in zip(infos, verdicts):
        if not ok:
            raise ValueError(f"its member {info.filename} fails its CRC-32 check: the file was damaged after it "
                             f"was written (a changed byte)")


def sha256_file(path, block=1 << 22):
    """The sha256 of a file, read in blocks (streaming: memory stays flat for any size)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


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
