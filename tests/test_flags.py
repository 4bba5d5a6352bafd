"""plumbing/flags.py: train.py's flags checked at start-up, through the real scripts (tests/test_faults.py's runner):
each value out of its range is one line naming the flag that was given, before anything is written."""
import os

from test_faults import case, check, run_batches


def test_out_of_range_numbers_name_the_flag_given(tmp_path):
    """Issue 44: curriculum extremes traced back (an OverflowError) or trained on a broken alpha table, --min_lr
    above --lr diverged and blamed --lr, a negative --curriculum_share was blamed on --curriculum_iters, --vocab_size
    1 on the model's shape flags, and --eps 1e30 trained a run that learns nothing to exit 0."""
    run = ["--out_dir", tmp_path / "run", "--dataset", tmp_path / "corpus.txt", "--max_iters", "4"]
    cases = [(["--log10_tau_start", "400"], "--log10_tau_start must be in [-30, 3), got 400.0"),
             (["--log10_tau_end=-40"], "--log10_tau_end must be in [-30, 3), got -40.0"),
             (["--gamma_min", "-1e6"], "--gamma_min must be in [-15, 15), got -1000000.0"),
             (["--gamma_max", "1e6"], "--gamma_max must be in [-15, 15), got 1000000.0"),
             (["--lr", "1e-3", "--min_lr", "1e-2"], "--min_lr 0.01 is above --lr 0.001"),
             (["--curriculum_share=-0.5"], "--curriculum_share must be in [0, 1], got -0.5"),
             (["--vocab_size", "1"], "--vocab_size must be an int >= 2, got 1"),
             (["--eps", "1e30"], "--eps must be in (0, 1), got 1e+30")]
    check(run_batches([case("train.py", *run, *argv, cwd=tmp_path, expect=words) for argv, words in cases]
                      + [case("distillation/distill.py", "--init", tmp_path / "ckpt.pt", "--out_dir", tmp_path / "d",
                              "--gamma_min=-30", cwd=tmp_path, expect="both in [-15, 15)")]))
    assert os.listdir(tmp_path) == []
