"""The transformer (one forward), its presets, RoPE scaling, Hugging Face naming, reward and value heads."""
