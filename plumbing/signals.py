"""Stop signals: SIGINT / SIGTERM end a run at the next step with a checkpoint, abandon evaluation or sampling
at once, and never interrupt a swap of weights half-way."""
import signal
from contextlib import contextmanager

import torch
import torch.distributed as dist


@contextmanager
def deferred_signals():
    """SIGINT / SIGTERM wait until the block is done (delivered, and handled, right after it)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Interrupted(KeyboardInterrupt):
    """A stop signal inside `interruptible`: evaluation or sampling ends at once."""


@contextmanager
def stop_signals():
    """SIGINT / SIGTERM set a flag (the loop saves and exits at the next step) instead of killing the process;
    inside `interruptible(stop)` they raise Interrupted at once."""
    stop = {"signal": None, "raise": False}

    def handler(signum, frame):
        stop["signal"] = signum
        if stop["raise"]:
            raise Interrupted(signum)
    old = signal.signal(signal.SIGINT, handler), signal.signal(signal.SIGTERM, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, old[0]), signal.signal(signal.SIGTERM, old[1])


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
