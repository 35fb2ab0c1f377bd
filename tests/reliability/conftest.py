"""Fixtures of tests/train (a tiny pre-training recipe over prepared shards) for the reliability tests."""

import logging

import pytest

from tests.train.conftest import make_recipe, shards_dir  # noqa: F401  (fixtures of tests/train)


@pytest.fixture()
def lmforge_log(caplog):
    """``caplog`` that sees the ``lmforge`` logger's records even after the CLI stopped their propagation."""
    logger = logging.getLogger("lmforge")
    level, propagate = logger.level, logger.propagate
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # each record reaches caplog's handler once
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)
    logger.propagate = propagate
