"""--help teaches: every flag of every script is described and grouped from one place, its config dataclass's
source comments (cli.field_help), and `--preset NAME --help` shows what a preset sets."""
import dataclasses
import glob
import importlib
import json
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


def test_field_help_reads_groups_and_inheritance_from_source():
    docs, groups = field_help(Child)
    assert docs == {"top": ("above every group", None), "lr": ("a new default, a new description", "optimisation"),
                    "tag": ("a '#' inside a default stays the default", "optimisation"),
                    "device": ("auto | cpu | cuda (continued)", "runtime"), "seed": ("", "runtime"),
                    "data": ("the corpus", "data"), "threads": ("CPU threads", "runtime")}
    # the subclass's own groups first, then its bases'; equal titles are one group with the base's description
    assert groups == [("data", None), ("optimisation", None), ("runtime", "where the run happens")]
    assert field_help(Base)[0]["lr"] == ("the learning rate", "optimisation")
    assert Child().tag == "a#b" and Child().seed == 3


def test_help_shows_the_scripts_defaults_and_a_presets_values(capsys, monkeypatch):
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
    assert "the training objective: sddlm | sddlm_v1" in groups["preset and objective"].split("--loss LOSS")[1]
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


def test_train_help_shows_the_values_the_run_will_use(capsys, monkeypatch):
    """Issue 36: `python train.py --help` showed defaults the run does not use (max_iters 1000, lr 0.001, ema 0.999,
    curriculum_iters 0, where it trains 900, 0.002, 0 and 450), and `--preset tiny --help` two widths (96 and 128).
    Every flag's help shows the value the run takes without it: the default preset's (tiny, or small for a
    torchrun launch on CUDA), with the curriculum's share of the run applied; the tiny width is set in one place."""
    import torch
    import train
    from model import ModelConfig
    from plumbing import cli
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)

    def help_of(argv):
        with pytest.raises(SystemExit) as e:
            train.parse_config(argv + ["--help"])
        assert e.value.code == 0
        return capsys.readouterr().out

    def check(argv, preset):
        run, flags = train.parse_config(argv), flag_help(help_of(argv))[0]
        assert run.preset == preset
        given = {a[2:] for a in argv if a.startswith("--")}                   # these show their defaults
        wrong = {f.name: flags[f.name] for f in dataclasses.fields(run) if f.name not in given
                 and not flags[f.name].endswith(f"(default {cli._show(getattr(run, f.name))})")}
        assert not wrong, wrong
        return run
    run = check([], "tiny")                                                   # python train.py
    assert (run.max_iters, run.lr, run.ema, run.curriculum_iters) == (900, 0.002, 0.0, 450)
    assert check(["--device", "cpu"], "tiny") == dataclasses.replace(run, device="cpu")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")                          # torchrun train.py, on CUDA
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(cli, "resolve_device", lambda name: torch.device("cpu" if name == "cpu" else "cuda"))
    flagship = check([], "small")
    assert (flagship.max_iters, flagship.curriculum_iters, flagship.block_size) == (1_000_000, 500_000, 1024)
    assert check(["--device", "cpu"], "tiny") == dataclasses.replace(run, device="cpu")
    text = " ".join(help_of(["--preset", "tiny", "--device", "cpu"]).split())
    assert re.findall(r"n_embd\W+(\d+)", text) == ["0", "96"]                # the flag (0 = the preset's), the model
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"block_size", "vocab_size", "dropout"}
    assert not {k for recipe in train.TRAIN_PRESETS.values() for k in recipe} & model_fields   # widths: model.PRESETS


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


SCRIPTS = ["train.py", "sample.py", "eval_ppl.py", "prepare.py", "distillation/distill.py",
           "downstream/eval_downstream.py", "bench/bench.py", "bench/bench_prepare.py", "figures/plot.py",
           "hub/pretrained.py"]


