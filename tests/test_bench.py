"""bench/bench.py runs every row and table from the same memory: what one allocated (activations, autograd graphs,
optimizer temporaries, an out-of-memory error's traceback and the tensors its frames hold) is gone before the next
starts, and a row that runs out of memory reads n/a while the rest still run. The CPU has no allocator statistics,
so these tests count what the interpreter holds instead: the bytes of the distinct storages of every live tensor
(gc.get_objects), put where bench reads torch.cuda.memory_allocated on a GPU, and weak references to a row's
tensors. Exact equalities: a count of bytes, no rounding."""
import gc
import itertools
import json
import math
import re
import weakref

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bench import bench
import curriculum.gaussian as curriculum
from model import ModelConfig, build_model

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py

TINY = ["--preset", "tiny", "--block_size", "16", "--batch_size", "2", "--n_layer", "1", "--n_embd", "32",
        "--n_head", "2", "--vocab_size", "64", "--repeats", "1", "--warmup", "1", "--head_chunks", "2"]


def live_tensor_bytes(device=None):
    """Bytes of the distinct storages of every tensor the interpreter holds, reachable or not (a tensor kept alive
    by a reference cycle counts until the cycle is collected)."""
    objs = gc.get_objects()
    kinds = {t for t in set(map(type, objs)) if issubclass(t, torch.Tensor)}
    storages = {}
    for t in itertools.compress(objs, map(kinds.__contains__, map(type, objs))):     # (C-speed filter: ~0.1 s)
        try:         # tensors without a storage of their own, or (a compilation's fake tensors) without memory
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        except (RuntimeError, NotImplementedError):
            continue
    return sum(storages.values())


def record_entries(monkeypatch, names, at_entry):
    """Wrap bench's functions `names` so that at_entry(name, args) runs as each is called."""
    for name in names:
        real = getattr(bench, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            at_entry(_name, args)
            return _real(*args, **kwargs)
        monkeypatch.setattr(bench, name, wrapped)


@pytest.mark.slow
def test_every_row_and_table_starts_from_the_same_memory(monkeypatch, capsys):
    """The bytes of live tensors at the start of every training step after the first round (which makes the AdamW
    moments the runs keep), and at the start of every table, are the same; bench's own check, given the same
    count in place of memory_allocated, finds nothing left behind and says so. (Before: each activation count
    left its autograd graph alive for good -- its pack hook handed each saved output back to autograd, a cycle
    through C++ that gc cannot collect -- and the sampler ran beside every training model.)"""
    entries = {"train_step": [], "table": []}
    record_entries(monkeypatch, ["train_step"], lambda name, args: entries["train_step"].append(live_tensor_bytes()))
    record_entries(monkeypatch, ["bench_training", "bench_sampler", "bench_head"],
                   lambda name, args: entries["table"].append((name, live_tensor_bytes())))
    monkeypatch.setattr(bench, "allocated_bytes", live_tensor_bytes, raising=False)
    argv = TINY + ["--losses", "sddlm,ar", "--curriculum", "sddlm", "--sample_steps", "1", "--json"]
    curriculum.clear_alpha_tables()    # what earlier tests in this process left (the curriculum's cached tables,
    gc.collect()                       # tensors in reference cycles) is not bench's: its first table starts clean
    assert bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    rows = 3                                   # sddlm, ar (a model of its own), sddlm+curriculum
    assert len(entries["train_step"]) == 2 * rows + rows
    later = entries["train_step"][rows:]       # round 2, then one profiled step each (CPU's step MiB)
    assert later == [later[0]] * len(later), later
    assert [name for name, _ in entries["table"]] == ["bench_training", "bench_sampler", "bench_head"]
    assert [b for _, b in entries["table"]] == [entries["table"][0][1]] * 3, entries["table"]
    assert out["memory_left"] == {} and out["memory_baseline"] == entries["table"][0][1]
    assert out["out_of_memory"] == {} and all(r["step_ms"] > 0 and r["act_bytes"] > 0 for r in out["losses"].values())
    assert "memory: every table, and every row after the first round, ended with memory_allocated where it started " \
           f"({out['memory_baseline'] / 2 ** 20:,.1f} MiB before the first table)" in bench.markdown(out)


def test_rows_free_what_a_measurement_left_naming_what_stays(monkeypatch):
    """bench.Rows with the count of live tensors in place of memory_allocated: a measurement that keeps a tensor
    is named with its bytes; one whose tensor sits in a reference cycle, or that runs out of memory holding tensors
    (in its frame, which the traceback holds, and in a cycle), leaves nothing (Python's automatic collection is off
    here: nothing but Rows frees a cycle) and the latter gives None with the reason; a lasting one (a model) is not
    checked; the end of a table drops the curriculum's cached alpha tables; any other error propagates."""
    monkeypatch.setattr(bench, "allocated_bytes", live_tensor_bytes)
    rows, kept, refs = bench.Rows(torch.device("cpu")), [], []

    def cycle(n):
        c = [torch.ones(n)]
        c.append(c)
        refs.append(weakref.ref(c[0]))

    def out_of_memory():
        held = torch.ones(1 << 14)
        refs.append(weakref.ref(held))
        cycle(1 << 14)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                     "of 139.80 GiB of which 147.00 MiB is free.")

    gc.collect()
    gc.disable()
    try:
        assert rows.measure("keeps", lambda: kept.append(torch.zeros(1000)) or 7) == 7
        assert rows.measure("cycle", lambda: cycle(1000) or 8) == 8
        assert rows.measure("oom", out_of_memory) is None
        assert rows.measure("model", lambda: kept.append(torch.zeros(10)), lasting=True) is None
        assert rows.measure("table", lambda: len(curriculum.alpha_table(64, n_points=3)), end_of_table=True) == 3
    finally:
        gc.enable()
    assert rows.left == {"keeps": 4000} and all(r() is None for r in refs) and len(refs) == 3
    assert rows.out_of_memory == {"oom": "CUDA out of memory (tried to allocate 2.00 GiB; 147.00 MiB of 139.80 GiB "
                                          "free)"}
    assert curriculum.alpha_table.cache_info().currsize == 0
    def bug():
        raise RuntimeError("not a memory fault")
    with pytest.raises(RuntimeError, match="not a memory fault"):
        rows.measure("bug", bug)


