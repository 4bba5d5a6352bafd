"""plumbing/cli.py's one error line, through the scripts."""
import os
import subprocess
import sys

from test_faults import case, check, run_batches

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root


def test_a_stray_rank_in_one_process_still_gets_its_error_line(tmp_path):
    """RANK=1 left in the environment of one process (no WORLD_SIZE): no job, so the process speaks for itself
    (rank 0's silence would be a bare exit 2); a training script names the variable and the fix."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(RANK="1", OMP_NUM_THREADS="1")
    for argv, line in [(["downstream/eval_downstream.py"], "error: checkpoint not found: out/ckpt.pt"),
                       (["train.py", "--out_dir", "o"], "error: the launch environment is contradictory: RANK=1 is "
                        "not below WORLD_SIZE=1 (unset: one process) (RANK=1); launch with torchrun (it sets them "
                        "all), or unset them to run one process")]:
        p = subprocess.run([sys.executable, os.path.join(HERE, argv[0]), *argv[1:]], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and p.stderr.startswith(line) and p.stderr.count("\n") == 1, p.stderr
    assert os.listdir(tmp_path) == []


def test_seed_flags_out_of_range_are_one_line_naming_them(tmp_path):
    """Issue 44: a seed past 64 bits traced back in five scripts (torch's generators take 64 bits) and eval_ppl.py
    took it modulo 2^64; every seed flag is checked where the flags are parsed, in [0, 2^60) (gen_seed x 8 + group
    stays in 63 bits)."""
    big, too_big = str(2 ** 64), "--seed must be an integer in [0, 2^60), got 18446744073709551616"
    data = ["--dataset", tmp_path / "corpus.txt"]               # none: a run past the check fails at once
    check(run_batches([case("train.py", *data, "--seed", big, cwd=tmp_path, expect=too_big),
                       case("train.py", *data, "--gen_seed", 2 ** 61, cwd=tmp_path,
                            expect="--gen_seed must be an integer in"),
                       case("eval_ppl.py", "--seed", big, cwd=tmp_path, expect=too_big),
                       case("sample.py", "--seed=-1", cwd=tmp_path, expect="--seed must be an integer in [0, 2^60)"),
                       case("distillation/distill.py", "--seed", big, cwd=tmp_path, expect=too_big),
                       case("downstream/eval_downstream.py", "--seed", big, cwd=tmp_path, expect=too_big)]))
