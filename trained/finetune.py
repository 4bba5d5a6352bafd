"""A run that starts from a trained model (train.py --init SOURCE: fine-tuning). SOURCE is read as every script's
--ckpt (read_init); the run takes its architecture, its tokenizer and its block size, refuses the flags that
contradict them, starts from its weights (the EMA at the same weights) and records where it started. The
optimizer, the schedule, the step count and the EMA are the run's own, fresh. A fine-tuning run resumed with
--resume 1 (without --init) reads the same from its own checkpoint, which records them.

Why the block size may differ: the models position tokens by RoPE, computed for any length, so no weight depends
on it; SOURCE's is the default, and an explicit --block_size trains at another length (what the weights then do
past SOURCE's length is for the training to teach)."""
import os
from dataclasses import asdict, dataclass

import torch

from data import get_tokenizer
from diffusion import OBJECTIVES
from model import PRESETS, ModelConfig
from plumbing.checkpoint import read_checkpoint
from plumbing.cli import ConfigError, UsageError, first_line
from plumbing.integrity import check_tokenizer_identity
from plumbing.runlog import start_lines
from trained.checkpoint import check_data_tokenizer, load_model, load_tokenizer

# train.py's data flags SOURCE sets unless they are given on the command line (a preset's are not)
FROM_SOURCE = ("tokenizer", "block_size")
# the model fields a preset names that are its shape (the vocabulary is the tokenizer's, the length a data flag,
# the output layer's padding a matter of speed: start_at)
SHAPE = ("arch", "n_layer", "n_head", "n_embd", "cond_dim", "mlp_hidden", "time_cond", "causal")


@dataclass
class Source:
    """The trained model a run starts from. label: how messages name it (--init SPEC, or the resumed checkpoint);
    model_config: its ModelConfig fields; tokenizer: the tokenizer it was trained with ("" when it records none);
    block_size: its training length; record: what the run records of it (finetuned_from: source, objective, step,
    weights); meta: its meta (the tokenizer's identity); weights: its state dict (None when a resumed run reads its
    own checkpoint: the weights come from there)."""
    label: str
    model_config: dict
    tokenizer: str
    block_size: int
    record: dict
    meta: dict = None
    weights: dict = None

    @property
    def described(self):
        """SOURCE in a few words: `spec` (objective X, step N, EMA weights)."""
        r = self.record
        return f"{r['source']} (objective {r['objective']}, step {r['step']}, {r['weights']} weights)"

    def model_config_for(self, cfg, data_dir, meta):
        """The run's ModelConfig: SOURCE's model at this run's --block_size and --dropout, its output layer padded to
        --vocab_multiple where given (else SOURCE's padding); once the prepared data (data_dir, meta) are checked
        to be tokenized by SOURCE's tokenizer (on a resume trained.checkpoint.open_out_dir does)."""
        if self.weights is not None:
            fix = "give a --data_dir prepared with it, or leave --data_dir out (train.py prepares one)"
            check_data_tokenizer(data_dir, meta, {"meta": self.meta, "model_config": self.model_config}, self.label,
                                 fix=fix)
        fields = dict(self.model_config, block_size=cfg.block_size, dropout=cfg.dropout)
        if cfg.vocab_multiple:
            fields["vocab_multiple"] = cfg.vocab_multiple
        return ModelConfig(**fields)

    def extra(self):
        """What a checkpoint of the run adds (RunPlumbing's extra): where it started."""
        return {"finetuned_from": self.record}

    def lines(self, cfg, raw_model, env):
        """The run's start lines (plumbing.runlog.start_lines) and one that says what it fine-tunes."""
        length = (f"L = {cfg.block_size}, trained at {self.block_size}" if cfg.block_size != self.block_size
                  else f"L = {cfg.block_size}")
        return (start_lines(cfg, raw_model, env) + f"\nfine-tuning from {self.described}: its model ({length}) and "
                f"tokenizer, --loss {cfg.loss}; a fresh optimizer, schedule, step count and EMA (the recipe: --preset "
                f"{cfg.preset} and the flags given)")


