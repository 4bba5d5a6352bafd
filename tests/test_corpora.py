"""corpora.py: what a local file becomes, and its readers, through prepare.py."""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ENV, HERE, case, check_last, md5s, one_error, run_batches
import data
from data import DataError
import prepare

PLAY = "".join(f"First Citizen:\nBefore we proceed any further, hear me speak {i}.\n\nCORIOLANUS:\nWhat's the "
               f"matter, you dissentious rogues {i}?\n\n\n" for i in range(40))


@pytest.mark.parametrize("wrap", [True, False])
def test_a_lone_txt_keeps_its_lines_and_blank_lines_when_decoded(tmp_path, wrap):
    """A play's paragraphs became documents whose EOS decodes to nothing: samples ran a speaker into the line
    before ("...speak 3.CORIOLANUS:"). The prepared ids of a lone .txt decode (BOS, EOS and padding dropped) to its
    paragraphs with their lines as they were and a blank line after each."""
    (tmp_path / "play.txt").write_text(PLAY)
    out = prepare.prepare_dataset(str(tmp_path / "play.txt"), "sp_train:320", str(tmp_path / "data"), 64, wrap=wrap,
                                  val_fraction=0.1, progress=False)
    tok = data.get_tokenizer(data.load_meta(out)["tokenizer"])
    before = []
    for split in ("train", "val"):      # each split's stream ends where its last whole block ends
        text = ""
        for x0, mask in data.eval_batches(out, split, 64):
            mask = x0 >= 0 if mask is None else mask          # wrapped blocks have no padding
            text += "".join(tok.decode([i for i, m in zip(row, ms) if m and i not in (tok.bos_id, tok.eos_id)])
                            for row, ms in zip(x0.tolist(), mask.tolist()))
        before += [text[m.start() - 2:m.start()] for m in re.finditer("CORIOLANUS:|First Citizen:", text)][1:]
        assert "\n\n\n" not in text and "CORIOLANUS:\nWhat's the matter" in text
    assert len(before) > 40 and set(before) == {"\n\n"}, set(before)


def test_a_bad_jsonl_line_past_a_mib_is_named_by_its_number(tmp_path):
    """The reader takes the file in ~1 MiB blocks of whole lines; a line's number counts the lines, not blocks."""
    lines = [json.dumps({"text": f"document {i} " + "x" * 1000}) for i in range(2500)]
    lines[2399] = '{"text": "cut'
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"c.jsonl line 2400: not JSON"):
        prepare.main(["--dataset", str(tmp_path / "c.jsonl"), "--tokenizer", "gpt2", "--data_dir",
                      str(tmp_path / "d")])


@pytest.mark.slow
def test_text_that_is_no_unicode_and_empty_samples_are_one_line(run_ar, tmp_path):
    t = tmp_path
    (t / "lone.jsonl").write_text('{"text": "a fine first record"}\n{"text": "bad \\ud800 one"}\n'
                                  '{"text": "a fine last record"}\n')
    (t / "empty.jsonl").write_text('{"ids": [5, 6, 7, 8], "text": "x"}\n{"ids": [], "text": ""}\n')
    before = md5s(run_ar.root)
    cases = [case("prepare.py", "--dataset", t / "lone.jsonl", "--tokenizer", tok, "--block_size", "32",
                  "--data_dir", t / f"d{i}", cwd=t, expect="lone.jsonl record 2: field 'text' is not Unicode text")
             for i, tok in enumerate(["gpt2", "sp_train:64"])]
    cases += [case("eval_ppl.py", "--metric", "genppl", "--samples", t / "empty.jsonl", "--judge", run_ar.ar, cwd=t,
                   expect="empty.jsonl:2: an empty sample")]
    check_last(run_batches(cases))
    assert not (t / "d0").exists() and not (t / "d1").exists() and md5s(run_ar.root) == before
    # a --prompt that is not UTF-8 (bytes on the command line): one line, not a TypeError
    p = subprocess.run([sys.executable.encode(), os.path.join(HERE, "sample.py").encode(), b"--ckpt",
                        run_ar.ckpt.encode(), b"--prompt", b"\xff\xfe the", b"--num_samples", b"1", b"--steps", b"2"],
                       capture_output=True, text=True, env=ENV, cwd=t, timeout=300)
    assert "is not Unicode text" in one_error(p)


def test_each_splits_byte_total_bounds_what_its_bar_counts(tmp_path):
    """prepare's bar counts each document's UTF-8 bytes against Docs.nbytes; a count past that total makes tqdm
    draw a frame without it (seen under load, when long documents came first): the totals are bounds, for a .txt
    (split in pieces) and a record file alike, with the long documents in either split."""
    import corpora
    long, short = "ä" * 3000, "b"
    for docs in ([long] * 40 + [short] * 400, [short] * 400 + [long] * 40):
        txt, records = tmp_path / "c.txt", tmp_path / "c.jsonl"
        txt.write_text("\n\n".join(docs), encoding="utf-8")
        records.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
        for path in (txt, records):
            for split in corpora.load_corpus(str(path)):
                counted = sum(len(d.encode()) for d in split.raw())
                assert counted <= split.nbytes <= counted + path.stat().st_size, (path.name, docs[0][:1])
