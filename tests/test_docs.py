"""README.md and docs/ say what is true: every relative link resolves (to a file, and to a heading where it names
one), every script a command block runs exists, README's install and test lines are the ones CI runs, and README
stays a card (at most 250 lines; the long pages live in docs/)."""
import glob
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
def test_ci_stage_two_reruns_of_the_fast_tests_only_those_stage_one_skipped(tmp_path):
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
