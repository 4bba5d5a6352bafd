"""README.md and docs/ say what is true: every relative link resolves (to a file, and to a heading where it names
one), every script a command block runs exists, README's install and test lines are the ones CI runs, and README
stays a card (at most 250 lines; the long pages live in docs/)."""
import glob
import math
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
PAGES = ["README.md", "RESULTS.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/docs/*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
EXTERNAL_MODULES = {"pytest", "pip", "venv", "torch.distributed.run"}


def read(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def slug(heading):
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page):
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", FENCE.sub("", read(page)), re.M)}


def bash_blocks(page):
    return [m.group(1) for m in re.finditer(r"^```bash\n(.*?)^```", read(page), re.M | re.S)]


def commands(page):
    """Each command of the page's bash blocks, comments dropped and continuation lines joined."""
    out = []
    for block in bash_blocks(page):
        for cmd in block.replace("\\\n", " ").splitlines():
            cmd = cmd.split(" #")[0].strip()
            if cmd and not cmd.startswith("#"):
                out.append(cmd)
    return out


def test_the_pages_exist():
    assert {"docs/reliability.md", "docs/nodes.md", "docs/data.md", "docs/model_folders.md"} <= set(PAGES)


def test_readme_is_a_card_of_at_most_250_lines():
    n = len(read("README.md").splitlines())
    assert n <= 250, f"README.md has {n} lines; move a long section into a docs/ page and link it"


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_resolves_to_a_file_and_heading(page):
    text = FENCE.sub("", read(page))
    links = [m.group(1) for m in LINK.finditer(text)]
    assert links or page == "RESULTS.md"
    base = os.path.dirname(os.path.join(ROOT, page))
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):       # http:, https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = os.path.normpath(os.path.join(base, path)) if path else os.path.join(ROOT, page)
        if not os.path.exists(target):
            broken.append(f"{link} (no such file)")
        elif anchor and target.endswith(".md") and anchor not in anchors(os.path.relpath(target, ROOT)):
            broken.append(f"{link} (no such heading)")
    assert not broken, f"{page}: " + ", ".join(broken)


@pytest.mark.parametrize("page", PAGES)
def test_every_script_a_command_runs_exists(page):
    missing = []
    for cmd in commands(page):
        words = cmd.split()
        scripts = [w for w in words if w.endswith(".py") and "=" not in w and "$" not in w]
        modules = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "-m" and words[i - 1] == "python"]
        missing += [s for s in scripts if not os.path.isfile(os.path.join(ROOT, s))]
        missing += [m for m in modules if m not in EXTERNAL_MODULES
                    and not os.path.isfile(os.path.join(ROOT, m.replace(".", "/") + ".py"))]
    assert not missing, f"{page} runs scripts that do not exist: {missing}"


def test_readme_install_and_test_lines_are_what_ci_runs_first():
    """.ci/run's stage 1 is README's Quick start verbatim: its pip installs, in order, then its test command."""
    quick = read("README.md").split("## Quick start", 1)[1]
    readme = [c for c in commands_of(quick) if c.startswith("pip install") or "pytest" in c]
    ci = read(".ci/run")
    stage1 = ci[ci.index("stage 1"):ci.index("stage 2")]
    ci_cmds = [c.strip() for c in stage1.splitlines()[1:] if c.strip() and not c.strip().startswith(("echo", "#"))]
    normal = [re.sub(r"^python -m pip install -q ", "pip install ", c) for c in ci_cmds]
    assert readme == normal, f"README's Quick start {readme} != .ci/run's stage 1 {ci_cmds}"
    assert readme[-1] == "python -m pytest -q"


