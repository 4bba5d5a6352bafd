"""plumbing/flags.py: the scripts' flags checked at start, before any work, each refusal one line naming the flag
that was given and the fix."""
import os
import shutil

import pytest
import torch

from conftest import case, check_last, check_one_line, copy_run, md5s, run_batches


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
    check_one_line(run_batches([case("train.py", *run, *argv, cwd=tmp_path, expect=words) for argv, words in cases]
                      + [case("distillation/distill.py", "--init", tmp_path / "ckpt.pt", "--out_dir", tmp_path / "d",
                              "--gamma_min=-30", cwd=tmp_path, expect="--gamma_min must be in [-15, 15), got -30.0")]))
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_bad_flags_fail_at_start_and_create_nothing(run4, tmp_path):
    before = md5s(run4.data_dir)
    out = tmp_path / "out"
    flags = [(["--eval_interval", "0"], "--eval_interval must be >= 1"),
             (["--log_interval", "0"], "--log_interval must be >= 1"),
             (["--ckpt_interval", "0"], "--ckpt_interval must be >= 1"),
             (["--eval_iters", "-1"], "--eval_iters (0 = the whole split)"),
             (["--eps", "-1"], "--eps must be in (0, 1)"),
             (["--lr", "nan"], "--lr: expected a finite number, got 'nan'"),
             (["--lr", "-1"], "--lr must be in (0, inf)"),
             (["--lr", "inf"], "--lr: expected a finite number, got 'inf'"),
             (["--beta1", "1.5"], "--beta1 must be in [0, 1)"),
             (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
             (["--n_head", "3"], "n_embd=64 must split into n_head=3"),
             (["--dtype", "float16"], "--dtype must be auto, float32 or bfloat16"),
             (["--device", "tpu"], "--device must be auto, cpu or cuda"),
             (["--max_iter", "5"], "unrecognized arguments: --max_iter")]
    if not torch.cuda.is_available():
        flags.append((["--device", "cuda"], "no CUDA device is available"))
    cases = [case("train.py", *run4.train, "--out_dir", out, *args, cwd=tmp_path, expect=words)
             for args, words in flags]
    cases += [case("prepare.py", "--dataset", run4.corpus, "--block", "16", cwd=tmp_path, expect="unrecognized"),
              case("sample.py", "--ckpt", run4.ckpt, "--num_sample", "2", cwd=tmp_path, expect="unrecognized"),
              *[case("eval_ppl.py", "--ckpt", run4.ckpt, "--t_min", t_min, cwd=tmp_path,
                     expect="--t_min must be in (0, 1)") for t_min in ("0", "2")],
              case("eval_ppl.py", "--ckpt", run4.ckpt, "--max_batches", "-1", cwd=tmp_path,
                   expect="--max_batches must be >= 0")]
    check_one_line(run_batches(cases[:10], cases[10:]))
    assert not out.exists() and md5s(run4.data_dir) == before and os.listdir(tmp_path) == []


@pytest.mark.slow
def test_start_up_messages_come_before_the_work_and_name_the_fix(run_tok, tmp_path):
    t = tmp_path
    for d in ("w1", "w2", "w3", "w4", "w5"):          # fresh working folders: what a refusal leaves is visible
        (t / d).mkdir()
    run = copy_run(run_tok, t / "run")
    long_dir = t / "long"
    long_dir.mkdir()
    long_corpus = long_dir / ("c" * 236 + ".txt")
    shutil.copy(run_tok.corpus, long_corpus)
    before = md5s(run), md5s(run_tok.data_dir)
    resume = [a for a in run_tok.train if a not in ("--data_dir", run_tok.data_dir)]   # the default data folder, in cwd
    cases = [case("train.py", *run_tok.train, "--out_dir", "", cwd=t / "w1", expect="--out_dir is empty"),
             case("distillation/distill.py", "--init", run_tok.ckpt, "--out_dir", "", cwd=t / "w1",
                  expect="--out_dir is empty"),
             case("train.py", *resume, "--out_dir", run, "--resume", "1", "--block_size", "64", cwd=t / "w2",
                  expect="(block_size changed): --block_size was 32, now 64"),
             case("train.py", *resume, "--out_dir", run, "--resume", "1", "--tokenizer", "sp_train:300", cwd=t / "w2",
                  expect="(tokenizer changed): --tokenizer 'sp_train:300' is another by content"),
             case("prepare.py", "--dataset", run_tok.corpus, "--tokenizer", "sp_train:100", "--block_size", "32",
                  cwd=t / "w3", expect="use --tokenizer sp_train:N with N >= "),
             case("distillation/distill.py", "--init", t / "missing.pt", "--out_dir", t / "w4" / "dcd", cwd=t,
                  expect="no such checkpoint"),
             case("distillation/distill.py", "--init", run_tok.corpus, "--out_dir", t / "w4" / "dcd", cwd=t,
                  expect="cannot read it"),
             case("distillation/distill.py", "--init", run_tok.ckpt, "--data_dir", t / "w5",
                  "--out_dir", t / "w4" / "dcd", cwd=t, expect="meta.json missing"),
             case("prepare.py", "--dataset", long_corpus, "--tokenizer", "sp_train:320", "--block_size", "32",
                  cwd=long_dir, expect=["ok", "train: "])]
    results = run_batches(cases[:4], cases[4:])
    check_last(results)
    assert "character_coverage" not in results[4]["stderr"]
    for d in ("w1", "w2", "w3", "w4", "w5"):          # nothing prepared, no out_dir, no temp folder or lock
        assert os.listdir(t / d) == [], d
    assert (md5s(run), md5s(run_tok.data_dir)) == before
    [folder] = os.listdir(long_dir / "data")          # a valid name: its temp folder's suffix fits too
    assert len(folder.encode()) <= 160 and "~" in folder and os.path.isfile(long_dir / "data" / folder / "meta.json")
