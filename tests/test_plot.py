"""figures/plot.py draws each of the paper's figures from small fabricated run logs, eval_ppl.py and bench/bench.py JSON
(Agg backend, no display), reads the curves back exactly, names the judge, refuses to mix judges, and writes the
table rows. Skipped where matplotlib is not installed (the table test needs no matplotlib)."""
import json
import os

import pytest

from figures import plot
from plumbing.cli import UsageError

JUDGE = "ar:out-ar/ckpt.pt@step1000"


def fabricate(tmp_path, judge=JUDGE):
    """Three run folders with log.jsonl + config.json, their genppl and nelbo evaluations, and a bench.json."""
    runs, evals = [], []
    for i, (loss, eps) in enumerate([("sddlm", 1e-6), ("sddlm_v1", 1e-6), ("sddlm_v1", 1e-3)]):
        d = tmp_path / f"run{i}"
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"train_config": {"loss": loss, "eps": eps}}))
        rows = [{"step": s, "loss": 5.0 - s / 100} for s in (10, 20)]
        rows += [{"step": s, "val_loss": 4.0, "val_nelbo": 5.0 - s / 200 - i, "val_ppl": 150.0 - s / 2 - 10 * i}
                 for s in (25, 50, 75, 100)]
        rows += [{"step": s, "gen_ppl": 900.0 - 5 * s - 50 * i, "gen_entropy": 4.0 + s / 1000 + i / 10,
                  "gen_samples": 32, "gen_steps": 128, "gen_seed": 0, "gen_sampler": "ancestral, final step ancestral",
                  "gen_judge": judge} for s in (25, 50, 75, 100)]
        (d / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(str(d))
        ckpt = str(d / "ckpt.pt")
        g = tmp_path / f"gen{i}.json"
        g.write_text(json.dumps({"metric": "genppl", "ckpt": ckpt, "ckpt_step": 100,
                                 "config": {"seed": 0, "final_step": "ancestral", "top_p": 1.0},
                                 "results": [{"model": ckpt, "steps": s, "samples": 64, "gen_ppl": 1000.0 / s + i,
                                              "entropy": 4.1 + i / 10, "judge": judge} for s in (8, 32, 128)]}))
        n = tmp_path / f"nelbo{i}.json"
        n.write_text(json.dumps({"metric": "nelbo", "ckpt": ckpt, "ckpt_step": 100,
                                 "results": [{"ppl": 160.0 + i, "nll": 5.0}]}))
        evals += [str(g), str(n)]
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({
        "date": "2026-11-23T12:00:00+00:00", "device": "CPU test", "dtype": "float32", "cuda": False, "block_size": 128,
        "bench_config": {"batch_size": 8}, "model": {"params": 1.55e6, "vocab_size": 2048},
        "losses": {n: {"step_ms": 150.0 + 10 * k, "peak_mem_bytes": None, "step_mem_bytes": (90 + k) * 2 ** 20}
                   for k, n in enumerate(["sddlm", "sddlm_v1", "sddlm_v2", "naive", "duo", "ar"])}}))
    return runs, evals, str(bench)


def test_curves_are_read_back_exactly_and_labelled_by_objective(tmp_path):
    runs, _, _ = fabricate(tmp_path)
    c = [plot.training_curves(r) for r in runs]
    assert [x["label"] for x in c] == ["sddlm", "sddlm_v1", "sddlm_v1 (ε=0.001)"]
    assert c[2]["val"] == [(s, 150.0 - s / 2 - 20) for s in (25, 50, 75, 100)]
    assert c[1]["gen"] == [(s, 900.0 - 5 * s - 50, 4.0 + s / 1000 + 0.1) for s in (25, 50, 75, 100)]
    assert c[0]["judges"] == {JUDGE}


