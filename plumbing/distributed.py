"""Where a process runs in a torchrun job (Env: nodes, processes, CPU threads), and how the ranks agree: the model
each rank trains (wrap_model), each rank's micro-batches and its slice of the draws made for the global batch, the
one host sync of the training loop (agree), and work done on rank 0 or once per node."""
import datetime
import inspect
import os
import socket
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from plumbing.cli import UsageError, autocast_for, first_line, parse_bool, resolve_device, resolve_dtype
from plumbing.memory import cuda_allocator_env


@dataclass
class Env:
    """Where this process runs: device and its place in a torchrun job (launch_env, setup_distributed)."""
    device: torch.device
    ddp: bool = False
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node: int = 0                    # torchrun's GROUP_RANK: which node (machine) this process runs on
    nnodes: int = 1
    local_world_size: int = 1        # processes on this node
    threads: int = 0                 # torch's CPU threads in this process (0: not set, a CUDA run)
    threads_from: str = ""           # why that many: "--threads", "OMP_NUM_THREADS" or the cores per process
    master_addr: str = ""            # MASTER_ADDR:MASTER_PORT, rank 0's store, where the ranks join
    master_port: int = 0
    restart: int = 0                 # torchrun's TORCHELASTIC_RESTART_COUNT
    started: float = field(default_factory=time.time)   # when this process took its place (the run's start-up ends)

    @property
    def master(self):
        return self.rank == 0

    def describe(self):
        """The run's shape for the log's first lines: '2 nodes x 1 process, cpu, 1 torch thread per process'."""
        plural = lambda n, word: f"{n} {word}{'' if n == 1 else 'es' if word.endswith('s') else 's'}"
        where = f"{plural(self.nnodes, 'node')} x {plural(self.local_world_size, 'process')}, {self.device.type}"
        return where + (f", {plural(self.threads, 'torch thread')} per process ({self.threads_from})"
                        if self.threads else "")

    def autocast(self, dtype):
        """The network's autocast on this device for --dtype `dtype` (auto: bf16 on CUDA, float32 elsewhere)."""
        return autocast_for(self.device, resolve_dtype(dtype, self.device))

    def micro_batches(self, model, cfg, x0_all, mask_all, draws_all):
        """This rank's part of a global batch, x0_all (B_rank, L) and its mask or None, in cfg.grad_accum micro-batches,
        each with its slice of every draw made for the global batch (rank_slice) and the context its backward runs
        in (DDP all-reduces on the last only). Yields (x0, mask, draws, context) on this process's device."""
        micro = x0_all.shape[0] // cfg.grad_accum
        for m in range(cfg.grad_accum):
            x0 = x0_all[m * micro:(m + 1) * micro].to(self.device, non_blocking=True)
            mask = None if mask_all is None else mask_all[m * micro:(m + 1) * micro].to(self.device)
            draws = [rank_slice(v, self.rank, self.world_size, m, cfg.grad_accum) for v in draws_all]
            yield x0, mask, draws, (model.no_sync() if self.ddp and m < cfg.grad_accum - 1 else nullcontext())


