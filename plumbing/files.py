"""Output that is never half-written, and the leftovers of writers that were killed."""
import errno
import json
import os
import re
import shutil

from cli import UsageError, first_line, os_error_line


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
            re.sub(r"^\[enforce fail at [^]]*\][ .]*", "", first_line(e) or type(e).__name__)
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
