"""prepare.py, through the real script."""
import json
import os
import subprocess
import sys

from test_train import _corpus

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root


def test_wrap_0_says_the_share_of_tokens_it_drops(tmp_path):
    """Issue 44: --wrap 0 cut each document to block_size - 2 tokens and dropped most of a corpus without a word;
    a note on stderr says how many (the count is the documents' tokens past block_size - 2, from meta.json)."""
    _corpus(tmp_path / "corpus.txt")
    p = subprocess.run([sys.executable, os.path.join(HERE, "prepare.py"), "--dataset", tmp_path / "corpus.txt",
                        "--tokenizer", "sp_train:300", "--data_dir", tmp_path / "data", "--wrap", "0", "--block_size",
                        "16"], capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert p.returncode == 0, p.stderr
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    dropped, tokens = meta["train_dropped_tokens"], meta["train_tokens"]
    assert dropped > tokens / 2          # 5 sentences a document, 14 tokens kept of each
    assert (f"note: --wrap 0 keeps a document's first 14 tokens: {dropped:,} of the train split's {tokens:,} tokens "
            f"({dropped / tokens:.1%}) are dropped; --wrap 1 keeps them all") in p.stderr