def start_at(run, state):
    """The run's model starts at the weights `state` (a state dict: train.py --init, distillation/distill.py), its
    EMA at the same weights. An output layer (lm_head) with other padding rows than the run's (--vocab_multiple) is
    fitted to padded_vocab_size rows: the vocabulary's rows kept, the padding rows zero (never used: the model
    returns only the vocabulary's logits). Every rank loads the same weights, so a DDP run still equals one
    process."""
    mcfg, state = run.raw_model.config, dict(state)
    rows = mcfg.padded_vocab_size
    for name in ("lm_head.weight", "lm_head.bias"):
        v = state.get(name)
        if v is not None and v.shape[0] != rows:
            state[name] = torch.zeros((rows,) + tuple(v.shape[1:]), dtype=v.dtype)
            state[name][:mcfg.vocab_size] = v[:mcfg.vocab_size]
    run.raw_model.load_state_dict(state)
    if run.ema is not None:
        with torch.no_grad():
            for e, p in zip(run.ema, run.raw_model.parameters()):
                e.copy_(p.detach())


# -----------------------------------------------------------------------------------------------
# reading SOURCE

def read_init(spec, use_ema=True):
    """--init SPEC (train.py, distillation/distill.py) -> (model, checkpoint dict) as every script's --ckpt reads it
    (trained.checkpoint.load_model), on the CPU: its EMA weights where it has them and use_ema. One that does not
    load -> UsageError (one line)."""
    if not spec.startswith("duo:") and not os.path.exists(spec):
        raise UsageError(f"--init {spec}: no such checkpoint or model folder (duo:PATH or duo:USER/NAME for Duo's)")
    try:
        return load_model(spec, "cpu", use_ema=use_ema)
    except UsageError as e:
        raise UsageError(f"--init {spec}: cannot read it ({first_line(e)})") from None


def load_source(spec, use_ema=True):
    """--init SOURCE -> Source (read_init)."""
    model, ckpt = read_init(spec, use_ema)
    train_config, meta = ckpt.get("train_config") or {}, dict(ckpt.get("meta") or {})
    used_ema = bool(ckpt.get("used_ema")) or (use_ema and ckpt.get("ema") is not None)
    objective = train_config.get("loss") or "unknown"
    if ckpt.get("distill_config") or ckpt.get("distilled_from"):
        objective += ", distilled (DCD)"
    where = spec if spec.startswith("duo:") else os.path.abspath(spec)
    record = {"source": where, "objective": objective, "step": ckpt.get("step"),
              "weights": "EMA" if used_ema else "live"}
    mcfg = asdict(model.config)
    return Source(f"--init {spec}", mcfg, meta.get("tokenizer") or "", mcfg["block_size"], record, meta,
                  {k: v.detach() for k, v in model.state_dict().items()})


def resumed_source(out_dir):
    """The Source of a fine-tuning run resumed from out_dir/ckpt.pt (it records finetuned_from, its model, tokenizer
    and block size), without its weights; None for any other checkpoint (or none: the resume's own checks report
    it). Read memory-mapped: no weights are read here."""
    path = os.path.join(out_dir, "ckpt.pt")
    try:
        saved = read_checkpoint(path, mmap=True)
        record, train_config = saved.get("finetuned_from"), saved["train_config"]
        model_config = dict(saved["model_config"])
        tokenizer, block_size = train_config["tokenizer"], train_config["block_size"]
    except Exception:
        return None
    if not isinstance(record, dict) or not isinstance(tokenizer, str) or not isinstance(block_size, int):
        return None
    return Source(f"{path} (fine-tuned from {record.get('source')})", model_config, tokenizer,
                  model_config.get("block_size", block_size), record)


# -----------------------------------------------------------------------------------------------
# the run's flags against SOURCE

