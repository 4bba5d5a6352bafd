"""The plumbing of a run, each concern in a room of its own, so that the method's files read as the algorithm:
errors (one-line failures), files (atomic writes, stale temp files, no output over an input), lock (one run per
out_dir), distributed (torchrun set-up, agreement between ranks), signals (every stop signal, at every phase),
checkpoint (the state dict, save / keep / restore, resume checks, loading a model and its tokenizer), duo (Duo's
released checkpoints), memory (the micro-batch probe) and runlog (log.jsonl). Nothing here imports a script."""