def test_cuda_rows_check_allocated_and_free_cache_between_tables(monkeypatch):
    """The CUDA path of bench.Rows, with memory_allocated, the cuBLAS workspaces and the allocator's cache faked
    (no GPU here): every measurement hands cuBLAS's workspaces back before reading the count; what it kept is
    named; the cached blocks go back to the device only after running out of memory and at a table's end (never
    between a table's steps, where taking them again would be timed)."""
    allocated, calls = [1024], []
    monkeypatch.setattr(bench, "allocated_bytes", lambda device: allocated[0])
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("workspaces"), raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    def keep(n):
        allocated[0] += n

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    rows = bench.Rows(torch.device("cuda"))
    assert rows.measure("step", lambda: 5) == 5 and calls == ["workspaces"]
    rows.measure("keeps", lambda: keep(512))
    rows.measure("model", lambda: keep(256), lasting=True)
    assert calls == ["workspaces"] * 3 and rows.left == {"keeps": 512}
    assert rows.measure("oom", out_of_memory) is None and calls[-2:] == ["workspaces", "empty_cache"]
    rows.measure("table", lambda: None, end_of_table=True)
    assert calls[-2:] == ["workspaces", "empty_cache"] and rows.left == {"keeps": 512}
    assert rows.out_of_memory == {"oom": "CUDA out of memory (tried to allocate 2.00 GiB)"}


def test_saved_activation_bytes_leaves_no_graph_behind():
    """The activation count's graph is gone when it returns (nothing but the result is left), and its count is
    the bytes autograd saves: exp saves its output (4 n bytes), mul saves both inputs (the output of exp, counted
    once, and x2's 4 n bytes); the parameter x is excluded."""
    n = 1000
    x = torch.randn(n, requires_grad=True)
    x2 = torch.randn(n)
    outs = []

    def fn():
        y = x.exp()
        outs.append(weakref.ref(y))
        return (y * (x2 + 1)).sum()
    before = live_tensor_bytes()
    assert bench.saved_activation_bytes(fn, [x]) == 4 * n + 4 * n
    assert outs[0]() is None and live_tensor_bytes() == before


def test_profile_prints_where_a_rows_extra_step_spends_time(capsys):
    """--profile 1: one more step of each row, and one more run of the sampler, under torch.profiler, its ops by
    self time (on CPU: the CPU's), printed after the tables; the model's matmuls are among them, and the sampler's
    pass over the logits (their block log-sum-exps)."""
    argv = TINY + ["--losses", "sddlm", "--curriculum", "", "--sample_steps", "2", "--long_blocks", "0",
                   "--head_chunks", "0", "--warmup", "0", "--profile", "1"]
    assert bench.main(argv) == 0
    table = capsys.readouterr().out
    assert "One more sddlm step under torch.profiler, after the timed rounds:" in table
    profile, sampler = table.split("One more sddlm step under torch.profiler")[1].split(
        "One more sample.generate (2 steps) under torch.profiler, after the timed rounds:")
    assert "Self CPU time total" in profile and "aten::mm" in profile and "aten::addmm" in profile
    assert "Self CPU time total" in sampler and "aten::logsumexp" in sampler and "aten::addmm" in sampler


