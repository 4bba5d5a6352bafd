"""The command-line plumbing every script shares, so that each script is only its own concern: its flags, its
entry point (a failure or a stop signal is one line), the device and precision the network runs in."""
import argparse
import dataclasses
import math
import os
import re
import signal
import sys
import time
from contextlib import nullcontext, suppress
from functools import cache

LAUNCH = time.time()   # the script's start: its first line imports this module (log.jsonl's "t" counts from here)


class UsageError(ValueError, argparse.ArgumentTypeError):
    """Bad input from the command line (a flag, a file, a checkpoint): printed as one line, exit code 2. Raised by a
    flag's parser (finite_float), argparse prefixes the flag; the Python API's callers see a ValueError."""


class OutOfMemory(Exception):
    """A configuration that does not fit in memory, with what did not fit and the flag to change: printed as one
    line by the process that hit it (under torchrun it may be one rank only), exit code 2."""


class ConfigError(UsageError):
    """A bad flag or an incompatible run: reported as one line, exit code 2."""


def first_line(e):
    """The first line of an exception's message ('' for none): a one-line report keeps the cause, not the trace."""
    return (str(e).strip().splitlines() or [""])[0]


def os_error_line(e):
    """An OSError as one line: 'No space left on device: out/ckpt.pt', or its own message."""
    what = e.strerror or str(e) or type(e).__name__
    return f"{what}: {e.filename}" if e.filename else what


def show(text):
    """Print generated text or results on stdout, once the script has saved them: a character the terminal's
    encoding lacks is shown as a backslash escape, and a reader that has gone (`| head`) ends the showing quietly
    while the work goes on (stdout then goes to /dev/null; the exit code stays the script's)."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        print(text.encode(encoding, "backslashreplace").decode(encoding, "replace"), flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def bar_hidden(show=True):
    """Whether a progress bar stays hidden: not asked for, or TQDM_DISABLE set in the environment (tqdm's own
    switch, which an explicit `disable=` argument would otherwise override)."""
    return not show or os.environ.get("TQDM_DISABLE", "").strip().lower() in ("1", "true", "yes", "on")


def is_out_of_memory(e):
    """torch's CUDA out-of-memory error, a failed CPU allocation (a RuntimeError from the CPU allocator) or
    Python's own MemoryError (an allocation refused under `ulimit -v`, in numpy or the interpreter)."""
    if isinstance(e, MemoryError) or "std::bad_alloc" in str(e):   # a C++ allocation refused, as torch passes it on
        return True
    import torch
    return isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e)


def oom_summary(e):
    """torch's out-of-memory message -> its first line in short: 'CUDA out of memory (tried to allocate
    12.27 GiB; 1.20 GiB of 79.19 GiB free)'."""
    if isinstance(e, MemoryError):
        return "CPU out of memory (Python's MemoryError" + (f": {first_line(e)})" if first_line(e) else ")")
    if "std::bad_alloc" in str(e):
        return "CPU out of memory (std::bad_alloc)"
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
    word = str(s).strip().lower()
    if word in ("1", "true", "yes", "y", "0", "false", "no", "n"):
        return word in ("1", "true", "yes", "y")
    raise argparse.ArgumentTypeError(f"expected 0/1, got {s!r}")


def finite_float(s, name=None):
    """A float flag's value: a finite number. nan, inf and -inf are refused here, once for every script's flags
    (a nan guidance weight or learning rate would run to the end and write garbage), and for the Python API's
    keywords (name: the keyword, which the message then names)."""
    try:
        value = float(s)
    except (TypeError, ValueError):
        raise UsageError(f"{name + ': ' if name else ''}invalid float value: {s!r}") from None
    if not math.isfinite(value):
        raise UsageError(f"{name + ': ' if name else ''}expected a finite number, got {s!r}")
    return value


SEED_END = 2 ** 60      # seeds: torch's generators take 64 bits, and the scripts derive more (gen_seed x 8 + group)


