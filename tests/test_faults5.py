"""Nothing lost, nothing silent, part IV (issue 38), through the real scripts: outputs replace only what sddlm wrote
(never a user's file, a companion file, a link, a pipe or a device node), damaged weights are refused (a NaN, a
changed byte, a flipped bit, integer tensors), a launch environment is checked as a whole and a rank waiting for the
others stops on a signal or a timeout, absurd sizes are refused before any allocation naming the flag or field, and
every model config read from disk is checked as its flags are, naming the file and the field. Each fault is ONE
'error:' line, no traceback, exit code 2 (130 for a signal), and nothing already written changes (md5 before and
after). Script cases run in batches (tests/test_faults.py's runner)."""
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

import train
from model import ModelConfig, build_model
from plumbing import distributed, files, integrity, memory
from plumbing.cli import UsageError
from test_faults import ENV, HERE, case, md5s, run_batches
from test_faults3 import check
from test_train import TINY, _corpus


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _edit_checkpoint(src, dst, edit):
    ck = torch.load(src, weights_only=True)
    edit(ck)
    torch.save(ck, dst)
    return str(dst)


def _edit_folder(src, dst, edit_config=None, edit_bytes=None):
    shutil.copytree(src, dst)
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    if edit_bytes is not None:
        edit_bytes(dst)
    return str(dst)


def _flip_bit_in_a_tensor(path, member_name):
    """One bit of a tensor's bytes inside ckpt.pt changed, the zip's index (and its CRCs) left as written."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(member_name))
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        n, e = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        at = info.header_offset + 30 + n + e + info.file_size // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A corpus, its prepared data and a 2-step run (ckpt.pt with EMA, its model folder with the weights' sha256)."""
    root = tmp_path_factory.mktemp("faults5")
    _corpus(root / "corpus.txt")
    b = SimpleNamespace(root=root, corpus=str(root / "corpus.txt"), data_dir=str(root / "data"), out=root / "run")
    assert train.main(TINY + ["--dataset", b.corpus, "--data_dir", b.data_dir, "--out_dir", str(b.out),
                              "--max_iters", "2", "--eval_interval", "2"]) == 0
    b.ckpt, b.model = str(b.out / "ckpt.pt"), b.out / "model"
    return b


# -----------------------------------------------------------------------------------------------
# fast: the rules themselves

def test_an_output_is_new_or_a_regular_file_sddlm_wrote(tmp_path):
    t = tmp_path
    (t / "notes.txt").write_text("my notes\n")
    (t / "res.json").write_text('{"mine": 1}\n')
    (t / "ours.json").write_text(json.dumps({files.WRITTEN_BY: files.signature("eval_ppl.py"), "x": 1}))
    (t / "ours.md").write_text(files.text_mark("figures/plot.py") + "\n| a |\n")
    (t / "ours.jsonl").write_text(json.dumps({files.WRITTEN_BY: "sddlm sample.py", "sample": 0}) + "\n{}\n")
    (t / "old_run_config.json").write_text(json.dumps({"train_config": {}, "model_config": {}, "meta": {}}))
    torch.save({"model": {}, "model_config": {}}, t / "ckpt.pt")
    torch.save({"weights": torch.zeros(2)}, t / "theirs.pt")
    os.symlink(t / "ours.json", t / "link.json")
    os.mkfifo(t / "fifo")
    for name in ("new.json", "ours.json", "ours.md", "ours.jsonl", "old_run_config.json", "ckpt.pt"):
        files.check_output(str(t / name), "--out")
    for name, words in [("notes.txt", "was not written by sddlm"), ("res.json", "was not written by sddlm"),
                        ("theirs.pt", "was not written by sddlm"), ("link.json", "is a symbolic link"),
                        ("fifo", "is a named pipe"), (".", "is a folder")]:
        with pytest.raises(UsageError, match=words):
            files.check_output(str(t / name), "--out")
    # the atomic replace itself refuses what is not a regular file of ours, whoever calls it; appending, what is not
    # a regular file
    for name in ("link.json", "fifo", "notes.txt"):
        with pytest.raises(OSError, match="refusing to"):
            files.save_atomic(str(t / name), lambda tmp: open(tmp, "w").close())
    for name in ("link.json", "fifo"):
        with pytest.raises(OSError, match="refusing to write"):
            files.append_jsonl(str(t / name), [{"a": 1}])
    assert os.path.islink(t / "link.json") and stat.S_ISFIFO(os.lstat(t / "fifo").st_mode)
    assert (t / "notes.txt").read_text() == "my notes\n" and sorted(os.listdir(t)) == sorted(
        ["notes.txt", "res.json", "ours.json", "ours.md", "ours.jsonl", "old_run_config.json", "ckpt.pt",
         "theirs.pt", "link.json", "fifo"])                                 # no temp file left behind


def test_model_numel_counts_what_the_model_allocates():
    """model_numel, from the shapes alone, against the tensors a built model holds (an independent route)."""
    for kw in [dict(n_layer=2, n_embd=64, n_head=2, vocab_size=320, block_size=32),
               dict(arch="llama", time_cond=False, n_layer=3, n_embd=64, n_head=4, vocab_size=1000, vocab_multiple=128,
                    block_size=16, mlp_hidden=100),
               dict(time_cond=False, causal=True, n_layer=1, n_embd=32, n_head=2, vocab_size=77, vocab_multiple=8,
                    block_size=8, cond_dim=16)]:
        config = ModelConfig(**kw)
        model = build_model(config)
        assert memory.model_numel(config) == (sum(p.numel() for p in model.parameters()),
                                              sum(b.numel() for b in model.buffers()))


