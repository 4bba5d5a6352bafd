"""
The command-line plumbing every script shares, so that each script is only its own concern.

  parse_flags     one --flag per field of a script's dataclass (booleans as 0/1, a bare --flag means 1),
                  optional presets (dicts of overrides; explicit flags win), no prefix abbreviations
  run_cli         the entry point: bad input and resource faults become ONE line on stderr, exit code 2
                  (a stop signal, Ctrl-C included: one line, exit code 130; plumbing/signals.py)
  resolve_device, resolve_dtype, autocast_for      where and in which precision the network runs
  UsageError, ConfigError, OutOfMemory, first_line  the one-line failures a user can act on
Output that is never half-written is plumbing/files.py; a checkpoint and its tokenizer, plumbing/checkpoint.py.
"""
import argparse
import dataclasses
import os
import re
import sys
from contextlib import nullcontext

import torch


class UsageError(ValueError):
    """Bad input from the command line (a flag, a file, a checkpoint): printed as one line, exit code 2."""


class OutOfMemory(Exception):
    """A configuration that does not fit in memory, with what did not fit and the flag to change: printed as one
    line by the process that hit it (under torchrun it may be one rank only), exit code 2."""


class ConfigError(UsageError):
    """A bad flag or an incompatible run: reported as one line, exit code 2."""


def first_line(e):
    """The first line of an exception's message ('' for none): a one-line report keeps the cause, not the trace."""
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


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
    text = first_line(e) or type(e).__name__
    cpu = re.search(r"can't allocate memory: you tried to allocate (\d+) bytes", text)
    if cpu:
        return f"CPU out of memory (tried to allocate {int(cpu.group(1)) / 2 ** 30:.2f} GiB)"
    tried = re.search(r"[Tt]ried to allocate ([0-9.]+ [KMGT]?i?B)", text)
    free = re.search(r"total capacity of ([0-9.]+ [KMGT]?i?B) of which ([0-9.]+ [KMGT]?i?B) is free", text)
    if tried is None:
        return text.split(". ")[0]
    return (text.split(". ")[0] + f" (tried to allocate {tried.group(1)}"
            + (f"; {free.group(2)} of {free.group(1)} free)" if free else ")"))


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
    change) or an OS error on a file becomes one line on stderr and exit code 2, never a traceback. Every stop
    signal (plumbing.signals.STOP_SIGNALS) ends it with one line and exit code 130, its temp files removed."""
    from plumbing.signals import EXIT_CODE, exiting, install, signal_name
    install()
    try:
        code = main()
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
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", None)
        _fail("interrupted" + (f" by {signal_name(signum)}" if signum else ""), code=EXIT_CODE)
    exiting()
    sys.exit(code)


def _fail(message, code=2, any_rank=False):
    """Print `error: message` and exit with `code`. Under torchrun every rank fails alike on bad input, so rank 0
    speaks for all; a fault one rank may hit alone (any_rank: out of memory) is reported by that rank."""
    from plumbing.signals import exiting
    exiting()
    rank = os.environ.get("RANK", "0")
    if rank == "0" or any_rank:
        from tqdm import tqdm
        for bar in list(getattr(tqdm, "_instances", ())):    # end an open progress bar's line first
            bar.close()
        try:
            print(f"error: {'' if rank == '0' else f'rank {rank}: '}{message}", file=sys.stderr)
        except OSError:         # no terminal left to print to (SIGHUP): the exit code still tells
            pass
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
