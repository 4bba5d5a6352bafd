"""Where a process runs in a torchrun job, and how the ranks agree: set-up and tear-down, the one host sync of
the training loop (agree), any_rank, and a decision taken on rank 0 that every rank then shares."""
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cli import OutOfMemory, UsageError, oom_summary, resolve_device
from plumbing.lock import acquire_folder
from plumbing.signals import deferred_signals


@dataclass
class Env:
    """Where this process runs: device and its place in a torchrun job."""
    device: torch.device
    ddp: bool = False
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def master(self):
        return self.rank == 0


def setup_distributed(cfg):
    """torchrun's environment -> Env (process group joined, CUDA device chosen), or a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(cfg.device)
    env = Env(device, ddp=world_size > 1, world_size=world_size)
    if env.ddp:
        env.rank, env.local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
        env.device = torch.device("cuda", env.local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return env


def any_rank(env, flag):
    """True on every rank when `flag` is true on any (a collective: every rank must call it)."""
    if not env.ddp:
        return bool(flag)
    t = torch.tensor(float(flag), device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def agree(env, loss_sum, bad, stopping):
    """The only host sync of the loop: under DDP every rank reaches it at the same steps, averages the loss
    and learns whether ANY rank saw a non-finite loss or a signal. -> (loss_sum, bad, stopping) as Python values."""
    if env.ddp:
        dist.all_reduce(loss_sum)
        loss_sum /= env.world_size
        flags = torch.tensor([float(bad), float(stopping)], device=env.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad, stopping = flags[0], flags[1]
    return loss_sum.item(), bool(bad), bool(stopping)


def on_rank0(env, work, *errors):
    """work() -> value on rank 0, broadcast to every rank. An error of the kinds `errors` on rank 0 is raised on
    every rank, as the same exception type with the same one line, instead of leaving the others at a barrier."""
    box = [None, None]
    if env.master:
        try:
            box[0] = work()
        except errors as e:
            box[1] = e
    if env.ddp:
        dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise box[1]
    return box[0]


def run_distributed(cfg, work):
    """work(env) in this process's place of a torchrun job (setup_distributed), holding the lock on cfg.out_dir
    (plumbing.lock: one run per folder), the process group torn down after it. Out of memory -> one line naming
    the micro-batch and the flag that halves it; the checkpoint on disk is kept. Shared by train.py and
    distill.py."""
    env = setup_distributed(cfg)
    held = []

    def lock():
        with deferred_signals():      # a signal now must not leave a lock (or a new empty out_dir) unrecorded
            held.append(acquire_folder(cfg.out_dir))
    try:
        # one run per out_dir: rank 0 locks it, and every rank fails alike when another run holds it
        on_rank0(env, lock, UsageError)
        return work(env)
    except torch.OutOfMemoryError as e:
        micro = cfg.batch_size // (env.world_size * cfg.grad_accum)
        fix = (f"set --grad_accum {2 * cfg.grad_accum} (micro-batch {micro // 2})" if micro > 1 and
               cfg.batch_size % (2 * env.world_size * cfg.grad_accum) == 0 else
               "lower --batch_size, --block_size or the model size")
        raise OutOfMemory(f"out of memory at micro-batch {micro} (--batch_size {cfg.batch_size} / {env.world_size} "
                          f"rank(s) / --grad_accum {cfg.grad_accum}): {oom_summary(e)}; {fix}; the last checkpoint "
                          f"in {cfg.out_dir} is kept") from None
    finally:
        for lock in held:
            lock.release()
        if env.ddp and dist.is_initialized():
            dist.destroy_process_group()
