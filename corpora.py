"""
The corpora sddlm reads, as documents (prepare.py tokenizes them): Duo's named corpora (HF_CORPORA), any parquet set
on the hub, and local files and folders (LOCAL_FORMATS), each split read lazily as Docs.

    train, val = load_corpus("pydoc")     # or a local corpus, a name in HF_CORPORA, "hf:REPO[:CONFIG][@REVISION]"
"""
import collections
import hashlib
import itertools
import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

from data import BOM, DataError, check_text, file_sha256, open_binary, read_text, text_blocks
from plumbing.cli import first_line

# -----------------------------------------------------------------------------
# Detokenizers (Duo applies them to raw text before tokenizing). Rules: (regex, replacement), in order.


def _apply(rules, text):
    for pattern, replacement in rules:
        text = re.sub(pattern, replacement, text)
    return text


_WT_RULES = [
    (r"s ' ", "s' "),
    *[(rf" @{re.escape(c)}@ ", c) for c in "-,."],               # "1 @,@ 000" -> "1,000"
    *[(rf" {re.escape(p)} ", f"{p} ") for p in ":;.!?,"],         # one pass per mark, as Duo does
    *[(rf"{re.escape(a)}\s*([^{re.escape(b)}]*?)\s*{re.escape(b)}", rf"{a}\1{b}")
      for a, b in ["()", "[]", "{}", '""', "''"]],                # "( x )" -> "(x)"
    (r"= = = =", "===="), (r"= = =", "==="), (r"= =", "=="),     # "= = Heading = =" -> "== Heading =="
    (" \u00b0 ", "\u00b0"), (r" \n", "\n"), (r"\n ", "\n"),
    (r" N ", " 1 "), (r" 's", "'s"),
]
_PTB_RULES = [(r" 's", "'s"), (r"s ' ", "s' "), (r" n't", "n't"), (r" \n ", "\n"), (r"\\/", "/"),
              (r" N(?= )", " 1"),                                 # every " N " (also in runs "N N N") -> " 1 "
              (r"\$ 1", "$1"), (r"# 1", "#1"), (r"<unk>", "?")]
_LM1B_RULES = [
    (r"http : / / ", "http://"), (r"https : / / ", "https://"),
    (r" '(\w+)", r"'\1"), (r" (\w+) \. ", r" \1. "), (r" (\w+) \.$", r" \1."),
    (r" \? ", "? "), (r" \?$", "?"), (r" ! ", "! "), (r" !$", "!"),
    (r" , ", ", "), (r" : ", ": "), (r" ; ", "; "), (r" / ", "/"),
    (r'" ([^"]+) "', r'"\1"'), (r"' ([^']+) '", r"'\1'"),
    (r"\( ([^()]+) \)", r"(\1)"), (r"\[ ([^\[\]]+) \]", r"[\1]"),
    (r"\$ ", "$"), ("\u00a3 ", "\u00a3"),
]


def wt_detokenizer(text):
    return _apply(_WT_RULES, text)


def ptb_detokenizer(text):
    return _apply(_PTB_RULES, text)


def lm1b_detokenizer(text):
    return _apply(_LM1B_RULES, text)


def lambada_detokenizer(text):
    return "\n" + text.replace("\u201c", '"').replace("\u201d", '"').strip()


def scientific_papers_detokenizer(text):
    return lm1b_detokenizer(wt_detokenizer(text))


# -----------------------------------------------------------------------------
# Named corpora: Duo's splits, fields and detokenizers, read from parquet files (no loading script, which
# `datasets` >= 4 refuses). docs/data.md says how each repository and revision was checked.

@dataclass(frozen=True)
class HFSource:
    repo: str                 # hub dataset repository
    revision: str             # a commit where known, else the branch holding the parquet files
    data_files: dict          # split name -> glob of its files inside the repository
    train: str | None         # Duo's train split expression (None: an evaluation-only set)
    val: str
    field: str                # the text column
    detokenizer: Callable | None = None
    streaming: bool = False   # read without a local Arrow copy (SlimPajama's 627B tokens)


