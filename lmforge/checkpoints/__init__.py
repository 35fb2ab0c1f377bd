"""Finding, verifying and loading a model: one checkpoint directory's files (``files.py``), a
run's checkpoints and a model loaded from either kind (``load.py``), and the device a verb runs
on (``device.py``). Below every package that loads a model; training checkpoints (optimizer,
RNG, resume) are ``train.checkpoint``'s."""