def test_table_rows_name_step_judge_sampler_seed_and_eps(tmp_path):
    runs, evals, _ = fabricate(tmp_path)
    gen, nelbo = plot.eval_rows(evals)
    text = plot.tables(gen, nelbo, 32)
    rows = [line for line in text.splitlines() if line.startswith("| sddlm")]
    assert len(rows) == 2 + 2                     # the 2 models at the default ε, then the 2 V1 rows of the ε sweep
    assert f"| sddlm | {1000 / 32:.1f} | 4.10 | 160.0 |" in text
    assert f"`{runs[1]}/ckpt.pt` (100)" in text and f"`{JUDGE}`" in text
    assert "ancestral, 32 steps, final ancestral, top-p 1.0 | 64 | 0 |" in text
    assert f"| sddlm_v1 | 0.001 | {1000 / 32 + 2:.1f} | 4.30 | 162.0 |" in text
    with pytest.raises(UsageError, match="no Gen PPL evaluation at 16"):
        plot.tables(gen, nelbo, 16)


def test_table_cells_carry_the_recorded_standard_errors(tmp_path):
    """Gen PPL, entropy and the NELBO PPL of a table row each ± its standard error, as eval_ppl.py --out records
    them (gen_ppl_se, entropy_se; ppl_se); an evaluation without them (an older file) prints the value alone."""
    ckpt = str(tmp_path / "run" / "ckpt.pt")
    gen = tmp_path / "gen.json"
    gen.write_text(json.dumps({"metric": "genppl", "ckpt": ckpt, "ckpt_step": 9, "config": {"seed": 0},
                               "results": [{"steps": 32, "samples": 16, "gen_ppl": 724.25, "gen_ppl_se": 35.5,
                                            "entropy": 4.5, "entropy_se": 0.0125, "judge": JUDGE}]}))
    nelbo = tmp_path / "nelbo.json"
    nelbo.write_text(json.dumps({"metric": "nelbo", "ckpt": ckpt, "results": [{"ppl": 159.72, "ppl_se": 2.84}]}))
    text = plot.tables(*plot.eval_rows([str(gen), str(nelbo)]), 32)
    assert "| 724.2 ± 35.5 | 4.50 ± 0.01 | 159.7 ± 2.8 |" in text, text


def png_ok(path, min_bytes=8000):
    """A real, non-blank PNG: the signature, a plausible size, and more than one colour in its pixels."""
    import matplotlib.image
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
    assert os.path.getsize(path) > min_bytes, path
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 300 and img[..., :3].std() > 0.05, path