def test_generation_past_the_machine_refused_at_start(monkeypatch):
    """--long_blocks 10^12: the long samples' tokens (>= 24 bytes each) fit no machine's memory: one line naming
    --long_blocks before any row runs (before: after every training row, by torch, or by the kernel's OOM killer)."""
    record_entries(monkeypatch, ["bench_training"], lambda name, args: pytest.fail("a row ran before the check"))
    with pytest.raises(bench.UsageError, match=r"--batch_size 2 x --long_blocks x L 16000000000000: .* lower "
                                               r"--long_blocks"):
        bench.main(TINY + ["--losses", "sddlm", "--sample_steps", "1", "--long_blocks", str(10 ** 12)])


def test_each_table_prints_as_it_finishes_under_a_bar(monkeypatch, capsys):
    """Nothing waits for the end of the run: the training table is on stdout before the sampler starts, the
    sampler's before the fused head starts; the progress bar (stderr) counts every measurement up to its total."""
    seen = {}
    record_entries(monkeypatch, ["bench_sampler", "bench_head"],
                   lambda name, args: seen.setdefault(name, capsys.readouterr()))
    assert bench.main(TINY + ["--losses", "sddlm", "--curriculum=", "--sample_steps", "2", "--long_blocks", "0"]) == 0
    assert "| sddlm |" in seen["bench_sampler"].out and "| sampler |" not in seen["bench_sampler"].out
    assert "| sample.generate (ancestral)" in seen["bench_head"].out and "fused head" not in seen["bench_head"].out
    rest = capsys.readouterr()
    assert "kept logits" in rest.out
    # model, 2 rounds, activations, step MiB; the training table, the sampler, the fused head
    counts = [(int(a), int(b)) for a, b in re.findall(r"\| *(\d+)/(\d+) \[", seen["bench_sampler"].err + rest.err)]
    assert counts[-1] == (8, 8) and {b for _, b in counts} == {8}
    assert [a for a, _ in counts] == sorted(a for a, _ in counts)


# -----------------------------------------------------------------------------
# bench/bench.py: its FLOP formula against torch's counter, an end-to-end run, its flags and its n/a rows

def test_bench_flop_formula_matches_torch_flop_counter():
    """6 N T + 12 n_layer L d T + 6 d V T against every matmul of a forward + backward, counted by torch
    (the math SDPA backend so the attention matmuls are visible); the only gap is the per-sequence adaLN."""
    model = build_model(ModelConfig(vocab_size=300, block_size=64, n_layer=3, n_head=4, n_embd=64, cond_dim=32))
    x = torch.randint(0, 300, (2, 64))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, torch.full((2,), 0.5)).sum().backward()
    # counted FLOPs are exact integers; the formula counts the adaLN (3 layers x 32 x 384) and time-MLP weights
    # per token, their matmuls run per sequence: a 0.4% gap at these shapes (measured 1.0039), inside 1%
    assert counter.get_total_flops() / bench.model_flops_per_step(model, 2, 64) == pytest.approx(1, abs=0.01)


def test_bench_runs_end_to_end_and_reports_every_loss(capsys):
    argv = ["--preset", "tiny", "--block_size", "16", "--batch_size", "2", "--n_layer", "2", "--repeats", "2",
            "--warmup", "1", "--sample_steps", "2", "--head_chunks", "8", "--long_blocks", "4", "--json"]
    assert bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["losses"]) == bench.ALL_LOSSES.split(",") + ["sddlm+curriculum"]
    table = bench.markdown(out)
    assert out["losses"]["sddlm+curriculum"]["step_vs_plain"] > 0 and "| sddlm+curriculum step / sddlm step | " in \
        table and f"| sampler time / its forwards' time | {1 + out['sampler']['overhead']:.3f} (" in table
    for name, r in out["losses"].items():
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["act_bytes"] > 0 and len(r["step_ms_all"]) == 2, name
        assert 0 < r["mfu"] and r["peak_mem_bytes"] is None, name      # CPU: no peak memory, never a guess
    assert out["losses"]["duo"]["step_vs_duo"] == 1.0
    assert out["losses"]["duo"]["act_bytes"] > out["losses"]["sddlm"]["act_bytes"]   # the (B, L, V) float32
    assert out["sampler"]["nfe"] == 3 and math.isfinite(out["sampler"]["overhead"])  # 2 steps + the final one
    assert out["sampler"]["psi_vs_ancestral"] > 0 and math.isfinite(out["sampler"]["psi_overhead"])
    table = bench.markdown(out)
    assert all(f"| {name} |" in table for name in out["losses"]) and "n/a" in table and "(psi, kappa = 0.9)" in table
    head = out["head"]                      # the fused head: 3 output-layer products with kept logits, else 4
    assert head["kept"]["products"] == 3 and head["chunks"] == 8       # counted matmul FLOPs: exact integers
    assert head["recomputed"]["products"] == 4 and head["kept"]["ms"] > 0
    assert "| kept logits | " in table and "| recomputed logits | " in table and "kept / recomputed time: " in table
    assert out["memory_baseline"] is None and out["memory_left"] == {} and "memory" not in table   # CPU: no check
    assert "\n\nmemory: every table, and every row after the first round, ended with memory_allocated where it " \
           "started (1.5 MiB before the first table)" in bench.markdown({**out, "memory_baseline": 1536 * 1024})
    assert "\n\nmemory NOT released (later rows ran with less): sddlm act left 0.0 MiB (4,000 bytes) allocated; " \
           "training rows left 2.0 MiB (2,097,152 bytes) allocated" in \
        bench.markdown({**out, "memory_left": {"sddlm act": 4000, "training rows": 2 ** 21}})
    long = out["long"]                      # 64 tokens in windows of 16: 4, 1 + 48/8 and 1 + 48/4 sampler calls
    assert [(r["stride"], r["windows"], r["predicted"]) for r in long["rows"]] == [(16, 4, 1.0), (8, 7, 1.75),
                                                                                  (4, 13, 3.25)]
    assert long["seq_len"] == 64 and all(r["ms_per_token"] > 0 and r["vs_block"] > 0 for r in long["rows"])
    assert "| sample.generate_long | 8 | 7 | " in table


