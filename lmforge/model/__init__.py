"""The transformer, its presets, checkpoints, Hugging Face naming and generation."""
