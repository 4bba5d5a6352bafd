"""
The command-line and file plumbing every script shares, so that each script is only its own concern.

  parse_flags     one --flag per field of a script's dataclass (booleans as 0/1, a bare --flag means 1),
                  optional presets (dicts of overrides; explicit flags win), no prefix abbreviations
  run_cli         the entry point: bad input and resource faults become ONE line on stderr, exit code 2
                  (Ctrl-C: one line, exit code 130)
  resolve_device, resolve_dtype, autocast_for      where and in which precision the network runs
  load_model, load_tokenizer                       a train.py checkpoint and its tokenizer
  append_jsonl, write_json, save_atomic            output that is never half-written
  check_writable, remove_stale_temps               output paths checked before long work; leftovers of kills
"""
import argparse
import dataclasses
import errno
import json
import os
import re
import shutil
import sys
from contextlib import nullcontext

import torch


class UsageError(ValueError):
    """Bad input from the command line (a flag, a file, a checkpoint): printed as one line, exit code 2."""


class OutOfMemory(Exception):
    """A configuration that does not fit in memory, with what did not fit and the flag to change: printed as one
    line by the process that hit it (under torchrun it may be one rank only), exit code 2."""


# -----------------------------------------------------------------------------------------------
# flags

def parse_bool(s):
    """'1/true/yes/y' -> True, '0/false/no/n' -> False (any case); booleans pass through."""
    if isinstance(s, bool):
        return s
    if str(s).strip().lower() in ("1", "true", "yes", "y"):
        return True
    if str(s).strip().lower() in ("0", "false", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected 0/1, got {s!r}")


def parse_flags(cls, argv=None, description=None, presets=None):
    """One --flag per field of the dataclass `cls`; argparse errors become UsageError.
    presets: {name: {field: value}}; the field `preset` picks one, and only flags given explicitly override it."""
    p = argparse.ArgumentParser(description=description, argument_default=argparse.SUPPRESS, allow_abbrev=False)
    for f in dataclasses.fields(cls):
        if f.type in (bool, "bool"):
            p.add_argument(f"--{f.name}", type=parse_bool, nargs="?", const=True, metavar="0|1",
                           help=f"default {int(f.default)}")
        else:
            p.add_argument(f"--{f.name}", type=f.type,
                           metavar=f.name.upper(), help=f"default {f.default!r}")

    def error(message):
        raise UsageError(message)
    p.error = error
    given = vars(p.parse_args(argv))
    if presets is None:
        return cls(**given)
    preset = given.get("preset", cls.preset)
    if preset not in presets:
        raise UsageError(f"unknown --preset {preset!r}; choose from {', '.join(presets)}")
    return cls(**{**presets[preset], **given})


def run_cli(main, *errors, oom_hint="lower --batch_size"):
    """The scripts' entry point: run main(); a UsageError or one of `errors` (bad input the script reports
    rather than a bug), running out of memory (OutOfMemory, or torch's own error with `oom_hint`, the flag to
    change) or an OS error on a file becomes one line on stderr and exit code 2, never a traceback."""
    try:
        sys.exit(main())
    except OutOfMemory as e:
        _fail(str(e), any_rank=True)
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
        _fail(f"out of memory: {oom_summary(e)}; {oom_hint}", any_rank=True)
    except (UsageError, *errors) as e:
        _fail(str(e))
    except OSError as e:
        _fail(os_error_line(e))
    except KeyboardInterrupt:
        _fail("interrupted", code=130)


def os_error_line(e):
    """An OSError as one line: 'No space left on device: out/ckpt.pt', or its own message."""
    what = e.strerror or str(e) or type(e).__name__
    return f"{what}: {e.filename}" if e.filename else what


def is_out_of_memory(e):
    """torch's CUDA out-of-memory error, or a failed CPU allocation (a RuntimeError from the CPU allocator)."""
    return isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e)


