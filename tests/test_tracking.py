"""--tensorboard and --wandb hold the scalars of log.jsonl at its steps, only rank 0 logs, a resumed run continues
the same step axis (and wandb run), and a missing package is one line before any work (CPU, offline)."""
import json
import os
import random
import sys
import types
from types import SimpleNamespace

import pytest

import train
from plumbing.cli import UsageError
from plumbing import tracking
from plumbing.runlog import Log

TINY = ["--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--block_size", "16", "--batch_size", "4",
        "--warmup_iters", "2", "--num_samples", "0", "--eval_iters", "1", "--log_interval", "5",
        "--eval_interval", "10", "--ckpt_interval", "10", "--tokenizer", "sp_train:300",
        "--curriculum_iters", "0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, one_thread):
    d = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["cat", "dog", "bird", "fish", "tree", "house", "sees", "likes", "finds", "eats", "the", "a"]
    (d / "corpus.txt").write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(40)) for _ in range(400)))
    return str(d / "corpus.txt"), str(d / "data")


def run(args, out_dir, corpus):
    path, data_dir = corpus
    return train.main(TINY + ["--dataset", path, "--data_dir", data_dir, "--out_dir", str(out_dir)] + args)


def log_scalars(out_dir):
    """{key: [(step, value), ...]} of log.jsonl's numbers, the trackers' reference."""
    series = {}
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        for record in map(json.loads, f):
            for k, v in tracking.scalars(record).items():
                series.setdefault(k, []).append((record["step"], v))
    return series


def test_tensorboard_events_equal_log_jsonl_across_a_resume(corpus, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter
    assert run(["--max_iters", "10", "--tensorboard"], tmp_path, corpus) == 0
    # A run killed after logging step 15 but before its next checkpoint: the resume from step 10 logs 15 again,
    # and its first try must not stay beside the second (log.jsonl drops it the same way).
    with SummaryWriter(os.path.join(tmp_path, tracking.TENSORBOARD_DIR)) as w:
        w.add_scalar("loss", 123.0, 15)
    with open(os.path.join(tmp_path, "log.jsonl"), "a") as f:
        f.write(json.dumps({"step": 15, "loss": 123.0}) + "\n")
    assert run(["--max_iters", "20", "--tensorboard", "--resume", "1"], tmp_path, corpus) == 0
    expected = log_scalars(tmp_path)
    assert {"loss", "lr", "tokens_per_s", "val_ppl"} <= set(expected)
    assert [s for s, _ in expected["loss"]] == [5, 10, 15, 20] and 123.0 not in [v for _, v in expected["loss"]]
    events = EventAccumulator(os.path.join(tmp_path, tracking.TENSORBOARD_DIR)).Reload()
    assert set(events.Tags()["scalars"]) == set(expected)
    for key, points in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in points], key
        # events store float32: one rounding, <= 2^-24 relative
        assert all(v == pytest.approx(w, rel=1e-6) for (_, v), (_, w) in zip(got, points)), key
    assert "config" in "".join(events.Tags()["tensors"])


class StandInWandb(types.ModuleType):
    """Records what a run sends to wandb, so that CI, which does not install wandb, checks the calls (the test
    with the real package, offline, reads its run files back)."""

    def __init__(self):
        super().__init__("wandb")
        self.runs = []

    def init(self, **kwargs):
        run = SimpleNamespace(kwargs=kwargs, id=kwargs["id"] or f"run{len(self.runs)}", rows=[], metrics=[],
                              finished=False)
        run.log, run.define_metric = run.rows.append, lambda name, **kw: run.metrics.append((name, kw))
        run.finish = lambda: setattr(run, "finished", True)
        self.runs.append(run)
        return run

    def Table(self, columns, data):   # noqa: N802 (wandb's name)
        return ("table", columns, data)