@pytest.mark.slow
def test_every_figure_has_labelled_axes_and_the_judge_in_title(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    runs, evals, bench = fabricate(tmp_path)
    out = tmp_path / "figs"
    import matplotlib.pyplot as plt
    captured, real_save = {}, plot._save

    def spy(fig, out_dir, name, dpi):
        captured[name] = [(ax.get_xlabel(), ax.get_ylabel(), ax.get_title(), ax.get_legend()) for ax in fig.axes]
        captured[name + ":styles"] = [(line.get_marker(), str(line.get_linestyle())) for line in fig.axes[0].lines]
        captured[name + ":suptitle"] = fig._suptitle.get_text() if fig._suptitle else ""
        return real_save(fig, out_dir, name, dpi)
    plot._save = spy
    try:
        assert plot.main(["--runs", ",".join(runs), "--evals", ",".join(evals), "--bench", bench,
                          "--out_dir", str(out)]) == 0
    finally:
        plot._save = real_save
        plt.close("all")
    names = ["training_gen_ppl.png", "training_entropy.png", "training_val_ppl.png", "gen_ppl_vs_steps.png",
             "time_memory.png"]
    printed = capsys.readouterr().out
    for name in names:
        png_ok(out / name)
        assert f"wrote {out / name}" in printed
    for name in names[:4]:
        (xlabel, ylabel, title, legend), = captured[name]
        assert xlabel and ylabel and legend is not None, name
    for name in ("training_gen_ppl.png", "training_entropy.png", "gen_ppl_vs_steps.png"):
        assert "judge: AR out-ar/ckpt.pt, step 1000" in captured[name][0][2], name
    for name in names[:4]:                    # every curve its own marker and dashes: coinciding curves stay visible
        styles = captured[name + ":styles"]
        assert len(styles) == 3 and len(set(m for m, _ in styles)) == len(set(d for _, d in styles)) == 3, name
    assert [lab.get_text() for lab in captured["gen_ppl_vs_steps.png"][0][3].get_texts()] == \
        ["sddlm", "sddlm_v1", "sddlm_v1 (ε=0.001)"]
    assert "(ms)" in captured["time_memory.png"][0][1] and "(MiB)" in captured["time_memory.png"][1][1]
    assert "CPU test" in captured["time_memory.png:suptitle"]


def test_curves_draw_95_percent_bands_and_the_curriculums_end(tmp_path):
    """Every point that the log recorded with a 95% interval is drawn with it as a band (val_ppl_lo..hi; Gen PPL's
    gen_ppl_lo..hi; the entropy's mean -+ 1.96 SE); the step after which a run's curriculum ended (its log's
    "curriculum_end" event, else config.json's curriculum_iters for a log from before the event) is a dotted line
    named in the legend, on the training loss (new: training_loss.png, where the loss jumps) and every curve."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from types import SimpleNamespace
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"train_config": {"loss": "sddlm", "curriculum_iters": 40}}))
    rows = [{"step": s, "loss": 2.1 if s <= 40 else 2.9} for s in range(10, 101, 10)]
    rows.insert(4, {"step": 40, "event": "curriculum_end", "message": "the curriculum ends"})
    rows += [{"step": s, "val_nelbo": 5.0, "val_ppl": 150.0 - s / 2, "val_ppl_lo": 140.0 - s / 2,
              "val_ppl_hi": 161.0 - s / 2} for s in (50, 100)]
    rows += [{"step": s, "gen_ppl": 900.0 - s, "gen_ppl_lo": 850.0 - s, "gen_ppl_hi": 950.0 - s, "gen_entropy": 4.0,
              "gen_entropy_se": 0.05, "gen_samples": 8, "gen_steps": 16, "gen_seed": 0, "gen_sampler": "ancestral",
              "gen_judge": JUDGE} for s in (50, 100)]
    (d / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    old = tmp_path / "old"                                   # a log from before the event: config.json says it
    old.mkdir()
    (old / "config.json").write_text(json.dumps({"train_config": {"loss": "duo", "curriculum_iters": 30}}))
    (old / "log.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0}) + "\n" for s in (10, 50, 90)))
    curves = [plot.training_curves(str(d)), plot.training_curves(str(old))]
    assert curves[0]["curriculum_end"] == 40 and curves[1]["curriculum_end"] == 30
    assert curves[0]["val_band"] == [(50, 115.0, 136.0), (100, 90.0, 111.0)]
    captured, real_save = {}, plot._save

    def spy(fig, out_dir, name, dpi):
        ax = fig.axes[0]
        captured[name] = ([(tuple(line.get_xdata()), line.get_label()) for line in ax.lines if line.get_linestyle() == ":"],
                          [c.get_paths()[0].vertices for c in ax.collections])
        return real_save(fig, out_dir, name, dpi)
    plot._save = spy
    try:
        written = plot.plot_training(curves, SimpleNamespace(out_dir=str(tmp_path), dpi=60))
    finally:
        plot._save = real_save
        plt.close("all")
    assert sorted(os.path.basename(w) for w in written) == ["training_entropy.png", "training_gen_ppl.png",
                                                            "training_loss.png", "training_val_ppl.png"]
    for name in captured:
        marks = {x[0]: label for x, label in captured[name][0]}
        assert marks[40].startswith("curriculum ends after step 40"), (name, marks)
        assert (30 in marks) == (name == "training_loss.png"), name      # the old run has a loss curve only
    bands = {name: captured[name][1] for name in captured}
    assert len(bands["training_loss.png"]) == 0
    for name, lo, hi in (("training_val_ppl.png", (115.0, 90.0), (136.0, 111.0)),
                         ("training_gen_ppl.png", (800.0, 750.0), (900.0, 850.0)),
                         ("training_entropy.png", (4.0 - 1.96 * 0.05,) * 2, (4.0 + 1.96 * 0.05,) * 2)):
        (vertices,) = bands[name]
        assert vertices[:, 1].min() == pytest.approx(min(lo)) and vertices[:, 1].max() == pytest.approx(max(hi)), name
        assert set(vertices[:, 0].tolist()) == {50.0, 100.0}, name


def test_runs_of_different_judges_are_never_drawn_together(tmp_path):
    pytest.importorskip("matplotlib")
    runs, _, _ = fabricate(tmp_path / "a")
    other, _, _ = fabricate(tmp_path / "b", judge="hf:gpt2-large")
    with pytest.raises(UsageError, match="different judges"):
        plot.main(["--runs", f"{runs[0]},{other[1]}", "--out_dir", str(tmp_path / "figs")])


def test_judges_are_named_by_folder_and_step_not_whole_path():
    assert plot.judge_label("ar:/work/runs/issue10/tiny/ar/ckpt.pt@step1000") == "AR ar/ckpt.pt, step 1000"
    assert plot.judge_label("ar:/home/me/out-ar/model@step20") == "AR out-ar/model, step 20"
    assert plot.judge_label("hf:gpt2-large") == "gpt2-large"


def draw_gen_ppl_vs_steps(evals, tmp_path, only_128):
    """plot_gen_ppl_vs_steps on the fabricated evaluations, those of `only_128` (indices) cut to 128 steps ->
    its axes, as (legend labels, lines' (x, y, linestyle), title, x tick labels) each."""
    for i in only_128:
        e = json.loads(open(evals[i]).read())
        e["results"] = [r for r in e["results"] if r["steps"] == 128]
        open(evals[i], "w").write(json.dumps(e))
    gen, _ = plot.eval_rows(evals[::2])
    captured, real_save = [], plot._save
    plot._save = lambda fig, out_dir, name, dpi: captured.extend(
        ([t.get_text() for t in ax.get_legend().get_texts()],
         [(list(line.get_xdata()), list(line.get_ydata()), line.get_linestyle()) for line in ax.lines],
         ax.get_title(), [t.get_text() for t in ax.get_xticklabels()]) for ax in fig.axes)
    try:
        plot.plot_gen_ppl_vs_steps(gen, plot.PlotConfig(out_dir=str(tmp_path)))
    finally:
        plot._save = real_save
    return captured


def test_a_model_at_one_step_count_says_so_in_the_legend(tmp_path):
    pytest.importorskip("matplotlib")
    _, evals, _ = fabricate(tmp_path)
    (labels, lines, _, ticks), = draw_gen_ppl_vs_steps(evals, tmp_path, only_128=[0])
    assert labels == ["sddlm, at 128 steps only", "sddlm_v1", "sddlm_v1 (ε=0.001)"]
    assert lines[0] == ([128], [1000 / 128], "None")          # a lone point, with no line in its legend entry
    assert ticks == ["8", "32", "128"]


def test_an_eps_sweep_at_one_step_count_gets_an_eps_panel(tmp_path):
    pytest.importorskip("matplotlib")
    _, evals, _ = fabricate(tmp_path)
    steps_panel, eps_panel = draw_gen_ppl_vs_steps(evals, tmp_path, only_128=[4])   # V1 at ε = 1e-3: 128 only
    assert steps_panel[0] == ["sddlm", "sddlm_v1"]
    labels, lines, title, ticks = eps_panel
    # V1 at its default ε (run 1) and at ε = 1e-3 (run 2), both at 128 steps: fabricate's 1000 / steps + run
    v1_style = steps_panel[1][1][2]                            # drawn as V1 is in the steps panel
    assert labels == ["sddlm_v1, 128 steps"] and lines == [([1e-6, 1e-3], [1000 / 128 + 1, 1000 / 128 + 2], v1_style)]
    assert "at 128 sampling steps" in title and ticks == ["1e-06 (default)", "0.001"]


def test_torn_and_garbage_log_lines_are_skipped_and_counted(tmp_path):
    runs, _, _ = fabricate(tmp_path)
    log = os.path.join(runs[0], "log.jsonl")
    good = open(log, "rb").read()
    lines = good.split(b"\n")
    garbage = [b"not json at all", b'[1, 2]', b'{"step": "7", "val_ppl": 1.0}', b'{"step": 80, "gen_ppl": 5.0}',
               b"\xff\xfe"]
    torn = b"\n".join(lines[:3] + garbage + lines[3:]) + b'{"step": 1' + b"\0" * 40
    open(log, "wb").write(torn)
    records, skipped = plot.read_log(log)
    assert skipped == [4, 5, 6, 7, 8, 16]                 # the 5 garbage lines and the NUL-torn last one
    open(log, "wb").write(good)
    assert records == plot.read_log(log)[0] and plot.read_log(log)[1] == []


@pytest.mark.slow
def test_plot_script_on_real_world_logs_and_wrong_schemas(tmp_path):
    """Through the real script: a torn log is drawn with one line counting what was skipped (exit 0); an input
    file of the wrong shape is one error line, exit 2."""
    import subprocess
    import sys
    pytest.importorskip("matplotlib")
    runs, evals, bench = fabricate(tmp_path)
    with open(os.path.join(runs[0], "log.jsonl"), "ab") as f:
        f.write(b"garbage\n" + b'{"step": 30, "loss"' + b"\0" * 64)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root

    def plot_py(*argv):
        p = subprocess.run([sys.executable, os.path.join(here, "figures/plot.py"), *argv, "--out_dir", str(tmp_path / "f")],
                           capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return p.returncode, p.stderr.strip().splitlines()
    code, err = plot_py("--runs", ",".join(runs))
    assert code == 0 and len(err) == 1 and "skipped 2 unreadable line(s)" in err[0] and "line 11, 12" in err[0], err
    assert os.path.getsize(tmp_path / "f" / "training_val_ppl.png") > 8000
    wrong = {"list.json": [], "results.json": {"metric": "genppl", "results": {}},
             "rows.json": {"metric": "genppl", "results": [{"steps": 8}]}}
    for name, content in wrong.items():
        (tmp_path / name).write_text(json.dumps(content))
        code, err = plot_py("--evals", str(tmp_path / name))
        assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {tmp_path / name}: "), (name, err)
    (tmp_path / "bench_list.json").write_text("[]")
    (tmp_path / "run_bad").mkdir()
    (tmp_path / "run_bad" / "config.json").write_text("[]")
    (tmp_path / "run_bad" / "log.jsonl").write_text("")
    for argv, words in [(("--bench", str(tmp_path / "bench_list.json")), "not a bench/bench.py --json 1 output"),
                        (("--runs", str(tmp_path / "run_bad")), "not a train.py config.json")]:
        code, err = plot_py(*argv)
        assert code == 2 and len(err) == 1 and words in err[0], (argv, err)


def plot_script(*argv, cwd):
    """python figures/plot.py ARGV, the real script, run in cwd -> (exit code, stdout, stderr lines)."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.join(here, "figures", "plot.py"), *map(str, argv)], cwd=cwd,
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    return p.returncode, p.stdout, p.stderr.strip().splitlines()


def test_figures_go_beside_the_runs_replacing_only_when_asked(tmp_path):
    """Issue 31: plot.py wrote into the repository's figures/ by default, over its committed PNGs. Now the default
    is plots/ beside the data, and a file that exists is refused in one line (nothing written) unless --overwrite 1."""
    pytest.importorskip("matplotlib")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs, evals, bench = fabricate(tmp_path / "exp")
    work = tmp_path / "work"                    # the working directory: nothing may land in it
    work.mkdir()
    committed = {name: open(os.path.join(here, "figures", name), "rb").read()
                 for name in os.listdir(os.path.join(here, "figures")) if name.endswith(".png")}
    listing = sorted(os.listdir(os.path.join(here, "figures")))
    code, out, err = plot_script("--runs", runs[0], cwd=work)
    assert code == 0, err
    assert sorted(os.listdir(os.path.join(runs[0], "plots"))) == ["training_entropy.png", "training_gen_ppl.png",
                                                                  "training_loss.png", "training_val_ppl.png"]
    code, out, err = plot_script("--runs", ",".join(runs), "--bench", bench, cwd=work)    # several: their parent
    assert code == 0 and sorted(os.listdir(tmp_path / "exp" / "plots")) == [
        "time_memory.png", "training_entropy.png", "training_gen_ppl.png", "training_loss.png",
        "training_val_ppl.png"], err
    code, out, err = plot_script("--evals", evals[0], cwd=work)                          # beside the evaluation
    assert code == 0 and os.listdir(tmp_path / "exp" / "plots") and (tmp_path / "exp" / "plots" /
                                                                       "gen_ppl_vs_steps.png").exists()
    assert os.listdir(work) == []
    # an existing file: refused in one line, nothing written, unless --overwrite 1
    plots = os.path.join(runs[0], "plots")
    before = {p: os.path.getmtime(os.path.join(plots, p)) for p in os.listdir(plots)}
    code, out, err = plot_script("--runs", runs[0], "--evals", ",".join(evals), "--table", tmp_path / "table.md",
                                 cwd=work)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "--overwrite 1" in err[0], err
    assert "training_gen_ppl.png" in err[0] and not os.path.exists(os.path.join(plots, "gen_ppl_vs_steps.png"))
    assert before == {p: os.path.getmtime(os.path.join(plots, p)) for p in before}
    assert not (tmp_path / "table.md").exists()
    # --overwrite 1 replaces what figures/plot.py wrote (the PNGs above), never a file of the user's (issue 38), so
    # a user's file is refused alike with or without it, and the refusal names no --overwrite 1
    (tmp_path / "table.md").write_text("my table")
    for overwrite in ([], ["--overwrite", "1"]):
        code, out, err = plot_script("--runs", runs[0], "--evals", ",".join(evals), "--table",
                                     tmp_path / "table.md", *overwrite, cwd=work)
        assert code == 2 and err == [f"error: --table {tmp_path / 'table.md'} exists and was not written by sddlm, "
                                     f"so it is not replaced; move it away or choose another --table"], err
    assert (tmp_path / "table.md").read_text() == "my table"
    assert before == {p: os.path.getmtime(os.path.join(plots, p)) for p in before}
    os.remove(tmp_path / "table.md")
    for _ in range(2):                  # a new table, then the same one replaced
        code, out, err = plot_script("--runs", runs[0], "--evals", ",".join(evals), "--table", tmp_path / "table.md",
                                     "--overwrite", "1", cwd=work)
        assert code == 0 and (tmp_path / "table.md").read_text().split("\n", 1)[1].startswith("|"), err
    assert (tmp_path / "table.md").read_text().startswith("<!-- written by sddlm figures/plot.py")
    assert (tmp_path / "exp" / "run0" / "plots" / "gen_ppl_vs_steps.png").exists()
    assert committed == {name: open(os.path.join(here, "figures", name), "rb").read() for name in committed}
    assert sorted(os.listdir(os.path.join(here, "figures"))) == listing        # the repository's figures/ untouched


@pytest.mark.slow
def test_a_finished_run_names_the_command_drawing_its_curves(tmp_path):
    """train.py's last lines name figures/plot.py (and tensorboard --logdir when --tensorboard 1 logged the run);
    the named plot command, run as printed, draws the run's curves beside it."""
    import shlex
    import subprocess
    import sys
    pytest.importorskip("matplotlib")
    pytest.importorskip("tensorboard")
    from test_train import TINY
    from conftest import write_corpus
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    write_corpus(tmp_path / "corpus.txt")
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "train.py", *TINY, "--dataset", tmp_path / "corpus.txt", "--data_dir",
                        tmp_path / "data", "--out_dir", out, "--max_iters", "4", "--eval_interval", "2",
                        "--tensorboard", "1"], cwd=here, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    curves = p.stdout.strip().splitlines()[-1]
    assert curves == (f"  curves:       python figures/plot.py --runs {out} (PNGs in {out / 'plots'}); "
                      f"tensorboard --logdir {out / 'tensorboard'}")
    command = shlex.split(curves.split("curves:", 1)[1].split(" (PNGs")[0])
    assert command[:2] == ["python", "figures/plot.py"]
    r = subprocess.run([sys.executable, *command[1:]], cwd=here, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and (out / "plots" / "training_val_ppl.png").exists(), r.stderr
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(out / "tensorboard"))
