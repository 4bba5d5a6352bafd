"""plumbing/cli.py: what every script's flags share, through the real scripts (tests/test_faults.py's runner)."""
from test_faults import case, check, run_batches


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