def usable_cores():
    """The cores this process may run on (its affinity mask: a container's or taskset's limit, not the host's)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def idle_cores(cores, seconds=0.1):
    """How many of `cores` (ids) sat idle over the next `seconds`, from the kernel's counters (/proc/stat:
    idle + iowait over all time of each core), or None where they cannot be read (not Linux)."""
    def counters():
        with open("/proc/stat") as f:
            return {row[0]: [int(v) for v in row[1:9]] for row in map(str.split, f) if row[0].startswith("cpu")}
    try:
        before = counters()
        time.sleep(seconds)
        after = counters()
        spent = [[b - a for a, b in zip(before[f"cpu{c}"], after[f"cpu{c}"])] for c in cores]
    except (OSError, ValueError, KeyError):
        return None
    return sum((d[3] + d[4]) / sum(d) if sum(d) else 1.0 for d in spent)


def check_threads(threads, source):
    """A number of CPU threads asked for (source: "--threads" or "OMP_NUM_THREADS=") beyond this process's usable
    cores (a million crash torch's thread pool: a segmentation fault) -> UsageError naming the source."""
    cores = len(usable_cores())
    if threads > cores:
        raise UsageError(f"{source}{' ' if source.startswith('--') else ''}{threads} asks for more threads than the "
                         f"{cores} usable cores of this machine; give at most {cores}, or leave it unset (the default)")


def omp_threads():
    """OMP_NUM_THREADS as a number of threads (its first item: OpenMP also takes a list per nesting level), or 0 when
    unset or empty; a value that is no positive whole number, or above the usable cores -> UsageError."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return 0
    first = value.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise UsageError(f"OMP_NUM_THREADS={value!r} is not a number of threads; set a whole number >= 1, or unset it")
    check_threads(int(first), "OMP_NUM_THREADS=")
    return int(first)


def cpu_threads(threads, local_world_size):
    """torch's thread count for a CPU process -> (count, why): --threads N > 0 (checked by plumbing.run.launch), else
    OMP_NUM_THREADS, else the usable cores idle at start (rounded, all of them where unknown) shared by this node's
    processes, at least one each. Why not all the cores: docs/nodes.md, "CPU threads"."""
    if threads > 0:
        return threads, "--threads"
    omp = omp_threads()
    if omp:
        return omp, "OMP_NUM_THREADS"
    cores = usable_cores()
    idle = idle_cores(cores)
    free = len(cores) if idle is None else min(len(cores), max(1, round(idle)))
    why = f"{len(cores)} usable cores" + ("" if idle is None else f", {idle:.1f} idle at start")
    return max(1, free // local_world_size), f"{why}, {local_world_size} per node"


# -----------------------------------------------------------------------------------------------
# the launch: torchrun's environment, checked as a whole, and the ranks joining

LAUNCH_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")


class LaunchError(UsageError):
    """A launch environment that is incomplete or contradictory, or ranks that did not meet (join): every rank
    prints it (exit code 2), since a rank that cannot trust RANK, or that waited for rank 0 in vain, cannot know
    that rank 0 speaks for it."""
    every_rank = True


def launch_env(environ=None):
    """torchrun's variables (LAUNCH_VARS) -> Env (no device yet), checked as a whole before anything starts
    (docs/reliability.md, "Distributed launch"), else one line naming them -> LaunchError. Nodes: GROUP_RANK /
    GROUP_WORLD_SIZE, else ranks counted in blocks of LOCAL_WORLD_SIZE per node (torchrun numbers the ranks of one
    node consecutively)."""
    e = os.environ if environ is None else environ
    given = {k: e[k].strip() for k in LAUNCH_VARS if k in e}
    shown = ", ".join(f"{k}={v}" for k, v in given.items()) or "none set"
    fix = "launch with torchrun (it sets them all), or unset them to run one process"

    def fail(problem):
        raise LaunchError(f"the launch environment is {problem} ({shown}); {fix}")
    for k, v in given.items():
        if k != "MASTER_ADDR" and not v.isdigit():
            fail(f"not usable: {k}={e[k]!r} is not a whole number")
    num = {k: int(v) for k, v in given.items() if k != "MASTER_ADDR"}
    world = num.get("WORLD_SIZE", 1)
    if world < 1:
        fail("not usable: WORLD_SIZE must be >= 1")
    rank, local_rank = num.get("RANK", 0), num.get("LOCAL_RANK", 0)
    local_world = num.get("LOCAL_WORLD_SIZE", world)
    nnodes = num.get("GROUP_WORLD_SIZE", max(1, world // max(local_world, 1)))
    node = num.get("GROUP_RANK", rank // max(local_world, 1))
    if world > 1:
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not given.get(k)]
        if missing:
            fail(f"incomplete: WORLD_SIZE={world} but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                 f"not set")
        if not 1 <= num["MASTER_PORT"] <= 65535:
            fail(f"not usable: MASTER_PORT={num['MASTER_PORT']} is not a port (1-65535)")
    contradictions = [
        (rank >= world, f"RANK={rank} is not below WORLD_SIZE={given.get('WORLD_SIZE', '1 (unset: one process)')}"),
        (not 1 <= local_world <= world, f"LOCAL_WORLD_SIZE={local_world} is not in 1..WORLD_SIZE={world}"),
        (local_rank >= local_world, f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world}"),
        (local_rank > rank, f"LOCAL_RANK={local_rank} is above RANK={rank}"),
        (node >= nnodes, f"GROUP_RANK={node} is not below GROUP_WORLD_SIZE={nnodes}")]
    for wrong, why in contradictions:
        if wrong:
            fail(f"contradictory: {why}")
    ddp = world > 1                      # one process is one node
    return Env(None, ddp, rank, world, local_rank, node if ddp else 0, nnodes if ddp else 1, local_world,
               master_addr=given.get("MASTER_ADDR", ""), master_port=num.get("MASTER_PORT", 0),
               restart=num.get("TORCHELASTIC_RESTART_COUNT", 0))


def join(env, timeout, poll=0.2, report=30.0):
    """Every rank of the job meets the others at rank 0's store before the process group is made, in short waits in
    Python that a stop signal ends, saying whom it waits for every `report` seconds and giving up after `timeout`
    (--dist_timeout; docs/reliability.md, "Distributed launch"). -> the store, for dist.init_process_group."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    where, start = f"{env.master_addr}:{env.master_port}", time.monotonic()
    step = datetime.timedelta(seconds=max(1.0, min(10.0, timeout)))
    said = [start - report]

    def waiting(what, missing=None):
        waited = time.monotonic() - start
        if waited > timeout:
            raise LaunchError(f"rank {env.rank}: {what} within --dist_timeout {timeout:g} s at {where}: start "
                             f"every rank (torchrun on each node, the same MASTER_ADDR and MASTER_PORT), or raise "
                             f"--dist_timeout")
        if time.monotonic() - said[0] >= report:
            print(f"rank {env.rank}: waiting for {missing or what} at {where} ({waited:.0f} s; gives up after "
                  f"--dist_timeout {timeout:g} s)", file=sys.stderr, flush=True)
            said[0] = time.monotonic()
        time.sleep(poll)
    try:                                 # a host name that does not resolve is MASTER_ADDR's fault, not the port's
        socket.getaddrinfo(env.master_addr, env.master_port)
    except (OSError, UnicodeError) as e:
        raise LaunchError(f"rank {env.rank}: MASTER_ADDR={env.master_addr} does not resolve to an address "
                         f"({getattr(e, 'strerror', None) or e}); set MASTER_ADDR to rank 0's host name or IP address "
                         f"(torchrun --master_addr), the same on every rank") from None
    if env.rank == 0 and not agent:
        try:
            store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, True, timeout=step,
                                  wait_for_workers=False, multi_tenant=True,
                                  use_libuv=os.environ.get("USE_LIBUV", "1") == "1")
        except (RuntimeError, ValueError) as e:
            raise LaunchError(f"rank 0 cannot host the job's store at {where} ({first_line(e).split('. ')[0]}); "
                             f"choose another MASTER_PORT") from None
    else:
        while True:                      # a plain socket first: the store's own retries log C++ traces
            try:
                socket.create_connection((env.master_addr, env.master_port), timeout=1).close()
                break
            except OSError:                # MASTER_ADDR resolves (checked above): rank 0's store is not up yet
                waiting("rank 0's store did not answer", "rank 0's store")
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, False, timeout=step)
    arrivals = dist.PrefixStore(f"sddlm/join/{env.restart}", store)
    arrivals.set(f"rank{env.rank}", "1")
    arrivals.add("count", 1)
    while arrivals.add("count", 0) < env.world_size:
        missing = [r for r in range(env.world_size) if not arrivals.check([f"rank{r}"])] \
            if time.monotonic() - said[0] >= report or time.monotonic() - start > timeout else []
        names = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing[:8]))}" + \
            (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        waiting(f"{names} of {env.world_size} did not join", f"{names} of {env.world_size} to join")
    store.set_timeout(dist.default_pg_timeout)
    return dist.PrefixStore("default_pg", store)


