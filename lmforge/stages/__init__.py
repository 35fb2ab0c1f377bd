"""Stages of the lifecycle, one module per verb."""
