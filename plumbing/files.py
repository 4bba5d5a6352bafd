"""Output that is never half-written, never written over an input, never written over what the project did not write
(the one rule for every writer: check_output), and the leftovers of writers that were killed."""
import errno
import fnmatch
import itertools
import json
import os
import re
import shutil
import socket
import stat
from contextlib import suppress

from plumbing.cli import UsageError, first_line, os_error_line
from plumbing.signals import deferred_signals


def append_jsonl(path, records):
    """Append whole lines with a single write on an O_APPEND descriptor, then fsync: earlier lines are never
    touched, and concurrent writers do not interleave inside one batch of lines. A failed write (a full disk)
    is cut back, so no partial line is left; a stop signal waits until the lines are whole."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    refuse_special(path)
    with deferred_signals():
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
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
    disk: OSError, or torch.save's RuntimeError) becomes one OSError saying what was kept. The rename replaces only
    a regular file this project wrote (writer_of): a device node, a pipe, a link or anyone else's file is
    refused (OSError), whoever the caller and whatever it checked before (root may rename over /dev/null)."""
    refuse_special(path)
    if os.path.lexists(path) and writer_of(path) is None:
        raise OSError(errno.EEXIST, f"{path} exists and was not written by sddlm; refusing to replace it (move it "
                                    f"away, then run again)")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = temp_name(path)
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
        raise write_failure(e, path) from None


def write_failure(e, path, then=""):
    """A failed write of `path` (OSError, torch.save's RuntimeError, a library's error carrying the OS's, such as
    safetensors' 'No space left on device (os error 28)') -> one OSError: what failed, the free space there, what
    is kept, and `then` (what to do next)."""
    reason = os_error_line(e) if isinstance(e, OSError) else \
        re.sub(r"^\[enforce fail at [^]]*\][ .]*", "", first_line(e) or type(e).__name__)
    try:
        free = f"; {shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free / 2 ** 30:.2f} GiB free there"
    except OSError:
        free = ""
    kept = f"the previous {path} is kept" if os.path.exists(path) else "nothing was written"
    number = getattr(e, "errno", None) or (int(m.group(1)) if (m := re.search(r"os error (\d+)", str(e))) else None)
    return OSError(number or errno.EIO,
                   f"could not write {path} ({reason}{free}); {kept}" + (f"; {then}" if then else ""))


def writing(path, write, *args, then=""):
    """write(*args), which writes `path` (a file or a folder, e.g. trained.export.export): a write that fails for
    lack of space or another OS fault, in whatever error its library raises, -> one OSError (write_failure);
    any other error passes through."""
    try:
        return write(*args)
    except UsageError:
        raise
    except Exception as e:
        if not (isinstance(e, OSError) or re.search(r"os error \d+|No space left|file write failed|Disk quota",
                                                     str(e))):
            raise
        raise write_failure(e, path, then) from None


TEMP_MARK = ".sddlm-tmp-"     # every temp file or folder: <path>.sddlm-tmp-<host>-<pid>-<8 hex>, no user's file's name


def temp_name(path):
    """The one name of a temp file or folder written before it replaces `path` (save_atomic, a model folder, a
    preparation): unique to this process, and marked as the project's, with its writer's host and pid."""
    return f"{os.path.normpath(path)}{TEMP_MARK}{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"


def remove_stale_temps(path):
    """Remove the temp files and folders (temp_name) in `path`'s folder left by this host's writers that no longer run
    (killed half-way). Only names that carry the mark are touched: a living writer's are kept, and so is every other
    name (a user's model.old2024 or ckpt.pt.tmp2024)."""
    folder = os.path.dirname(os.path.normpath(path)) or "."
    if os.name != "posix" or not os.path.isdir(folder):      # os.kill(pid, 0) probes a process only on POSIX
        return
    ours = re.compile(rf".+{re.escape(TEMP_MARK + socket.gethostname())}-(\d+)-[0-9a-f]{{8}}")
    for entry in os.listdir(folder):
        if (m := ours.fullmatch(entry)) and not pid_alive(int(m.group(1))):
            remove_path(os.path.join(folder, entry))