def test_the_zip_crc_finds_one_flipped_bit(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.arange(4096, dtype=torch.float32)}, "model_config": {}}, path)
    with open(path, "rb") as f:
        integrity.check_zip(f, str(path))                     # as written: passes
    _flip_bit_in_a_tensor(path, "data/0")
    with open(path, "rb") as f, pytest.raises(ValueError, match="data/0 fails its CRC-32 check"):
        integrity.check_zip(f, str(path))


def test_weights_must_be_finite_floats():
    integrity.check_weights({"w": torch.ones(3), "b": torch.zeros(0)}, "ckpt.pt", "model")
    for bad, words in [(torch.tensor([1.0, float("nan")]), "not finite"), (torch.tensor([float("-inf")]), "not finite"),
                       (torch.ones(2, dtype=torch.int64), "holds int64 values, not weights")]:
        with pytest.raises(UsageError, match=words):
            integrity.check_weights({"w": torch.ones(2), "x": bad}, "ckpt.pt", "ema")


@pytest.mark.parametrize("env, words", [
    ({}, None), ({"WORLD_SIZE": "1"}, None), ({"LOCAL_RANK": "0"}, None),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}, None),
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a whole number"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK and MASTER_ADDR and MASTER_PORT are not set"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR and MASTER_PORT are not set"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE must be >= 1"),
    ({"RANK": "1"}, "RANK=1 is not below WORLD_SIZE=1"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not a port"),
    ({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
      "MASTER_PORT": "1"}, "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     "LOCAL_WORLD_SIZE=3 is not in 1..WORLD_SIZE=2"),
])
def test_the_launch_environment_is_checked_as_a_whole(env, words):
    if words is None:
        distributed.launch_env(env)
    else:
        with pytest.raises(distributed.LaunchError, match=words):
            distributed.launch_env(env)