@pytest.mark.slow
def test_ci_stage_two_reruns_only_fast_tests_stage_one_skipped(tmp_path):
    """tests/conftest.py: a run records the tests (and whole modules) it skipped; --skipped_before (CI's stage 2,
    after the extras are installed) keeps of the fast tests only those, and every slow test; without pytest's cache
    (tools/mutate.py runs -p no:cacheprovider) nothing is recorded and everything selected runs."""
    import shutil
    import subprocess
    import sys
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\naddopts = -m \"not slow\"\n")
    (tmp_path / "test_a.py").write_text("import pytest, os\n"
                                        "def test_fast(): pass\n"
                                        "def test_extra(): pytest.importorskip(os.environ['EXTRA'])\n"
                                        "@pytest.mark.slow\ndef test_slow(): pass\n")
    (tmp_path / "test_b.py").write_text("import pytest, os\npytest.importorskip(os.environ['EXTRA'])\n"
                                        "def test_module_of_an_extra(): pass\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = lambda extra, *args: subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-v", *args],
                                              cwd=tmp_path, env={**env, "EXTRA": extra}, capture_output=True, text=True)
    first = run("no_such_module_here")                        # stage 1: the extra is missing
    assert first.returncode == 0 and "1 passed, 2 skipped" in first.stdout, first.stdout[-2000:]
    second = run("json", "-m", "slow or not slow", "--skipped_before")   # stage 2: the extra is there
    assert second.returncode == 0, second.stdout[-2000:]
    ran = set(re.findall(r"^(test_\w+\.py::\w+) PASSED", second.stdout, re.M))
    assert ran == {"test_a.py::test_extra", "test_a.py::test_slow", "test_b.py::test_module_of_an_extra"}, ran
    assert "1 deselected" in second.stdout
    no_cache = run("json", "-m", "slow or not slow", "--skipped_before", "-p", "no:cacheprovider")
    assert no_cache.stdout.count(" PASSED") == 4, no_cache.stdout[-2000:]   # nothing recorded: everything runs


def commands_of(text):
    block = re.search(r"^```bash\n(.*?)^```", text, re.M | re.S).group(1)
    return [c.split(" #")[0].strip() for c in block.splitlines() if c.strip()]


@pytest.mark.parametrize("page", PAGES)
def test_every_project_import_in_a_python_block_resolves(page):
    """The three-line API and every other snippet import from files that exist (e.g. hub/pretrained.py)."""
    missing = []
    for block in re.findall(r"^```python\n(.*?)^```", read(page), re.M | re.S):
        for module in re.findall(r"^from ([\w.]+) import", block, re.M):
            if not os.path.isfile(os.path.join(ROOT, module.replace(".", "/") + ".py")):
                missing.append(module)
    assert not missing, f"{page} imports modules that do not exist here: {missing}"


# -----------------------------------------------------------------------------------------------
# what README.md and docs/ say about the code: its names exist, its numbers are the presets'

