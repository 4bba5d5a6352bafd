"""The run's plumbing (plumbing/run.py): a compiled run compiles each kind of step before its first step, none
after; the log dates every record from the launch, its last record is the run's end, and the console says, after
the first step, where the start went (on the CPU: no memory probe)."""
import contextlib
import functools
import io
import json
import re

import pytest
import torch
import torch._dynamo.utils

import test_train
import train
from test_train import corpus  # noqa: F401  (the fixture)


@pytest.fixture(scope="module")
def compiled_run(corpus, tmp_path_factory):  # noqa: F811
    """A tiny --compile 1 run whose curriculum ends at step 3 of 6, with the graphs dynamo made after each step.
    TorchDynamo decides what to compile and when (its guards) before any backend runs, so its "eager" backend
    counts the same compilations as Inductor, whose C++ build would take minutes on a 2-core CPU."""
    out, graphs = tmp_path_factory.mktemp("run"), []
    mp = pytest.MonkeyPatch()
    mp.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    real = train.train_step
    mp.setattr(train, "train_step", lambda *a, **k: (real(*a, **k), graphs.append(
        torch._dynamo.utils.counters["stats"]["unique_graphs"]))[0])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert test_train.run(["--compile", "1", "--curriculum_iters", "3", "--max_iters", "6",
                                   "--log_interval", "1", "--eval_interval", "100"], out, corpus) == 0
    finally:
        mp.undo()
        torch._dynamo.reset()
    return [json.loads(line) for line in open(out / "log.jsonl")], graphs, printed.getvalue()


def test_compiled_run_compiles_nothing_after_its_first_step(compiled_run):
    records, graphs, _ = compiled_run
    assert any(r.get("event") == "curriculum_end" and r["step"] == 3 for r in records)
    assert len(graphs) == 6 and graphs[0] >= 2 and graphs == graphs[:1] * 6, graphs


def test_log_records_carry_seconds_since_launch_and_the_start(compiled_run):
    records, _, printed = compiled_run
    times = [r["t"] for r in records]
    assert len(times) >= 8 and times == sorted(times) and times[0] > 0
    assert records[-1] == {"step": 6, "t": times[-1], "event": "end"}          # after the model folder: the run's end
    line = next(line for line in printed.splitlines() if line.startswith("started in"))
    assert printed.index(line) < printed.index("step 3: the curriculum ends")           # printed after step 1
    total, parts = re.fullmatch(r"started in ([0-9.]+) s: (.*)", line).groups()
    parts = dict((name, float(s)) for name, s in re.findall(r"([a-z -]+?) ([0-9.]+) s(?:, |$)", parts))
    assert list(parts) == ["start-up", "data", "model", "compilation", "first step"], parts
    assert abs(sum(parts.values()) - float(total)) <= 0.05 * len(parts) + 0.05       # each rounded to 0.1 s
    assert float(total) - 0.05 <= records[0]["t"] and records[0]["step"] == 1       # step 1's record comes after
