"""Evaluation: tasks in lm-evaluation-harness format, their metrics, and the harness adapter."""
