"""
The EleutherAI lm-evaluation-harness (lm-eval 0.4.x) model "sddlm". Importing this module registers it; running
it is the harness's own command line with the model available, every flag the harness's (`... run --help`):

    python -m lm_eval_sddlm --model sddlm --model_args ckpt=out/ckpt.pt,mc_draws=128,cfg_w=1.1 \\
        --tasks arc_easy,lambada_standard --batch_size 16 --device cuda --output_path results/
    python -m lm_eval_sddlm --model sddlm --model_args ckpt=out/ckpt.pt,steps=64 --tasks my_task \\
        --include_path my_tasks/ --device cpu --batch_size 16

This runs lm_eval.__main__.cli_evaluate, the function behind the `lm_eval` console script. The bare `lm_eval`
command cannot see this model: lm-eval 0.4.13 looks models up in its own package and in modules already imported
(no plugin discovery) and builds the model before it loads any task. In Python: `import lm_eval_sddlm`, then
lm_eval.simple_evaluate(model="sddlm", model_args=...).

--model_args (an unknown name is an error):
  ckpt=out/ckpt.pt      a train.py checkpoint (diffusion; EMA weights unless use_ema=false)
  mc_draws=128          Monte Carlo draws per request of the NELBO bound (SMDM 1024, LLaDA 128)
  cfg_w=0               unsupervised CFG weight w for every request type (the paper: 1.1)
  seed=1234             every request's noise comes from generators seeded with it (order-independent results)
  greedy_check=argmax   is_greedy of loglikelihood: argmax (t = 1 argmax) | generate (lambada_steps sampler steps)
  lambada_steps=8       sampler steps of greedy_check=generate
  steps=128             generate_until: reverse steps of sample.generate
  final_step=auto       generate_until: the sampler's final step, ancestral | greedy | none | auto (greedy for
                        NELBO models, ancestral for the SDDLM losses: sample.default_final_step)
  top_p=1.0             generate_until: nucleus on x_theta
  sampler=ancestral     generate_until: ancestral | psi, with psi_kappa, psi_eta, psi_profile, psi_loop_t and
                        psi_fracs as sample.py's flags of those names (psi_eta=1/0.02/1: "/" separates phases)
  rolling_context=1     loglikelihood_rolling: clean tokens before each window's piece (lm-eval's context_len)
  dtype=auto, add_bos=true
--batch_size is Monte Carlo draws per forward (SMDM's meaning; 2 x rows with CFG), not requests per batch;
--device cpu|cuda|cuda:N.
Request types (eval_downstream.Scorer does the work; its docstrings give the estimates exactly):
  loglikelihood          (context, continuation) -> (lower bound on log p(continuation | context), is_greedy)
  loglikelihood_rolling  (text,) -> a LOWER BOUND on log p(text) over windows of block_size tokens: the word and
                         byte perplexities lm-eval reports from it are upper bounds (the paper's zero-shot PPL too)
  generate_until         (context, gen_kwargs) -> max_gen_toks tokens sampled after the fixed context, cut at EOS
                         and the stop strings; the task's do_sample/temperature/... do not apply and are named once
"""
import argparse
import importlib
import sys

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

import eval_downstream as ed
from cli import UsageError, load_model, load_tokenizer, parse_bool, resolve_device, resolve_dtype, run_cli
from data import DataError
from sample import check_sampler, default_final_step, parse_psi

MODEL_ARGS = ("ckpt", "mc_draws", "cfg_w", "seed", "greedy_check", "lambada_steps", "steps", "final_step", "top_p",
              "sampler", "psi_kappa", "psi_eta", "psi_profile", "psi_loop_t", "psi_fracs", "rolling_context", "use_ema",
              "dtype", "add_bos")

# The harness's own models first: lm-eval's get_model imports them only into an EMPTY registry, so registering
# "sddlm" alone would hide "hf", "dummy", ...
importlib.import_module("lm_eval.models")


_NOTED = set()


def note_once(key, message):
    """A note on stderr, once per process (eval_downstream's CLI builds one adapter per task and setting)."""
    if key not in _NOTED:
        _NOTED.add(key)
        print(f"sddlm: {message}", file=sys.stderr)


def coerce(value, typ, name):
    """lm-eval passes model_args as strings or already coerced: '16' -> 16, 'true' -> True."""
    if value is None or isinstance(value, typ) and not (typ is int and isinstance(value, bool)):
        return value
    s = str(value).strip().lower()
    try:
        if typ is bool:
            return parse_bool(s)
        return typ(float(s)) if typ is int and float(s).is_integer() else typ(s)
    except (ValueError, argparse.ArgumentTypeError):
        raise ed.EvalError(f"sddlm model argument {name}={value!r} is not a valid {typ.__name__}") from None