def test_wandb_gets_log_jsonl_and_resume_continues_the_run(corpus, tmp_path,
                                                                                         monkeypatch):
    wandb = StandInWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: object())
    assert run(["--max_iters", "10", "--wandb"], tmp_path, corpus) == 0
    assert run(["--max_iters", "20", "--wandb", "--resume", "1", "--num_samples", "2"], tmp_path, corpus) == 0
    first, second = wandb.runs
    assert first.finished and second.finished
    assert first.kwargs["resume"] is None and second.kwargs == {**second.kwargs, "id": first.id, "resume": "allow"}
    assert first.kwargs["config"]["train_config"]["max_iters"] == 10
    assert first.kwargs["config"]["model_config"]["n_embd"] == 32
    assert ("*", {"step_metric": "step"}) in first.metrics
    got = {}
    for row in first.rows + second.rows:
        for k, v in row.items():
            if k not in ("step", "samples"):
                got.setdefault(k, []).append((row["step"], v))
    assert got == log_scalars(tmp_path)
    tables = [row for row in second.rows if "samples" in row]
    assert len(tables) == 1 and tables[0]["step"] == 20
    kind, columns, data = tables[0]["samples"]
    assert columns == ["step", "sample"] and len(data) == 2 and all(isinstance(t, str) and t for _, t in data)


@pytest.mark.parametrize("flag,package", [("--wandb", "wandb"), ("--tensorboard", "tensorboard")])
def test_missing_tracker_package_is_one_line_before_any_work(flag, package, corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UsageError) as e:
        run(["--max_iters", "10", flag], tmp_path / "out", corpus)
    assert str(e.value) == f"{flag} needs the {package} package: pip install {package}"
    assert not os.path.exists(tmp_path / "out")


def test_only_rank0_opens_trackers(tmp_path, monkeypatch):
    opened = []
    monkeypatch.setattr("plumbing.runlog.open_trackers", lambda cfg, step, config: opened.append(step) or [])
    cfg = SimpleNamespace(out_dir=str(tmp_path), batch_size=4, block_size=16, loss="sddlm", max_iters=10,
                          resume=False, tensorboard=True)
    with Log(cfg, SimpleNamespace(master=False), 0) as log:
        log.progress(5, 1.0, 1e-3)
    assert opened == [] and not os.listdir(tmp_path)
    with Log(cfg, SimpleNamespace(master=True), 0) as log:
        log.progress(5, 1.0, 1e-3)
    assert opened == [0]


def wandb_history(path):
    """The history rows of a wandb offline run file (run-ID.wandb), read without wandb's reader, which 0.31 no
    longer ships in Python: a 7-byte header, then LevelDB-log records (crc32, length, kind; kinds 1 = whole,
    2/3/4 = first/middle/last piece) in 32 KiB blocks, each record a serialized wandb Record protobuf."""
    from wandb.proto import wandb_internal_pb2
    data, pos, piece, rows = open(path, "rb").read(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:                          # a block's tail too short for a header is padding
            pos += left
            continue
        n, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if n == 0 and kind == 0:
            pos += left
            continue
        piece, pos = piece + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(piece)
            piece = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_real_wandb_offline_files_hold_log_jsonl_across_a_resume(corpus, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("wandb.proto.wandb_internal_pb2")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert run(["--max_iters", "10", "--wandb"], tmp_path, corpus) == 0
    assert run(["--max_iters", "20", "--wandb", "--resume", "1", "--num_samples", "2"], tmp_path, corpus) == 0
    import wandb
    wandb.teardown()   # in-process runs: the service finishes writing the run files when it shuts down (a script's exit)
    with open(os.path.join(tmp_path, tracking.WANDB_ID_FILE)) as f:
        run_id = f.read().strip()
    files = sorted(os.path.join(d, f"run-{run_id}.wandb") for d in os.scandir(os.path.join(tmp_path, "wandb"))
                   if d.name.startswith("offline-run-"))
    assert len(files) == 2 and all(map(os.path.exists, files))       # both runs wrote to the same run id
    got = {}
    rows = [row for path in files for row in wandb_history(path)]
    for row in rows:
        for k, v in row.items():
            if not k.startswith("_") and k != "step" and not k.startswith("samples"):
                got.setdefault(k, []).append((row["step"], v))
    assert {k: sorted(v) for k, v in got.items()} == log_scalars(tmp_path)   # the two files' order: not by name
    assert [row["step"] for row in rows if "samples/nrows" in row] == [20]
    assert [row["samples/nrows"] for row in rows if "samples/nrows" in row] == [2]