def test_bench_rejects_bad_flags_in_one_line():
    with pytest.raises(bench.UsageError, match="--losses"):
        bench.parse_args(["--losses", "sddlm,elbo"])
    with pytest.raises(bench.UsageError, match="--preset"):
        bench.parse_args(["--preset", "huge"])
    with pytest.raises(bench.UsageError, match="unknown --head 'lean'; choose from auto, plain, fused, fused_recompute"):
        bench.parse_args(["--head", "lean"])
    assert bench.configs_for(bench.parse_args(["--head", "fused_recompute"]), "sddlm")[0].head == "fused_recompute"
    assert bench.parse_args(["--json", "--compile"]).json is True


def test_bench_prints_n_a_for_what_does_not_fit(monkeypatch, capsys):
    """A row whose step, or a measurement whose tensors, run out of memory reads 'n/a (out of memory)'; the other
    rows, the sampler, the fused head and the reason still come out. What the failed step held -- a tensor in its
    frame (the traceback holds it) and one in a reference cycle -- is gone before the next row starts: Python's
    automatic collection is off here, so nothing but bench frees the cycle."""
    real_step, real_saved = bench.train_step, bench.saved_activation_bytes
    refs, starts = [], []

    def step(run, tcfg, env, x0):
        starts.append([r() is not None for r in refs])
        if tcfg.loss == "duo":
            held = torch.ones(1 << 16)
            cycle = [torch.ones(1 << 16)]
            cycle.append(cycle)
            refs.extend([weakref.ref(held), weakref.ref(cycle[0])])
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.27 GiB. GPU 0 has a total "
                                         "capacity of 79.19 GiB of which 1.20 GiB is free.")
        return real_step(run, tcfg, env, x0)

    def saved(fn, params):
        starts.append([r() is not None for r in refs])
        if saved.calls == 0:
            saved.calls += 1
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1000 bytes")
        return real_saved(fn, params)
    saved.calls = 0
    monkeypatch.setattr(bench, "train_step", step)
    monkeypatch.setattr(bench, "saved_activation_bytes", saved)
    argv = ["--preset", "tiny", "--block_size", "16", "--batch_size", "2", "--n_layer", "1", "--repeats", "1",
            "--warmup", "0", "--sample_steps", "1", "--losses", "duo,sddlm,ar", "--curriculum", "", "--head_chunks", "2"]
    gc.collect()
    gc.disable()
    try:
        assert bench.main(argv) == 0
    finally:
        gc.enable()
    table = capsys.readouterr().out
    assert len(refs) == 2 and len(starts) > 3 and all(alive == [False, False] for alive in starts[1:]), starts
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert rows["duo"].startswith("| duo | n/a (out of memory) | n/a | ") and rows["duo"].count("n/a") == 10
    assert "| sddlm | " in table and "| ar | " in table and "(out of memory)" not in rows["ar"]
    assert " n/a (out of memory) | " in rows["sddlm"]       # its act MiB measurement did not fit
    assert "duo step: CUDA out of memory (tried to allocate 12.27 GiB; 1.20 GiB of 79.19 GiB free)" in table
    assert "sddlm act: CPU out of memory" in table and "| sample.generate (ancestral) | " in table
    assert "| kept logits | " in table
