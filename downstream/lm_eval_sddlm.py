"""
The EleutherAI lm-evaluation-harness (lm-eval 0.4.x) model "sddlm". Importing this module registers it; running
it is the harness's own command line with the model available, every flag the harness's (`... run --help`):

    python -m downstream.lm_eval_sddlm --model sddlm --model_args ckpt=out/ckpt.pt,mc_draws=128,cfg_w=1.1 \\
        --tasks arc_easy,lambada_standard --batch_size 16 --device cuda --output_path results/
    python -m downstream.lm_eval_sddlm --model sddlm --model_args pretrained=out/model,steps=64 --tasks my_task \\
        --include_path my_tasks/ --device cpu --batch_size 16
    python -m downstream.lm_eval_sddlm --help        # the harness's flags, then the sddlm model arguments below

This runs lm_eval.__main__.cli_evaluate, the function behind the `lm_eval` console script. The bare `lm_eval`
command cannot see this model: lm-eval 0.4.13 looks models up in its own package and in modules already imported
(no plugin discovery) and builds the model before it loads any task. In Python: `import lm_eval_sddlm`, then
lm_eval.simple_evaluate(model="sddlm", model_args=...).

--model_args of --model sddlm (comma-separated NAME=VALUE; an unknown name is an error):
  ckpt=out/ckpt.pt      the model: a train.py or distill.py checkpoint, a model folder (out/model) or duo:PATH (EMA
                        weights unless use_ema=false); pretrained=PATH is the same argument, under lm-eval's usual name
  mc_draws=128          Monte Carlo draws per request of the NELBO bound (SMDM 1024, LLaDA 128)
  cfg_w=0               unsupervised CFG weight w for every request type (the paper: 1.1)
  seed=1234             every request's noise comes from generators seeded with it (order-independent results)
  greedy_check=argmax   is_greedy of loglikelihood: argmax (t = 1 argmax) | generate (lambada_steps sampler steps)
  lambada_steps=8       sampler steps of greedy_check=generate
  steps=128             generate_until: reverse steps of the diffusion sampler
  final_step=auto       generate_until: the sampler's final step, ancestral | greedy | none | auto (greedy for
                        NELBO models, ancestral for the SDDLM losses, as sample.py chooses)
  top_p=1.0             generate_until: nucleus on x_theta
  sampler=ancestral     generate_until: ancestral | psi, with psi_kappa, psi_eta, psi_profile, psi_loop_t, psi_fracs,
                        psi_rescale and psi_grid as sample.py's flags of those names (psi_eta=1/0.02/1: "/"
                        separates phases; psi_rescale=duo psi_grid=duo: Duo's published Psi settings)
  stride=0              generate_until past block_size - 1 tokens: new tokens per semi-autoregressive window, the
                        rest of the block held fixed (0 = half a block)
  rolling_context=1     loglikelihood_rolling: clean tokens before each window's piece (lm-eval's context_len)
  dtype=auto, add_bos=true
--batch_size is Monte Carlo draws per forward (SMDM's meaning; 2 x rows with CFG), not requests per batch;
--device cpu|cuda|cuda:N.
Request types (downstream/scoring.py does the work; its docstrings give the estimates exactly):
  loglikelihood          (context, continuation) -> (lower bound on log p(continuation | context), is_greedy)
  loglikelihood_rolling  (text,) -> a LOWER BOUND on log p(text) over windows of block_size tokens: the word and
                         byte perplexities lm-eval reports from it are upper bounds (the paper's zero-shot PPL too)
  generate_until         (context, gen_kwargs) -> max_gen_toks tokens sampled after the fixed context (any number:
                         semi-autoregressive windows past the block), cut at EOS and the stop strings; the task's
                         do_sample/temperature/... do not apply and are named once
"""
import os, sys  # noqa: E401  (run as a file, python FOLDER/SCRIPT.py: the repository root goes on the path)
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing import cli  # first: a stop signal while the imports below load is one line, exit 130
cli.stop_at_once(__name__)

import importlib

import torch

from downstream import lm_eval_adapter as adapter
from downstream.scoring import EvalError
from plumbing.cli import UsageError, run_cli
from data import DataError

try:
    from lm_eval.api.registry import register_model
except ImportError:
    if __name__ != "__main__":           # imported: the caller's own lm_eval needs it anyway
        raise
    print(f"error: python -m downstream.lm_eval_sddlm needs lm-eval, an optional extra: pip install {adapter.LM_EVAL}",
          file=sys.stderr)
    sys.exit(2)

# The harness's own models first: lm-eval's get_model imports them only into an EMPTY registry, so registering
# "sddlm" alone would hide "hf", "dummy", ...
importlib.import_module("lm_eval.models")


SDDLMHarness = register_model("sddlm")(adapter.lm_eval_model_class())


def main():
    """The harness's command line (sys.argv as given) with "sddlm" registered; lm-eval's own failures (a dataset
    that cannot be reached, ...) become one line. --help (-h): the harness's help, then the sddlm model's."""
    asks_help = any(a in ("-h", "--help") for a in sys.argv[1:])
    if not asks_help:
        adapter.hub_offline_check()     # before lm-eval imports `datasets`
    from lm_eval.__main__ import cli_evaluate
    try:
        cli_evaluate()
    except SystemExit as e:
        if asks_help and e.code in (0, None):     # then the sddlm model's: this docstring from --model_args on
            print("\nsddlm model (--model sddlm):\n\n" + __doc__[__doc__.index("--model_args"):].strip() + "\n")
            return 0
        raise
    except (UsageError, DataError, torch.OutOfMemoryError):    # ours, reported by run_cli
        raise
    except Exception as e:
        raise EvalError(adapter.lm_eval_failure(e)) from None
    return 0


if __name__ == "__main__":
    run_cli(main, DataError, oom_hint="lower --batch_size (Monte Carlo draws per forward)")
