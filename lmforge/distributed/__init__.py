"""Applying parallelism, activation checkpointing and compilation to a built model."""