def code_words():
    """What a help text must not show a user: the repository's module-level constants (ALL_CAPS names assigned at
    the top of a .py file), its function names, and references module.name into its own modules."""
    constants, functions, modules = set(), set(), set()
    for path in glob.glob(os.path.join(HERE, "*.py")) + glob.glob(os.path.join(HERE, "*", "*.py")):
        if os.path.relpath(path, HERE).startswith("tests"):
            continue
        source = open(path).read()
        constants |= set(re.findall(r"^([A-Z][A-Z0-9]*_[A-Z0-9_]+|[A-Z]{4,}S)\s*[:=]", source, flags=re.M))
        functions |= {f for f in re.findall(r"^\s*def ([a-z]\w*_\w+)\(", source, flags=re.M)}
        modules.add(os.path.basename(path)[:-3])
    return constants, functions, modules


def help_problems(script, text, flags, zero_one=()):
    """The faults of one --help text: code names, True/False for 0/1 flags, '(default 0)' with no word on 0.
    flags: {flag: its help}; zero_one: the flags that take 0/1."""
    constants, functions, modules = code_words()
    # flag names, lm-eval's request types, the paper's symbols
    functions -= set(flags) | {"generate_until", "loglikelihood_rolling", "x_theta"}
    # the flags' own metavars (--n_layer N_LAYER) and environment variables ($OMP_NUM_THREADS) are not code names
    plain = re.sub(r"--(\w+)\s+\1\b", r"--\1", text, flags=re.I)
    plain = re.sub(r"\$[A-Z_]+", "", plain)
    words = set(re.findall(r"\b[A-Z][A-Z0-9_]*_[A-Z0-9_]+\b|\b[A-Z]{4,}S\b", plain))
    problems = [f"{script}: code name {w}" for w in sorted(words & constants)]
    problems += [f"{script}: underscore constant {w}" for w in sorted(set(re.findall(r"\b[A-Z]+_[A-Z_]+\b", plain)))]
    names = set(re.findall(r"\b[a-z]\w*_\w+\b", plain))
    problems += [f"{script}: function name {w}" for w in sorted(names & functions)]
    dotted = re.findall(r"\b(\w+)\.(?!py\b|pt\b|jsonl?\b|txt\b|md\b|model\b|safetensors\b)[A-Za-z_]\w*", plain)
    problems += [f"{script}: code reference {m}" for m in dotted if m in modules]
    problems += [f"{script}: {w} for a 0/1 flag" for w in re.findall(r"\((?:True|False)\)|\bTrue\b|\bFalse\b", text)]
    for flag, help_line in flags.items():          # a 0/1 flag's 0 is off; a seed's 0 is one seed among others
        if flag in zero_one or flag.endswith("seed"):
            continue
        if re.search(r"\(default 0\)$", help_line) and not re.search(r"\b0\s*(=|:|means)|\(0\b", help_line):
            problems.append(f"{script}: --{flag} says nothing of what its default 0 means: {help_line!r}")
    return problems


def flag_help(text):
    """--help output -> ({flag: its whole help text, unwrapped}, the flags that take 0/1)."""
    out, zero_one, flag = {}, set(), None
    for line in text.splitlines():
        m = re.match(r"\s+--(\w+)(?: (\S+))?(?:\s{2,}(.*))?$", line)
        if m:
            flag = m.group(1)
            out[flag] = (m.group(3) or "").strip()
            if m.group(2) == "[0|1]":
                zero_one.add(flag)
        elif flag and line.startswith(" " * 10) and line.strip():
            out[flag] = (out[flag] + " " + line.strip()).strip()
        else:
            flag = None
    return out, zero_one


HELP_RUNNER = """
import contextlib, io, json, os, runpy, sys
out = {}
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code
    out[script] = [code, buf.getvalue()]
print(json.dumps(out))
"""