def whole(value, name, low=0, high=None):
    """An integer flag's or keyword's value in [low, high) -> value; a bool, a float or a number out of range ->
    UsageError (a ValueError) naming it. Every script's seed flags are checked here as they are parsed."""
    import numbers
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low or (
            high is not None and value >= high):
        span = f">= {low}" if high is None else f"in [{low}, {'2^60' if high == SEED_END else high})"
        raise UsageError(f"{name} must be an integer {span}, got {value!r}")
    return value


def finite_floats(s, flag, sep=","):
    """A list flag's value, numbers separated by `sep` ('0.45,0.5,0.05') -> tuple of finite floats, each parsed as
    finite_float parses a float flag; an empty item, a word, nan or inf -> UsageError naming the flag."""
    values, items = [], str(s).replace(" ", "").split(sep)
    for item in items:
        try:
            values.append(finite_float(item))
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"{flag}: {e}" + (f" in {str(s)!r}" if len(items) > 1 else "")) from None
    return tuple(values)


def parse_flags(cls, argv=None, description=None, presets=None, preset_note=None, default_preset=None, resolve=None,
                given=None):
    """One --flag per field of the dataclass `cls`, described and grouped in --help from its source comments
    (field_help); argparse errors become UsageError. The command line is parsed once.
    presets: {name: {field: value}}; the field `preset` picks one (without --preset: default_preset(given), given
    the flags on the command line, else the field's default), and only flags given explicitly override it.
    resolve(cfg, given) -> cfg: the script's rules that set a field from others (train.py: the curriculum's share of
    the run). --help shows for each flag the value the run takes when the flag is not given: the default, the
    preset's value and what resolve makes of them; `--preset NAME --help` marks NAME's values where they differ
    from a run without --preset. preset_note(name) -> more lines about what NAME sets beyond the flags (train.py:
    its model's shape). given: a dict that receives the flags on the command line, for the script's later rules
    (train.py: --init's)."""
    flags = vars(_parser(cls, description).parse_args(argv))       # argv None: the command line
    wants_help = flags.pop("help", False)
    default, name = None, None
    if presets is not None:
        default = default_preset(flags) if default_preset else cls.preset
        name = flags.get("preset", default)
        if name not in presets:
            raise UsageError(f"unknown --preset {name!r}; choose from {', '.join(presets)}")
    if wants_help:
        _print_help(cls, description, presets, name, default, "preset" in flags, preset_note, resolve)
    if given is not None:
        given.update(flags)
    return _config(cls, presets, name, flags, resolve)


def _config(cls, presets, name, given, resolve):
    """The config of the preset `name` (None: no presets), the flags `given` over it, then resolve's rules."""
    cfg = cls(**({**presets[name], "preset": name, **given} if presets else given))
    for f in dataclasses.fields(cls):
        if f.name.endswith("seed"):
            whole(getattr(cfg, f.name), f"--{f.name}", 0, SEED_END)
    return resolve(cfg, given) if resolve else cfg


def _parser(cls, description, shown=None, epilog=None):
    """The argparse parser of cls's flags; shown: {field: the value its help shows} (help only)."""
    docs, groups = field_help(cls)
    p = argparse.ArgumentParser(description=description, argument_default=argparse.SUPPRESS, allow_abbrev=False,
                                usage="%(prog)s [--FLAG VALUE ...]", epilog=epilog, add_help=False)
    p._negative_number_matcher = re.compile(r"^-\.?\d")     # -1e6 is a value, as Python 3.13's argparse reads it
    p.add_argument("-h", "--help", action="store_true", help="show this help message and exit")
    parents = {None: p}
    for title, text in groups:
        parents[title] = p.add_argument_group(title, text)
    for f in dataclasses.fields(cls):
        text, group = docs.get(f.name, ("", None))
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = (shown or {}).get(f.name, f"default {_show(None if default is dataclasses.MISSING else default)}")
        help_text = (f"{text} ({value})" if text else value).replace("%", "%%")
        kind = f.type if callable(f.type) else {"int": int, "float": float, "bool": bool}.get(f.type, str)
        kind = {float: finite_float, bool: parse_bool}.get(kind, kind)
        how = dict(nargs="?", const=True, metavar="0|1") if kind is parse_bool else dict(metavar=f.name.upper())
        parents[group].add_argument(f"--{f.name}", type=kind, help=help_text, **how)     # a bare --flag means 1

    def error(message):
        raise UsageError(message)
    p.error = error
    return p