HF_CORPORA = {
    "openwebtext": HFSource("Skylion007/openwebtext", "79d93d786212f7344586290adb811d4ae6a1762c",
                            {"train": "plain_text/train-*.parquet"}, "train[:-100000]", "train[-100000:]", "text"),
    "lm1b": HFSource("billion-word-benchmark/lm1b", "refs/convert/parquet",
                     {"train": "plain_text/train/*.parquet", "test": "plain_text/test/*.parquet"}, "train", "test",
                     "text", lm1b_detokenizer),
    "wikitext2": HFSource("Salesforce/wikitext", "b08601e04326c79dfdd32d625aee71d232d685c3",
                          {"train": "wikitext-2-raw-v1/train-*.parquet",
                           "validation": "wikitext-2-raw-v1/validation-*.parquet"}, "train", "validation", "text",
                          wt_detokenizer),
    "wikitext103": HFSource("Salesforce/wikitext", "b08601e04326c79dfdd32d625aee71d232d685c3",
                            {"train": "wikitext-103-raw-v1/train-*.parquet",
                             "validation": "wikitext-103-raw-v1/validation-*.parquet"}, "train", "validation", "text",
                            wt_detokenizer),
    "ptb": HFSource("ptb-text-only/ptb_text_only", "6003d540889b95fc8c8403a3f04619f3b943fc8d",
                    {"train": "penn_treebank/train/*.parquet", "validation": "penn_treebank/validation/*.parquet"},
                    "train", "validation", "sentence", ptb_detokenizer),
    "lambada": HFSource("EleutherAI/lambada_openai", "761609c75432cf25d076cd41b8182b7f3ceaae6e",
                        {"test": "default/test/*.parquet"},
                        None, "test", "text", lambada_detokenizer),
    "ag_news": HFSource("fancyzhx/ag_news", "main",
                        {"train": "data/train-*.parquet", "test": "data/test-*.parquet"}, "train", "test", "text"),
    "arxiv": HFSource("ccdv/arxiv-summarization", "240aaf1a969b3f8cd0ade6986bfad0cd730ee288",
                      {"train": "document/train-*.parquet", "validation": "document/validation-*.parquet"},
                      "train", "validation", "article", scientific_papers_detokenizer),
    "pubmed": HFSource("ccdv/pubmed-summarization", "6b30a2cae59b11ed77cb19959bffccbbd18e1106",
                       {"train": "document/train-*.parquet", "validation": "document/validation-*.parquet"},
                       "train", "validation", "article", scientific_papers_detokenizer),
    "slimpajama": HFSource("cerebras/SlimPajama-627B", "main",
                           {"train": "train/chunk*/*.jsonl.zst", "validation": "validation/chunk*/*.jsonl.zst"},
                           "train", "validation", "text", streaming=True),
}


class Docs:
    """The documents of one split, read lazily (the corpus itself stays on disk): iterating gives them as
    training sees them; raw() gives them before `detokenizer`, which the tokenizing workers apply. units(), where
    given, gives the same documents as work units for the workers, (reader, *args): a worker reads
    reader(*args) itself (the paragraphs of a .txt piece, the rows of an Arrow split)."""

    def __init__(self, raw, detokenizer=None, nbytes=None, units=None):
        self.raw, self.detokenizer, self.nbytes, self.units = raw, detokenizer, nbytes, units  # raw: () -> iter

    def __iter__(self):
        return map(self.detokenizer, self.raw()) if self.detokenizer else self.raw()


def _check_field(name, field, columns, kind):
    """The text column `field` is among `columns` and its type (`kind`, Arrow's name) is text -> else DataError."""
    if field not in columns:
        raise DataError(f"{name} has no text field {field!r}; its fields are {', '.join(columns)} (--text_field)")
    if str(kind) not in ("string", "large_string", "string_view"):
        raise DataError(f"{name}: field {field!r} holds {kind}, not text (--text_field)")