def oom_summary(e):
    """torch's out-of-memory message -> its first line in short: 'CUDA out of memory (tried to allocate
    12.27 GiB; 1.20 GiB of 79.19 GiB free)'."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    cpu = re.search(r"can't allocate memory: you tried to allocate (\d+) bytes", text)
    if cpu:
        return f"CPU out of memory (tried to allocate {int(cpu.group(1)) / 2 ** 30:.2f} GiB)"
    tried = re.search(r"[Tt]ried to allocate ([0-9.]+ [KMGT]?i?B)", text)
    free = re.search(r"total capacity of ([0-9.]+ [KMGT]?i?B) of which ([0-9.]+ [KMGT]?i?B) is free", text)
    if tried is None:
        return text.split(". ")[0]
    return (text.split(". ")[0] + f" (tried to allocate {tried.group(1)}"
            + (f"; {free.group(2)} of {free.group(1)} free)" if free else ")"))


def _fail(message, code=2, any_rank=False):
    """Print `error: message` and exit with `code`. Under torchrun every rank fails alike on bad input, so rank 0
    speaks for all; a fault one rank may hit alone (any_rank: out of memory) is reported by that rank."""
    rank = os.environ.get("RANK", "0")
    if rank == "0" or any_rank:
        from tqdm import tqdm
        for bar in list(getattr(tqdm, "_instances", ())):    # end an open progress bar's line first
            bar.close()
        print(f"error: {'' if rank == '0' else f'rank {rank}: '}{message}", file=sys.stderr)
    sys.exit(code)


# -----------------------------------------------------------------------------------------------
# device and precision

def resolve_device(name):
    """'auto' (CUDA when available) | 'cpu' | 'cuda' -> torch.device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise UsageError(f"--device must be auto, cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name, device):
    """'auto' (bf16 autocast on CUDA, float32 elsewhere) | 'float32' | 'bfloat16' -> torch.dtype."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in ("float32", "bfloat16"):
        raise UsageError(f"--dtype must be auto, float32 or bfloat16, got {name!r}")
    return getattr(torch, name)


def autocast_for(device, dtype):
    """A fresh bf16/fp16 autocast context for the network; float32 (or None) runs it as it is."""
    if dtype in (torch.bfloat16, torch.float16):
        return torch.autocast(torch.device(device).type, dtype=dtype)
    return nullcontext()


# -----------------------------------------------------------------------------------------------
# checkpoints and tokenizers

def load_model(path, device, use_ema=True):
    """model.load_checkpoint (or, for "duo:PATH_OR_HUB_NAME", model.load_duo_checkpoint: one of Duo's released
    checkpoints; for a folder, pretrained.load_folder: a model folder) with its errors as UsageError (one line)
    -> (model in eval mode, checkpoint)."""
    from model import load_checkpoint, load_duo_checkpoint
    try:
        if path.startswith("duo:"):
            return load_duo_checkpoint(path[len("duo:"):], device=device, use_ema=use_ema)
        if os.path.isdir(path):                    # a model folder (pretrained.py): safetensors + config.json
            from pretrained import load_folder
            return load_folder(path, device=device, use_ema=use_ema)
        return load_checkpoint(path, device=device, use_ema=use_ema)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    except TypeError as e:    # a model_config with keys this ModelConfig does not know
        raise UsageError(f"{path}: its model_config does not fit this version of model.py ({e})") from None


def load_tokenizer(ckpt):
    """The checkpoint's tokenizer (data.get_tokenizer(meta["tokenizer"])), or None with the reason."""
    from data import get_tokenizer
    spec = (ckpt.get("meta") or {}).get("tokenizer")
    if spec is None:
        return None, "the checkpoint has no meta['tokenizer']"
    try:
        return get_tokenizer(spec), None
    except Exception as e:  # a missing tokenizer file, package or network; reported, never hidden
        return None, f"tokenizer {spec!r} unavailable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


# -----------------------------------------------------------------------------------------------
# output that is never half-written

def append_jsonl(path, records):
    """Append whole lines with a single write on an O_APPEND descriptor, then fsync: earlier lines are never
    touched, and concurrent writers do not interleave inside one batch of lines. A failed write (a full disk)
    is cut back, so no partial line is left."""
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    size = os.fstat(fd).st_size
    try:
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    except OSError:
        os.ftruncate(fd, size)
        raise
    finally:
        os.close(fd)


def save_atomic(path, write):
    """write(tmp_path) then fsync and rename over `path`: a reader sees the old file or the new one, never
    a part. The temp file is unique to this process and removed when the write fails; a failed write (a full
    disk: OSError, or torch.save's RuntimeError) becomes one OSError saying what was kept."""
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if not isinstance(e, (OSError, RuntimeError)):
            raise
        reason = os_error_line(e) if isinstance(e, OSError) else \
            re.sub(r"^\[enforce fail at [^]]*\][ .]*", "", (str(e).strip() or type(e).__name__).splitlines()[0])
        try:
            free = f"; {shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free / 2 ** 30:.2f} GiB free there"
        except OSError:
            free = ""
        kept = f"the previous {path} is kept" if os.path.exists(path) else "nothing was written"
        raise OSError(getattr(e, "errno", None) or errno.EIO, f"could not write {path} ({reason}{free}); {kept}"
                      ) from None


def remove_stale_temps(path):
    """Remove save_atomic's temp files of `path` left by processes that no longer run (killed during a save)."""
    folder, prefix = os.path.dirname(path) or ".", os.path.basename(path) + ".tmp"
    if os.name != "posix":         # os.kill(pid, 0) probes a process only on POSIX
        return
    for name in os.listdir(folder):
        pid = name.removeprefix(prefix)
        if name.startswith(prefix) and pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                os.remove(os.path.join(folder, name))
            except OSError:
                pass


def check_writable(path, flag, folder=False):
    """Fail now, before any long work, unless `path` can be written: a file (not a folder), or with folder=True
    a folder (not a file); it, or its nearest existing parent, writable. flag names the option in the message."""
    if folder and os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a file, not a folder")
    if not folder and os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a folder; give a file name")
    nearest = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    while not os.path.exists(nearest):
        nearest = os.path.dirname(nearest)
    if not os.path.isdir(nearest):
        raise UsageError(f"{flag} {path}: {nearest} is a file, not a folder")
    target = path if os.path.exists(path) else nearest
    if not os.access(target, os.W_OK):
        raise UsageError(f"{flag} {path}: {target} is not writable")


def write_json(path, obj):
    """Atomically write obj as indented JSON."""
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
    save_atomic(path, write)
