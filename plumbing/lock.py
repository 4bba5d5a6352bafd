"""One run per folder: a train.py or distillation/distill.py run holds an exclusive lock on its out_dir
(out_dir/.lock, holding the holder's pid, host and start time) for its whole life, so a second run into the same
folder stops at once instead of interleaving its log and checkpoints with the first. The OS releases the lock when
its holder dies (SIGKILL included), so a lock file left by a killed run is taken over; on a file system without
flock the recorded pid is probed instead (on the same host)."""
import json
import os
import socket
import stat
import sys
import time
from contextlib import suppress

from plumbing.cli import UsageError
from plumbing.files import check_writable, kind_of, pid_alive, remove_unfinished

LOCK = ".lock"


class FolderLock:
    """out_dir/.lock held by this process (acquire_folder); release() unlocks it, removes the lock file and the
    folders this run created if they are empty."""

    def __init__(self, path, fd, created, before=None):
        self.path, self.fd, self.created, self.before = path, fd, created, before

    def release(self):
        if self.fd is None:
            return
        remove_unfinished(os.path.dirname(self.path), self.before)     # a run that saved nothing leaves nothing
        with suppress(OSError):
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        os.close(self.fd)
        self.fd = None
        for folder in self.created:            # deepest first: a run that wrote nothing leaves no folder
            try:
                os.rmdir(folder)
            except OSError:
                break


def _lock_record(fd):
    """The record a lock file holds, when it is what acquire_folder writes there: {} for nothing yet (a run killed
    before writing it), or one JSON object of its fields (pid, host, started, command; a garbled value is still a
    lock's); None for anything else."""
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8")
        record = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and set(record) <= {"pid", "host", "started", "command"} else None


def open_lock_file(path, where, fix):
    """Open (create) the lock file `path` -> its descriptor, never through a symbolic link. What is there already
    must be a lock file of ours (a regular file, empty or holding a lock record: _lock_record); a link, a folder,
    a pipe, a device or a user's file is never written to nor removed -> UsageError naming `where` and `fix`.
    FileNotFoundError when its folder is gone; another OSError when the folder is not writable."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0), 0o644)
    except (FileNotFoundError, PermissionError):
        raise
    except OSError:                            # a symbolic link (ELOOP), a folder (EISDIR)
        fd = None
    if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode) or _lock_record(fd) is None:
        if fd is not None:
            os.close(fd)
        kind = kind_of(path) or "file"
        what = "a file that is not an sddlm lock" if kind == "file" else f"a {kind}, not an sddlm lock file"
        raise UsageError(f"{where}: {path} is {what}, so it is neither written nor removed; move it away or {fix}")
    return fd


def _in_use(out_dir, holder, path):
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"])) \
        if isinstance(holder.get("started"), (int, float)) else "?"
    return UsageError(f"--out_dir {out_dir} is in use by another run ({holder.get('command') or 'a run'}, pid "
                      f"{holder.get('pid', '?')} on host {holder.get('host', '?')}, since {since}); wait for it to "
                      f"end or choose another --out_dir (if that run is gone, delete {path})")


def acquire_folder(out_dir):
    """Create out_dir if needed and lock it for this run -> FolderLock. Held by another living run -> UsageError
    (one line naming its pid and host); nothing is created then. An empty out_dir: check_run_flags refuses it."""
    check_writable(out_dir, "--out_dir", folder=True)
    created, d = [], os.path.abspath(out_dir)
    while not os.path.exists(d):
        created.append(d)
        d = os.path.dirname(d)
    path = os.path.join(out_dir, LOCK)
    import fcntl
    while True:
        os.makedirs(out_dir, exist_ok=True)
        try:
            fd = open_lock_file(path, f"--out_dir {out_dir}", "choose another --out_dir")
        except FileNotFoundError:              # the folder was removed by a run ending just now
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_record(fd) or {}
            os.close(fd)
            raise _in_use(out_dir, holder, path) from None
        except OSError:                        # no flock on this file system: the recorded pid decides
            holder = _lock_record(fd) or {}
            pid, same_host = holder.get("pid"), holder.get("host") == socket.gethostname()
            if isinstance(pid, int) and pid != os.getpid() and (not same_host or pid_alive(pid)):
                os.close(fd)
                raise _in_use(out_dir, holder, path) from None
        with suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break                          # else: the file was replaced while we locked it; lock the new one
        os.close(fd)
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                         "command": " ".join([os.path.basename(sys.argv[0] or "python")] + sys.argv[1:])[:300]})
    os.ftruncate(fd, 0)
    os.pwrite(fd, (record + "\n").encode(), 0)
    return FolderLock(path, fd, created, before=set(os.listdir(out_dir)) - {LOCK})
