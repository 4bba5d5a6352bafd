"""
Prepare a corpus for sddlm once: documents -> token memmaps that training reads (layout: data.py).

    python prepare.py --dataset openwebtext --tokenizer gpt2 --block_size 1024     # then torchrun ... train.py
    python prepare.py --dataset pydoc --tokenizer sp_train:2048 --block_size 128   # built in, offline
    python prepare.py --dataset my_corpus.jsonl --text_field body --tokenizer gpt2 --num_proc 16

train.py runs the same preparation itself when the folder is missing; running it beforehand (once, with every
core of the node) keeps it out of a multi-GPU job. The default folder's name ends in a digest of everything that
determines the tokens (data_key), so an edited corpus gets a new folder, never stale tokens.

The corpora and how they are read: corpora.py. Documents are read streaming, tokenized by --num_proc worker
processes and written in order, so the bytes written do not depend on --num_proc and memory does not grow with the
corpus.
"""

from plumbing import cli  # first: a stop signal while the imports below load is one line, exit 130
cli.stop_at_once(__name__)

import collections
import errno
import hashlib
import itertools
import json
import multiprocessing
import os
import pathlib
import shutil
import signal
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from corpora import HF_CORPORA, corpus_fingerprint, load_corpus, start_method
from data import (PROBE, DataError, DiskFullError, file_sha256, file_stat, full_data_key, get_tokenizer, key_digest,
                  load_meta, same_data_on_every_node, train_sentencepiece, unlisted_checksums, verify_prepared,
                  wrap_blocks)
from plumbing.cli import UsageError, os_error_line, set_stop_handlers
from plumbing.distributed import on_each_node, usable_cores
from plumbing.flags import check_prepare_flags
from plumbing.files import check_writable, kind_of, refuse_overwrite, remove_stale_temps, run_outputs, temp_name
from plumbing.signals import deferred_signals
from trained.checkpoint import check_data_tokenizer, check_resume_data

# -----------------------------------------------------------------------------
# Content keys: what identifies prepared data

PREP_VERSION = 2   # bump when preparation changes the tokens it writes


def data_key(dataset, tokenizer_spec, block_size, wrap=True, insert_eos=True, val_fraction=0.05, text_field="text"):
    """Everything that determines the prepared tokens, as a dict (stored in meta.json; its digest names the
    default folder). The tokenizer enters by content; sp_train:N is trained on the corpus, which is in the key.
    dataset / tokenizer_spec None: not read (their entries None)."""
    if tokenizer_spec is not None and tokenizer_spec.startswith("sp_train:"):
        if not tokenizer_spec.removeprefix("sp_train:").isdigit():
            raise DataError(f"tokenizer {tokenizer_spec!r}: expected sp_train:VOCAB_SIZE, e.g. sp_train:2048")
        tokenizer = tokenizer_spec
    else:
        tokenizer = None if tokenizer_spec is None else get_tokenizer(tokenizer_spec).fingerprint
    key = dict(version=PREP_VERSION, corpus=dataset and corpus_fingerprint(dataset, text_field), tokenizer=tokenizer,
               block_size=block_size, wrap=wrap, insert_eos=insert_eos, val_fraction=val_fraction)
    if text_field != "text":     # only then: keys of data prepared before --text_field existed stay the same
        key["text_field"] = text_field
    if dataset and os.path.isfile(dataset) and dataset.endswith((".txt", ".txt.gz")):   # a lone file's paragraphs
        key["paragraphs"] = "each ends in a blank line"
    return key


def prepared_dir(dataset, tokenizer_spec, block_size, wrap=True, insert_eos=True, val_fraction=0.05,
                 text_field="text"):
    """The default folder of a prepared dataset: data/<dataset name>-<tokenizer>-<L>[-padded]-<digest of data_key>.
    Reads the corpus and the tokenizer (to fingerprint them); a missing one -> DataError."""
    key = data_key(dataset, tokenizer_spec, block_size, wrap, insert_eos, val_fraction, text_field)
    name = os.path.basename(os.path.normpath(dataset.split("@")[0] if dataset.startswith("hf:") else dataset))
    for suffix in (".gz", ".txt", ".jsonl", ".json", ".parquet"):
        name = name.removesuffix(suffix)
    name = name.replace(":", "-")
    tok = tokenizer_spec.replace(":", "").replace("/", "_")
    if tokenizer_spec.startswith("sp:") or tokenizer_spec.endswith(".model"):   # by file name: the key has its content
        tok = "sp_" + os.path.basename(tokenizer_spec.removeprefix("sp:")).removesuffix(".model")
    return os.path.join("data", f"{_short(name)}-{_short(tok)}-{block_size}" + ("" if wrap else "-padded") +
                        f"-{key_digest(key)}")