def setup_distributed(cfg, env):
    """The Env of launch_env completed: the ranks joined, the process group made, CUDA device chosen, CPU threads set
    by cpu_threads; or a single process."""
    env.device, env.started = resolve_device(cfg.device), time.time()
    if env.device.type == "cpu":
        env.threads, env.threads_from = cpu_threads(cfg.threads, env.local_world_size)
        torch.set_num_threads(env.threads)
    if env.device.type == "cuda":           # before the first CUDA allocation: the allocator reads it once
        os.environ.update(cuda_allocator_env(os.environ))
    if env.ddp:
        dist.init_process_group(backend="nccl" if env.device.type == "cuda" else "gloo",
                                store=join(env, cfg.dist_timeout), rank=env.rank, world_size=env.world_size)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
        env.device = torch.device("cuda", env.local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return env


def compiles(flag, preset, device):
    """--compile auto | 1 | 0 -> whether the training model and evaluation's forward are torch.compile'd. auto: on
    CUDA for the paper's presets (every preset but tiny), where the model and the fused output layer compile to one
    graph and each step runs 1.2-1.35x faster; eager on the CPU and for the tiny demo, whose run would not win back
    the minutes compiling takes. 1 / 0 force it."""
    if str(flag).strip().lower() == "auto":
        return device.type == "cuda" and preset != "tiny"
    if str(flag).strip().lower() not in ("1", "true", "yes", "y", "0", "false", "no", "n"):
        raise UsageError(f"--compile must be auto, 1 or 0, got {flag!r}")
    return parse_bool(flag)


def wrap_model(raw_model, env, compile):
    """The model the training step calls: raw_model in DDP under torchrun, then compiled, after the memory probe, so
    that each gradient bucket's all-reduce overlaps the backward pass (docs/training.md, "The step"). DDP keeps the
    gradients as views of its buckets (gradient_as_bucket_view: no second copy); they start as zeros, so every step,
    the first after a resume too, accumulates into the buckets alike (train.optimizer_step zeroes them in place)."""
    model = raw_model
    if env.ddp:
        for p in raw_model.parameters():
            p.grad = torch.zeros_like(p)
        # no buffer sync at each forward: the only buffers are the RoPE tables, identical on every rank (torch 2.13
        # renamed the flag and warns at its old name)
        no_sync = {("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
                    else "broadcast_buffers"): False}
        model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None,
                    gradient_as_bucket_view=True, **no_sync)
        model.config = raw_model.config        # read through the wrappers (diffusion.loss_terms: the vocabulary)
    return torch.compile(model) if compile else model


