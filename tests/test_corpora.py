"""corpora.py's readers, through prepare.py."""
import json

import pytest

from data import DataError
import prepare


def test_a_bad_jsonl_line_past_a_mib_is_named_by_its_number(tmp_path):
    """The reader takes the file in ~1 MiB blocks of whole lines; a line's number counts the lines, not blocks."""
    lines = [json.dumps({"text": f"document {i} " + "x" * 1000}) for i in range(2500)]
    lines[2399] = '{"text": "cut'
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"c.jsonl line 2400: not JSON"):
        prepare.main(["--dataset", str(tmp_path / "c.jsonl"), "--tokenizer", "gpt2", "--data_dir",
                      str(tmp_path / "d")])
