"""The one training loop, its optimizer and schedule, checkpoints and metrics."""