# -----------------------------------------------------------------------------------------------
# the scripts, in batches

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the cores and the memory")
def test_launch_environments_threads_and_absurd_sizes_are_refused_at_start(tmp_path):
    """Each of these ran until the machine gave up (or crashed) before: now one line in a few seconds, before any
    data are prepared or any model allocated, naming the variable, the flag or the field; nothing is created."""
    t = tmp_path
    run = lambda name: ["--out_dir", t / name, "--max_iters", "1"]
    ddp = {"WORLD_SIZE": "2", "RANK": "0"}
    cases = [
        case("train.py", *run("a"), cwd=t, env={"WORLD_SIZE": "2", "RANK": "0"},
             expect="WORLD_SIZE=2 but MASTER_ADDR and MASTER_PORT are not set"),
        case("train.py", *run("b"), cwd=t, env={"WORLD_SIZE": "2"}, expect="WORLD_SIZE=2 but RANK and MASTER_ADDR"),
        case("train.py", *run("c"), cwd=t, env={"WORLD_SIZE": "abc"}, expect="WORLD_SIZE='abc' is not a whole number"),
        case("train.py", *run("d"), cwd=t, env={**ddp, "MASTER_ADDR": "x", "MASTER_PORT": "1", "LOCAL_RANK": "5"},
             expect="contradictory: LOCAL_RANK=5 is not below LOCAL_WORLD_SIZE=2"),
        case("distillation/distill.py", "--init", t / "none.pt", *run("e"), cwd=t, env={"WORLD_SIZE": "abc"},
             expect="WORLD_SIZE='abc' is not a whole number"),
        case("distillation/distill.py", "--init", t / "none.pt", *run("f"), cwd=t, env={"WORLD_SIZE": "2"},
             expect="WORLD_SIZE=2 but RANK and MASTER_ADDR"),
        # a MASTER_ADDR that does not resolve is named (rank 0 used to blame the port after 5 s); a rank other than 0
        # that gives up waiting says so itself (it used to exit 2 without a line: rank 0 speaks for all, but is gone)
        *[case(script, *extra, *run(f"addr{rank}"), cwd=t, env={**ddp, "RANK": rank, "MASTER_ADDR":
                                                                "no.such.host.invalid", "MASTER_PORT": "29511"},
               expect=f"rank {rank}: MASTER_ADDR=no.such.host.invalid does not resolve to an address")
          for rank in ("0", "1") for script, extra in (("train.py", []),
                                                        ("distillation/distill.py", ["--init", t / "none.pt"]))],
        case("train.py", *run("alone"), "--dist_timeout", "1", cwd=t,
             env={**ddp, "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())},
             expect="rank 1: rank 0's store did not answer within --dist_timeout 1 s at 127.0.0.1:"),
        case("train.py", *run("g"), "--threads", "1000000", cwd=t, expect="--threads 1000000 asks for more threads"),
        case("train.py", *run("h"), cwd=t, env={"OMP_NUM_THREADS": "1000000"},
             expect="OMP_NUM_THREADS=1000000 asks for more threads"),
        case("bench/bench.py", "--threads", "1000000", cwd=t, expect="--threads 1000000 asks for more threads"),
        case("bench/bench.py", "--repeats", "1", cwd=t, env={"OMP_NUM_THREADS": "1000000"},
             expect="OMP_NUM_THREADS=1000000 asks for more threads"),
        case("train.py", *run("i"), "--n_layer", "1000000000", cwd=t, expect="--n_layer 1000000000: training"),
        case("train.py", *run("j"), "--n_embd", "2000000", "--n_head", "2", cwd=t, expect="--n_embd 2000000: training"),
    ]
    check(run_batches(cases))
    assert sorted(os.listdir(t)) == []          # no data folder prepared, no out_dir made


@pytest.mark.slow
def test_outputs_replace_only_what_sddlm_wrote(base, tmp_path):
    """A user's --out, a companion .md never named, links, pipes and device nodes are refused before any work; what
    sddlm wrote is replaced (eval_ppl.py run twice into one --out)."""
    t = tmp_path
    (t / "notes.txt").write_text("my notes\n")
    (t / "res.json").write_text('{"mine": 1}\n')
    (t / "only_md").mkdir()
    (t / "only_md" / "res.md").write_text("my table\n")
    (t / "table.md").write_text("my table\n")
    (t / "mc.jsonl").write_text(json.dumps({"context": "the cat", "choices": [" sees", " eats"], "gold": 0}) + "\n")
    os.symlink(t / "notes.txt", t / "link.jsonl")
    os.mkfifo(t / "fifo.jsonl")
    shutil.copytree(base.model, t / "linked_model")
    os.remove(t / "linked_model" / "model.safetensors")
    os.symlink(base.model / "model.safetensors", t / "linked_model" / "model.safetensors")
    devices = []
    try:                                         # as root a device node's own rename is the danger (/dev/null)
        os.mknod(t / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        devices = ["null"]
    except (PermissionError, OSError):
        pass
    before = md5s(base.root)
    ppl = ["eval_ppl.py", "--ckpt", base.ckpt, "--max_batches", "1", "--mc_draws", "1"]
    evals = ",".join(os.path.join(HERE, "figures", "tiny", "evals", f) for f in
                     sorted(os.listdir(os.path.join(HERE, "figures", "tiny", "evals"))))
    ds = ["downstream/eval_downstream.py", "--ckpt", base.ckpt, "--jsonl", t / "mc.jsonl", "--mc_draws", "1"]
    cases = [
        case(*ppl, "--out", t / "notes.txt", cwd=t, expect=f"--out {t}/notes.txt exists and was not written by sddlm"),
        case(*ds, "--out", t / "res.json", cwd=t, expect=f"--out {t}/res.json exists and was not written by sddlm"),
        case(*ds, "--out", t / "only_md" / "res.json", cwd=t,
             expect=f"--out {t}/only_md/res.md exists and was not written by sddlm"),
        case("sample.py", "--ckpt", base.ckpt, "--num_samples", "1", "--steps", "2", "--out", t / "link.jsonl", cwd=t,
             expect="link.jsonl is a symbolic link"),
        case("sample.py", "--ckpt", base.ckpt, "--num_samples", "1", "--steps", "2", "--out", t / "fifo.jsonl", cwd=t,
             expect="fifo.jsonl is a named pipe, not a regular file"),          # (it used to wait for a reader)
        case("figures/plot.py", "--evals", evals, "--table", t / "table.md", "--overwrite", "1", "--out_dir",
             t / "plots", cwd=t, expect=f"--table {t}/table.md exists and was not written by sddlm"),
        case("hub/pretrained.py", "--ckpt", base.ckpt, "--out", t / "linked_model", cwd=t,
             expect="its model.safetensors is a symbolic link, not a file sddlm wrote"),
        *[case(*ppl, "--out", t / d, cwd=t, expect=f"--out {t}/{d} is a character device") for d in devices],
        *[case(*ds, "--out", t / d, cwd=t, expect=f"--out {t}/{d} is a character device") for d in devices],
        case(*ppl, "--out", t / "ours.json", cwd=t, expect=["ok", '"metric": "nelbo"']),     # new: written
    ]
    again = [case(*ppl, "--out", t / "ours.json", cwd=t, expect=["ok", '"metric": "nelbo"'])]   # ours: replaced
    check(run_batches(cases) + run_batches(again))
    assert md5s(base.root) == before
    assert (t / "notes.txt").read_text() == "my notes\n" and (t / "res.json").read_text() == '{"mine": 1}\n'
    assert (t / "only_md" / "res.md").read_text() == "my table\n" and (t / "table.md").read_text() == "my table\n"
    assert os.path.islink(t / "link.jsonl") and stat.S_ISFIFO(os.lstat(t / "fifo.jsonl").st_mode)
    assert os.path.islink(t / "linked_model" / "model.safetensors")
    assert all(stat.S_ISCHR(os.lstat(t / d).st_mode) for d in devices)
    assert json.loads((t / "ours.json").read_text())[files.WRITTEN_BY] == "sddlm eval_ppl.py"
    assert not (t / "only_md" / "res.json").exists() and not (t / "plots").exists()


@pytest.mark.slow
def test_damaged_weights_are_refused_by_every_reader(base, tmp_path):
    t = tmp_path

    def nan_ema(ck):
        ck["ema"][next(iter(ck["ema"]))].view(-1)[0] = float("nan")
    nan = _edit_checkpoint(base.ckpt, t / "nan_ema.pt", nan_ema)
    ints = _edit_checkpoint(base.ckpt, t / "ints.pt", lambda ck: ck["ema"].update(
        {k: v.to(torch.int64) for k, v in ck["ema"].items()}))
    flipped = t / "flipped.pt"
    shutil.copy(base.ckpt, flipped)
    _flip_bit_in_a_tensor(flipped, "data/0")                     # the first tensor saved: the model's embedding

    def change_a_byte(folder):
        path = folder / "model.safetensors"
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    changed = _edit_folder(base.model, t / "changed_model", edit_bytes=change_a_byte)
    ppl = lambda ckpt: ["eval_ppl.py", "--ckpt", ckpt, "--max_batches", "1"]
    cases = [
        case(*ppl(nan), cwd=t, expect=f"{nan}: its weights are not finite (ema "),
        case("sample.py", "--ckpt", nan, "--num_samples", "1", "--steps", "2", "--out", "", cwd=t,
             expect=f"{nan}: its weights are not finite"),
        case("hub/pretrained.py", "--ckpt", nan, "--out", t / "exported", cwd=t, expect="its weights are not finite"),
        case("distillation/distill.py", "--init", nan, "--out_dir", t / "dcd", cwd=t,
             expect="its weights are not finite"),
        case(*ppl(ints), cwd=t, expect="holds int64 values, not weights"),
        case(*ppl(flipped), cwd=t, expect="fails its CRC-32 check"),
        case("sample.py", "--ckpt", flipped, "--num_samples", "1", "--steps", "2", "--out", "", cwd=t,
             expect="fails its CRC-32 check"),
        case(*ppl(changed), cwd=t, expect="model.safetensors is not the file its config.json records (sha256"),
        case(*ppl(str(base.model)), cwd=t, expect=["ok", '"metric": "nelbo"']),       # as exported: read
    ]
    check(run_batches(cases))
    assert not (t / "exported").exists() and not (t / "dcd").exists()


@pytest.mark.slow
def test_model_configs_from_disk_are_checked_as_their_flags_naming_file_and_field(base, tmp_path):
    t = tmp_path

    def model_config(**fields):
        return lambda ck: ck["model_config"].update(fields)
    head0 = _edit_checkpoint(base.ckpt, t / "n_head0.pt", model_config(n_head=0))
    neg = _edit_checkpoint(base.ckpt, t / "n_embd_neg.pt", model_config(n_embd=-64))
    schedule = _edit_checkpoint(base.ckpt, t / "schedule.pt", lambda ck: ck["train_config"].update(noise_schedule="x"))
    folder = lambda name, **fields: _edit_folder(base.model, t / name, lambda c: c.update(fields))
    f_head0, f_tok = folder("f_head0", n_head=0), folder("f_tok", tokenizer="abc")
    f_layers, f_str = folder("f_layers", n_layer=10 ** 9), folder("f_str", n_head="2")
    f_objective = folder("f_objective", objective="nope")
    broken = _edit_folder(base.model, t / "broken", edit_bytes=lambda d: (d / "config.json").write_text('{"format":'))
    duo = t / "duo"
    duo.mkdir()
    (duo / "config.json").write_text("{not json")
    (duo / "model.safetensors").write_bytes(b"")
    samp = lambda ckpt: ["sample.py", "--ckpt", ckpt, "--num_samples", "1", "--steps", "2", "--out", ""]
    cases = [
        case(*samp(head0), cwd=t, expect=f"{head0}: model_config.n_head must be an int >= 1, got 0"),
        case("eval_ppl.py", "--ckpt", head0, cwd=t, expect=f"{head0}: model_config.n_head must be an int >= 1"),
        case("hub/pretrained.py", "--ckpt", head0, "--out", t / "exported", cwd=t, expect="model_config.n_head must be"),
        case("distillation/distill.py", "--init", head0, "--out_dir", t / "dcd", cwd=t,
             expect="model_config.n_head must be an int >= 1"),
        case("eval_ppl.py", "--ckpt", neg, cwd=t, expect=f"{neg}: model_config.n_embd must be an int >= 2, got -64"),
        case(*samp(schedule), cwd=t, expect=f"{schedule}: its field train_config.noise_schedule holds 'x'"),
        case(*samp(f_head0), cwd=t, expect=f"{f_head0}/config.json: n_head must be an int >= 1, got 0"),
        case("eval_ppl.py", "--ckpt", f_head0, cwd=t, expect=f"{f_head0}/config.json: n_head must be"),
        case(*samp(f_tok), cwd=t, expect=f"{f_tok}/config.json: its field tokenizer holds 'abc'"),
        case(*samp(f_str), cwd=t, expect=f"{f_str}/config.json: n_head must be an int >= 1, got '2'"),
        case(*samp(f_objective), cwd=t, expect=f"{f_objective}/config.json: its field objective holds 'nope'"),
        case(*samp(broken), cwd=t, expect=f"{broken}/config.json is not valid JSON"),
        case(*samp(f_layers), cwd=t, expect=f"{f_layers}/config.json: the weights (model.safetensors) do not fit its "
                                            f"n_layer 1000000000"),
        case(*samp(f"duo:{duo}"), cwd=t, expect=f"{duo}/config.json is not valid JSON"),
    ]
    check(run_batches(cases))
    assert not (t / "exported").exists() and not (t / "dcd").exists()


def test_a_model_folder_too_large_for_the_machine_names_its_field(tmp_path):
    """The memory check itself (a consistent folder cannot be made that large here): the field whose value costs the
    most is named, as the caller names it."""
    config = ModelConfig(n_layer=10 ** 9, n_embd=64, n_head=2, vocab_size=320, block_size=32)
    with pytest.raises(UsageError, match=r"out/model/config.json: n_layer 1000000000: the model needs at least .*"
                                         r"more than the .* of (available RAM|memory left|address space)"):
        memory.check_model_memory(config, "cpu", lambda field: f"out/model/config.json: {field}")
    wide = ModelConfig(n_layer=2, n_embd=2 * 10 ** 6, n_head=2, vocab_size=320, block_size=32)
    with pytest.raises(UsageError, match="config.json: n_embd 2000000"):
        memory.check_model_memory(wide, "cpu", lambda field: f"config.json: {field}")
    memory.check_model_memory(ModelConfig(n_layer=2, n_embd=64, n_head=2, vocab_size=320, block_size=32), "cpu",
                              lambda field: field)       # a small one passes


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals and /proc")
def test_a_rank_waiting_for_the_others_says_whom_and_stops_on_a_signal_or_its_timeout(tmp_path):
    """WORLD_SIZE=2 with rank 1 never started: rank 0 says it waits for rank 1, a SIGTERM ends it with 130 at once
    (it used to sit in one C++ call, deaf to signals), and --dist_timeout ends it with 2 and the rank that never
    came."""
    procs = {}
    for name, extra in (("signal", []), ("timeout", ["--dist_timeout", "3"])):
        env = {**ENV, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(_free_port()), "TQDM_DISABLE": "1"}
        procs[name] = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), "--out_dir",
                                        str(tmp_path / name), "--max_iters", "1", *extra], cwd=tmp_path, env=env,
                                       stderr=subprocess.PIPE, text=True)
    p = procs["signal"]
    first = p.stderr.readline()                 # the wait starts with its line (after the imports)
    assert "rank 0: waiting for rank 1 of 2 to join at 127.0.0.1:" in first, first
    p.send_signal(signal.SIGTERM)
    start = time.monotonic()
    rest = p.communicate(timeout=30)[1]
    assert p.returncode == 130 and time.monotonic() - start < 5, (p.returncode, rest)
    assert rest.strip().splitlines()[-1] == "error: interrupted by SIGTERM" and "Traceback" not in rest, rest
    q = procs["timeout"]
    err = q.communicate(timeout=60)[1]
    assert q.returncode == 2 and "Traceback" not in err, (q.returncode, err)
    assert err.strip().splitlines()[-1].startswith(
        "error: rank 0: rank 1 of 2 did not join within --dist_timeout 3 s at 127.0.0.1:"), err
    assert not (tmp_path / "signal").exists() and not (tmp_path / "timeout").exists()


