"""losses.py and test_losses.py travel together: copied alone into an empty folder with torch installed,
`python -m pytest test_losses.py` passes there. Each imports nothing from the project but losses.py."""
import ast
import os
import shutil
import subprocess
import sys

import pytest
import torch

import diffusion
import test_losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOWED = {"losses.py": {"math", "torch"}, "test_losses.py": {"math", "pytest", "torch", "losses"}}


def imported_modules(path):
    """The top-level names of every module a file imports, at any depth of its code (functions included)."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else node.module.split(".")[0])
    return names


@pytest.mark.parametrize("name", list(ALLOWED))
def test_the_two_files_import_nothing_else_from_the_project(name):
    assert imported_modules(os.path.join(ROOT, name)) <= ALLOWED[name]


def test_the_import_check_sees_an_import_inside_a_function(tmp_path):
    path = tmp_path / "t.py"
    path.write_text("import torch\n\ndef test_x():\n    from diffusion import sample_xt\n")
    assert imported_modules(path) == {"torch", "diffusion"}


def test_test_losses_copy_of_the_schedule_is_diffusions():
    t = torch.linspace(0, 1, 11, dtype=torch.float64)
    for a, b in zip(test_losses.log_linear_schedule(t), diffusion.log_linear_schedule(t)):
        assert torch.equal(a, b)


def run_alone(tmp_path, *args):
    for name in ALLOWED:
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    assert sorted(os.listdir(tmp_path)) == sorted(ALLOWED)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_losses.py", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_test_losses_collects_in_an_empty_folder(tmp_path):
    """The fast guard: in a folder holding only the two files, every test of test_losses.py is found (an import
    of another project file would fail here)."""
    out = run_alone(tmp_path, "--collect-only")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "test_losses.py::test_sddlm_v1_is_sddlm_minus_uniform_kl_up_to_constant" in out.stdout


@pytest.mark.slow
def test_test_losses_passes_in_an_empty_folder(tmp_path):
    out = run_alone(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert " passed" in out.stdout and "failed" not in out.stdout