DOC_PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/docs/*.md"))
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FILE_NAME = re.compile(r"\.(py|pt|json|jsonl|md|bin|safetensors|sh|txt|gz|model|png)$")


def project_module(dotted):
    """'trained.duo' -> True when it is a file of this repository (trained/duo.py), else False."""
    return os.path.isfile(os.path.join(ROOT, *dotted.split(".")) + ".py")


def code_names(page):
    """(module, name) for every `module.name` code span of a page whose module is one of the repository's files;
    in a table cell, a bare `name` after a `module.name` span names a member of the same module."""
    found = []
    for line in FENCE.sub("", read(page)).splitlines():
        for cell in line.split(" | ") if line.startswith("|") else [line]:
            module = None
            for span in CODE_SPAN.findall(cell):
                if " " in span or FILE_NAME.search(span) or not re.fullmatch(r"[A-Za-z_][\w.]*", span):
                    continue
                parts = span.split(".")
                prefixes = [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]
                prefixes = [prefix for prefix in prefixes if project_module(prefix)]
                if prefixes:
                    module = prefixes[0]
                    found.append((module, span[len(module) + 1:]))
                elif len(parts) == 1 and module is not None and line.startswith("|"):
                    found.append((module, span))
    return found


def test_every_module_name_the_pages_give_in_code_exists():
    """Issue 37: README's equation table named diffusion.predictor_weights, which does not exist, and pointed at
    functions the sampler does not run. Every `module.name` that README.md and docs/ give in a code span (and each
    bare `name` that follows one in a table cell) is imported and looked up."""
    import importlib
    missing, checked = [], 0
    for page in DOC_PAGES:
        for module, name in code_names(page):
            obj = importlib.import_module(module)
            for attr in name.split("."):
                obj = getattr(obj, attr, None)
            checked += 1
            if obj is None:
                missing.append(f"{page}: {module}.{name}")
    assert checked > 40 and not missing, "names the pages give that the code does not have: " + ", ".join(missing)


def preset_facts():
    """The presets as the code builds them: {name: the TrainConfig of `--preset name`} and {name: its model's
    fields (model.PRESETS) with `params`, its parameter count at that vocabulary}."""
    import torch
    import train
    from model import PRESETS, DiffusionTransformer, ModelConfig
    models = {}
    for name in ("tiny", "small", "lm1b", "large"):
        with torch.device("meta"):
            models[name] = dict(PRESETS[name], params=DiffusionTransformer(ModelConfig(**PRESETS[name])).num_params())
    return {name: train.parse_config(["--preset", name]) for name in models}, models


# (page, what the page says, with the numbers as named groups, the values the code gives them): the numbers the
# pages give about a preset; a claim reworded is a claim to add here
PRESET_CLAIMS = [
    ("README.md",
     r"trains the `tiny` preset \((?P<params>[\d.]+)M parameters, (?P<steps>\d+) steps, Duo's curriculum\s+for the "
     r"first half\)",
     lambda p, m: dict(params=round(m["tiny"]["params"] / 1e6, 2), steps=p["tiny"].max_iters,
                       half=p["tiny"].curriculum_share == 0.5)),
    ("README.md",
     r"`bash reproduce.sh tiny` runs it[^:]*: at (?P<params>[\d.]+)M\s+parameters",
     lambda p, m: dict(params=round(m["tiny"]["params"] / 1e6, 2))),
    ("README.md",
     r"\| learning rate, schedule \| (?P<lr>[\de.-]+), linear decay \|.*\n"
     r"\| warm-up steps \| (?P<warmup>\d+) \|.*\n"
     r"\| β₁, β₂ \| (?P<b1>[\d.]+), (?P<b2>[\d.]+) \|.*\| curriculum \(Duo\) \| (?P<curr>\d+)K steps.*\n"
     r"\| global batch \| (?P<batch>\d+) \|.*\| curriculum γ \| \[−(?P<g0>[\d.]+), −(?P<g1>[\d.]+)\] / "
     r"\[−(?P<g2>[\d.]+), −(?P<g3>[\d.]+)\].*\n"
     r"\| training steps \| (?P<steps>\d+)k \|.*\| dropout \| (?P<dropout>[\d.]+) \|.*\n"
     r"\| EMA decay \| (?P<ema>[\d.]+) \|",
     lambda p, m: dict(lr=p["small"].lr, warmup=p["small"].warmup_iters, b1=p["small"].beta1, b2=p["small"].beta2,
                       curr=p["small"].curriculum_iters / 1000, batch=p["small"].batch_size, g0=-p["small"].gamma_min,
                       g1=-p["small"].gamma_max, g2=-p["lm1b"].gamma_min, g3=-p["lm1b"].gamma_max,
                       steps=p["small"].max_iters / 1000, dropout=p["small"].dropout, ema=p["small"].ema)),
    ("docs/training.md",
     r"\| `tiny` \| DiT, (?P<layers>\d+) layers, (?P<width>\d+) wide \((?P<params>[\d.]+)M params at K = (?P<K>\d+)\) "
     r"\| CPU demo: built-in corpus, SentencePiece (?P<sp>\d+), L = (?P<L>\d+), batch (?P<batch>\d+), (?P<steps>\d+) "
     r"steps, lr (?P<lr>[\de.-]+), beta2 (?P<beta2>[\d.]+), warm-up (?P<warmup>\d+), Duo's curriculum for the first "
     r"(?P<curr>\d+), no EMA; end-of-run samples with top-p (?P<top_p>[\d.]+)",
     lambda p, m: dict(layers=m["tiny"]["n_layer"], width=m["tiny"]["n_embd"],
                       params=round(m["tiny"]["params"] / 1e6, 2), K=m["tiny"]["vocab_size"],
                       sp=int(p["tiny"].tokenizer.split(":")[1]), L=p["tiny"].block_size, batch=p["tiny"].batch_size,
                       steps=p["tiny"].max_iters, lr=p["tiny"].lr, beta2=p["tiny"].beta2,
                       warmup=p["tiny"].warmup_iters, curr=p["tiny"].curriculum_iters, top_p=p["tiny"].sample_top_p,
                       no_ema=p["tiny"].ema == 0)),
    ("docs/model_folders.md",           # float32 weights; the checkpoint adds AdamW's two moments, and no EMA
     r"`model.safetensors` holds no pickle, 4 bytes a weight: (?P<mb>[\d.]+) MB for the tiny model; its `ckpt.pt` is "
     r"about three times\s+that \(the weights and AdamW's two moments; the tiny preset keeps no EMA\)",
     lambda p, m: dict(mb=round(4 * m["tiny"]["params"] / 1e6, 1), no_ema=p["tiny"].ema == 0)),
    ("docs/training.md",
     r"Duo's DiT-small, (?P<params>[\d,]+) params at K = (?P<K>\d+)",
     lambda p, m: dict(params=m["small"]["params"], K=m["small"]["vocab_size"])),
    ("docs/training.md",
     r"\| `lm1b` \| DiT-small, (?P<params>[\d,]+) params at K = (?P<K>\d+) \| LM1B, bert-base-uncased, L = (?P<L>\d+)",
     lambda p, m: dict(params=m["lm1b"]["params"], K=m["lm1b"]["vocab_size"], L=p["lm1b"].block_size)),
    ("docs/training.md",
     r"L = (?P<L>\d+), batch (?P<batch>\d+), AdamW (?P<lr>[\de.-]+) \((?P<b1>[\d.]+), (?P<b2>[\d.]+)\), "
     r"wd (?P<wd>[\d.]+)",
     lambda p, m: dict(L=p["large"].block_size, batch=p["large"].batch_size, lr=p["large"].lr, b1=p["large"].beta1,
                       b2=p["large"].beta2, wd=p["large"].weight_decay)),
    ("docs/training.md",
     r"\(tiny: the first half; small/owt/lm1b: (?P<k>\d+)K of (?P<m>\d+)M\)",
     lambda p, m: dict(half=p["tiny"].curriculum_share == 0.5, k=p["small"].curriculum_iters / 1000,
                       m=p["small"].max_iters / 1e6)),
]


def test_the_pages_numbers_of_a_preset_are_what_it_builds():
    """Issue 37: README said the tiny model has 1.5M parameters in one place and 1.02M in another, and the tiny
    width was set in two files. The parameter counts, widths, steps and recipe numbers README.md and
    docs/training.md give about the presets, each against the value the code builds (defined there once)."""
    configs, models = preset_facts()
    wrong = []
    for page, pattern, expected in PRESET_CLAIMS:
        found = re.search(pattern, read(page))
        assert found, f"{page} no longer says {pattern[:70]!r}...: update PRESET_CLAIMS with what it says now"
        for key, value in expected(configs, models).items():
            said = found.groupdict().get(key)
            if isinstance(value, bool):           # a fact in words ("the first half", "no EMA"): true of the code
                ok = value
            else:
                ok = said is not None and math.isclose(float(said.replace(",", "")), float(value), rel_tol=1e-9)
            if not ok:
                wrong.append(f"{page}: {key} {said!r}, the code: {value!r}")
    assert not wrong, "; ".join(wrong)


def test_readme_names_the_curves_commands_a_finished_run_prints():
    """README said a finished run prints the TensorBoard and plot commands; it prints TensorBoard's only when the
    run logged to TensorBoard."""
    from types import SimpleNamespace
    from plumbing.runlog import finish_lines
    for tensorboard in (False, True):
        cfg = SimpleNamespace(out_dir="out", num_samples=0, tensorboard=tensorboard, wandb=False)
        printed = finish_lines(cfg, "training", 1, "out/ckpt.pt", "out/model")
        assert "python figures/plot.py --runs out" in printed and ("tensorboard --logdir" in printed) == tensorboard
    assert ("a finished run prints the plot command, and TensorBoard's with `--tensorboard 1`"
            in " ".join(read("README.md").split()))


def test_docs_say_what_the_one_process_vs_ddp_tests_check():
    """docs/nodes.md said one process and DDP are "tested for equal weights", docs/testing.md that weights after
    AdamW differ by up to 2 lr. The pages name what the tests compare (gradients through AdamW's moments at lr
    1e-30, the evaluation), and every test a page names exists."""
    pages = {page: read(page) for page in DOC_PAGES}
    assert not [page for page, text in pages.items() if "equal weights" in text]
    named = {(f, t) for text in pages.values() for f, t in re.findall(r"tests/(test_\w+\.py)::(test_\w+)", text)}
    missing = [f"{f}::{t}" for f, t in named if f"def {t}(" not in read(os.path.join("tests", f))]
    assert not missing, f"the docs name tests that do not exist: {missing}"
    nodes = " ".join(pages["docs/nodes.md"].split())
    assert "equal gradients, to float32 rounding, through AdamW's moments at `--lr 1e-30`" in nodes
    assert {("test_train.py", "test_two_process_torchrun_matches_one_process"), ("test_validation.py",
            "test_one_and_two_gloo_processes_give_the_same_validation")} <= named


def test_readmes_python_api_runs_outside_the_repository(tmp_path):
    """`from hub.pretrained import SDDLM` failed outside the repository (No module named 'hub'): README says how
    to run it from anywhere, and that way imports it in another folder."""
    import subprocess
    import sys
    how = re.search(r"put it on the path first: `PYTHONPATH=(\S+) python`", read("README.md"))
    assert how, "README's three-line API no longer says how to use it outside the repository"
    env = {**os.environ, "PYTHONPATH": how.group(1).replace("/path/to/sddlm", ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", "from hub.pretrained import SDDLM"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