# -----------------------------------------------------------------------------------------------
# the same classes, further cases (a second sweep): lock files, both weight sets, messages that name what is there

def test_lock_files_are_never_written_through_nor_a_users_file_replaced(tmp_path):
    """out_dir/.lock (train.py, distill.py) and a data folder's <data_dir>.lock (prepare.py) are opened only when
    they are absent or a lock of ours (empty, or a record naming a pid and a host); a link to elsewhere, a user's
    file, a pipe or a folder is refused in one line naming it, and left as it was."""
    from plumbing import lock
    t = tmp_path
    (t / "theirs.txt").write_text("my notes\n")
    for name, make, words in [("link", lambda p: os.symlink(t / "theirs.txt", p), "is a symbolic link"),
                              ("mine", lambda p: p.write_text("my lock notes\n"),
                               "is a file that is not an sddlm lock"),
                              ("pipe", lambda p: os.mkfifo(p), "is a named pipe"),
                              ("dir", lambda p: p.mkdir(), "is a folder")]:
        (t / name).mkdir()
        make(t / name / ".lock")
        with pytest.raises(UsageError, match=f"--out_dir {t / name}: {t / name}/.lock {words}"):
            lock.acquire_folder(str(t / name))
        assert files.kind_of(str(t / name / ".lock")) == files.kind_of(str(t / name / ".lock"))   # still there
        assert os.path.lexists(t / name / ".lock")
    assert (t / "theirs.txt").read_text() == "my notes\n" and (t / "mine" / ".lock").read_text() == "my lock notes\n"
    for name, content in (("empty", ""), ("killed", '{"pid": 999999999, "host": "h", "started": 0}\n')):
        (t / name).mkdir()
        (t / name / ".lock").write_text(content)         # a killed run's lock (or one killed before writing): taken
        held = lock.acquire_folder(str(t / name))
        assert json.loads((t / name / ".lock").read_text())["pid"] == os.getpid()
        held.release()