def _print_help(cls, description, presets, name, default, named, preset_note, resolve):
    """--help as parse_flags describes it, then exit 0. name: the run's preset, named by --preset or not; default:
    the one it takes without --preset."""
    shown, epilog = None, None
    if presets is not None:
        values = lambda preset: {f.name: getattr(_config(cls, presets, preset, {}, resolve), f.name)
                                 for f in dataclasses.fields(cls)}
        run, without = values(name), values(default)
        shown = {k: (f"--preset {name}: {_show(v)}; default {_show(without[k])}" if v != without[k]
                     else f"default {_show(v)}") for k, v in run.items()}
        sets = ", ".join(f"{k}={_show(v)}" for k, v in presets[name].items()) or "no flag (the defaults)"
        lines = [f"--preset {name} sets: {sets}"] if named else [
            f"presets: {', '.join(presets)}; --preset NAME --help shows the values NAME sets (explicit flags win)",
            f"without --preset: {name}, whose values are the defaults above; it sets: {sets}"]
        epilog = "; ".join(lines + ([preset_note(name)] if preset_note is not None else []))
    _parser(cls, description, shown, epilog).print_help()
    sys.exit(0)


def _show(v):
    """A default as --help shows it: booleans as 0/1 (as they are given), strings quoted only when empty."""
    return str(int(v)) if isinstance(v, bool) else '""' if v == "" else str(v)


def field_help(cls):
    """The --help text of a config dataclass, read from its source (and its bases'): -> ({field: (description,
    group title or None)}, [(group title, group description or None)] in display order).

    The convention every script's config follows (nanoGPT's look, one place for a flag's meaning):
      - a field's description is the trailing `# comment` on its line; comment-only lines indented deeper than
        the fields continue it;
      - a comment line at the fields' own indentation opens a group: its text is the group's title (keep it
        short: model, data, optimisation, diffusion, evaluation, runtime, ...), further comment lines right
        below it describe the group; every field below belongs to it until the next such line;
      - fields under equal titles share one group, also across a base class and its subclass;
      - a subclass that redefines a field (another default) keeps the field's group and description unless its
        own line has a comment, which then replaces the description.
    Groups show the subclass's own first, then its bases'; fields above any group line show ungrouped, first."""
    docs, order = {}, []
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):   # bases first
        own_fields, own_groups = _class_comments(klass)
        for name, (text, title) in own_fields.items():
            docs[name] = (text or docs[name][0], docs[name][1]) if name in docs else (text, title)
        new = {}
        for title, text in own_groups:
            new.setdefault(title, text)
        order = [(t, d) for t, d in new.items() if t not in dict(order)] + order     # a subclass's own groups first
    used = {title for _, title in docs.values()}
    return docs, [(t, d) for t, d in order if t in used]


