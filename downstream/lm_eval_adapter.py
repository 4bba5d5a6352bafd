"""
The EleutherAI lm-evaluation-harness adapter (lm-eval 0.4.x, an optional extra imported only inside the functions
that need it) of downstream/lm_eval_sddlm.py's model "sddlm" and of downstream/eval_downstream.py's lm-eval tasks.
"""
import argparse
import functools
import math
import os
import sys

import torch

from data import not_a_file
from downstream.scoring import GREEDY_CHECKS, MAX_GEN_TOKS, EvalError, load_scorer
from plumbing.cli import SEED_END, UsageError, finite_float, first_line, parse_bool, resolve_device, whole
from sample import check_sampler, check_stride, parse_psi


LM_EVAL = "lm-eval==0.4.13"   # the version the adapter is tested with (CI installs it)


@functools.cache
def lm_eval_model_class():
    """The lm-eval model class (needs lm-eval): _Harness on lm-eval's LM, built once. eval_downstream's CLI passes
    instances to lm-eval; downstream/lm_eval_sddlm.py registers the class as "sddlm"."""
    from lm_eval.api.model import LM
    return type("SDDLMHarness", (_Harness, LM), {"__doc__": _Harness.__doc__, "__module__": __name__})


MODEL_ARGS = ("ckpt", "pretrained", "mc_draws", "cfg_w", "seed", "greedy_check", "lambada_steps", "steps", "final_step",
              "top_p", "sampler", "psi_kappa", "psi_eta", "psi_profile", "psi_loop_t", "psi_fracs", "psi_rescale",
              "psi_grid", "stride", "rolling_context", "use_ema", "dtype", "add_bos")

_NOTED = set()


def note_once(key, message):
    """A note on stderr, once per process (eval_downstream's CLI builds one adapter per task and setting)."""
    if key not in _NOTED:
        _NOTED.add(key)
        print(f"sddlm: {message}", file=sys.stderr)


def coerce(value, typ, name):
    """lm-eval passes model_args as strings or already coerced: '16' -> 16, 'true' -> True."""
    if value is None or isinstance(value, typ) and not (typ is int and isinstance(value, bool)) and \
            not (typ is float and not math.isfinite(value)):
        return value
    s = str(value).strip().lower()
    try:
        if typ is bool:
            return parse_bool(s)
        if typ is float:
            return finite_float(s)      # nan, inf: refused, as every float flag
        return typ(float(s)) if typ is int and float(s).is_integer() else typ(s)
    except (ValueError, argparse.ArgumentTypeError):
        raise EvalError(f"sddlm model argument {name}={value!r} is not a valid {typ.__name__}") from None


def model_argument(check, *args):
    """check(*args) of sample.py, whose messages name its flags, which are these model arguments."""
    try:
        return check(*args)
    except UsageError as e:
        raise EvalError(f"sddlm model argument {str(e).lstrip('-')}") from None