def start_from(cfg, given):
    """train.py's start-up with --init (or a resumed fine-tuning run), before any data is prepared. given: the flags
    on the command line. -> the Source, or None for a run from random weights."""
    source = load_source(cfg.init, cfg.init_ema) if cfg.init else resumed_source(cfg.out_dir) if cfg.resume else None
    if source is None:
        return None
    check_flags(cfg, given, source)
    if not source.tokenizer and "tokenizer" not in given:
        raise ConfigError(f"{source.label} records no tokenizer; give the one it was trained with (--tokenizer "
                          f"gpt2 | sp:PATH | hf:NAME)")
    for name in FROM_SOURCE:
        if name not in given:
            setattr(cfg, name, getattr(source, name))
    if source.weights is not None:
        source.meta = tokenizer_identity(source.meta, source.model_config, source.label)
        if cfg.tokenizer != source.tokenizer and not cfg.tokenizer.startswith("sp_train:"):
            check_tokenizer_identity(get_tokenizer(cfg.tokenizer), {"meta": source.meta,
                                                                    "model_config": source.model_config},
                                     source.label, fix="give its tokenizer, or leave --tokenizer out")
    return source


def check_flags(cfg, given, source):
    """The flags given on the command line that contradict SOURCE's model -> ConfigError (one line): --n_layer,
    --n_head, --n_embd, --vocab_size, a --preset whose model has another shape, and an objective of the other kind
    (--loss ar trains a causal model; a diffusion loss a bidirectional one)."""
    theirs = source.model_config
    what = (f"the model of {source.label}, a {theirs['n_layer']}-layer {theirs['arch']} of width {theirs['n_embd']}, "
            f"{theirs['n_head']} heads, vocabulary {theirs['vocab_size']}")
    for name in ("n_layer", "n_head", "n_embd", "vocab_size"):
        if given.get(name) and given[name] != theirs[name]:
            raise ConfigError(f"--{name} {given[name]} contradicts {what}, which the run trains; leave --{name} out")
    if "preset" in given:
        preset = PRESETS[cfg.preset]
        diff = [k for k in SHAPE if k in preset and preset[k] is not None and preset[k] != theirs.get(k)]
        if diff:
            shown = ", ".join(f"{k} {preset[k]}" for k in diff)
            raise ConfigError(f"--preset {cfg.preset} names another model ({shown}) than {what}, which the run "
                              f"trains; leave --preset out, or name a preset of its shape")
    causal = OBJECTIVES[cfg.loss].causal
    if causal != bool(theirs.get("causal")):
        kind = "the autoregressive baseline (causal)" if theirs.get("causal") else "a diffusion model (bidirectional)"
        fix = "--loss ar" if theirs.get("causal") else "a diffusion --loss (sddlm, sddlm_v1, sddlm_v2, duo, ...)"
        raise ConfigError(f"--loss {cfg.loss} trains {'a causal' if causal else 'a bidirectional'} model, but "
                          f"{source.label} is {kind}: the architecture differs; fine-tune it with {fix}")


def tokenizer_identity(meta, model_config, label):
    """A loaded model's meta (label: how messages name it) with its tokenizer's sha256, vocabulary and special ids,
    loaded where it records only the tokenizer's name (Duo's checkpoints: "gpt2"), so that the data's tokenizer is
    checked by content. A tokenizer that cannot be loaded here -> UsageError (the run needs it for its data)."""
    meta = dict(meta or {})
    if not meta.get("tokenizer") or meta.get("tokenizer_sha256"):
        return meta
    tok, why = load_tokenizer({"meta": meta, "model_config": model_config}, label)
    if tok is None:
        raise UsageError(f"{label}: its tokenizer: {why}")
    meta.update(tokenizer_sha256=tok.fingerprint or None, vocab_size=tok.vocab_size, bos_id=tok.bos_id,
                eos_id=tok.eos_id, pad_id=tok.pad_id)
    return meta