def _class_comments(klass):
    """The field lines and group lines of one class's own source (see field_help): ({name: (description, group
    title)}, [(title, description)]); empty where the source is not available."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize
    fields, groups = {}, []
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return fields, groups
    comments = {t.start[0]: (t.start[1], t.string.lstrip("#").strip())     # row -> (column, text)
                for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef))
    names = {n.lineno: n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}     # row -> field
    body_col = node.body[0].col_offset
    title, last, previous = None, None, None     # the open group, the last field, what the line above is
    for r, line in enumerate(source.splitlines()[node.lineno:], node.lineno + 1):
        if not line.strip():
            previous = None
        elif r in comments and comments[r][0] == len(line) - len(line.lstrip()):     # a line of comment only
            col, text = comments[r]
            if col > body_col:                                    # continues the description of the field above
                if previous == "field":
                    fields[last] = (f"{fields[last][0]} {text}".strip(), fields[last][1])
            elif previous == "group":                             # describes the group it follows
                t, d = groups[-1]
                groups[-1] = (t, f"{d} {text}" if d else text)
            else:                                                 # a group line
                title, previous = text, "group"
                groups.append((title, None))
        elif r in names:
            last, previous = names[r], "field"
            fields[last] = (comments.get(r, (0, ""))[1], title)
        else:
            previous = "code"
    return fields, groups


# -----------------------------------------------------------------------------------------------
# stop signals at a script's start (the training loop's own handling: plumbing/signals.py)

STOP_SIGNALS = tuple(getattr(signal, name) for name in
                     ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGXCPU")
                     if hasattr(signal, name))
EXIT_CODE = 130      # stopped by a signal: what was done is saved, the same command (--resume 1) continues it


def signal_name(signum):
    """15 -> 'SIGTERM'."""
    try:
        return signal.Signals(signum).name
    except (ValueError, TypeError):
        return f"signal {signum}"


class Interrupted(KeyboardInterrupt):
    """A stop signal (signum) outside the training loop's flag: the work in progress ends at once."""

    def __init__(self, signum=None):
        super().__init__(signum)
        self.signum = signum


def _raise(signum, frame):
    raise Interrupted(signum)


def set_stop_handlers(handler):
    """handler for every stop signal, or {signal: handler} as this returns them (puts them back; None, a handler set
    outside Python, cannot be) -> the handlers it replaces (only the main thread may set them)."""
    old = {}
    for s in STOP_SIGNALS:
        h = handler.get(s) if isinstance(handler, dict) else handler
        if h is not None:
            with suppress(ValueError, OSError):
                old[s] = signal.signal(s, h)
    return old


_REPORTED = []       # the error line this process printed (run_cli's _fail), so a late signal adds no second one


def _rank():
    """This process's RANK as a string, "0" when unset or not a whole number, or outside a job of several processes
    (no WORLD_SIZE above 1: a stray RANK): a launch environment that launch_env refuses must still be printed."""
    rank, world = (os.environ.get(k, "").strip() for k in ("RANK", "WORLD_SIZE"))
    return str(int(rank)) if rank.isdigit() and world.isdigit() and int(world) > 1 else "0"


def _exit_at_once(phase):
    """The handler of a stop signal while starting (before run_cli: nothing is written yet, nothing to clean up) or
    exiting (the outcome is decided, and a signal raised inside the interpreter's shutdown would print a traceback):
    one line, unless the error line is out already, and exit code 130 at once."""
    def handler(signum, frame):
        for stream in (sys.stdout, sys.stderr):
            with suppress(Exception):
                stream.flush()
        if not _REPORTED and _rank() == "0":
            with suppress(OSError):
                os.write(2, f"error: interrupted by {signal_name(signum)} while {phase}\n".encode())
        os._exit(EXIT_CODE)
    return handler


@cache          # registered once per process
def _ignore_at_shutdown():
    """Stop signals are ignored by the last exit handler (registered first, atexit runs them in reverse): the
    interpreter's shutdown then puts SIG_DFL back in place of every Python handler before it frees its modules
    (torch's take a while), so a stop signal there would kill the process by the signal (exit 143 for SIGTERM, no
    message). Ignored from there on, the process ends with the exit code its script chose (130 after a stop)."""
    import atexit
    atexit.register(set_stop_handlers, signal.SIG_IGN)


def stop_at_once(name):
    """A script's first call, before its imports (torch alone takes seconds to load): run as a script (name is
    "__main__"), a stop signal from here until run_cli takes over prints one line and exits 130 at once
    (_exit_at_once). Imported as a library, it does nothing."""
    if name == "__main__":
        _ignore_at_shutdown()
        set_stop_handlers(_exit_at_once("starting"))
        sys.excepthook = _out_of_memory_while_starting