def remove_path(path):
    """Remove a file, a link or a folder (quietly: what cannot be removed stays)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with suppress(OSError):
            os.remove(path)


def pid_alive(pid):
    """Whether process `pid` runs on this host (one we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:             # one we may not signal
        pass
    return True


# what a train.py / distillation/distill.py run writes into its out_dir (runlog, checkpoint, trained.export, tracking)
RUN_OUTPUTS = ("ckpt.pt", "ckpt_*.pt", "config.json", "log.jsonl", "model", "tensorboard", "wandb_run_id", "wandb",
               ".lock")
RUN_FOLDERS = ("model", "tensorboard", "wandb")


def run_outputs(out_dir):
    """The paths a run writes into out_dir (a glob for the kept checkpoints), for refuse_overwrite."""
    return [os.path.join(out_dir, name) for name in RUN_OUTPUTS] if out_dir else []


def run_output_names(out_dir):
    """The names in out_dir that match a run's outputs (RUN_OUTPUTS, kept checkpoints included)."""
    try:
        return [e for e in os.listdir(out_dir) if any(fnmatch.fnmatchcase(e, n) for n in RUN_OUTPUTS)]
    except OSError:
        return []


def check_run_outputs(out_dir):
    """A resumed run replaces and appends to the outputs in out_dir that its earlier part wrote: each must be what a
    run writes there, a regular file (ckpt.pt, log.jsonl, ...) or a folder (model/, tensorboard/, wandb/), never a
    symbolic link or a device -> UsageError naming it, before any work."""
    for name in sorted(set(run_output_names(out_dir)) - {".lock"}):     # the first in name order is named
        path, want = os.path.join(out_dir, name), "folder" if name in RUN_FOLDERS else "file"
        kind = kind_of(path)
        if kind != want:
            raise UsageError(f"{path} is a {kind}, not the {want} a run writes there, so the run would not replace "
                             f"it; move it away, then resume")


def remove_unfinished(out_dir, before):
    """A run that ends without a checkpoint in out_dir (it failed, or was stopped, before its first save) leaves
    out_dir as it found it: the run outputs it wrote (config.json, log.jsonl, tensorboard/, ...) that were not there
    before (before: out_dir's entries when the run began) are removed. Nothing else is touched."""
    if before is None or os.path.exists(os.path.join(out_dir, "ckpt.pt")):
        return
    for entry in set(run_output_names(out_dir)) - before - {".lock"}:
        remove_path(os.path.join(out_dir, entry))


def refuse_overwrite(outputs, inputs):
    """Before any work: no output of a script is one of its inputs. outputs, inputs: {flag: path or list of paths}
    ('' and None are skipped; an input spec's "sp:" / "duo:" prefix is dropped, and an input not on disk, e.g. a
    hub name, cannot be overwritten). Paths are compared resolved (os.path.realpath, and the same file under two
    names); an output may end in a glob (out_dir/ckpt_*.pt). One line (UsageError) when an output IS an input,
    when an input lies inside an output (a folder written whole), or when an output would land inside an input
    folder (a corpus folder would read it as a document)."""
    def paths(specs, input_side):
        for flag, spec in specs.items():
            for p in ([spec] if isinstance(spec, str) else list(spec or ())):
                p = str(p or "").strip()
                if input_side:
                    p = p.removeprefix("sp:").removeprefix("duo:")
                if p and (os.path.exists(p) or not input_side):
                    yield flag, p, os.path.realpath(p)

    def inside(child, parent):
        return child.startswith(parent.rstrip(os.sep) + os.sep)
    ins, outs = paths(inputs, True), paths(outputs, False)
    for (in_flag, inp, in_real), (out_flag, out, out_real) in itertools.product(ins, outs):
        if any(c in os.path.basename(out_real) for c in "*?["):
            same = (os.path.dirname(out_real) == os.path.dirname(in_real)
                    and fnmatch.fnmatchcase(os.path.basename(in_real), os.path.basename(out_real)))
        else:
            same = out_real == in_real or (os.path.exists(out) and os.path.samefile(out, inp))
        if same:
            what = f"{out_flag} writes {out}, which is" if out_flag.endswith("_dir") else f"{out_flag} {out} is"
            raise UsageError(f"{what} the input {in_flag} {inp} itself; writing it would destroy it: "
                             f"choose another {out_flag}")
        if inside(in_real, out_real):
            raise UsageError(f"{out_flag} {out} would be written over the input {in_flag} {inp}, which "
                             f"lies inside it; choose another {out_flag}")
        if inside(out_real, in_real) and os.path.isdir(in_real):
            raise UsageError(f"{out_flag} {out} lies inside the input folder {in_flag} {inp}, which "
                             f"would then read it; choose an {out_flag} outside it")


def check_writable(path, flag, folder=False):
    """Fail now, before any long work, unless `path` can be written: a file (not a folder), or with folder=True
    a folder (not a file, pipe or device: named by what it is); it, or its nearest existing parent, writable; no
    link to nothing on the way (one that does not exist: the link is named, and its target). flag names the option."""
    part = os.path.abspath(path)
    while not os.path.exists(part):
        if os.path.islink(part):
            target = os.path.join(os.path.dirname(part), os.readlink(part))
            fix = "" if part == os.path.abspath(path) and not folder else f" or create {target}"   # not a file's
            raise UsageError(f"{flag} {path}: {part} is a link to {target}, which does not exist; remove the link{fix}")
        part = os.path.dirname(part)
    if folder and os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a {kind_of(os.path.realpath(path))}, not a folder; give a folder")
    if not folder and os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a folder; give a file name")
    nearest = part if not os.path.exists(path) or os.path.isdir(path) else os.path.dirname(part)
    if not os.path.isdir(nearest):
        raise UsageError(f"{flag} {path}: {nearest} is a {kind_of(os.path.realpath(nearest))}, not a folder")
    target = path if os.path.exists(path) else nearest
    if not os.access(target, os.W_OK):
        raise UsageError(f"{flag} {path}: {target} is not writable")


def check_appendable(path, flag, keys, writer):
    """An existing file at `path` is appended to only when `writer` wrote it: its first line is a JSON object
    holding `keys` (an empty file too). Anything else -> UsageError (one line): appending would change a file the
    project did not write."""
    if not os.path.isfile(path):           # absent (a link, pipe or device: check_output refuses it first)
        return
    try:
        with open(path, "rb") as f:
            first = f.readline(1 << 26).strip()
    except OSError as e:
        raise UsageError(f"{flag} {path} cannot be read ({os_error_line(e)})") from None
    try:
        record = json.loads(first) if first else dict.fromkeys(keys)
    except ValueError:
        record = None
    if not (isinstance(record, dict) and all(k in record for k in keys)):
        raise UsageError(f"{flag} {path} exists and was not written by {writer} (its first line is not a {writer} "
                         f"record); appending would change it: choose another {flag}")


# -----------------------------------------------------------------------------------------------
# the one rule for every writer: create a new file, or replace (append to) a regular file this project wrote

WRITTEN_BY = "written_by"       # the field every JSON output (and JSONL record) carries: "sddlm <script>"
TEXT_MARK = "<!-- written by sddlm"   # the first line of a text output (markdown): a comment no renderer shows
# a model card's second part starts with this line (trained/folder.py): a README.md without it is the user's, and is
# never replaced
CARD_MARK = ("<!-- sddlm model card, written by hub/pretrained.py and replaced by the next export into this folder; "
             "delete this line to keep the file as your own -->")
PNG_SOFTWARE = "sddlm"          # a PNG's tEXt "Software" chunk starts with this (figures/plot.py)
# what earlier versions wrote without the field, recognised by its keys -> the script that wrote it
OUR_KEYS = (({"train_config", "model_config", "meta"}, "train.py"),
            ({"distill_config", "model_config", "meta"}, "distillation/distill.py"),
            ({"metric", "results", "config"}, "eval_ppl.py"),
            ({"checkpoint", "definitions", "results"}, "downstream/eval_downstream.py"),
            ({"sample", "ids", "settings"}, "sample.py"), ({"step"}, "train.py"))


def signature(script):
    """The value of WRITTEN_BY for a file `script` writes: 'sddlm eval_ppl.py'."""
    return f"sddlm {script}"


def text_mark(script):
    """The first line of a text file `script` writes, by which the next run knows it may replace it."""
    return (f"{TEXT_MARK} {script}; its next run replaces this file (delete this line to keep the file as your "
            f"own) -->")


def kind_of(path):
    """What is at `path`, in words ("file": a regular file), or None for nothing."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    kinds = ((stat.S_ISREG, "file"), (stat.S_ISDIR, "folder"), (stat.S_ISLNK, "symbolic link"),
             (stat.S_ISFIFO, "named pipe"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
             (stat.S_ISBLK, "block device"))
    return next((name for test, name in kinds if test(mode)), "special file")


def refuse_special(path, flag=None):
    """Nothing that is not a regular file is written over: a symbolic link (renaming over it would drop the link, and
    writing through it would write elsewhere), a device node, a named pipe, a socket -> OSError (UsageError
    naming `flag`, before any work)."""
    kind = kind_of(path)
    if kind in (None, "file", "folder"):
        return
    what = f"{kind} (to {os.readlink(path)})" if kind == "symbolic link" else kind
    text = (f"{path} is a {what}, not a regular file: outputs are written only to regular files (results are "
            f"printed on stdout as well)")
    if flag is None:
        raise OSError(errno.EEXIST, f"refusing to write {text}")
    raise UsageError(f"{flag} {text}; give a file path")


def writer_of(path):
    """Which of this project's scripts wrote the regular file at `path`, by its content -> signature(script) (or
    "sddlm checkpoint" for a torch checkpoint), None when sddlm did not write it: a JSON object (or a JSONL file's
    first record) whose WRITTEN_BY starts with 'sddlm ' (or with the keys an earlier version wrote, OUR_KEYS); a text
    file whose first lines hold TEXT_MARK (or a model card's mark); a PNG whose "Software" is ours; a torch checkpoint
    (a zip whose pickle names a model_config). Reads at most a few MiB."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
            if head.startswith(b"\x89PNG"):
                return signature("figures/plot.py") if _png_software(head).startswith(PNG_SOFTWARE) else None
            if head.startswith(b"PK"):
                return "sddlm checkpoint" if _torch_checkpoint(f) else None
            text = head.decode("utf-8", errors="replace")
            if text.lstrip().startswith("{"):
                record = _json_head(f, text)
                if not isinstance(record, dict):
                    return None
                mark = record.get(WRITTEN_BY)
                if isinstance(mark, str) and mark.startswith("sddlm "):
                    return mark
                return next((signature(script) for keys, script in OUR_KEYS if keys <= set(record)), None)
            for line in text.splitlines()[:8]:
                if line.startswith(CARD_MARK):
                    return signature("hub/pretrained.py")
                if line.startswith(TEXT_MARK):
                    return signature(line[len(TEXT_MARK):].strip().split(";")[0].strip())
    except OSError:
        return None


def _json_head(f, text, limit=16 << 20):
    """The first record of a JSONL file, or the whole of a JSON file of at most `limit` bytes; None otherwise."""
    with suppress(ValueError):
        return json.loads(text.split("\n", 1)[0])
    if os.fstat(f.fileno()).st_size > limit:
        return None
    f.seek(0)
    with suppress(ValueError):
        return json.loads(f.read().decode("utf-8"))


def _png_software(head):
    """A PNG's tEXt "Software" value among the chunks before its image data ('' if none)."""
    i = 8
    while i + 8 <= len(head):
        n, kind = int.from_bytes(head[i:i + 4], "big"), head[i + 4:i + 8]
        if kind == b"IDAT":
            break
        if kind == b"tEXt":
            key, _, value = head[i + 8:i + 8 + n].partition(b"\0")
            if key == b"Software":
                return value.decode("latin-1")
        i += 12 + n
    return ""


def _torch_checkpoint(f):
    """Whether a zip is a torch.save'd checkpoint of this project (its data.pkl names a model_config)."""
    import zipfile
    try:
        with zipfile.ZipFile(f) as z:
            pickles = [i for i in z.infolist() if i.filename.endswith("/data.pkl")]
            return bool(pickles) and pickles[0].file_size < (64 << 20) and b"model_config" in z.read(pickles[0])
    except (zipfile.BadZipFile, OSError, ValueError):
        return False


def check_output(path, flag, append=None, script=None):
    """The one rule every writer follows, before any work: an output path is new (its folder writable, made if
    need be), or a regular file this project wrote (writer_of), which is replaced; anything else (a user's file, a
    folder, a link, a device, a pipe) -> UsageError naming `flag` and the fix. script: the writer, when only its own
    earlier outputs may be replaced (eval_ppl.py's --out never replaces a checkpoint, a run's config.json or
    sample.py's samples). append=(keys, writer): appended to, so an existing file must hold `writer`'s records."""
    check_writable(path, flag)
    refuse_special(path, flag)
    if append is not None:
        check_appendable(path, flag, *append)
    elif os.path.lexists(path):
        writer = writer_of(path)
        if writer is None:
            raise UsageError(f"{flag} {path} exists and was not written by sddlm, so it is not replaced; move it "
                             f"away or choose another {flag}")
        if script is not None and writer != signature(script):
            what = "a checkpoint" if writer == "sddlm checkpoint" else f"written by {writer.removeprefix('sddlm ')}"
            raise UsageError(f"{flag} {path} exists and is {what}, not an earlier output of {script}, so it is not "
                             f"replaced; choose another {flag}")


def check_outputs(outputs, append=None, script=None):
    """check_output for each {flag: path or list of paths} ('' and None skipped)."""
    for flag, spec in outputs.items():
        for path in ([spec] if isinstance(spec, str) else list(spec or ())):
            if path:
                check_output(str(path), flag, append, script)


def write_json(path, obj):
    """Atomically write obj as indented JSON."""
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
    save_atomic(path, write)
