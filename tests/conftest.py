"""Shared by the tests: the one-thread fixture, the test process's own signal handlers kept (a script's run_cli
called in-process installs its stop handlers), and the explicit-matrix oracles of the uniform-state process
(Eq. (discrete_marginal) as a K x K transition matrix, Eq. (reverse) by Bayes' rule on those matrices), which live
in test_losses.py (it travels alone with losses.py) and are shared from here; the rounding bounds every float
tolerance of the suite is derived from (below); train.py in one process and in two (the DDP tests); CI's
--skipped_before (below); and the scripts' fault cases (run in child processes, their one error line checked) with
the small runs they start from; a toy model's config and a small prepared corpus for the training loop's
plumbing (at the end)."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from plumbing.cli import STOP_SIGNALS
from test_losses import bayes_posterior, transition_matrix  # noqa: F401  (the oracles, for the tests)
from model import ModelConfig, build_model
import prepare
import train


@pytest.fixture(autouse=True)
def _signal_handlers():
    """Each test starts and ends with pytest's handlers: cli.run_cli, called in-process, replaces them."""
    old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    yield
    for s, h in old.items():
        if h is not None:
            signal.signal(s, h)


@pytest.fixture(scope="module")
def one_thread():
    """Tests on tiny tensors: on a busy 2-core machine a second intra-op thread only adds waiting (10-40x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Rounding: every tolerance of the suite is derived from the operation it guards (and says how in one comment),
# never fitted to one CPU: another CPU's kernels (ATEN_CPU_CAPABILITY default / avx2 / avx512) round the same
# operations in another order. u = unit roundoff: one rounding errs by at most u relatively.

def unit_roundoff(dtype):
    """u of a float dtype: 2^-53 float64, 2^-24 float32, 2^-8 bfloat16 (8 significant bits)."""
    return torch.finfo(dtype).eps / 2


def reduction_tol(n, dtype):
    """A sum of n terms in dtype, in any order (blocked, vectorised, pairwise), errs from the exact sum by at most
    gamma_n * sum|terms|, gamma_n = n u / (1 - n u) (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed.,
    Lemma 3.1 and eq. (4.4)); two orders differ by at most twice that. -> 2 gamma_n, relative to sum|terms|."""
    nu = n * unit_roundoff(dtype)
    assert nu < 0.5, (n, dtype)
    return 2 * nu / (1 - nu)


def forward_tol(roundings, size, dtype=torch.float32):
    """Two evaluations of one network on the same weights and inputs whose sums run in other orders (other batch
    shapes, thread counts, ranks): along an output's path `roundings` roundings (its sums' lengths over the layers)
    of values no larger than `size`, each errs by <= roundings * u * size (first order): the two by twice that."""
    return 2 * roundings * size * unit_roundoff(dtype)


def assert_adam_moments_close(state_a, state_b, n_terms, dtype=torch.float32):
    """Two training routes (one process vs DDP, eager vs compiled) from the same weights at a learning rate too
    small to move them (--lr 1e-30: an AdamW step moves a weight by <= lr, far below its rounding), compared
    through AdamW's state (optimizer state_dicts): its first moment m_k = sum_s (1 - beta1) beta1^(k-s) g_s is a
    fixed weighted sum (weights <= 1 in all) of the steps' gradients, each a sum of n_terms token terms, so the
    routes differ by <= reduction_tol(n_terms) times the terms' size, taken as the gradients' weighted RMS
    sqrt(v_k / (1 - beta2^k)) (an entry's terms are as large as the tensor's largest entries). Not the weights
    after real AdamW steps: Adam divides by sqrt(v) + eps, which turns a rounding-level difference of an entry
    that is itself near rounding level into up to 2 lr, and normalises away a wrong gradient scale."""
    tol = reduction_tol(n_terms, dtype)
    beta2 = state_a["param_groups"][0]["betas"][1]
    assert state_a["state"].keys() == state_b["state"].keys() and state_a["state"]
    for i, a in state_a["state"].items():
        b = state_b["state"][i]
        assert float(a["step"]) == float(b["step"]) > 0, i
        scale = (a["exp_avg_sq"].max() / (1 - beta2 ** float(a["step"]))).sqrt().item()
        assert scale > 0, f"parameter {i} never had a gradient: nothing to compare (start from trained weights)"
        torch.testing.assert_close(b["exp_avg"], a["exp_avg"], rtol=0, atol=tol * scale, msg=f"parameter {i}")


# CI's stage 2 (.ci/run): the fast suite has just passed on README's install, so of the fast tests it reruns only
# those that run skipped (for want of an optional extra, now installed); the slow tests all run.

def train_in_one_and_two_processes(args, tmp_path):
    """train.py with `args` in one process (out_dir tmp_path/one) and under torchrun in two (tmp_path/two), one
    torch thread each -> their two checkpoints, loaded (the DDP tests compare them)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, launcher in (("one", []), ("two", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"])):
        r = subprocess.run([sys.executable, *launcher, "train.py", *map(str, args), "--out_dir", str(tmp_path / name)],
                           cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (name, r.stderr[-3000:])
    return [torch.load(tmp_path / name / "ckpt.pt", weights_only=False) for name in ("one", "two")]


def write_corpus(path, lines=2500, seed=0):
    """The tests' toy corpus: `lines` random sentences of a six-noun, four-verb grammar, five to a line."""
    import random
    rng = random.Random(seed)
    nouns, verbs = ["cat", "dog", "bird", "fish", "tree", "house"], ["sees", "likes", "finds", "eats"]
    text = [f"the {rng.choice(nouns)} {rng.choice(verbs)} the {rng.choice(nouns)} ." for _ in range(lines)]
    path.write_text("\n".join(" ".join(text[i:i + 5]) + "\n" for i in range(0, len(text), 5)))


def pytest_addoption(parser):
    parser.addoption("--skipped_before", action="store_true",
                     help="of the fast tests run only those the last run without this flag skipped (CI's stage 2)")


SKIPPED = set()                                  # node ids of the tests (and modules) this run skipped


def pytest_runtest_logreport(report):
    if report.skipped:
        SKIPPED.add(report.nodeid)


def pytest_collectreport(report):
    if report.skipped:                           # a module-level importorskip skips the whole module
        SKIPPED.add(report.nodeid)


def pytest_sessionfinish(session):
    config = session.config                      # (-p no:cacheprovider: no cache, nothing recorded)
    if getattr(config, "cache", None) is not None and session.testscollected and not config.option.collectonly and \
            not hasattr(config, "workerinput") and not config.getoption("skipped_before"):
        config.cache.set("sddlm/skipped", sorted(SKIPPED))


# test_losses.py travels alone with losses.py (no pytest.ini there to register a marker): its float32 / bf16 tests
# are marked numerics here
LOSSES_NUMERICS = ("test_bf16_logits_are_scored_in_float32_in_chunks_of_rows",
                   "test_sddlm_v1_unbounded_below_without_eps_bounded_with_it", "test_usdm_nelbo_is_nonnegative",
                   "test_every_loss_on_bf16_logits_matches_float64",
                   "test_sddlm_target_logit_gradient_is_rounded_once_in_bf16")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith("test_losses.py::") and item.originalname in LOSSES_NUMERICS:
            item.add_marker(pytest.mark.numerics)
    cache = getattr(config, "cache", None)
    skipped = cache.get("sddlm/skipped", None) if cache is not None and config.getoption("skipped_before") else None
    if skipped is None:                          # no flag, or no earlier run recorded: everything selected runs
        return
    wanted = lambda item: item.get_closest_marker("slow") or any(
        item.nodeid == s or item.nodeid.startswith(s + "::") for s in skipped)
    config.hook.pytest_deselected(items=[item for item in items if not wanted(item)])
    items[:] = [item for item in items if wanted(item)]


# The scripts' fault cases: each case run through the real script (in a child process, in batches side by side),
# its one error line and exit code checked; and the small runs they start from.

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": HERE}

RUNNER = r"""
import contextlib, io, json, os, runpy, sys, traceback
results = []
for case in json.load(sys.stdin):
    os.chdir(case["cwd"])
    sys.argv = [case["script"], *case["argv"]]
    saved = dict(os.environ)
    os.environ.update(case.get("env") or {})
    err, out, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            runpy.run_path(os.path.join(os.environ["PYTHONPATH"], case["script"]), run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = "traceback"
    os.environ.clear()
    os.environ.update(saved)
    results.append(dict(case, code=code, stderr=err.getvalue(), stdout=out.getvalue()))
json.dump(results, sys.__stdout__)
"""


def run_batches(*batches):
    """Each batch (a list of dicts: script, argv, cwd, expect) in its own child process, the batches side by
    side -> the cases with code, stderr and stdout."""
    procs = [subprocess.Popen([sys.executable, "-c", RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV, cwd=HERE) for _ in batches]
    for p, batch in zip(procs, batches):
        p.stdin.write(json.dumps([{k: str(v) if k == "cwd" else v for k, v in c.items()} for c in batch]))
        p.stdin.close()
    results = []
    for p in procs:
        out, err = p.stdout.read(), p.stderr.read()
        assert p.wait(timeout=600) == 0, err[-3000:]
        results += json.loads(out)
    return results


def case(script, *argv, cwd, expect, env=None):
    """expect: words of the one error line (exit code 2), or ("ok", words in stdout) for exit code 0. env: variables
    set for this case only."""
    return dict(script=script, argv=[str(a) for a in argv], cwd=str(cwd), expect=expect, env=env or {})


def check_one_line(results):
    """Every case failed as one 'error:' line with its words and exit code 2 (or succeeded as expected)."""
    wrong = []
    for r in results:
        if isinstance(r["expect"], list):       # ("ok", words): success
            if r["code"] != 0 or r["expect"][1] not in r["stdout"]:
                wrong.append(r)
            continue
        lines = r["stderr"].strip().splitlines()
        if r["code"] != 2 or len(lines) != 1 or not lines[0].startswith("error: ") or r["expect"] not in lines[0]:
            wrong.append(r)
    assert not wrong, "\n\n".join(f"{r['script']} {' '.join(r['argv'])}\n  expected {r['expect']!r}, got code "
                                  f"{r['code']}, stderr:\n{r['stderr'][-1500:]}" for r in wrong)


def md5s(folder):
    """{relative path: md5} of every file under folder ({} when it does not exist)."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), folder)] = hashlib.md5(fh.read()).hexdigest()
    return out


@pytest.fixture(scope="session")
def run4(tmp_path_factory):
    """A corpus, its prepared data and a 4-step run (ckpt.pt, log.jsonl, config.json)."""
    from test_train import TINY               # here, not above: test_train imports this file
    root = tmp_path_factory.mktemp("run4")
    write_corpus(root / "corpus.txt")
    b = SimpleNamespace(root=root, corpus=str(root / "corpus.txt"), data_dir=str(root / "data"), out=str(root / "run"))
    b.train = TINY + ["--dataset", b.corpus, "--data_dir", b.data_dir]
    assert train.main(b.train + ["--out_dir", b.out, "--max_iters", "4", "--eval_interval", "4"]) == 0
    b.ckpt = os.path.join(b.out, "ckpt.pt")
    return b


QUIET = {**ENV, "TQDM_DISABLE": "1"}


def wait_until(condition, timeout=120, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def start(script, *args, cwd, name, env=QUIET):
    """script in its own process, stdout and stderr to files in cwd/../name.{out,err} -> (Popen, out, err); no
    progress bars unless env says otherwise."""
    out, err = cwd.parent / f"{name}.out", cwd.parent / f"{name}.err"
    p = subprocess.Popen([sys.executable, os.path.join(HERE, script), *map(str, args)], cwd=cwd, env=env,
                         stdout=open(out, "w"), stderr=open(err, "w"))
    return p, out, err


def check_last(results):
    """Each case ended with its code (2 unless expect is ("ok", words)) and, for a failure, exactly one line
    'error: ...' holding its words, the last of stderr, and no traceback."""
    wrong = []
    for r in results:
        if isinstance(r["expect"], list):
            if r["code"] != 0 or r["expect"][1] not in r["stdout"] + r["stderr"]:
                wrong.append(r)
            continue
        lines = [line for line in r["stderr"].splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error: ")]
        if r["code"] != 2 or len(errors) != 1 or lines[-1] != errors[0] or r["expect"] not in errors[0] \
                or "Traceback" in r["stderr"]:
            wrong.append(r)
    assert not wrong, "\n\n".join(f"{r['script']} {' '.join(r['argv'])}\n  expected {r['expect']!r}, got code "
                                  f"{r['code']}, stderr:\n{r['stderr'][-1500:]}" for r in wrong)


@pytest.fixture(scope="session")
def run_tok(tmp_path_factory):
    """A corpus, its prepared data, a 4-step run, and a second corpus prepared with a tokenizer of the same size
    but other pieces (what a re-prepared folder puts at a checkpoint's tokenizer path)."""
    from test_train import TINY               # here, not above: test_train imports this file
    root = tmp_path_factory.mktemp("run_tok")
    write_corpus(root / "corpus.txt")
    text = (root / "corpus.txt").read_text()
    (root / "other.txt").write_text(text.replace("the ", "a ").replace("cat", "lion").replace("dog", "wolf"))
    b = SimpleNamespace(root=root, corpus=str(root / "corpus.txt"), data_dir=str(root / "data"),
                        out=str(root / "run"), other=str(root / "other_data"))
    b.train = TINY + ["--dataset", b.corpus, "--data_dir", b.data_dir]
    assert train.main(b.train + ["--out_dir", b.out, "--max_iters", "4", "--eval_interval", "4"]) == 0
    prepare.prepare_dataset(str(root / "other.txt"), "sp_train:320", b.other, 32, progress=False)
    b.ckpt = os.path.join(b.out, "ckpt.pt")
    return b


def copy_run(b, folder, edit=None):
    """A copy of the base run (ckpt.pt, log.jsonl, config.json); edit(ckpt dict) changes its checkpoint."""
    os.makedirs(folder)
    for f in ("ckpt.pt", "log.jsonl", "config.json"):
        shutil.copy(os.path.join(b.out, f), os.path.join(folder, f))
    if edit is not None:
        ck = torch.load(os.path.join(folder, "ckpt.pt"), weights_only=False)
        edit(ck)
        torch.save(ck, os.path.join(folder, "ckpt.pt"))
    return str(folder)


def unshare_available():
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def run_ar(tmp_path_factory):
    """A corpus, its prepared data, a 4-step diffusion run (with its model folder), a 4-step AR run (a Gen PPL
    judge), and a corpus prepared with a tokenizer of the same size but other pieces."""
    from test_train import TINY               # here, not above: test_train imports this file
    root = tmp_path_factory.mktemp("run_ar")
    write_corpus(root / "corpus.txt")
    text = (root / "corpus.txt").read_text()
    (root / "other.txt").write_text(text.replace("the ", "a ").replace("cat", "lion").replace("dog", "wolf"))
    b = SimpleNamespace(root=root, corpus=str(root / "corpus.txt"), data_dir=str(root / "data"),
                        out=str(root / "run"), ar=str(root / "ar"), other=str(root / "other_data"))
    b.train = TINY + ["--dataset", b.corpus, "--data_dir", b.data_dir]
    short = ["--max_iters", "4", "--eval_interval", "4"]
    assert train.main(b.train + ["--out_dir", b.out, *short]) == 0
    assert train.main(b.train + ["--out_dir", b.ar, "--loss", "ar", *short]) == 0
    prepare.prepare_dataset(str(root / "other.txt"), "sp_train:320", b.other, 32, progress=False)
    b.ckpt = os.path.join(b.out, "ckpt.pt")
    return b


def copy_data(b, folder, edit_meta=None):
    """A copy of the base data folder (times kept); edit_meta(meta dict) changes its meta.json."""
    shutil.copytree(b.data_dir, folder, copy_function=shutil.copy2)
    if edit_meta is not None:
        meta = json.loads((folder / "meta.json").read_text())
        edit_meta(meta)
        (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def one_error(p, code=2):
    """p (a CompletedProcess) ended with `code` and stderr's last line is its one 'error: ' line -> that line."""
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert p.returncode == code and len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in p.stderr, \
        (p.returncode, p.stderr[-2000:])
    return errors[0]


def edit_checkpoint(src, dst, edit):
    ck = torch.load(src, weights_only=True)
    edit(ck)
    torch.save(ck, dst)
    return str(dst)


def edit_folder(src, dst, edit_config=None, edit_bytes=None):
    shutil.copytree(src, dst)
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    if edit_bytes is not None:
        edit_bytes(dst)
    return str(dst)


@pytest.fixture(scope="session")
def run_ema(tmp_path_factory):
    """A corpus, its prepared data and a 2-step run (ckpt.pt with EMA, its model folder with the weights' sha256)."""
    from test_train import TINY               # here, not above: test_train imports this file
    root = tmp_path_factory.mktemp("run_ema")
    write_corpus(root / "corpus.txt")
    b = SimpleNamespace(root=root, corpus=str(root / "corpus.txt"), data_dir=str(root / "data"), out=root / "run")
    assert train.main(TINY + ["--dataset", b.corpus, "--data_dir", b.data_dir, "--out_dir", str(b.out),
                              "--max_iters", "2", "--eval_interval", "2"]) == 0
    b.ckpt, b.model = str(b.out / "ckpt.pt"), b.out / "model"
    return b


TOY = ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    d = tmp_path_factory.mktemp("loop")
    (d / "c.txt").write_text("\n\n".join(f"the cat {i} sees the dog {i % 7} ." * 3 for i in range(300)))
    return prepare.prepare_dataset(str(d / "c.txt"), "gpt2", str(d / "data"), 16, progress=False, num_proc=1)

# -----------------------------------------------------------------------------
# a small model from train.py's config path, for the fast paths' tests (test_train, test_curriculum, test_sample,
# test_bench), and whether torch.compile can run here

SMALL = dict(preset="tiny", block_size=16, batch_size=4, n_layer=2, n_head=2, n_embd=32)


def compiler_missing():
    """Why torch.compile cannot run its CPU backend here (a skip reason), or None."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this platform"
    if not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        return "no C++ compiler for TorchInductor's CPU backend"
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":     # its generated C++ uses at::vec, undeclared there
        return "TorchInductor's C++ does not build under ATEN_CPU_CAPABILITY=default (torch 2.13)"
    return None


def small_model(loss="sddlm", vocab_size=61, seed=0, perturb=0.05, **overrides):
    """A 2-layer DiT (or its causal twin for 'ar') from train.py's config path, with the zero-initialised
    output and adaLN layers perturbed so that every parameter gets a gradient."""
    tcfg = train.TrainConfig(**{**SMALL, "loss": loss, **overrides})
    torch.manual_seed(seed)
    model = build_model(train.model_config_for(tcfg, vocab_size))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(perturb * torch.randn_like(p))
    return model, tcfg


def grads(model):
    """Every parameter's gradient, flattened into one vector."""
    return torch.cat([p.grad.flatten() for p in model.parameters()])
