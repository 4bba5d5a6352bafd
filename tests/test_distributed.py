"""plumbing/distributed.py: the launch environment checked as a whole before any work; a rank waiting for the
others says whom it waits for and stops on a signal or its timeout."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import ENV, HERE, case, check_last, run_batches
from plumbing import distributed


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("env, words", [
    ({}, None), ({"WORLD_SIZE": "1"}, None), ({"LOCAL_RANK": "0"}, None),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}, None),
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a whole number"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK and MASTER_ADDR and MASTER_PORT are not set"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR and MASTER_PORT are not set"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE must be >= 1"),
    ({"RANK": "1"}, "RANK=1 is not below WORLD_SIZE=1"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not a port"),
    ({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
      "MASTER_PORT": "1"}, "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     "LOCAL_WORLD_SIZE=3 is not in 1..WORLD_SIZE=2"),
])
def test_the_launch_environment_is_checked_as_a_whole(env, words):
    if words is None:
        distributed.launch_env(env)
    else:
        with pytest.raises(distributed.LaunchError, match=words):
            distributed.launch_env(env)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the cores and the memory")
def test_bad_environments_threads_and_sizes_refused_at_start(tmp_path):
    """Each of these ran until the machine gave up (or crashed) before: now one line in a few seconds, before any
    data are prepared or any model allocated, naming the variable, the flag or the field; nothing is created."""
    t = tmp_path
    run = lambda name: ["--out_dir", t / name, "--max_iters", "1"]
    ddp = {"WORLD_SIZE": "2", "RANK": "0"}
    cases = [
        case("train.py", *run("a"), cwd=t, env={"WORLD_SIZE": "2", "RANK": "0"},
             expect="WORLD_SIZE=2 but MASTER_ADDR and MASTER_PORT are not set"),
        case("train.py", *run("b"), cwd=t, env={"WORLD_SIZE": "2"}, expect="WORLD_SIZE=2 but RANK and MASTER_ADDR"),
        case("train.py", *run("c"), cwd=t, env={"WORLD_SIZE": "abc"}, expect="WORLD_SIZE='abc' is not a whole number"),
        case("train.py", *run("d"), cwd=t, env={**ddp, "MASTER_ADDR": "x", "MASTER_PORT": "1", "LOCAL_RANK": "5"},
             expect="contradictory: LOCAL_RANK=5 is not below LOCAL_WORLD_SIZE=2"),
        case("distillation/distill.py", "--init", t / "none.pt", *run("e"), cwd=t, env={"WORLD_SIZE": "abc"},
             expect="WORLD_SIZE='abc' is not a whole number"),
        case("distillation/distill.py", "--init", t / "none.pt", *run("f"), cwd=t, env={"WORLD_SIZE": "2"},
             expect="WORLD_SIZE=2 but RANK and MASTER_ADDR"),
        # a MASTER_ADDR that does not resolve is named (rank 0 used to blame the port after 5 s); a rank other than 0
        # that gives up waiting says so itself (it used to exit 2 without a line: rank 0 speaks for all, but is gone)
        *[case(script, *extra, *run(f"addr{rank}"), cwd=t, env={**ddp, "RANK": rank, "MASTER_ADDR":
                                                                "no.such.host.invalid", "MASTER_PORT": "29511"},
               expect=f"rank {rank}: MASTER_ADDR=no.such.host.invalid does not resolve to an address")
          for rank in ("0", "1") for script, extra in (("train.py", []),
                                                        ("distillation/distill.py", ["--init", t / "none.pt"]))],
        case("train.py", *run("alone"), "--dist_timeout", "1", cwd=t,
             env={**ddp, "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
             expect="rank 1: rank 0's store did not answer within --dist_timeout 1 s at 127.0.0.1:"),
        case("train.py", *run("g"), "--threads", "1000000", cwd=t, expect="--threads 1000000 asks for more threads"),
        case("train.py", *run("h"), cwd=t, env={"OMP_NUM_THREADS": "1000000"},
             expect="OMP_NUM_THREADS=1000000 asks for more threads"),
        case("bench/bench.py", "--threads", "1000000", cwd=t, expect="--threads 1000000 asks for more threads"),
        case("bench/bench.py", "--repeats", "1", cwd=t, env={"OMP_NUM_THREADS": "1000000"},
             expect="OMP_NUM_THREADS=1000000 asks for more threads"),
        case("train.py", *run("i"), "--n_layer", "1000000000", cwd=t, expect="--n_layer 1000000000: training"),
        case("train.py", *run("j"), "--n_embd", "2000000", "--n_head", "2", cwd=t, expect="--n_embd 2000000: training"),
    ]
    check_last(run_batches(cases))
    assert sorted(os.listdir(t)) == []          # no data folder prepared, no out_dir made


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals and /proc")
def test_a_waiting_rank_names_whom_stops_on_signal_or_timeout(tmp_path):
    """WORLD_SIZE=2 with rank 1 never started: rank 0 says it waits for rank 1, a SIGTERM ends it with 130 at once
    (it used to sit in one C++ call, deaf to signals), and --dist_timeout ends it with 2 and the rank that never
    came."""
    procs = {}
    for name, extra in (("signal", []), ("timeout", ["--dist_timeout", "3"])):
        env = {**ENV, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "TQDM_DISABLE": "1"}
        procs[name] = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), "--out_dir",
                                        str(tmp_path / name), "--max_iters", "1", *extra], cwd=tmp_path, env=env,
                                       stderr=subprocess.PIPE, text=True)
    p = procs["signal"]
    first = p.stderr.readline()                 # the wait starts with its line (after the imports)
    assert "rank 0: waiting for rank 1 of 2 to join at 127.0.0.1:" in first, first
    p.send_signal(signal.SIGTERM)
    start = time.monotonic()
    rest = p.communicate(timeout=30)[1]
    assert p.returncode == 130 and time.monotonic() - start < 5, (p.returncode, rest)
    assert rest.strip().splitlines()[-1] == "error: interrupted by SIGTERM" and "Traceback" not in rest, rest
    q = procs["timeout"]
    err = q.communicate(timeout=60)[1]
    assert q.returncode == 2 and "Traceback" not in err, (q.returncode, err)
    assert err.strip().splitlines()[-1].startswith(
        "error: rank 0: rank 1 of 2 did not join within --dist_timeout 3 s at 127.0.0.1:"), err
    assert not (tmp_path / "signal").exists() and not (tmp_path / "timeout").exists()
