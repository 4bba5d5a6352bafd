"""A trained model in the forms it takes on disk, read and written as the method needs: checkpoint (a ckpt.pt read,
its fields checked, a resume's checkpoint against the run, a model and its tokenizer loaded for sampling and
evaluation), fields (a checkpoint's and config.json's records checked as their flags are), folder (model folders
read), export (model folders written, with their card), duo (Duo's released checkpoints) and finetune (a run that
starts from a trained model: --init). Below the scripts, above the method's files; plumbing/ is the ground floor."""
