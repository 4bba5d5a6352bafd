"""The plumbing of a run, each concern in a room of its own, so that the method's files read as the algorithm:
cli (flags from a dataclass, one-line errors, exit codes, device and dtype), files (atomic writes, stale temp files,
no output over an input), lock (one run per out_dir), distributed (torchrun set-up, agreement between ranks),
signals (every stop signal, at every phase), checkpoint (the state dict, save / keep / restore, resume checks,
loading a model and its tokenizer), folder (model folders: reading and checking), export (writing a model folder
and its card), duo (Duo's released
checkpoints), memory (the micro-batch probe), runlog (log.jsonl, the progress bar, a run's first and last lines),
tracking (wandb, TensorBoard), integrity (what a reader checks before it trusts a file; the divergence rule),
flags (train.py's flags checked at start-up), finetune (a run that starts from a trained model: --init) and run
(RunPlumbing: the training loop's plumbing behind one face).
Nothing here imports a script."""
