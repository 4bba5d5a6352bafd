"""The plumbing of a run, each concern in a room of its own, so that the method's files read as the algorithm:
cli (flags from a dataclass, one-line errors, exit codes, device and dtype), files (atomic writes, stale temp files,
no output over an input), lock (one run per out_dir), distributed (torchrun set-up, agreement between ranks),
signals (every stop signal, at every phase), checkpoint (the run's state dict: save / keep / restore, the checks
before a resume that need no model), memory (sizes against the machine, the micro-batch probe), runlog (log.jsonl,
the progress bar, a run's first and last lines), tracking (wandb, TensorBoard), integrity (what a reader checks
before it trusts a file, whatever the model; the divergence rule), flags (train.py's flags checked at start-up) and
run (RunPlumbing: the training loop's plumbing). The ground floor: nothing here imports the method (what a run
needs of the model or the objective comes in as a value or a callable) nor a script; a trained model's own forms
are trained/'s."""
