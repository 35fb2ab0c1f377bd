"""Finding, verifying and loading a model: one checkpoint directory's files (``files.py``), a
run's checkpoints and a model loaded from either kind (``load.py``), the device a verb runs
on (``device.py``), and merged checkpoints (``merge.py``). Below every package that loads a
model; training checkpoints (optimizer, RNG, resume) are ``train.checkpoint``'s."""