@register_model("sddlm")
class SDDLMHarness(LM):
    """lm-eval's three request types over eval_downstream.Scorer (one model, its tokenizer, the MC settings)."""

    def __init__(self, ckpt="out/ckpt.pt", mc_draws=128, cfg_w=0.0, seed=1234, greedy_check="argmax",
                 lambada_steps=8, steps=128, final_step="auto", top_p=1.0, sampler="ancestral", psi_kappa="eta",
                 psi_eta="0.9", psi_profile="linear", psi_loop_t=0.1, psi_fracs="0.45/0.5/0.05", rolling_context=1,
                 use_ema=True,
                 dtype="auto", add_bos=True, batch_size=16, max_batch_size=None, device="auto",
                 trust_remote_code=None, scorer=None, **unknown):
        """As lm-eval builds it from --model_args plus batch_size/max_batch_size/device (and trust_remote_code,
        meant for datasets; neither it nor max_batch_size is used); or around an existing Scorer (eval_downstream's
        CLI), whose model settings then apply."""
        super().__init__()
        if unknown:
            raise ed.EvalError(f"unknown sddlm model argument(s) {', '.join(sorted(unknown))}; "
                               f"known: {', '.join(MODEL_ARGS)}")
        self.cfg_w, self.greedy_check = coerce(cfg_w, float, "cfg_w"), str(greedy_check)
        if self.greedy_check not in ed.GREEDY_CHECKS:
            raise ed.EvalError(f"greedy_check must be one of {', '.join(ed.GREEDY_CHECKS)}, got {greedy_check!r}")
        self.steps, self.final_step = coerce(steps, int, "steps"), str(final_step)
        self.top_p = coerce(top_p, float, "top_p")
        try:
            check_sampler(self.steps, self.final_step, self.top_p)
            # lm-eval splits --model_args at commas, so the phases of the loop profile are separated by "/"
            self.psi = parse_psi(str(sampler), *(str(a).replace("/", ",") for a in (psi_kappa, psi_eta)),
                                 str(psi_profile), coerce(psi_loop_t, float, "psi_loop_t"),
                                 str(psi_fracs).replace("/", ","), self.steps)
        except UsageError as e:      # its messages name sample.py's flags, which are these model arguments
            raise ed.EvalError(f"sddlm model argument {str(e).lstrip('-')}") from None
        self.rolling_context = coerce(rolling_context, int, "rolling_context")
        self.scorer = scorer or self.load_scorer(ckpt, coerce(mc_draws, int, "mc_draws"), coerce(seed, int, "seed"),
                                                 coerce(lambada_steps, int, "lambada_steps"),
                                                 coerce(use_ema, bool, "use_ema"), str(dtype),
                                                 coerce(add_bos, bool, "add_bos"), batch_size, device)
        if self.final_step == "auto":
            self.final_step = self.scorer.final_step
        block_size = self.scorer.model.config.block_size
        if not 0 <= self.rolling_context < block_size:
            raise ed.EvalError(f"rolling_context must be in [0, {block_size - 1}], got {self.rolling_context}")

    @staticmethod
    def load_scorer(ckpt, mc_draws, seed, lambada_steps, use_ema, dtype, add_bos, batch_size, device):
        """The checkpoint's model and tokenizer in an eval_downstream.Scorer (its sampler on its training schedule)."""
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            batch_size = 16   # no automatic batch-size search: draws per forward is a fixed choice
        batch_size = coerce(batch_size, int, "batch_size")
        if batch_size < 1 or mc_draws < 1:
            raise ed.EvalError(f"batch_size and mc_draws must be >= 1, got {batch_size} and {mc_draws}")
        if batch_size == 1 and mc_draws > 1:
            note_once("batch", f"--batch_size 1 (lm-eval's default) runs one of the {mc_draws} Monte Carlo draws "
                               f"per forward; --batch_size 16 or more is much faster")
        name = str(device or "auto")
        device = resolve_device(name.split(":")[0])
        device = torch.device(name) if ":" in name else device     # lm-eval may pass "cuda:0"
        model, ckpt_dict = load_model(str(ckpt), device, use_ema)
        tokenizer, why = load_tokenizer(ckpt_dict)
        if tokenizer is None:
            raise ed.EvalError(f"{ckpt}: {why}")
        return ed.Scorer(model, tokenizer, mc_draws=mc_draws, batch_size=batch_size, seed=seed,
                         lambada_steps=lambada_steps, dtype=resolve_dtype(dtype, device), add_bos=add_bos,
                         schedule=(ckpt_dict.get("train_config") or {}).get("noise_schedule") or "loglinear",
                         final_step=default_final_step(ckpt_dict))

    def loglikelihood(self, requests, disable_tqdm=False):
        scored = self.scorer.loglikelihood([tuple(req.args) for req in requests], self.cfg_w, self.greedy_check)
        return [(float(ll), bool(greedy)) for ll, greedy in scored]

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
            if int(kwargs.get("max_gen_toks", ed.MAX_GEN_TOKS)) > L - 1:
                note_once("long", f"max_gen_toks {kwargs.get('max_gen_toks', ed.MAX_GEN_TOKS)} does not fit the "
                                  f"model's window: generating {L - 1} tokens (block_size {L} - 1)")
        return self.scorer.generate_until([tuple(req.args) for req in requests], self.cfg_w, self.steps,
                                          self.final_step, self.top_p, psi=self.psi)


def main():
    """The harness's command line (sys.argv as given) with "sddlm" registered; lm-eval's own failures (a dataset
    that cannot be reached, ...) become one line."""
    offline = ed.hub_offline_check()     # before lm-eval imports `datasets`
    if offline:
        print(offline, file=sys.stderr)
    from lm_eval.__main__ import cli_evaluate
    try:
        cli_evaluate()
    except (UsageError, DataError, torch.OutOfMemoryError):    # ours, reported by run_cli
        raise
    except Exception as e:
        raise ed.EvalError(ed.lm_eval_failure(e)) from None
    return 0


if __name__ == "__main__":
    run_cli(main, DataError, oom_hint="lower --batch_size (Monte Carlo draws per forward)")
