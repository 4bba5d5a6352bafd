"""--help teaches: every flag of every script is described and grouped from one place, its config dataclass's
source comments (cli.field_help), and `--preset NAME --help` shows what a preset sets."""
import dataclasses
import glob
import importlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from plumbing.cli import field_help, parse_flags

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root


def script_configs():
    """(script, its config dataclass) for every parse_flags(Config, ...) call in the repository's scripts."""
    found = []
    for path in sorted(glob.glob(os.path.join(HERE, "*.py")) + glob.glob(os.path.join(HERE, "*", "*.py"))):
        script = os.path.relpath(path, HERE)
        if script.startswith(("tests", "tools")):
            continue
        with open(path) as f:
            for name in re.findall(r"parse_flags\((\w+)", f.read()):
                module = importlib.import_module(script[:-3].replace(os.sep, "."))
                if name != "cls":
                    found.append((script, getattr(module, name)))
    return found


def test_every_flag_of_every_script_has_a_description():
    configs = script_configs()
    assert {script for script, _ in configs} >= {"train.py", "distillation/distill.py", "sample.py", "eval_ppl.py",
                                                 "downstream/eval_downstream.py", "prepare.py", "hub/pretrained.py", "bench/bench.py",
                                                 "bench/bench_prepare.py", "figures/plot.py"}
    missing = [f"{script}: --{f.name}" for script, cls in configs for f in dataclasses.fields(cls)
               if not field_help(cls)[0].get(f.name, ("", None))[0]]
    assert not missing, "flags without a '# description' on their line: " + ", ".join(missing)


@dataclass
class Base:
    """A docstring with a # that is not a comment."""
    top: int = 1                     # above every group
    # optimisation
    lr: float = 1e-3                 # the learning rate
    tag: str = "a#b"                 # a '#' inside a default stays the default
    # runtime
    # where the run happens
    device: str = "auto"             # auto | cpu
                                     # | cuda (continued)
    seed: int = 0


@dataclass
class Child(Base):
    # data
    data: str = ""                   # the corpus
    lr: float = 1e-4                 # a new default, a new description
    seed: int = 3
    # runtime
    threads: int = 0                 # CPU threads


def test_field_help_reads_descriptions_groups_and_inheritance_from_the_source():
    docs, groups = field_help(Child)
    assert docs == {"top": ("above every group", None), "lr": ("a new default, a new description", "optimisation"),
                    "tag": ("a '#' inside a default stays the default", "optimisation"),
                    "device": ("auto | cpu | cuda (continued)", "runtime"), "seed": ("", "runtime"),
                    "data": ("the corpus", "data"), "threads": ("CPU threads", "runtime")}
    # the subclass's own groups first, then its bases'; equal titles are one group with the base's description
    assert groups == [("data", None), ("optimisation", None), ("runtime", "where the run happens")]
    assert field_help(Base)[0]["lr"] == ("the learning rate", "optimisation")
    assert Child().tag == "a#b" and Child().seed == 3


def test_help_shows_the_scripts_own_defaults_and_a_presets_values(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    presets = {"tiny": {}, "big": {"lr": 0.5, "data": "owt"}}

    @dataclass
    class WithPreset(Child):
        preset: str = "tiny"             # tiny | big

    def help_of(argv):
        with pytest.raises(SystemExit) as e:
            parse_flags(WithPreset, argv + ["--help"], presets=presets)
        assert e.value.code == 0
        return " ".join(capsys.readouterr().out.split())      # unwrapped
    text = help_of([])
    assert "--lr LR a new default, a new description (default 0.0001)" in text
    assert "--seed SEED default 3" in text and "--preset NAME --help shows the values NAME sets" in text
    text = help_of(["--preset", "big"])
    assert "--lr LR a new default, a new description (--preset big: 0.5; default 0.0001)" in text
    assert "--preset big sets: lr=0.5, data=owt" in text
    assert parse_flags(WithPreset, ["--preset", "big", "--lr", "0.25"], presets=presets).lr == 0.25


def sections(help_text):
    """--help output -> {group title: the text of its flags}."""
    out, title = {}, None
    for line in help_text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            out[title] = ""
        elif title is not None:
            out[title] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in out.items()}


def test_train_help_describes_and_groups_its_flags():
    env = {**os.environ, "COLUMNS": "200"}
    r = subprocess.run([sys.executable, "train.py", "--help"], cwd=HERE, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    groups = sections(r.stdout)
    assert "a key of OBJECTIVES: sddlm | sddlm_v1" in groups["preset and objective"].split("--loss LOSS")[1]
    assert "--block_size BLOCK_SIZE sequence length L (default 128)" in groups["data"]
    assert "--lr LR peak AdamW learning rate" in groups["optimisation"]
    assert "--eval_interval EVAL_INTERVAL validation loss and NELBO PPL" in groups["evaluation, logging, checkpoints"]
    assert "--keep_every" in groups["evaluation, logging, checkpoints"]        # a TrainConfig field, a base's group
    assert "--device DEVICE auto | cpu | cuda (default auto)" in groups["runtime"]
    assert "--curriculum_iters" in groups["Duo's Gaussian-guided curriculum"]
    r = subprocess.run([sys.executable, "train.py", "--preset", "small", "--help"], cwd=HERE, env=env,
                       capture_output=True, text=True, timeout=120)
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "sequence length L (--preset small: 1024; default 128)" in text
    assert "--preset small sets: dataset=openwebtext, tokenizer=gpt2, block_size=1024" in text
    assert "n_layer=12, n_head=12, n_embd=768" in text                             # its model, from model.PRESETS


def test_distill_help_shows_distills_own_defaults(capsys, monkeypatch):
    from distillation import distill
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        distill.parse_config(["--help"])
    groups = sections(capsys.readouterr().out)
    assert "--lr LR peak AdamW learning rate, reached after warmup_iters (default 0.0001)" in groups["optimisation"]
    assert "--out_dir OUT_DIR the run's folder" in groups["evaluation, logging, checkpoints"]
    assert "(default out-dcd)" in groups["evaluation, logging, checkpoints"]
    assert "--init INIT the model to distil" in groups["the model to distil"]
