"""trained/folder.py: reading a model folder, through the real scripts."""
import json
import os
import subprocess
import sys

from trained.export import export
from test_pretrained import HERE, fake_checkpoint, tok_path  # noqa: F401  (tok_path: the fixture)


def test_a_newer_folder_format_says_upgrade_not_not_a_model(tmp_path, tok_path):  # noqa: F811
    """Issue 44: a model folder of a later format ("sddlm-model-3") was "not a model folder"; it is one, of a newer
    version than this one reads: one line saying so and the fix."""
    folder, _ = export(fake_checkpoint(tmp_path / "ckpt.pt", tok_path), tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "format": "sddlm-model-3"}))
    p = subprocess.run([sys.executable, os.path.join(HERE, "sample.py"), "--ckpt", folder, "--out", ""],
                       capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    assert p.returncode == 2 and p.stderr.splitlines()[-1] == (
        f"error: {folder} is a model folder of format 'sddlm-model-3', newer than this version of sddlm reads "
        f"(sddlm-model-1 or sddlm-model-2): upgrade sddlm (git pull) to load it"), p.stderr