def test_an_output_replaces_only_an_earlier_output_of_its_own_script(tmp_path):
    """sddlm's files are not all alike: eval_ppl.py --out run/ckpt.pt replaced a trained checkpoint with a 1 KB JSON
    (exit code 0), and a run's config.json or sample.py's samples alike. writer_of names the script by content."""
    t = tmp_path
    (t / "ppl.json").write_text(json.dumps({files.WRITTEN_BY: files.signature("eval_ppl.py"), "x": 1}))
    (t / "table.md").write_text(files.text_mark("downstream/eval_downstream.py") + "\n| a |\n")
    (t / "run_config.json").write_text(json.dumps({"train_config": {}, "model_config": {}, "meta": {}}))
    (t / "samples.jsonl").write_text(json.dumps({"sample": 0, "ids": [1], "settings": {}}) + "\n")
    torch.save({"model": {}, "model_config": {}}, t / "ckpt.pt")
    assert [files.writer_of(str(t / n)) for n in ("ppl.json", "table.md", "run_config.json", "samples.jsonl",
                                                   "ckpt.pt")] == \
        ["sddlm eval_ppl.py", "sddlm downstream/eval_downstream.py", "sddlm train.py", "sddlm sample.py",
         "sddlm checkpoint"]
    files.check_output(str(t / "ppl.json"), "--out", script="eval_ppl.py")          # its own: replaced
    files.check_output(str(t / "table.md"), "--out", script="downstream/eval_downstream.py")
    for name, script, words in [("ckpt.pt", "eval_ppl.py", "is a checkpoint, not an earlier output of eval_ppl.py"),
                                ("run_config.json", "eval_ppl.py", "is written by train.py, not an earlier output"),
                                ("samples.jsonl", "eval_ppl.py", "is written by sample.py"),
                                ("ppl.json", "downstream/eval_downstream.py", "is written by eval_ppl.py"),
                                ("table.md", "figures/plot.py", "is written by downstream/eval_downstream.py")]:
        with pytest.raises(UsageError, match=words):
            files.check_output(str(t / name), "--out", script=script)


