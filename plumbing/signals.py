"""What the training loop and evaluation do with stop signals: every signal a terminal, a job scheduler (Slurm's
preemption: SIGTERM, or SIGUSR1 / SIGUSR2 with --signal) or the OS (SIGXCPU: a CPU-time limit) sends to end a job.
Which signals those are, and what a script does with them outside the loop (one line, exit code 130), is
plumbing/cli.py's: the ground floor every script starts from."""
import signal
import threading
from contextlib import contextmanager

import torch.distributed as dist

from plumbing.cli import Interrupted, set_stop_handlers
from plumbing.distributed import any_rank


@contextmanager
def deferred_signals():
    """Stop signals wait until the block is done, then are handled as they would have been. Held back at the level
    of Python's handlers, not by the thread's signal mask: the kernel may deliver a signal to any thread (torch's,
    a process pool's), and Python runs its handler in the main thread whichever thread received it."""
    if threading.current_thread() is not threading.main_thread():
        yield          # Python runs signal handlers in the main thread only: nothing can interrupt this block
        return
    pending = []
    old = set_stop_handlers(lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        set_stop_handlers(old)
        if pending:
            signal.raise_signal(pending[0])     # raise_signal runs a Python handler before it returns


@contextmanager
def stop_signals():
    """Stop signals set a flag (the loop saves and exits at the next step) instead of ending the process;
    inside `interruptible(stop)` they raise Interrupted at once. The handlers before it are restored after."""
    stop = {"signal": None, "raise": False}

    def handler(signum, frame):
        stop["signal"] = signum
        if stop["raise"]:
            raise Interrupted(signum)
    old = set_stop_handlers(handler)
    try:
        yield stop
    finally:
        set_stop_handlers(old)


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


def reduced_unless_stopped(stop, env, work):
    """Work a stop signal abandons (interruptible): work() -> this rank's float64 sums, then added over the ranks,
    unless a signal interrupted the work on any rank, which every rank learns first (any_rank), so no collective
    is left waiting. -> the sums added over ranks, or None when any rank was interrupted."""
    sums, interrupted = None, False
    try:
        with interruptible(stop):
            sums = work()
    except Interrupted:
        interrupted = True
    if any_rank(env, interrupted):
        return None
    if env.ddp:
        sums = sums.to(env.device)
        dist.all_reduce(sums)
        return sums.cpu()
    return sums