def rank_slice(t_global, rank, world_size, micro_step, grad_accum):
    """The part of a global-batch vector that belongs to one rank and one gradient-accumulation step: every draw
    of a step is made for the global batch on every rank alike and sliced here, so a DDP run equals one process."""
    n = t_global.shape[0] // (world_size * grad_accum)        # check_run_flags: the batch divides evenly
    start = (rank * grad_accum + micro_step) * n
    return t_global[start:start + n]


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


def _attempt(work, errors):
    """[work(), None], or [None, the error] when it raises one of `errors`."""
    try:
        return [work(), None]
    except errors as e:
        return [None, e]


def on_rank0(env, work, *errors):
    """work() -> value on rank 0, broadcast to every rank. An error of the kinds `errors` on rank 0 is raised on
    every rank, as the same exception type with the same one line, instead of leaving the others at a barrier."""
    box = _attempt(work, errors) if env.master else [None, None]
    if env.ddp:
        dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise box[1]
    return box[0]


def on_each_node(env, work, *errors):
    """work() on the first process of every node (LOCAL_RANK 0), e.g. preparing data into a folder of that node's
    own disk, while the node's other processes wait. -> (the value of this process's node, {node: value}), on
    every rank. An error of the kinds `errors` on any node is raised on every rank as on_rank0's, naming the node
    when it is not node 0."""
    mine = _attempt(work, errors) if env.local_rank == 0 else [None, None]
    every = [(env.node, env.local_rank, *mine)]
    if env.ddp:
        every = [None] * env.world_size
        dist.all_gather_object(every, (env.node, env.local_rank, *mine))
    firsts = {node: (value, error) for node, local_rank, value, error in every if local_rank == 0}
    for node, (_, error) in sorted(firsts.items()):
        if error is not None:
            raise error if node == 0 else type(error)(f"node {node}: {error}")
    return firsts[env.node][0], {node: value for node, (value, _) in sorted(firsts.items())}
