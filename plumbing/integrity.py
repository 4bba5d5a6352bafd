"""What a script checks before it trusts what it reads, whatever the model: a field has the type its writer gave it,
the bytes are the ones written (the zip's CRC-32s, a model folder's recorded sha256), weights are floating-point,
finite and of the shapes wanted, the tokenizer is the one its ids came from; and the rule by which a training loss
counts as diverged. Each failure is one line naming the field or file and the fix. The checks that need the model's
own config live beside it (trained/checkpoint.py)."""
import hashlib
import math
import statistics
from collections import deque
from dataclasses import fields

import torch

from plumbing.cli import ConfigError, UsageError
from plumbing.distributed import usable_cores

# -----------------------------------------------------------------------------------------------
# checkpoint fields

CHECKPOINT_FIX = "the checkpoint was damaged or written by other code: use another checkpoint"


def expect(ok, path, field, value, wanted, error=ConfigError, fix=CHECKPOINT_FIX):
    """Not ok -> error: '{path}: its field {field} holds {value} ({type}), not {wanted}; {fix}'."""
    if not ok:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        kind = "None" if value is None else type(value).__name__
        raise error(f"{path}: its field {field} holds {shown} ({kind}), not {wanted}; {fix}")


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def fits(value, annotation):
    """value has the type a dataclass field declares (int: not a bool; float: int or float; None where the
    default is None)."""
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    types = {"int": int, "float": (int, float), "bool": bool, "str": str}
    if kind not in types:
        return True
    return isinstance(value, types[kind]) and (kind == "bool" or not isinstance(value, bool))   # a bool is an int


def check_dataclass_fields(config, cls, path, name, error):
    """Every key of `config` that is a field of `cls` has that field's type (unknown keys are the caller's)."""
    for f in fields(cls):
        if f.name in config and not (config[f.name] is None and f.default is None):
            expect(fits(config[f.name], f.type), path, f"{name}.{f.name}", config[f.name], f.type if
                    isinstance(f.type, str) else f.type.__name__, error)


def check_tensors(state, path, name, error):
    expect(isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                            for k, v in state.items()), path, name, state,
            "a dict of named tensors", error)


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
        with ThreadPoolExecutor(min(8, len(usable_cores()))) as pool:
            verdicts = list(pool.map(sound, infos))
    for info, ok in zip(infos, verdicts):
        if not ok:
            raise ValueError(f"its member {info.filename} fails its CRC-32 check: the file was damaged after it "
                             f"was written (a changed byte)")


def sha256_file(path):
    """The sha256 of a file, read in blocks (streaming: memory stays flat for any size)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
    diff = [f"{k} {getattr(tok, k)}, recorded {meta[k]}" for k in ("vocab_size", "bos_id", "eos_id", "pad_id")
            if meta.get(k) is not None and getattr(tok, k) != meta[k]]
    model_vocab = (ckpt.get("model_config") or {}).get("vocab_size")
    if model_vocab is not None and tok.vocab_size > model_vocab:
        diff.append(f"vocab_size {tok.vocab_size} > the model's {model_vocab}")
    if diff:
        raise UsageError(f"{where} is not the tokenizer {path} was trained with ({'; '.join(diff)}); {fix}")


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