def test_weight_sets_are_checked_whole_naming_the_tensor():
    """check_state_fits against a built model's state dict: a missing tensor, one the model has not, one of another
    shape, each named (load_state_dict's first line names none)."""
    model = build_model(ModelConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=8))
    want = model.state_dict()
    key = "blocks.0.attn.qkv.weight"
    integrity.check_state_fits(want, dict(want), "f.pt", "ema")                  # the model's own: fits
    for state, words in [({k: v for k, v in want.items() if k != key}, f"its ema weights do not fit the model: it "
                                                                         f"lacks {key};"),
                         ({**want, "blocks.7.x": torch.zeros(1)}, "it holds blocks.7.x, which the model has not"),
                         ({**want, key: want[key][:-1]}, f"it holds {key} of shape [95, 32], not [96, 32]")]:
        with pytest.raises(UsageError, match=words.replace("[", r"\[").replace("]", r"\]")):
            integrity.check_state_fits(want, state, "f.pt", "ema")
    # a resume checks every set it loads (a distillation's teacher too) and AdamW's moments, before loading any
    from plumbing.checkpoint import check_resume_state
    run = SimpleNamespace(raw_model=model, optimizer=torch.optim.AdamW(model.parameters()))
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1)).float().sum().backward()
    run.optimizer.step()
    ckpt = {"model": dict(want), "ema": dict(want), "teacher": dict(want), "optimizer": run.optimizer.state_dict()}
    check_resume_state(run, ckpt, "ckpt.pt")                                    # as saved: fits
    ckpt["optimizer"]["state"][1]["exp_avg"] = torch.zeros(3)
    with pytest.raises(UsageError, match=r"its optimizer state 1 exp_avg \(\[3\]\) does not fit parameter 1"):
        check_resume_state(run, ckpt, "ckpt.pt")
    with pytest.raises(UsageError, match=f"ckpt.pt: its teacher weights do not fit the model: it lacks {key}"):
        check_resume_state(run, {**ckpt, "teacher": {k: v for k, v in want.items() if k != key}}, "ckpt.pt")


def test_meta_json_values_and_writer_folders_are_named_by_what_they_are(tmp_path):
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