def _out_of_memory_while_starting(kind, e, trace):
    """An exception no handler caught (the imports before run_cli, torch's own among them): running out of memory
    there (`ulimit -v`) is one line and exit code 2 as everywhere else; anything else is a bug and shows its trace."""
    try:
        memory = isinstance(e, (MemoryError, RuntimeError)) and is_out_of_memory(e)
    except Exception:           # torch itself failed to import
        memory = False
    if not memory:
        return sys.__excepthook__(kind, e, trace)
    with suppress(OSError):
        print(f"error: out of memory while starting: {oom_summary(e)}; free memory or raise the limit (ulimit -v)",
              file=sys.stderr, flush=True)
    os._exit(2)


def run_cli(main, *errors, oom_hint="lower --batch_size"):
    """The scripts' entry point: run main(); a UsageError or one of `errors` (bad input the script reports
    rather than a bug), running out of memory (OutOfMemory, or torch's own error with `oom_hint`, the flag to
    change) or an OS error on a file becomes one line on stderr and exit code 2, never a traceback. Every stop
    signal (STOP_SIGNALS) raises Interrupted wherever the process is, so each `finally` on the way out runs (a
    preparation's temp folder, out_dir's lock and an out_dir the run left empty are removed), then ends it with one
    line and exit code 130 (a signal inside a long C++ call, SentencePiece training, takes effect when it returns)."""
    set_stop_handlers(_raise)
    _ignore_at_shutdown()
    try:
        code = main()
    except OutOfMemory as e:
        _fail(str(e), any_rank=True)
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
            raise
        _fail(f"out of memory: {oom_summary(e)}; {oom_hint}", any_rank=True)
    except (UsageError, *errors) as e:
        _fail(str(e), any_rank=getattr(e, "every_rank", False))
    except OSError as e:
        _fail(os_error_line(e))
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", None)
        _fail("interrupted" + (f" by {signal_name(signum)}" if signum else ""), code=EXIT_CODE)
    set_stop_handlers(_exit_at_once("exiting"))
    sys.exit(code)


def _fail(message, code=2, any_rank=False):
    """Print `error: message` and exit with `code`. Under torchrun every rank fails alike on bad input, so rank 0
    speaks for all; a fault one rank may hit alone (any_rank: out of memory) is reported by that rank."""
    set_stop_handlers(_exit_at_once("exiting"))
    rank = _rank()
    if rank == "0" or any_rank:
        from tqdm import tqdm
        for bar in list(getattr(tqdm, "_instances", ())):    # end an open progress bar's line first
            bar.close()
        with suppress(OSError):        # no terminal left to print to (SIGHUP): the exit code still tells
            _REPORTED.append(message)
            named = rank == "0" or message.startswith(f"rank {rank}: ")      # said once, by the rank it is
            print(f"error: {'' if named else f'rank {rank}: '}{message}", file=sys.stderr)
    sys.exit(code)


# -----------------------------------------------------------------------------------------------
# device and precision

def resolve_device(name):
    """'auto' (CUDA when available) | 'cpu' | 'cuda' -> torch.device."""
    import torch
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise UsageError(f"--device must be auto, cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    return torch.device(name)


def torchrun_on_cuda(device):
    """Whether this process was launched by torchrun (its environment says so) to run on CUDA (--device)."""
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    return torchrun and resolve_device(device).type == "cuda"


def resolve_dtype(name, device):
    """'auto' (bf16 autocast on CUDA, float32 elsewhere) | 'float32' | 'bfloat16' -> torch.dtype."""
    import torch
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in ("float32", "bfloat16"):
        raise UsageError(f"--dtype must be auto, float32 or bfloat16, got {name!r}")
    return getattr(torch, name)


def autocast_for(device, dtype):
    """A fresh bf16/fp16 autocast context for the network; float32 (or None) runs it as it is."""
    import torch
    if dtype in (torch.bfloat16, torch.float16):
        return torch.autocast(torch.device(device).type, dtype=dtype)
    return nullcontext()
