"""reproduce.sh end to end at a toy size: the AR judge, the four objectives with Gen PPL curves logged during
training, an ε run, every evaluation, the table rows and the figures; a second invocation skips everything."""
import os
import subprocess

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
TOY = ("--max_iters 6 --eval_interval 3 --ckpt_interval 3 --eval_iters 1 --n_layer 1 --n_embd 32 --n_head 2 "
       "--batch_size 4 --block_size 32")


@pytest.mark.slow
def test_tiny_writes_the_table_and_figures_and_reruns_for_free(tmp_path):
    pytest.importorskip("matplotlib")          # the report stage draws the figures
    env = {**os.environ, "RUNS": str(tmp_path / "runs"), "TRAIN_EXTRA": TOY, "SAMPLES": "4", "PAR": "2",
           "EPS_LOSSES": "sddlm_v1", "EPS_VALUES": "1e-3", "OMP_NUM_THREADS": "1"}
    stages = ["judge", "train", "eps", "eval", "report"]
    first = subprocess.run(["bash", "reproduce.sh", "tiny", *stages], cwd=HERE, env=env, capture_output=True,
                           text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    runs = tmp_path / "runs"
    table = (runs / "table.md").read_text()
    for loss in ("duo", "sddlm", "sddlm_v1", "sddlm_v2"):
        assert f"| {loss} |" in table and f"`{runs / loss / 'ckpt.pt'}` (6)" in table
    assert f"`ar:{runs / 'ar' / 'ckpt.pt'}@step6`" in table and "| sddlm_v1 | 0.001 |" in table
    assert "ancestral, 128 steps, final ancestral, top-p 1.0 | 4 | 0 |" in table
    with open(runs / "sddlm" / "log.jsonl") as f:
        assert '"gen_ppl"' in f.read()                          # the curve was logged during training
    for name in ("training_gen_ppl", "training_entropy", "training_val_ppl", "gen_ppl_vs_steps"):
        assert (runs / "figures" / f"{name}.png").stat().st_size > 5000
    again = subprocess.run(["bash", "reproduce.sh", "tiny", *stages[:-1]], cwd=HERE, env=env, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    lines = again.stdout.strip().splitlines()
    assert lines and all(line.startswith("skip") for line in lines), again.stdout