class _Harness:
    """lm-eval's three request types over Scorer (one model, its tokenizer, the MC settings)."""

    def __init__(self, ckpt=None, mc_draws=128, cfg_w=0.0, seed=1234, greedy_check="argmax",
                 lambada_steps=8, steps=128, final_step="auto", top_p=1.0, sampler="ancestral", psi_kappa="eta",
                 psi_eta="0.9", psi_profile="linear", psi_loop_t=0.1, psi_fracs="0.45/0.5/0.05", psi_rescale="remdm",
                 psi_grid="ours", stride=0, rolling_context=1, use_ema=True,
                 dtype="auto", add_bos=True, batch_size=16, max_batch_size=None, device="auto",
                 trust_remote_code=None, scorer=None, pretrained=None, **unknown):
        """As lm-eval builds it from --model_args plus batch_size/max_batch_size/device (and trust_remote_code,
        meant for datasets; neither it nor max_batch_size is used); or around an existing Scorer (eval_downstream's
        CLI), whose model settings then apply. pretrained= is lm-eval's usual name for ckpt= (default out/ckpt.pt)."""
        super().__init__()
        if ckpt is not None and pretrained is not None and str(ckpt) != str(pretrained):
            raise EvalError(f"sddlm model arguments ckpt={ckpt} and pretrained={pretrained} name two models; "
                            f"give one of them (they are the same argument)")
        ckpt = ckpt if ckpt is not None else pretrained if pretrained is not None else "out/ckpt.pt"
        if unknown:
            raise EvalError(f"unknown sddlm model argument(s) {', '.join(sorted(unknown))}; "
                               f"known: {', '.join(MODEL_ARGS)}")
        self.cfg_w, self.greedy_check = coerce(cfg_w, float, "cfg_w"), str(greedy_check)
        if self.greedy_check not in GREEDY_CHECKS:
            raise EvalError(f"greedy_check must be one of {', '.join(GREEDY_CHECKS)}, got {greedy_check!r}")
        self.steps, self.final_step = coerce(steps, int, "steps"), str(final_step)
        self.top_p = coerce(top_p, float, "top_p")
        model_argument(check_sampler, self.steps, self.final_step, self.top_p)
        # lm-eval splits --model_args at commas, so the phases of the loop profile are separated by "/"
        self.psi = model_argument(parse_psi, str(sampler), *(str(a).replace("/", ",") for a in (psi_kappa, psi_eta)),
                                  str(psi_profile), coerce(psi_loop_t, float, "psi_loop_t"),
                                  str(psi_fracs).replace("/", ","), self.steps, str(psi_rescale), str(psi_grid))
        self.rolling_context = coerce(rolling_context, int, "rolling_context")
        if coerce(lambada_steps, int, "lambada_steps") < 1:                  # as eval_downstream's --lambada_steps
            raise EvalError(f"lambada_steps must be >= 1, got {lambada_steps}")
        seed = whole(coerce(seed, int, "seed"), "sddlm model argument seed", 0, SEED_END)
        self.scorer = scorer or self.load_scorer(ckpt, coerce(mc_draws, int, "mc_draws"), batch_size, device,
                                                 coerce(use_ema, bool, "use_ema"), str(dtype), seed=seed,
                                                 lambada_steps=coerce(lambada_steps, int, "lambada_steps"),
                                                 add_bos=coerce(add_bos, bool, "add_bos"))
        if self.final_step == "auto":
            self.final_step = self.scorer.final_step
        block_size = self.scorer.model.config.block_size
        if not 0 <= self.rolling_context < block_size:
            raise EvalError(f"rolling_context must be in [0, {block_size - 1}], got {self.rolling_context}")
        self.stride = model_argument(check_stride, coerce(stride, int, "stride"), block_size)

    @staticmethod
    def load_scorer(ckpt, mc_draws, batch_size, device, use_ema, dtype, **settings):
        """scoring.load_scorer of --model_args ckpt=, with lm-eval's batch_size and device."""
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            batch_size = 16   # no automatic batch-size search: draws per forward is a fixed choice
        batch_size = coerce(batch_size, int, "batch_size")
        if batch_size < 1 or mc_draws < 1:
            raise EvalError(f"batch_size and mc_draws must be >= 1, got {batch_size} and {mc_draws}")
        if batch_size == 1 and mc_draws > 1:
            note_once("batch", f"--batch_size 1 (lm-eval's default) runs one of the {mc_draws} Monte Carlo draws "
                               f"per forward; --batch_size 16 or more is much faster")
        if not str(ckpt).startswith("duo:") and not (os.path.isfile(str(ckpt)) or os.path.isdir(str(ckpt))):
            raise EvalError(not_a_file(str(ckpt), f"checkpoint not found: {ckpt} (--model_args ckpt=PATH)",
                                       "the checkpoint"))     # the file first, then the device
        name = str(device or "auto")
        device = resolve_device(name.split(":")[0])
        device = torch.device(name) if ":" in name else device     # lm-eval may pass "cuda:0"
        return load_scorer(ckpt, device, use_ema, dtype, mc_draws=mc_draws, batch_size=batch_size, **settings)[0]

    def loglikelihood(self, requests, disable_tqdm=False):
        return self.scorer.loglikelihood([tuple(req.args) for req in requests], self.cfg_w, self.greedy_check)

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        note_once("rolling", f"loglikelihood_rolling returns a LOWER BOUND on log p(text) (the NELBO over windows "
                             f"of {self.scorer.model.config.block_size} tokens, {self.rolling_context} of them clean "
                             f"context): the perplexities and bits per byte computed from it are upper bounds")
        return self.scorer.loglikelihood_rolling([req.args[0] for req in requests], self.cfg_w, self.rolling_context)

    def generate_until(self, requests, disable_tqdm=False):
        L = self.scorer.model.config.block_size
        for _, kwargs in (req.args for req in requests):
            unused = sorted(set(kwargs) - {"until", "max_gen_toks"})
            if unused:
                note_once(("unused", *unused), f"generate_until samples with the diffusion sampler (steps="
                                               f"{self.steps}, final_step={self.final_step}, top_p={self.top_p}, "
                                               f"cfg_w={self.cfg_w}); the task's {', '.join(unused)} are not used")
            if int(kwargs.get("max_gen_toks", MAX_GEN_TOKS)) > L - 1:
                note_once("long", f"max_gen_toks {kwargs.get('max_gen_toks', MAX_GEN_TOKS)} is past the model's "
                                  f"window: generated in windows of {L} tokens, {self.stride} new in each (stride)")
        return self.scorer.generate_until([tuple(req.args) for req in requests], self.cfg_w, self.steps,
                                          self.final_step, self.top_p, psi=self.psi, stride=self.stride)