@pytest.mark.slow
def test_further_damaged_inputs_and_foreign_outputs_are_one_line_through_the_scripts(base, tmp_path):
    """Through the real scripts: the weight set not used (the live weights under the default EMA) is checked too;
    a missing or misshapen tensor is named; config.json's model_type; meta.json's values, and its block size
    against the files before the progress bar; lock files beside outputs; folder outputs named by what they are;
    figures/plot.py's refusal of a user's file names no --overwrite that would not help."""
    t = tmp_path
    key = "blocks.0.attn.qkv.weight"
    nan_live = _edit_checkpoint(base.ckpt, t / "nan_live.pt", lambda ck: ck["model"][key].view(-1).__setitem__(
        0, float("nan")))
    no_live = _edit_checkpoint(base.ckpt, t / "no_live.pt", lambda ck: ck["model"].pop(key))
    short_ema = _edit_checkpoint(base.ckpt, t / "short_ema.pt", lambda ck: ck["ema"].update({key: ck["ema"][key][:-1]}))
    gpt2 = _edit_folder(base.model, t / "gpt2_type", lambda c: c.update(model_type="gpt2"))

    def data_copy(name, **fields):
        shutil.copytree(base.data_dir, t / name)
        meta = json.loads((t / name / "meta.json").read_text())
        meta.update(fields)
        (t / name / "meta.json").write_text(json.dumps(meta))
        return str(t / name)
    half_block = data_copy("half_block", block_size=16)
    vocab0 = data_copy("vocab0", vocab_size=0)
    (t / "theirs.txt").write_text("my notes\n")
    for d in ("run_link", "dcd_mine"):
        (t / d).mkdir()
    os.symlink(t / "theirs.txt", t / "run_link" / ".lock")
    (t / "dcd_mine" / ".lock").write_text("my lock notes\n")
    (t / "prep.lock").write_text("my lock notes\n")
    (t / "table.md").write_text("my table\n")
    for n in ("ckpt.pt", "log.jsonl"):
        (t / f"own_{n}").mkdir()
        (t / f"own_{n}" / n).write_text("my notes\n")
    piped_tok = _edit_folder(base.model, t / "piped_tok", edit_bytes=lambda d: (os.remove(d / "tokenizer.model"),
                                                                                 os.mkfifo(d / "tokenizer.model")))
    (t / "bogus_tok.jsonl").write_text(json.dumps({files.WRITTEN_BY: "sddlm sample.py", "sample": 0, "text": "a b",
                                                   "ids": [1, 5, 6, 2], "settings": {"tokenizer": "zzz"}}) + "\n")
    piped_val = data_copy("piped_val")
    os.remove(os.path.join(piped_val, "val.bin"))
    os.mkfifo(os.path.join(piped_val, "val.bin"))

    def run_copy(name, edit):            # a run folder whose ckpt.pt was damaged, to resume
        shutil.copytree(base.out, t / name)
        _edit_checkpoint(base.ckpt, t / name / "ckpt.pt", edit)
        return ["train.py", *TINY, "--dataset", base.corpus, "--data_dir", base.data_dir, "--out_dir", t / name,
                "--resume", "1", "--max_iters", "4", "--eval_interval", "2"]

    def first_moment(edit):
        def change(ck):
            state = ck["optimizer"]["state"][0]
            state["exp_avg"] = edit(state["exp_avg"])
        return change
    resumes = {name: run_copy(name, edit) for name, edit in [
        ("r_missing", lambda ck: ck["model"].pop(key)),
        ("r_moment_shape", first_moment(lambda m: m.reshape(-1)[:-1])),
        ("r_moment_int", first_moment(lambda m: m.to(torch.int32))),
        ("r_state_list", lambda ck: ck["optimizer"].update(state=[1])),
        ("r_position", lambda ck: ck["data_state"].update(position=10 ** 12)),
        ("r_epoch_str", lambda ck: ck["data_state"].update(epoch="x"))]}
    samp = lambda ckpt: ["sample.py", "--ckpt", ckpt, "--num_samples", "1", "--steps", "2", "--out", ""]
    ppl = lambda ckpt, *a: ["eval_ppl.py", "--ckpt", ckpt, "--max_batches", "1", "--mc_draws", "1", *a]
    cases = [
        case(*resumes["r_missing"], cwd=t, expect=f"cannot resume from {t}/r_missing/ckpt.pt: its model weights do "
                                                  f"not fit the model: it lacks {key};"),
        case(*resumes["r_moment_shape"], cwd=t, expect="its optimizer state 0 exp_avg ([20479]) does not fit parameter "
                                                       "0 ([320, 64])"),
        case(*resumes["r_moment_int"], cwd=t, expect="its optimizer state 0 exp_avg holds int32 values"),
        case(*resumes["r_state_list"], cwd=t, expect="its optimizer state is not the one AdamW saves"),
        case(*resumes["r_position"], cwd=t, expect="data_state has epoch 0, position 1000000000000, outside the"),
        case(*resumes["r_epoch_str"], cwd=t, expect="data_state {'epoch': 'x'"),
        case(*samp(nan_live), cwd=t, expect=f"{nan_live}: its weights are not finite (model {key} holds NaN"),
        case(*ppl(no_live), cwd=t, expect=f"{no_live}: its model weights do not fit the model: it lacks {key};"),
        case(*samp(short_ema), cwd=t, expect=f"{short_ema}: its ema weights do not fit the model: it holds {key} of "
                                             f"shape [191, 64], not [192, 64]"),
        case(*samp(gpt2), cwd=t, expect=f"{gpt2}/config.json: its field model_type holds 'gpt2'"),
        case(*ppl(base.ckpt, "--data_dir", half_block), cwd=t, expect=f"{half_block}/val.bin has "),
        case(*ppl(base.ckpt, "--data_dir", vocab0), cwd=t, expect="field 'vocab_size' is 0, not an int >= 1"),
        case("eval_ppl.py", "--metric", "genppl", "--samples", t / "bogus_tok.jsonl", "--judge", t / "nope.pt", cwd=t,
             expect=f"--samples {t}/bogus_tok.jsonl: its settings.tokenizer 'zzz' does not load"),   # (retokenized)
        case(*samp(piped_tok), cwd=t, expect=f"{piped_tok}/tokenizer.model is a named pipe, not a regular file"),
        case(*ppl(base.ckpt, "--data_dir", piped_val), cwd=t, expect=f"{piped_val}/val.bin is a named pipe, not a "),
        case("train.py", *TINY, "--dataset", base.corpus, "--data_dir", base.data_dir, "--out_dir", t / "run_link",
             cwd=t, expect=f"{t}/run_link/.lock is a symbolic link, not an sddlm lock file"),
        case("distillation/distill.py", "--init", base.ckpt, "--out_dir", t / "dcd_mine", cwd=t,
             expect=f"{t}/dcd_mine/.lock is a file that is not an sddlm lock"),
        case("prepare.py", "--dataset", base.corpus, "--tokenizer", "gpt2", "--block_size", "16", "--data_dir",
             t / "prep", cwd=t, expect=f"{t}/prep.lock is a file that is not an sddlm lock"),
        case("prepare.py", "--dataset", base.corpus, "--tokenizer", "gpt2", "--block_size", "16", "--data_dir",
             t / "theirs.txt" / "sub", cwd=t, expect=f"--data_dir {t}/theirs.txt/sub: {t}/theirs.txt is a file, not"),
        case("prepare.py", "--dataset", base.corpus, "--tokenizer", "gpt2", "--block_size", "16", "--data_dir",
             t / "r_missing", cwd=t, expect=f"{t}/r_missing exists but holds no prepared dataset (no meta.json; it "
                                            f"holds ckpt.pt, config.json, log.jsonl, ...); use another --data_dir"),
        case("hub/pretrained.py", "--ckpt", base.ckpt, "--out", "/dev/null", cwd=t,
             expect="--out /dev/null is a character device, not a folder"),
        case("figures/plot.py", "--runs", base.out, "--table", t / "table.md", "--out_dir", t / "plots", cwd=t,
             expect=f"--table {t}/table.md exists and was not written by sddlm"),
        *[case("train.py", *TINY, "--dataset", base.corpus, "--data_dir", base.data_dir, "--out_dir", t / f"own_{n}",
               cwd=t, expect=f"{t}/own_{n}/{n} exists and a new run would replace it; move it elsewhere")
          for n in ("ckpt.pt", "log.jsonl")],       # a user's: not 'pass --resume 1' nor 'the log of an earlier run'
        case(*ppl(base.ckpt, "--out", t / "r_missing" / "ckpt.pt"), cwd=t,
             expect=f"--out {t}/r_missing/ckpt.pt exists and is a checkpoint, not an earlier output of eval_ppl.py"),
        case(*ppl(base.ckpt, "--out", t / "r_missing" / "config.json"), cwd=t,
             expect="config.json exists and is written by train.py, not an earlier output of eval_ppl.py"),
        case("bench/bench_prepare.py", "--work_dir", t / "theirs.txt", cwd=t,
             expect=f"--work_dir {t}/theirs.txt is a file, not a folder"),
    ]
    results = run_batches(cases)
    check(results)
    early = [r for r in results if half_block in r["argv"]]      # refused before the progress bar, not after it
    assert len(early) == 1 and len(early[0]["stderr"].strip().splitlines()) == 1, early[0]["stderr"]
    assert (t / "theirs.txt").read_text() == "my notes\n" and os.path.islink(t / "run_link" / ".lock")
    assert (t / "dcd_mine" / ".lock").read_text() == "my lock notes\n" == (t / "prep.lock").read_text()
    assert (t / "table.md").read_text() == "my table\n"
    assert not any((t / d).exists() for d in ("prep", "plots", "dcd")) and os.path.exists("/dev/null")
    assert sorted(os.listdir(t / "run_link")) == [".lock"] and sorted(os.listdir(t / "dcd_mine")) == [".lock"]
    # the flag that costs the memory is named: a round's --mc_draws times are drawn at once (10^9 float64 = 7.45 GiB,
    # refused under a 6 GiB address-space limit; the out-of-memory hint named only --batch_size)
    import resource
    (t / "mc.jsonl").write_text(json.dumps({"context": "the cat", "choices": [" sees", " eats"], "gold": 0}) + "\n")
    for argv in (["eval_ppl.py", "--ckpt", base.ckpt, "--max_batches", "1", "--batch_size", "1"],
                 ["downstream/eval_downstream.py", "--ckpt", base.ckpt, "--jsonl", t / "mc.jsonl"]):
        r = subprocess.run([sys.executable, os.path.join(HERE, argv[0]), *map(str, argv[1:]), "--mc_draws",
                            "1000000000"], capture_output=True, text=True, env=ENV, cwd=t, timeout=300,
                           preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30)))
        last = r.stderr.strip().splitlines()[-1]        # (eval_ppl.py sizes --mc_draws up front; downstream: the OOM)
        assert r.returncode == 2 and last.startswith("error: ") and "--mc_draws" in last, r.stderr[-2000:]
    for name in resumes:                 # a refused resume changes nothing in its folder
        assert md5s(t / name) == {**md5s(base.out), "ckpt.pt": md5s(t / name)["ckpt.pt"]}