def _short(part, limit=64):
    """A part of a folder name within `limit` UTF-8 bytes: a longer one keeps its start and gains a digest of the
    whole, so that the folder's name, with the temp folder's suffix, stays within a file name's 255 bytes (the
    data_key digest at the end keeps folders of different data apart either way)."""
    raw = part.encode()
    if len(raw) <= limit:
        return part
    return raw[:limit - 9].decode(errors="ignore") + "~" + hashlib.sha256(raw).hexdigest()[:8]


def _raw_meta(data_dir):
    """data_dir's meta.json as it is, unchecked ({} when absent, unreadable or not an object)."""
    try:
        meta = json.loads(pathlib.Path(data_dir, "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _unverifiable(data_dir, key):
    """The files a folder prepared from this very data_key lists no sha256 for ([] when it lists them all, or the
    folder is not one of ours): such a folder is prepared again, never trusted."""
    meta = _raw_meta(data_dir)       # absent or unreadable: _check_reusable / the caller reports it
    if not isinstance(meta.get("data_key"), dict) or full_data_key(meta["data_key"]) != full_data_key(key):
        return []                    # not one of ours, or another dataset's folder: refused, not replaced
    return unlisted_checksums(meta)


def _ours(data_dir):
    """The files a preparation wrote into data_dir, as its meta.json names them: what a new preparation may replace."""
    meta = _raw_meta(data_dir)
    parts = ("",) if meta.get("wrap", True) else ("", "_mask")
    names = {"meta.json", *(f"{split}{part}.bin" for split in ("train", "val") for part in parts)}
    if isinstance(meta.get("tokenizer_file"), str):
        names.add(meta["tokenizer_file"])
    for field in ("sha256", "stat"):
        if isinstance(meta.get(field), dict):
            names.update(meta[field])
    return names


def _replace_ours(tmp, out_dir):
    """Replace an unverifiable prepared folder's files by the fresh ones in tmp, file by file: only what an earlier
    preparation wrote there (_ours) is replaced, and everything else in out_dir (a user's own files) is kept. A
    file of the new preparation whose name a user's file holds -> DataError, before anything changes. meta.json
    goes first and comes back last, so no reader takes old and new files for one folder; a stop signal waits."""
    ours, names = _ours(out_dir), sorted(os.listdir(tmp), key=lambda n: n == "meta.json")
    theirs = [n for n in names if os.path.lexists(os.path.join(out_dir, n)) and
              (n not in ours or kind_of(os.path.join(out_dir, n)) != "file")]   # a link, a device: not ours
    if theirs:
        raise DataError(f"{os.path.join(out_dir, theirs[0])} was not written by prepare.py, and preparing {out_dir} "
                        f"again would replace it; move it elsewhere or use another --data_dir")
    with deferred_signals():
        if os.path.exists(os.path.join(out_dir, "meta.json")):
            os.remove(os.path.join(out_dir, "meta.json"))
        for name in names:
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    os.rmdir(tmp)


def _check_reusable(data_dir, key, verify=False):
    """A finished folder -> data_dir when it was prepared from the same data_key and its files verify."""
    old = load_meta(data_dir)
    if old.get("data_key") is None:
        raise DataError(f"{data_dir} was prepared by an older version of data.py (no data_key in meta.json); "
                        f"delete it or use another --data_dir")
    short = lambda v: str(v)[:12] + "..." if len(str(v)) > 15 else str(v)
    old_key = full_data_key(old["data_key"])
    if key.get("tokenizer") == old.get("tokenizer_sha256"):     # by content: the tokenizer it trained (sp_train:N)
        key = {**key, "tokenizer": old_key.get("tokenizer")}
    diff = [f"{k} content ({short(old_key.get(k))}, now {short(v)})" if k in ("corpus", "tokenizer") else
            f"{k}={old_key.get(k)!r} (asked {v!r})" for k, v in full_data_key(key).items()
            if old_key.get(k) != v]
    if diff:
        raise DataError(f"{data_dir} was prepared with a different {', '.join(diff)}; give the flags it was prepared "
                        f"with (its meta.json) or another --data_dir")
    verify_prepared(data_dir, old, full=verify)
    check_data_tokenizer(data_dir, old)            # meta.json still describes its tokenizer (an edited vocab_size)
    return data_dir


# -----------------------------------------------------------------------------
# Tokenizing: worker processes encode chunks of documents; the main process writes their results in order

_WORKER = {}    # the tokenizer of this worker process (set once by _init_worker)


def _init_worker(tokenizer_spec):
    set_stop_handlers(signal.SIG_IGN)       # the parent stops the pool and removes the temp folder
    if sys.platform.startswith("linux"):    # a killed preparation takes its workers with it (PR_SET_PDEATHSIG)
        with suppress(OSError, AttributeError):
            import ctypes
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    _WORKER["tok"] = get_tokenizer(tokenizer_spec, threads=1)


def _encode_chunk(chunk, detokenizer, wrap, insert_eos, block_size, dtype):
    """Documents -> dict(rows or stream, mask, counts): the work of one chunk, the same in any process.
    chunk: a list of documents, or (reader, *args), whose documents the worker reads itself (Docs.units).
    wrap: the chunk's token stream (each document's ids + EOS); else its rows [BOS] + ids[:L-2] + [EOS] + PAD."""
    tok = _WORKER["tok"]
    texts = chunk[0](*chunk[1:]) if isinstance(chunk, tuple) else chunk
    if detokenizer is not None:
        texts = [detokenizer(t) for t in texts]
    ids = tok.encode_batch(texts)
    out = dict(documents=len(texts), tokens=sum(map(len, ids)), bytes=sum(len(t.encode()) for t in texts))
    if wrap:
        eos = [tok.eos_id] if insert_eos else []
        out["stream"] = np.fromiter(itertools.chain.from_iterable(x + eos for x in ids), dtype,
                                    count=out["tokens"] + len(eos) * len(ids))
        return out
    L = block_size
    rows, mask = np.full((len(ids), L), tok.pad_id, dtype), np.zeros((len(ids), L), np.uint8)
    for r, x in enumerate(ids):
        seq = [tok.bos_id, *x[:L - 2], tok.eos_id]  # truncation keeps the closing EOS
        rows[r, :len(seq)], mask[r, :len(seq)] = seq, 1
    out.update(rows=rows, mask=mask, dropped_tokens=sum(max(0, len(x) - (L - 2)) for x in ids))
    return out


def _chunks(texts, max_chars=1 << 20, max_docs=1024):
    """Consecutive documents in lists of ~1 MB (or 1024 documents): a worker's unit of work."""
    chunk, chars = [], 0
    for t in texts:
        chunk.append(t)
        chars += len(t)
        if chars >= max_chars or len(chunk) >= max_docs:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _in_order(pool, chunks, job, window):
    """Results of _encode_chunk over `chunks`, in their order, with at most `window` chunks in flight (memory
    stays bounded however fast the corpus reads)."""
    if pool is None:
        yield from (_encode_chunk(c, *job) for c in chunks)
        return
    pending = collections.deque()
    for chunk in chunks:
        pending.append(pool.submit(_encode_chunk, chunk, *job))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def worker_count(num_proc):
    """The tokenizing processes for --num_proc: 0 or None = the usable cores, and more than the cores is capped to
    them with a note (more workers would only wait for a core; the bytes are the same for any count)."""
    cores = len(usable_cores())
    if num_proc and num_proc > cores:
        print(f"note: --num_proc {num_proc} is more than the {cores} usable cores: preparing with {cores}",
              file=sys.stderr)
    return min(num_proc or cores, cores)


def _write_split(docs, tok, out_dir, split, block_size, wrap, insert_eos, dtype, progress, pool=None, num_proc=1):
    """Tokenize docs and stream rows of length L = block_size to out_dir/{split}.bin (and {split}_mask.bin when
    un-wrapped), written in place (out_dir: a preparation's private temp folder) -> (counts, {file name: sha256})."""
    names = [f"{split}.bin"] + ([] if wrap else [f"{split}_mask.bin"])
    digests = {name: hashlib.sha256() for name in names}
    counts = collections.Counter(documents=0, tokens=0, sequences=0, dropped_tokens=0)   # tokens: without specials
    carry = np.zeros(0, dtype=dtype)  # wrapped: stream tokens not yet in a full block
    total = docs.nbytes
    bar = tqdm(total=total, desc=f"{split}", unit="B", unit_scale=True, dynamic_ncols=True,
               disable=cli.bar_hidden(progress) or bool(total and total < 1 << 18))   # under 256 KiB: no bar
    with ExitStack() as opened:
        files = {name: opened.enter_context(open(os.path.join(out_dir, name), "wb")) for name in names}

        def write(name, array):
            data = array.tobytes()
            files[name].write(data)
            digests[name].update(data)
        job = (docs.detokenizer, wrap, insert_eos, block_size, np.dtype(dtype).name)
        chunks = docs.units() if docs.units else _chunks(docs.raw())
        for out in _in_order(pool, chunks, job, window=2 * num_proc):
            if wrap:
                rows, carry = wrap_blocks(np.concatenate([carry, out["stream"]]), block_size, tok.bos_id, tok.eos_id)
            else:
                rows = out["rows"]
                write(f"{split}_mask.bin", out["mask"])
            write(f"{split}.bin", rows)
            counts.update(documents=out["documents"], tokens=out["tokens"], sequences=len(rows),
                          dropped_tokens=out.get("dropped_tokens", 0))
            bar.update(out["bytes"])
            bar.set_postfix(docs=counts["documents"], tokens=counts["tokens"], refresh=False)
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
    if bar.total and bar.n != bar.total:   # the total was an estimate (a file's bytes, shared out by documents)
        bar.total = bar.n
        bar.refresh()
    bar.close()
    counts["dropped_tokens"] += len(carry)  # wrapped: the final remainder (Duo drops one per 1000-document batch)
    if counts["sequences"] == 0 and counts["documents"] > 0:
        raise DataError(f"the {split} split gives no sequence of block_size {block_size}; use a smaller one")
    return counts, {name: d.hexdigest() for name, d in digests.items()}


# -----------------------------------------------------------------------------
# Preparation: one folder, built aside and renamed into place under a lock: concurrent runs are safe, and a failed
# one leaves nothing behind

@contextmanager
def _exclusive(lock_path, what):
    """Hold an exclusive lock on lock_path (a file beside the folder, removed afterwards). It spares a second
    process the same work; correctness does not rest on it (the folder appears by an atomic rename)."""
    from plumbing.lock import open_lock_file
    try:
        import fcntl
        fd = open_lock_file(lock_path, f"--data_dir {what}", "choose another --data_dir")   # never a user's file
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
        with suppress(OSError):
            if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                os.unlink(lock_path)
        os.close(fd)


def prepare_dataset(dataset, tokenizer_spec, out_dir, block_size, wrap=True, insert_eos=True,
                    val_fraction=0.05, progress=True, num_proc=None, text_field="text", verify=False, key=None):
    """Tokenize `dataset` once into out_dir/{train,val}.bin + meta.json and return out_dir. tokenizer_spec as in
    get_tokenizer, or "sp_train:N": a SentencePiece model of vocab N trained on the train split (tokenizer.model).
    num_proc: as worker_count. An out_dir prepared from the same data_key is reused (its files checked by size and
    time, or hashed when verify); a different one -> DataError (key: the data_key asked for, if not the arguments')."""
    if block_size < 3:
        raise DataError(f"block_size must be >= 3 (BOS + tokens + EOS), got {block_size}")
    key = key or data_key(dataset, tokenizer_spec, block_size, wrap, insert_eos, val_fraction, text_field)  # early
    out_dir = os.path.normpath(out_dir)
    redo = _unverifiable(out_dir, key)
    if os.path.isfile(os.path.join(out_dir, "meta.json")) and not redo:
        return _check_reusable(out_dir, key, verify)
    check_writable(out_dir, "--data_dir", folder=True)     # not a file, pipe or device, nor under one; writable
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not redo:   # someone's files (a run?): never advise deleting
        entries = sorted(os.listdir(out_dir))
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise DataError(f"{out_dir} exists but holds no prepared dataset (no meta.json; it holds {shown}); use another "
                        f"--data_dir")
    parent = os.path.dirname(os.path.abspath(out_dir))
    made_parent = not os.path.isdir(parent)
    os.makedirs(parent, exist_ok=True)
    try:
        with _exclusive(out_dir + ".lock", out_dir):
            redo = _unverifiable(out_dir, key)
            if os.path.isfile(os.path.join(out_dir, "meta.json")) and not redo:   # finished by the one we waited for
                return _check_reusable(out_dir, key, verify)
            remove_stale_temps(out_dir)    # a killed preparation's temp folder (this host's)
            if redo and progress:
                print(f"{out_dir}: its meta.json records no sha256 for {', '.join(redo)}, so its files cannot be "
                      f"verified; preparing it again", file=sys.stderr)
            # named before it is made, so that a stop signal at any point finds it to remove
            tmp = temp_name(os.path.join(parent, os.path.basename(out_dir)))
            try:
                os.mkdir(tmp)
                _prepare_into(tmp, out_dir, key, dataset, tokenizer_spec, block_size, wrap, insert_eos,
                              val_fraction, progress, worker_count(num_proc), text_field)
                try:
                    if redo:
                        _replace_ours(tmp, out_dir)
                    else:
                        os.rename(tmp, out_dir)     # atomic: readers see no folder or a finished one
                except OSError:
                    if not os.path.isfile(os.path.join(out_dir, "meta.json")):
                        raise
                    shutil.rmtree(tmp)         # another process (without a working lock) finished first
                    return _check_reusable(out_dir, key, verify)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        made_parent = False
        return out_dir
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DiskFullError(f"No space left on device while preparing {out_dir}; free space there or choose "
                                f"another --data_dir") from None
        raise
    finally:
        if made_parent:                        # a failed preparation leaves no empty data/ folder either
            with suppress(OSError):
                os.rmdir(parent)


def _prepare_into(tmp, out_dir, key, dataset, tokenizer_spec, block_size, wrap, insert_eos, val_fraction,
                  progress, num_proc=1, text_field="text"):
    sp_vocab = tokenizer_spec.removeprefix("sp_train:") if tokenizer_spec.startswith("sp_train:") else None
    tok = None if sp_vocab else get_tokenizer(tokenizer_spec)
    train_docs, val_docs = load_corpus(dataset, val_fraction, text_field)
    digests, encode_spec = {}, tokenizer_spec
    if sp_vocab:
        model = train_sentencepiece(train_docs, os.path.join(tmp, "tokenizer"), int(sp_vocab))
        tok, encode_spec = get_tokenizer("sp:" + model), "sp:" + model
        tok.spec = "sp:" + os.path.join(out_dir, "tokenizer.model")   # where it will be (load_meta resolves it)
        digests["tokenizer.model"] = tok.fingerprint
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.uint32
    meta = dict(dataset=dataset, tokenizer_request=tokenizer_spec, block_size=block_size, wrap=wrap,
                insert_eos=insert_eos, val_fraction=val_fraction, data_key=key,
                tokenizer=tok.spec, tokenizer_file="tokenizer.model" if sp_vocab else None,
                tokenizer_sha256=tok.fingerprint, vocab_size=tok.vocab_size, bos_id=tok.bos_id, eos_id=tok.eos_id,
                pad_id=tok.pad_id, dtype=np.dtype(dtype).name, probe_ids=tok.encode(PROBE),
                layout="row-major (sequences, block_size)")
    if dataset in HF_CORPORA:
        src = HF_CORPORA[dataset]
        meta["source"] = dict(repo=src.repo, revision=src.revision, data_files=src.data_files, train=src.train,
                              val=src.val, field=src.field)
    if text_field != "text":
        meta["text_field"] = text_field
    pool = None
    try:
        if num_proc > 1:   # a worker that dies (killed, out of memory) fails the preparation: BrokenProcessPool
            # a stop signal handled inside fork() leaves the parent's locks held and the pool hanging: the workers
            # start now (under fork, all at the first task), with stop signals held back until they have
            with deferred_signals():
                pool = ProcessPoolExecutor(num_proc, multiprocessing.get_context(start_method()), _init_worker,
                                           (encode_spec,))
                pool.submit(int)
        else:
            _WORKER["tok"] = get_tokenizer(encode_spec, threads=1)
        for split, docs in [("train", train_docs), ("val", val_docs)]:
            counts, split_digests = _write_split(docs, tok, tmp, split, block_size, wrap, insert_eos, dtype, progress,
                                                 pool, num_proc)
            meta.update({f"{split}_{k}": v for k, v in counts.items()})
            digests.update(split_digests)
    except BrokenProcessPool:
        raise DataError(f"a tokenizing worker of {out_dir} died (killed, or out of memory); lower --num_proc") from None
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    meta["sha256"] = digests
    dropped, tokens = meta["train_dropped_tokens"], meta["train_tokens"]
    if not wrap and dropped:          # documents cut to block_size - 2 tokens
        print(f"note: --wrap 0 keeps a document's first {block_size - 2} tokens: {dropped:,} of the train split's "
              f"{tokens:,} tokens ({dropped / tokens:.1%}) are dropped; --wrap 1 keeps them all (or raise "
              f"--block_size)", file=sys.stderr)
    # the one full check: the bytes on disk hash to what was written; their size and time are recorded, which
    # later starts compare instead of hashing
    for name, digest in digests.items():
        if file_sha256(os.path.join(tmp, name), cached=False) != digest:
            raise DataError(f"{os.path.join(tmp, name)} reads back other bytes than were written (a disk fault?); "
                            f"prepare again, or choose another --data_dir")
    meta["stat"] = {name: file_stat(os.path.join(tmp, name)) for name in digests}
    with open(os.path.join(tmp, "meta.json"), "w") as f:   # written last: its presence marks a finished folder
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


# -----------------------------------------------------------------------------
# A training run's data (train.py): prepared by the first process of each node, agreed on by content

def prepare_for_run(cfg, env, given):
    """train.py's data (cfg: its dataset, tokenizer, block_size, wrap, data_dir, text_field, num_proc, verify;
    env: its ranks; given: the flags on its command line) -> (absolute data_dir, meta), prepared in each node's folder
    or found there (a prepared --data_dir: adopt_prepared). Any node's error is every rank's same one line."""
    old = adopt_prepared(cfg, given)          # every rank: cfg takes the folder's settings

    def work():
        try:
            if old is None:
                key = data_key(cfg.dataset, cfg.tokenizer, cfg.block_size, cfg.wrap, text_field=cfg.text_field)
            else:                             # the flags given, by content; the folder's for the rest
                asked = data_key(given.get("dataset"), given.get("tokenizer"), cfg.block_size, cfg.wrap,
                                 old.get("insert_eos"), old.get("val_fraction"), cfg.text_field)
                key = {**old, **{k: v for k, v in full_data_key(asked).items() if v is not None}}
            check_resume_data(cfg, key)
            data_dir = os.path.abspath(cfg.data_dir or prepared_dir(cfg.dataset, cfg.tokenizer, cfg.block_size,
                                                                    cfg.wrap, text_field=cfg.text_field))
            # the default folder too (an explicit --data_dir is checked with the other inputs at start)
            refuse_overwrite({"--out_dir": run_outputs(cfg.out_dir)}, {"--data_dir": data_dir})
            prepare_dataset(cfg.dataset, cfg.tokenizer, data_dir, block_size=cfg.block_size, wrap=cfg.wrap,
                            num_proc=cfg.num_proc or None, text_field=cfg.text_field, verify=cfg.verify, key=key)
        except OSError as e:
            raise DataError(os_error_line(e)) from None
        meta = load_meta(data_dir)      # what this node tells the others: same_data_on_every_node
        return data_dir, key_digest(meta.get("data_key")), meta.get("sha256") or {}
    (data_dir, _, _), nodes = on_each_node(env, work, UsageError)      # DataError and ConfigError are UsageErrors
    same_data_on_every_node(nodes)
    return data_dir, load_meta(data_dir)


def adopt_prepared(cfg, given):
    """A --data_dir prepared already (by prepare.py, with any of its flags; moved, too) is read as it is: the data
    flags not given (--dataset, --tokenizer, --block_size, --wrap, --text_field) take the folder's values, its
    tokenizer where the folder is now -> the folder's data_key (None: no prepared folder there; the flags decide)."""
    try:
        meta = load_meta(os.path.abspath(cfg.data_dir)) if cfg.data_dir else {}
        old = full_data_key(meta["data_key"])
        folder = dict(dataset=meta.get("dataset") or cfg.dataset, tokenizer=meta["tokenizer"],
                      block_size=meta["block_size"], wrap=meta["wrap"], text_field=old["text_field"])
    except (DataError, KeyError, TypeError):      # unreadable: the preparation reports it
        return None
    for name, value in folder.items():
        if name not in given:
            setattr(cfg, name, value)
    return old


# -----------------------------------------------------------------------------

@dataclass
class PrepareConfig:
    dataset: str = "pydoc"           # pydoc (built in) | a local corpus (.txt, .jsonl, .json, .parquet, .txt.gz,
                                     # .jsonl.gz, an Arrow folder, or a folder of these) | openwebtext | lm1b |
                                     # wikitext2 | wikitext103 | ptb | lambada | ag_news | arxiv | pubmed |
                                     # slimpajama | hf:REPO[:CONFIG][@REVISION] (any parquet dataset on the hub)
    tokenizer: str = "sp_train:2048"  # gpt2 | sp:PATH.model | hf:NAME | sp_train:VOCAB (trained on the corpus)
    data_dir: str = ""               # output folder; "" = data/<dataset>-<tokenizer>-<L>-<digest>, as train.py
    block_size: int = 128            # tokens per sequence L (as train.py --block_size)
    wrap: bool = True                # OWT-style packing (1) or one padded sequence per document (0, LM1B-style)
    insert_eos: bool = True          # EOS between wrapped documents
    val_fraction: float = 0.05       # local corpora: share of the characters held out for validation
    text_field: str = "text"         # the text of a record (.jsonl, .parquet, Arrow, hf:REPO)
    num_proc: int = 0                # tokenizing processes (0 = the usable cores, and at most them; the bytes are
                                     # the same for any)
    verify: bool = False             # hash every file of an existing folder (a start checks size and time only)


def main(argv=None):
    cfg = cli.parse_flags(PrepareConfig, argv, "Tokenize a corpus once into token memmaps for sddlm.")
    check_prepare_flags(cfg.num_proc, cfg.val_fraction)
    settings = dict(wrap=cfg.wrap, insert_eos=cfg.insert_eos, val_fraction=cfg.val_fraction,
                    text_field=cfg.text_field)
    data_dir = cfg.data_dir or prepared_dir(cfg.dataset, cfg.tokenizer, cfg.block_size, **settings)
    written = not os.path.isfile(os.path.join(data_dir, "meta.json"))     # a prepared folder is reused, not rewritten
    refuse_overwrite({"--data_dir": data_dir if written else ""},
                     {"--dataset": cfg.dataset, "--tokenizer": cfg.tokenizer})
    out = prepare_dataset(cfg.dataset, cfg.tokenizer, data_dir, cfg.block_size, num_proc=cfg.num_proc or None,
                          verify=cfg.verify, **settings)
    meta = load_meta(out)
    print(f"{out}: tokenizer {meta['tokenizer']} (K={meta['vocab_size']}, {meta['dtype']}), block_size "
          f"{meta['block_size']}, wrap={meta['wrap']}")
    for split in ("train", "val"):
        print(f"  {split}: {meta[f'{split}_documents']} documents -> {meta[f'{split}_tokens']} tokens -> "
              f"{meta[f'{split}_sequences']} sequences")
    return 0


if __name__ == "__main__":
    cli.run_cli(main, DataError, ImportError)
