"""The plumbing of a run, each concern in a module of its own (cli, files, lock, distributed, signals, checkpoint,
memory, runlog, tracking, integrity, flags, run: each module's first lines say what it holds), so that the method's
files read as the algorithm. The ground floor: nothing here imports the method (what a run needs of the model or the
objective comes in as a value or a callable) nor a script; a trained model's own forms are trained/'s."""