OFFLINE_VARS = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


def hub_offline_check(timeout=3.0):
    """Offline, every Hugging Face dataset lm-eval tries to reach costs ~36 s of retries before it fails. Unless
    an offline variable or a proxy is set, try one TCP connection to the hub (HF_ENDPOINT, default huggingface.co);
    when it fails, set HF_DATASETS_OFFLINE=1 and HF_HUB_OFFLINE=1 for this process (datasets in the local cache
    still load, others fail at once) and print a note on stderr -> the note, or None. Call it before `datasets`
    is imported: both libraries read these variables once, at import."""
    import socket
    import urllib.parse
    if any(v in os.environ for v in OFFLINE_VARS):      # the user decided
        return None
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return None
    except OSError as e:
        for v in OFFLINE_VARS:
            os.environ[v] = "1"
        note = (f"note: {host}:{port} is unreachable ({type(e).__name__}); running with HF_DATASETS_OFFLINE=1 "
                f"HF_HUB_OFFLINE=1: datasets in the local Hugging Face cache load, others fail at once")
        print(note, file=sys.stderr)
        return note


def lm_eval_failure(e, task=None):
    """One line for an exception raised inside lm-eval (a dataset that cannot be reached, an unknown task, ...),
    naming the variable to set when the cause looks like a missing network."""
    msg = f"lm-eval failed{f' on task {task!r}' if task else ''}: {type(e).__name__}: {first_line(e)}"
    offline = any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes") for v in OFFLINE_VARS)
    if offline and ("Offline" in msg or "Hub" in msg):
        msg += " (offline mode: only datasets in the local Hugging Face cache can load)"
    elif not offline and ("Connection" in msg or "Hub" in msg or "resolve" in msg.lower()):
        msg += " (offline? set HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 to fail at once instead of retrying)"
    return msg


@functools.cache
def _task_manager(include_path):
    """lm-eval's task index (slow to build: once per run)."""
    from lm_eval.tasks import TaskManager
    return TaskManager(include_path=include_path or None)


def check_lm_eval_tasks(names, include_path=""):
    """Every name must be a task lm-eval knows (with the YAMLs under include_path), checked before any work."""
    if include_path and not all(os.path.isdir(p) for p in include_path.split(":") if p):
        raise EvalError(f"--include_path: not a folder: {include_path}")
    manager = _task_manager(include_path)
    unknown = [n for n in names if not manager.match_tasks([n])]
    if unknown:
        raise EvalError(f"unknown lm-eval task(s) {', '.join(unknown)}: not in lm-eval's task index"
                        + ("" if include_path else " (tasks of your own: --include_path FOLDER of task YAMLs)"))


def run_lm_eval(task, lm, limit, include_path=""):
    """One lm-eval task, zero-shot, with the adapter instance `lm` -> {metric: value, "n": ...} and each metric's
    standard error as lm-eval gives it ("metric_se": closed form for means such as acc, 1,000 bootstrap resamples
    for perplexities); a metric under a filter other than "none" is named "metric,filter". include_path: a folder
    of extra task YAMLs (e.g. offline tasks over local files)."""
    import lm_eval
    try:
        res = lm_eval.simple_evaluate(model=lm, tasks=[task], num_fewshot=0, limit=limit or None,
                                      bootstrap_iters=1000, log_samples=False, task_manager=_task_manager(include_path))
    except EvalError:
        raise
    except Exception as e:  # dataset download, a request the adapter cannot serve, ...: reported in one line
        raise EvalError(lm_eval_failure(e, task)) from None
    if res is None or task not in res.get("results", {}):
        raise EvalError(f"lm-eval returned no result for task {task!r} (a group name? list its subtasks instead)")
    output_type = (res.get("configs", {}).get(task) or {}).get("output_type")
    metrics = {"output_type": output_type}
    for key, value in res["results"][task].items():
        name, _, filt = key.partition(",")
        if filt and isinstance(value, (int, float)):
            se = name.endswith("_stderr")
            name = name.removesuffix("_stderr")
            if output_type == "loglikelihood" and name == "acc":
                name = f"acc_{lm.greedy_check}"   # LAMBADA-style acc is our is_greedy: say which protocol
            metrics[(name if filt == "none" else f"{name},{filt}") + ("_se" if se else "")] = value
    n = (res.get("n-samples") or {}).get(task, {})
    metrics["n"] = n.get("effective", n.get("original")) if isinstance(n, dict) else None
    return metrics