def _hf_texts(ds, field, name):
    """-> () -> the texts of a `datasets` split's column `field` (a missing one -> DataError naming the columns)."""
    # a streaming json split has no features: its columns are those of its first row
    columns = ds.column_names or list(ds.features or next(iter(ds), {}))
    _check_field(name, field, columns, getattr((ds.features or {}).get(field), "dtype", "string"))
    return lambda: (text for batch in ds.iter(batch_size=1000) for text in batch[field])


def start_method():
    """How prepare.py's tokenizing workers start: fork on Linux, where they start at once with the tokenizer
    already loaded and inherit a loaded hub split (_row_units). They run only the tokenizer (no torch, CUDA or
    NCCL), so the threads a torchrun rank 0 holds do not matter to them. spawn elsewhere."""
    return "fork" if sys.platform.startswith("linux") else "spawn"


_DATASETS = {}   # id -> a `datasets` split, kept for the workers, which fork after load_corpus and so hold it too


def _row_units(ds, field, rows=1000):
    """-> () -> work units (_dataset_rows, ...) over a `datasets` split's rows: its workers read their rows
    from the memory-mapped Arrow files themselves. None where workers cannot inherit the split (no fork) or it
    is not a `datasets.Dataset` (a streamed split has no row ranges)."""
    import datasets
    if start_method() != "fork" or not isinstance(ds, getattr(datasets, "Dataset", ())):
        return None
    _DATASETS[id(ds)] = ds
    return lambda: ((_dataset_rows, id(ds), field, i, min(i + rows, len(ds))) for i in range(0, len(ds), rows))


def _dataset_rows(key, field, start, stop):
    return _DATASETS[key][start:stop][field]


