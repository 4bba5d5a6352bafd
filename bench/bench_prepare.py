"""
Benchmark prepare.py: speed and peak memory of one preparation with 1, 2, ... worker processes, side by side.

    python bench/bench_prepare.py                  # ~100 MB .txt from pydoc, gpt2, L=1024, 1 vs 2 workers
    python bench/bench_prepare.py --corpus big.txt --num_procs 1,4,16 --rounds 2

The method and the columns: docs/data.md.
"""
import os, sys  # noqa: E401  (run as a file, python FOLDER/SCRIPT.py: the repository root goes on the path)
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing import cli  # first: a stop signal while the imports below load is one line, exit 130
cli.stop_at_once(__name__)

import json
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass

from plumbing.files import check_writable

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
# the child: run prepare.py's main, then report its own and its reaped workers' peak RSS (KiB on Linux)
CHILD = ("import resource, sys, prepare; code = prepare.main(sys.argv[1:]); "
         "u = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]; "
         "print('RUSAGE', *[x for r in u for x in (r.ru_maxrss, r.ru_utime + r.ru_stime)]); sys.exit(code)")


@dataclass
class BenchPrepareConfig:
    corpus: str = ""         # a corpus to prepare; "" = a generated .txt of --mb megabytes
    mb: int = 100            # size of the generated corpus in MB (shuffled pydoc text)
    tokenizer: str = "gpt2"  # as prepare.py --tokenizer
    block_size: int = 1024   # as prepare.py --block_size
    num_procs: str = "1,2"   # worker counts, compared side by side
    rounds: int = 1          # runs per worker count; the fastest is reported
    work_dir: str = ""       # where corpus and folders go; "" = a temp folder, removed afterwards


def make_corpus(path, mb, seed=0):
    from pydoc_data.topics import topics
    paragraphs = [p.strip("\n") for t in sorted(topics) for p in topics[t].split("\n\n") if p.strip()]
    rng, size = random.Random(seed), 0
    with open(path, "w") as f:
        while size < mb * 2 ** 20:
            rng.shuffle(paragraphs)
            for p in paragraphs:
                size += f.write(p + "\n\n")
    return path


def run_once(cfg, corpus, num_proc, out):
    cmd = [sys.executable, "-c", CHILD, "--dataset", corpus, "--tokenizer", cfg.tokenizer, "--block_size",
           str(cfg.block_size), "--num_proc", str(num_proc), "--data_dir", out]
    start = time.perf_counter()
    run = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    seconds = time.perf_counter() - start
    if run.returncode:
        sys.exit(f"error: prepare.py --num_proc {num_proc} failed: {run.stderr.strip().splitlines()[-1]}")
    self_kib, self_cpu, children_kib, children_cpu = map(float, run.stdout.split("RUSAGE")[1].split())
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    return dict(seconds=seconds, rss_main_mib=self_kib / 1024, rss_worker_mib=children_kib / 1024,
                cpu_main=self_cpu, cpu_workers=children_cpu,
                tokens=meta["train_tokens"] + meta["val_tokens"], sha256=meta["sha256"])


def main(argv=None):
    cfg = cli.parse_flags(BenchPrepareConfig, argv, "Benchmark prepare.py with several worker counts.")
    procs = [int(n) for n in cfg.num_procs.split(",")]
    if cfg.work_dir:
        check_writable(cfg.work_dir, "--work_dir", folder=True)     # a folder (made if need be), writable
        os.makedirs(cfg.work_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cfg.work_dir or None) as work:
        corpus = cfg.corpus or make_corpus(os.path.join(work, "corpus.txt"), cfg.mb)
        mb = os.path.getsize(corpus) / 2 ** 20
        best = {}
        for r in range(cfg.rounds):
            for n in procs:
                res = run_once(cfg, os.path.abspath(corpus), n, os.path.join(work, f"out-{n}-{r}"))
                if n not in best or res["seconds"] < best[n]["seconds"]:
                    best[n] = res
    base = best[procs[0]]
    print(f"prepare.py on {mb:.1f} MB ({corpus if cfg.corpus else 'pydoc text, shuffled'}), tokenizer "
          f"{cfg.tokenizer}, block_size {cfg.block_size}, {os.cpu_count()} cores, best of {cfg.rounds} round(s)\n")
    print("| workers | seconds | MB/s | tokens/s | speedup | CPU s main | CPU s workers | peak RSS main MiB | "
          "peak RSS worker MiB | same bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in procs:
        b = best[n]
        print(f"| {n} | {b['seconds']:.1f} | {mb / b['seconds']:.2f} | {b['tokens'] / b['seconds']:,.0f} | "
              f"{base['seconds'] / b['seconds']:.2f}x | {b['cpu_main']:.1f} | {b['cpu_workers']:.1f} | "
              f"{b['rss_main_mib']:.0f} | "
              f"{b['rss_worker_mib']:.0f} | {'yes' if b['sha256'] == base['sha256'] else 'NO'} |")
    return 0


if __name__ == "__main__":
    cli.run_cli(main)
