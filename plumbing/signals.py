"""Stop signals: every signal a terminal, a job scheduler (Slurm's preemption: SIGTERM, or SIGUSR1 / SIGUSR2 with
--signal) or the OS (SIGXCPU: a CPU-time limit) sends to end a job. At start-up (install, from cli.run_cli) each
raises Interrupted wherever the process is, so the way out removes temp folders and locks and the script ends
with one line and exit code 130. The training loop (stop_signals) turns them into a flag instead: the run saves
at the next step and exits 130. Evaluation and sampling are abandoned at once (interruptible), and a swap of
weights is never interrupted half-way (deferred_signals)."""
import os
import signal
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist

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


def _set(handler):
    """handler for every stop signal -> the handlers it replaces (only the main thread may set them)."""
    old = {}
    for s in STOP_SIGNALS:
        try:
            old[s] = signal.signal(s, handler)
        except (ValueError, OSError):
            pass
    return old


def install():
    """A script's start (cli.run_cli): every stop signal raises Interrupted, so each `finally` on the way out runs
    (a preparation's temp folder, out_dir's lock and an out_dir the run left empty are removed) and run_cli
    prints one line and exits 130. A signal inside a long C++ call (SentencePiece training) takes effect when it
    returns."""
    _set(_raise)


def _exit_now(signum, frame):
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(EXIT_CODE)


def exiting():
    """The script's outcome is decided (its result, or its one error line): a stop signal from now on ends the
    process at once with exit code 130, instead of raising inside the interpreter's shutdown (atexit, finalizers),
    where it would print a traceback."""
    _set(_exit_now)


def ignore_stop_signals():
    """A worker process (prepare.py's tokenizers) leaves stop signals to its parent, which stops the pool; the
    worker dies with the parent (PR_SET_PDEATHSIG)."""
    _set(signal.SIG_IGN)


@contextmanager
def deferred_signals():
    """Stop signals wait until the block is done (delivered, and handled, right after it)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextmanager
def stop_signals():
    """Stop signals set a flag (the loop saves and exits at the next step) instead of ending the process;
    inside `interruptible(stop)` they raise Interrupted at once. The handlers before it are restored after."""
    stop = {"signal": None, "raise": False}

    def handler(signum, frame):
        stop["signal"] = signum
        if stop["raise"]:
            raise Interrupted(signum)
    old = _set(handler)
    try:
        yield stop
    finally:
        for s, h in old.items():
            if h is not None:              # None: a handler set outside Python, which cannot be put back
                signal.signal(s, h)


@contextmanager
def interruptible(stop):
    """Work that a stop signal abandons (evaluation, sampling), rather than finishing it first: raises
    Interrupted on a signal received before or during it."""
    try:
        stop["raise"] = True
        if stop["signal"] is not None:
            raise Interrupted(stop["signal"])
        yield
    finally:
        stop["raise"] = False


def reduced_unless_stopped(stop, env, n, work):
    """Work a stop signal abandons (interruptible): work() -> this rank's float64 sums (n,), then ONE all-reduce of
    [interrupted, sums] that every rank joins, so a signal on any rank abandons the work on all of them and no
    collective is left waiting. -> the sums added over ranks, or None when any rank was interrupted."""
    sums, interrupted = torch.zeros(n, dtype=torch.float64), False
    try:
        with interruptible(stop):
            sums = work()
    except Interrupted:
        interrupted = True
    if env.ddp:
        both = torch.cat([torch.tensor([float(interrupted)], dtype=torch.float64), sums]).to(env.device)
        dist.all_reduce(both)
        interrupted, sums = bool(both[0] > 0), both[1:].cpu()
    return None if interrupted else sums