def _load_dataset(what, repo, revision=None, **kwargs):
    """datasets.load_dataset of `repo` at `revision` from the hub, or with SDDLM_HF_MIRROR=/folder from
    /folder/REPO (a downloaded snapshot); its failure -> one DataError line."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"dataset {what!r} needs the datasets package (pip install datasets); {OFFLINE}") from None
    mirror = os.environ.get("SDDLM_HF_MIRROR")
    path, kwargs = (os.path.join(mirror, repo), kwargs) if mirror else (repo, dict(kwargs, revision=revision))
    # only errors from the clients' loggers: a failed request is logged before it is raised, and becomes our line
    levels = {logger: logger.level for logger in map(logging.getLogger, ("huggingface_hub", "datasets"))}
    for logger in levels:
        logger.setLevel(logging.ERROR)
    try:
        return datasets.load_dataset(path, **kwargs)
    except Exception as e:   # no network, a missing repository, a changed hub layout: one line, not a traceback
        raise DataError(f"could not load {what} from {path} ({type(e).__name__}: {first_line(e)}); {OFFLINE}") from None
    finally:
        for logger, level in levels.items():
            logger.setLevel(level)


def _parse_hub_name(name):
    """ "hf:REPO[:CONFIG][@REVISION]" -> (repo, config or None, revision)."""
    spec, _, revision = name[3:].partition("@")
    repo, _, config = spec.partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise DataError(f"--dataset {name!r}: expected hf:OWNER/NAME[:CONFIG][@REVISION], e.g. hf:Salesforce/wikitext:"
                        f"wikitext-2-raw-v1")
    return repo, config or None, revision or "main"


def load_hf_split(name, which, text_field=None, val_fraction=0.05):
    """The "train" or "val" Docs of HF_CORPORA[name] (Duo's splits, text fields and detokenizers; no documents
    where the set has no such split) or of "hf:REPO[:CONFIG][@REVISION]" (its train split and its validation or
    test split; without either, the last val_fraction of train's rows is held out). Needs `datasets` (and the
    network, its cache, or SDDLM_HF_MIRROR)."""
    if name.startswith("hf:"):
        repo, config, revision = _parse_hub_name(name)
        splits, field = _load_dataset(name, repo, revision, name=config), text_field or "text"
        if "train" not in splits:
            raise DataError(f"{name} has no train split (it has {', '.join(splits)})")
        held_out = next((s for s in ("validation", "test") if s in splits), None)
        if held_out:
            ds = splits["train" if which == "train" else held_out]
        else:
            n = len(splits["train"])
            cut = n - max(1, round(val_fraction * n))
            ds = splits["train"].select(range(cut) if which == "train" else range(cut, n))
        return Docs(_hf_texts(ds, field, name), units=_row_units(ds, field))
    src = HF_CORPORA[name]
    split = src.train if which == "train" else src.val
    if split is None:
        return Docs(lambda: iter(()))
    ds = _load_dataset(name, src.repo, src.revision, data_files=src.data_files, split=split, streaming=src.streaming)
    return Docs(_hf_texts(ds, src.field, name), src.detokenizer, units=_row_units(ds, src.field))


# -----------------------------------------------------------------------------
# Local corpora

LOCAL_FORMATS = ".txt, .jsonl, .json, .parquet, .txt.gz, .jsonl.gz, an Arrow save_to_disk folder, or a folder of these"
OFFLINE = (f"offline: a local corpus ({LOCAL_FORMATS}), or SDDLM_HF_MIRROR=/folder holding the repository's files as "
           f"on the hub")
_TEXT = (".txt", ".txt.gz")
_RECORDS = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet")


def _is_arrow_folder(path):
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                       for f in ("state.json", "dataset_dict.json"))


def _walk(folder):
    return (_regular(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)


def _regular(path):
    """path, unless it exists as something other than a regular file or folder (a named pipe, a device, a socket:
    read once it is gone, and a second read, which every preparation makes, would wait forever) -> DataError."""
    if os.path.exists(path) and not (os.path.isfile(path) or os.path.isdir(path)):
        raise DataError(f"{path} is not a regular file or folder (a named pipe, device or socket can be read only "
                        f"once, and a preparation reads its corpus twice); save its content to a file and give that")
    return path


def _folder_files(folder):
    """The corpus files of a folder, sorted by path (the order of its documents)."""
    return sorted(p for p in _walk(folder) if p.endswith(_TEXT + _RECORDS))


_SEPARATOR = re.compile(r"\n\s*\n")          # between the paragraphs of a lone .txt
_TEXT_AFTER = re.compile(r"[^\S\n]*\S")      # a separator followed by this cannot grow in the next block


def _paragraph_pieces(path, block=1 << 20):
    """A text file in pieces of whole paragraphs (~`block` bytes), read a block at a time: a block is cut at the
    end of its last separator that more text cannot extend (one followed by a non-space on its line); the rest
    waits. Splitting a piece is the workers' job, so the main process touches no document. -> (piece, end):
    end, the byte offset where the piece ends in the file, so that a worker can read the piece itself; None
    in a .gz or from the first "\\r" on, where the text's bytes are not the file's."""
    carry, offset, exact = "", 0, not path.endswith(".gz")
    for text, nbytes, same in text_blocks(path, block):
        text, offset, exact = carry + text, offset + nbytes, exact and same
        end = _last_break(text)
        carry = text[end:]
        yield text[:end], offset - len(carry.encode()) if exact else None
    yield carry, offset if exact else None


def _piece_paragraphs(piece, a, b):
    """Paragraphs a:b of a .txt piece, given as its text or as (path, begin, end): bytes the worker reads."""
    return _split_paragraphs(piece if isinstance(piece, str) else _read_piece(*piece))[a:b]


def _read_piece(path, begin, end):
    """A piece that _paragraph_pieces cut at byte offsets begin:end, read by the worker that splits it."""
    with open(path, "rb") as f:
        f.seek(begin)
        raw = f.read(end - begin)
    try:
        if len(raw) != end - begin:
            raise ValueError("shorter")
        return raw[len(BOM) if begin == 0 and raw.startswith(BOM) else 0:].decode("utf-8")
    except ValueError:          # edited between the scan and this read (nothing half-written is kept)
        raise DataError(f"{path} changed while it was being prepared; prepare it again once it is complete") from None


def _split_paragraphs(text):
    """text -> its paragraphs, each stripped of newlines and then ending in one blank line, the blank ones dropped.
    The blank line stays in the text: the EOS between two documents decodes to nothing, and without it a sample
    would run one paragraph into the next ("...woneCORIOLANUS:")."""
    return [p + "\n\n" for p in map(str.strip, _SEPARATOR.split(text), itertools.repeat("\n")) if p.strip()]


def _piece_units(path, pieces, start, stop):
    """Work units (_piece_paragraphs, piece, a, b) giving paragraphs start:stop of a text file. pieces:
    (paragraphs, end byte) of each piece as _paragraph_pieces cuts it (found by load_corpus's scan). Where every
    end is known a unit names the piece's bytes, (path, begin, end), and its worker reads them: the main process
    reads nothing."""
    by_bytes = all(end is not None for _, end in pieces)
    texts = None if by_bytes else (piece for piece, _ in _paragraph_pieces(path))
    first, begin = 0, 0
    for count, end in pieces:
        piece = (path, begin, end) if by_bytes else next(texts)
        a, b = max(start - first, 0), min(stop - first, count)
        if a < b:
            yield _piece_paragraphs, piece, a, b
        first, begin = first + count, end
        if first >= stop:
            return


def _last_break(text):
    """The end of the last separator in text followed by a non-space on its line (0: none). The end of a greedy
    match does not depend on where the search started, so the text's last 64 KiB is searched first."""
    for start in (max(0, len(text) - (1 << 16)), 0):
        end = 0
        for m in _SEPARATOR.finditer(text, start):
            if _TEXT_AFTER.match(text, m.end()):
                end = m.end()
        if end or start == 0:
            return end


def _records(path, field):
    """The `field` of each record of a .jsonl/.json(.gz) or .parquet file, in order."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading parquet needs the pyarrow package (pip install pyarrow)") from None
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:
            raise DataError(f"{path}: not a parquet file ({type(e).__name__})") from None
        names = pf.schema_arrow.names
        _check_field(path, field, names, field in names and pf.schema_arrow.field(field).type)
        try:
            for batch in pf.iter_batches(batch_size=1024, columns=[field]):
                yield from batch.column(0).to_pylist()
        except (OSError, ValueError) as e:            # pyarrow's ArrowIOError / ArrowInvalid: a damaged file
            raise DataError(f"{path}: a damaged parquet file ({first_line(e) or type(e).__name__})") from None
        return
    with open_binary(path) as f:
        head = f.read(4096).removeprefix(BOM).lstrip()
    if head.startswith(b"["):            # a JSON array of records: read whole (JSON lines stream)
        lines = enumerate(json.loads(read_text(path)), 1)
    else:
        blocks = (text.removesuffix("\n").split("\n") for text, _, _ in text_blocks(path))   # whole lines
        lines = ((n, line) for n, line in enumerate(itertools.chain.from_iterable(blocks), 1) if line.strip())
    for n, row in lines:
        if isinstance(row, str):
            try:
                row = json.loads(row)
            except ValueError as e:
                raise DataError(f"{path} line {n}: not JSON ({e})") from None
        if not isinstance(row, dict) or field not in row:
            fields = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise DataError(f"{path} record {n} has no text field {field!r}; it has {fields} (--text_field)")
        if not isinstance(row[field], (str, type(None))):         # null: a missing document, skipped
            raise DataError(f"{path} record {n}: field {field!r} holds {type(row[field]).__name__}, not text "
                            f"(--text_field)")
        if row[field] is not None:
            check_text(row[field], f"{path} record {n}: field {field!r}")
        yield row[field]


def _file_docs(path, field, in_folder):
    """The documents of one local file: a .txt alone is split into paragraphs on blank lines (read a piece at a
    time, exactly as _split_paragraphs splits the whole text), a .txt in a folder is one document; records give one
    document each."""
    if not path.endswith(_TEXT):
        return _records(path, field)
    if in_folder:
        return [read_text(path)]
    return (p for piece, _ in _paragraph_pieces(path) for p in _split_paragraphs(piece))


def _arrow_docs(folder, field):
    try:
        import datasets
    except ImportError:
        raise DataError(f"{folder} is an Arrow save_to_disk folder: reading it needs the datasets package") from None
    ds = datasets.load_from_disk(folder)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{folder} holds the splits {', '.join(ds)}, no train split")
        ds = datasets.concatenate_datasets([ds[s] for s in ("train", "validation", "test") if s in ds])
    return _hf_texts(ds, field, folder)()


def _local_docs(name, field):
    """-> () -> iterator of the documents of pydoc or a local corpus, in order (nulls and blank ones skipped)."""
    if name == "pydoc":
        from pydoc_data.topics import topics
        return lambda: (topics[k] for k in sorted(topics))
    if not os.path.exists(_regular(name)):
        if name.endswith(_TEXT + _RECORDS) or os.sep in name:
            raise DataError(f"no such file or folder: {name}")
        raise DataError(f"unknown dataset {name!r}; expected pydoc, a local corpus ({LOCAL_FORMATS}), "
                        f"hf:REPO[:CONFIG], or one of {sorted(HF_CORPORA)}")
    if _is_arrow_folder(name):
        read = lambda: _arrow_docs(name, field)
    elif os.path.isdir(name):
        files = _folder_files(name)
        if not files:
            raise DataError(f"corpus {name} is empty: it holds no {LOCAL_FORMATS}")
        read = lambda: (d for p in files for d in _file_docs(p, field, True))
    elif name.endswith(_TEXT + _RECORDS):
        read = lambda: _file_docs(name, field, False)
    else:
        raise DataError(f"{name}: not a corpus format prepare.py reads; expected {LOCAL_FORMATS}")
    return lambda: (d for d in read() if isinstance(d, str) and d.strip())


def _tail_split(length_batches, val_fraction, name):
    """One pass over the documents' lengths (in batches) -> (their number n, cut), where the val split is
    documents [cut:], the trailing ones holding ~val_fraction of the characters (at least one, and at least one
    left for train): the last document d with len(d:) >= val_fraction * total. Memory: the batches that may
    still hold d, since a batch that the tail no longer needs is never needed again (the total, and so the
    tail wanted, only grows by what follows it)."""
    tail, tail_chars, total, n = collections.deque(), 0, 0, 0
    for lengths in length_batches:
        lengths = np.asarray(lengths, dtype=np.int64)
        if not len(lengths):
            continue
        chars = int(lengths.sum())
        n, total, tail_chars = n + len(lengths), total + chars, tail_chars + chars
        tail.append((lengths, chars))
        while len(tail) > 1 and tail_chars - tail[0][1] >= val_fraction * total:
            tail_chars -= tail.popleft()[1]
    if n == 0:
        raise DataError(f"corpus {name} is empty")
    if n < 2:
        raise DataError(f"corpus {name} has {n} document(s); need at least 2 for a train/val split")
    suffix = np.cumsum(np.concatenate([t[0] for t in tail])[::-1])     # len(d:) for d = n-1, n-2, ...
    enough = np.flatnonzero(suffix >= val_fraction * total)
    k = min(int(enough[0]) + 1, n - 1) if len(enough) else n - 1
    return n, n - k


def _length_batches(docs, text_bytes, size=4096):
    """The documents' lengths in lists of `size`: what _tail_split reads; each list's UTF-8 bytes appended to
    text_bytes (the progress bar's total)."""
    docs = iter(docs)
    for batch in iter(lambda: list(itertools.islice(docs, size)), []):
        text_bytes.append(sum(len(d.encode("utf-8", "surrogatepass")) for d in batch))
        yield list(map(len, batch))


def load_corpus(name, val_fraction=0.05, text_field="text"):
    """-> (train Docs, val Docs). name: "pydoc" (built-in: Python's help topics), a local corpus (LOCAL_FORMATS:
    its documents as _file_docs gives them, in path order; the val split: _tail_split's), a name in HF_CORPORA, or
    "hf:REPO[:CONFIG][@REVISION]". A local corpus is read once here (its text checked, its split found) and again,
    streaming, when the Docs are iterated."""
    if name in HF_CORPORA or name.startswith("hf:"):
        return (load_hf_split(name, "train", text_field, val_fraction),
                load_hf_split(name, "val", text_field, val_fraction))
    docs = _local_docs(name, text_field)
    units = None
    if os.path.isfile(name) and name.endswith(_TEXT):    # a lone .txt: its pieces go to the workers unsplit
        pieces = []        # (paragraphs, end byte) of each piece: where a split starts and ends, for _piece_units

        def piece_lengths():
            for piece, end in _paragraph_pieces(name):
                paragraphs = _split_paragraphs(piece)
                pieces.append((len(paragraphs), end))
                yield np.fromiter(map(len, paragraphs), np.int64, len(paragraphs))
        n, cut = _tail_split(piece_lengths(), val_fraction, name)
        units = lambda a, b: lambda: _piece_units(name, pieces, a, b)
        # the progress bars' totals are bounds a split's bytes never pass (tqdm drops a total that the count has
        # passed), put right at the end (prepare): here the file's bytes to the end of the piece of the split's last
        # paragraph, or from the start of the piece of its first
        nbytes = None if name.endswith(".gz") else os.path.getsize(name)    # a .gz's bytes are not the text's
        last, first = np.searchsorted(np.cumsum([count for count, _ in pieces]), [cut - 1, cut], side="right")
        train_bytes = nbytes and (pieces[last][1] or nbytes)
        val_bytes = nbytes and nbytes - ((pieces[first - 1][1] or 0) if first else 0)
    else:                          # the totals: the text's own bytes (a record file holds more)
        batch_bytes = []
        n, cut = _tail_split(_length_batches(docs(), batch_bytes), val_fraction, name)
        whole, rest = divmod(cut, 4096)     # the batch the cut falls in counts in both totals (see above)
        train_bytes, val_bytes = sum(batch_bytes[:whole + bool(rest)]), sum(batch_bytes[whole:])
    train = Docs(lambda: itertools.islice(docs(), cut), nbytes=train_bytes, units=units and units(0, cut))
    val = Docs(lambda: itertools.islice(docs(), cut, None), nbytes=val_bytes, units=units and units(cut, n))
    return train, val


# -----------------------------------------------------------------------------
# A corpus's content, as prepare.data_key names it

def corpus_fingerprint(name, text_field="text"):
    """sha256 of what load_corpus reads: a file's bytes; a folder's corpus files (relative paths and bytes);
    pydoc's topics. For a Hugging Face source, its repository, revision, files, splits, field and detokenizer
    (the hub's content is not hashed: the revision pins it)."""
    h = hashlib.sha256()
    if name == "pydoc":
        from pydoc_data.topics import topics
        h.update(json.dumps(topics, sort_keys=True).encode())
    elif name in HF_CORPORA:
        s = HF_CORPORA[name]
        h.update(f"hf:{s.repo}@{s.revision}:{sorted(s.data_files.items())}:{s.train}:{s.val}:{s.field}:"
                 f"{s.detokenizer and s.detokenizer.__name__}".encode())
    elif name.startswith("hf:"):
        repo, config, revision = _parse_hub_name(name)
        h.update(f"hf:{repo}:{config}@{revision}:{text_field}".encode())
    elif os.path.isdir(_regular(name)):
        files = sorted(_walk(name)) if _is_arrow_folder(name) else _folder_files(name)
        for path in files:
            h.update(f"{os.path.relpath(path, name)}\0{file_sha256(path)}\0".encode())
    elif os.path.isfile(name):
        return file_sha256(name)
    else:
        load_corpus(name)   # raises its DataError for a missing file or an unknown name
    return h.hexdigest()
