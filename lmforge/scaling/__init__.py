"""Scaling laws: fits of loss against parameters and tokens, compute-optimal plans, FLOP counts."""