def every_help(scripts=SCRIPTS, columns=120):
    """Each script's --help exactly as `python SCRIPT --help` prints it (its __main__ run in one process, so
    torch is imported once) -> {script: text}."""
    r = subprocess.run([sys.executable, "-c", HELP_RUNNER, *scripts], cwd=HERE, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "COLUMNS": str(columns), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for script, (code, text) in out.items():
        assert code in (0, None) and text.startswith("usage:"), (script, code, text[-2000:])
    return {script: text for script, (code, text) in out.items()}


def test_every_scripts_help_speaks_the_users_words():
    """Issue 31: help texts named code (LOCAL_FORMATS, HF_CORPORA, TRAIN_PRESETS, OBJECTIVES,
    model.PRESETS[preset], diffusion.default_final_step, ...), showed (True)/(False) for flags that take 0/1, and
    '(default 0)' with no word on what 0 means. Every script's --help, as a user runs it."""
    helps = every_help()
    problems = []
    for script, text in helps.items():
        flags, zero_one = flag_help(text)
        assert len(flags) >= 3, (script, text)
        problems += help_problems(script, text, flags, zero_one)
    assert not problems, "\n".join(problems)
    preset, _ = flag_help(helps["train.py"])      # and --preset says what a torchrun launch on CUDA trains
    assert "tiny" in preset["preset"] and "small for a torchrun launch on CUDA" in preset["preset"], preset["preset"]


def test_the_help_checker_finds_what_the_old_help_texts_showed():
    """help_problems on lines of the help texts of main 283effe: each fault is found, the fixed lines pass."""
    old = {"--dataset": "pydoc (built in) | a local corpus (LOCAL_FORMATS) | a name in HF_CORPORA (default pydoc)",
           "--preset": "tiny | owt (= small) | lm1b | medium | large (model + recipe), TRAIN_PRESETS (default tiny)",
           "--loss": "a key of OBJECTIVES: sddlm | sddlm_v1 (default sddlm)",
           "--bench_preset": "model preset (model.PRESETS) and training recipe (default tiny)",
           "--final_step": "ancestral | greedy | none | auto (by objective: default_final_step) (default auto)",
           "--wrap": "OWT-style packing (True) or LM1B-style per-sentence padding (False) (default 1)",
           "--n_layer": "Transformer blocks (default 0)"}
    for flag, line in old.items():
        text = f"  {flag} {flag[2:].upper()}  {line}\n"
        assert help_problems("old", text, {flag[2:]: line}), line
    fixed = {"n_layer": "Transformer blocks (0 = from the preset) (default 0)",
             "threads": "CPU threads; 0 = $OMP_NUM_THREADS or idle cores (default 0)",
             "wrap": "1: pack documents into full blocks; 0: one padded sequence per sentence (default 1)",
             "compile": "torch.compile the model (default 0)", "seed": "seeds the noise (default 0)"}
    text = "".join(f"  --{k} {k.upper()}  {v}\n" for k, v in fixed.items())
    assert help_problems("new", text, fixed, {"wrap", "compile"}) == []


def test_lm_eval_sddlm_help_is_the_harness_help_then_sddlms():
    """Issue 31: `python -m downstream.lm_eval_sddlm --help` printed only lm-eval's help. Now lm-eval's own, then
    the sddlm model's arguments (pretrained=/ckpt=, mc_draws=, ...) in the users' words; exit 0; no network probe."""
    pytest.importorskip("lm_eval", reason="lm-eval is optional (pip install lm-eval) and not installed here")
    for argv in (["--help"], ["run", "--help"]):
        r = subprocess.run([sys.executable, "-m", "downstream.lm_eval_sddlm", *argv], cwd=HERE, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0 and r.stderr == "", (argv, r.stderr[-2000:])
        harness, _, ours = r.stdout.partition("\nsddlm model (--model sddlm):\n")
        assert harness.startswith("usage: lm-eval") and ours, (argv, r.stdout[-3000:])
        assert ("--num_fewshot" in harness) == (argv[0] == "run")        # the harness's own help of that command
        for words in ("pretrained=PATH is the same argument", "ckpt=out/ckpt.pt", "mc_draws=128", "cfg_w=0",
                      "--batch_size is Monte Carlo draws per forward", "loglikelihood_rolling"):
            assert words in ours, words
        from downstream.lm_eval_adapter import MODEL_ARGS           # its argument names are the users' words here
        assert help_problems("lm_eval_sddlm", ours, dict.fromkeys(MODEL_ARGS, "")) == []


def bar_states(stderr, desc):
    """Every state a tqdm bar `desc` printed (carriage returns and newlines both end one) -> [(percent or None,
    done, total or None, has an ETA)]."""
    states = []
    for line in re.split(r"[\r\n]", stderr):
        line = line.strip()
        if not line.startswith(desc + ":"):
            continue
        m = re.match(re.escape(desc) + r":\s+(\d+)%\|[^|]*\| ([\d.]+[kMG]?)/([\d.]+[kMG]?) \[[\d:]+<([\d:?]+)", line)
        if m:
            states.append((int(m.group(1)), m.group(2), m.group(3), m.group(4) != "?"))
        else:
            states.append((None, line, None, False))        # a bar without a total: "train: 466kB [00:01, ...]"
    return states


def run_py(*argv):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"}
    env.pop("TQDM_DISABLE", None)
    return subprocess.run([sys.executable, *map(str, argv)], cwd=HERE, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_progress_bars_have_a_total_reach_it_and_show_an_eta(tmp_path):
    """Issue 31: prepare.py's byte bar had no total on the built-in corpus and stopped short of 100% on a .jsonl
    (its total was the file's bytes, JSON syntax included); eval_ppl.py's NELBO loop had no total and no ETA."""
    import torch
    from dataclasses import asdict
    from model import ModelConfig, build_model
    records = tmp_path / "c.jsonl"
    with open(records, "w") as f:            # ~0.9 MB of text in 1.7 MB of JSON: the bar counts the text
        for i in range(6000):
            f.write(json.dumps({"text": f"record {i}: " + "wörd " * (i % 50), "id": i}) + "\n")
    for dataset, folder in (("pydoc", tmp_path / "pydoc"), (records, tmp_path / "records")):
        r = run_py("prepare.py", "--dataset", dataset, "--tokenizer", "gpt2", "--data_dir", folder, "--num_proc", "1")
        assert r.returncode == 0, r.stderr[-2000:]
        states = bar_states(r.stderr, "train")
        assert states and all(s[2] is not None for s in states), (dataset, states)     # a total, from the start
        assert states[-1][0] == 100 and states[-1][1] == states[-1][2], (dataset, states[-1])
        assert len({s[2] for s in states}) <= 2, states        # the total was right, or put right at the end
    data_meta = json.load(open(tmp_path / "pydoc" / "meta.json"))
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=data_meta["vocab_size"], block_size=128, n_layer=1, n_head=2, n_embd=32, cond_dim=16)
    torch.save({"model": build_model(mc).state_dict(), "model_config": asdict(mc),
                "train_config": {"loss": "sddlm", "noise_schedule": "loglinear"}, "step": 1,
                "meta": {k: data_meta[k] for k in ("tokenizer", "tokenizer_sha256", "vocab_size", "bos_id", "eos_id",
                                                   "pad_id") if k in data_meta}}, tmp_path / "ckpt.pt")
    r = run_py("eval_ppl.py", "--ckpt", tmp_path / "ckpt.pt", "--data_dir", tmp_path / "pydoc", "--batch_size", "2",
               "--max_batches", "12", "--device", "cpu", "--max_rounds", "2")   # an untrained model never reaches
    assert r.returncode == 0, r.stderr[-2000:]                                     # --rel_se: 30 more rounds, ~8 min
    states = bar_states(r.stderr, "nelbo rounds 1-2")                           # its two rounds, in one pass
    assert states and all(s[2] == "24" for s in states), states            # 12 batches of 2: 24 sequences
    assert any(s[3] for s in states), states                                   # an ETA once the first batch ran
