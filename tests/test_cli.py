"""plumbing/cli.py's one error line, through the scripts."""
import errno
import os
import subprocess
import sys


import pytest

from conftest import case, check_last, check_one_line, md5s, run_batches
from plumbing import cli
import train






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
    check_one_line(run_batches([case("train.py", *data, "--seed", big, cwd=tmp_path, expect=too_big),
                       case("train.py", *data, "--gen_seed", 2 ** 61, cwd=tmp_path,
                            expect="--gen_seed must be an integer in"),
                       case("eval_ppl.py", "--seed", big, cwd=tmp_path, expect=too_big),
                       case("sample.py", "--seed=-1", cwd=tmp_path, expect="--seed must be an integer in [0, 2^60)"),
                       case("distillation/distill.py", "--seed", big, cwd=tmp_path, expect=too_big),
                       case("downstream/eval_downstream.py", "--seed", big, cwd=tmp_path, expect=too_big)]))


def test_flag_abbreviations_are_refused():
    with pytest.raises(cli.UsageError, match="unrecognized arguments: --max_iter"):
        cli.parse_flags(train.TrainConfig, ["--max_iter", "5"])
    assert cli.parse_flags(train.TrainConfig, ["--max_iters", "5"]).max_iters == 5


def test_run_cli_turns_os_faults_and_ctrl_c_into_one_line(capsys):
    def full():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "out/log.jsonl")

    def ctrl_c():
        raise KeyboardInterrupt
    for main, code, line in [(full, 2, "error: No space left on device: out/log.jsonl"),
                             (ctrl_c, 130, "error: interrupted")]:
        with pytest.raises(SystemExit) as e:
            cli.run_cli(main)
        assert e.value.code == code and capsys.readouterr().err.splitlines() == [line]


@pytest.mark.slow
def test_float_lists_refuse_nan_and_inf_naming_the_flag(run_ar, tmp_path):
    t = tmp_path
    psi = ["--sampler", "psi", "--psi_profile", "loop", "--steps", "4", "--num_samples", "1"]
    cases = [case("sample.py", "--ckpt", run_ar.ckpt, *psi, "--psi_fracs", "nan,0.5,0.5", "--out", t / "s.jsonl",
                  cwd=t, expect="--psi_fracs: expected a finite number, got 'nan' in 'nan,0.5,0.5'"),
             case("sample.py", "--ckpt", run_ar.ckpt, *psi, "--psi_fracs", "0.5,0.5,-inf", "--out", t / "s.jsonl",
                  cwd=t, expect="--psi_fracs: expected a finite number, got '-inf'"),
             case("sample.py", "--ckpt", run_ar.ckpt, *psi, "--psi_eta", "0.9,nan,0.9", "--out", t / "s.jsonl",
                  cwd=t, expect="--psi_eta: expected a finite number, got 'nan'"),
             case("eval_ppl.py", "--ckpt", run_ar.ckpt, "--metric", "genppl", "--judge", run_ar.ar, *psi,
                  "--psi_fracs", "0.5,nan,0.5", cwd=t, expect="--psi_fracs: expected a finite number, got 'nan'"),
             case("downstream/eval_downstream.py", "--ckpt", run_ar.ckpt, "--jsonl", t / "mc.jsonl", "--cfg", "on",
                  "--cfg_w_task", "mc=nan", cwd=t, expect="--cfg_w_task: expected NAME=W (W a finite number)")]
    (t / "mc.jsonl").write_text('{"context": "the cat", "choices": [" sees", " likes"], "gold": 0}\n')
    before = md5s(run_ar.root)
    check_last(run_batches(cases))
    assert not (t / "s.jsonl").exists() and md5s(run_ar.root) == before
    # lm-eval's --model_args of eval_downstream's model: strings, or values lm-eval already made floats
    from downstream import lm_eval_adapter as adapter, scoring
    for args, flag in (({"cfg_w": float("nan")}, "cfg_w"), ({"cfg_w": "inf"}, "cfg_w"),
                       ({"top_p": "nan"}, "top_p"), ({"psi_loop_t": float("inf")}, "psi_loop_t"),
                       ({"sampler": "psi", "psi_profile": "loop", "psi_fracs": "nan/0.5/0.5"}, "psi_fracs")):
        with pytest.raises(scoring.EvalError, match=f"sddlm model argument {flag}"):
            adapter._Harness(ckpt=run_ar.ckpt, **args)
