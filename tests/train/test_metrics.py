import errno
import json
import logging

import pytest

from lmforge.core.io import InputError
from lmforge.core.run import log
from lmforge.train.metrics import METRICS_FILE, MetricsLogger, read_metrics


def write_records(run_dir, steps, tail: str = "") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps)
    (run_dir / METRICS_FILE).write_text(text + tail)


@pytest.fixture()
def warnings(caplog):
    log.addHandler(caplog.handler)  # the lmforge logger does not propagate to the root logger
    try:
        with caplog.at_level(logging.WARNING, logger="lmforge"):
            yield caplog
    finally:
        log.removeHandler(caplog.handler)


def test_read_metrics_drops_a_torn_last_line_with_a_warning(tmp_path, warnings):
    write_records(tmp_path, [1, 2, 3], tail='{"step": 4, "lo')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert "torn" in warnings.text and f"{METRICS_FILE}:4" in warnings.text


def test_read_metrics_names_the_file_and_line_of_a_corrupt_line_in_the_middle(tmp_path):
    write_records(tmp_path, [1], tail='{"step": 2, "lo\n' + json.dumps({"step": 3}) + "\n")
    with pytest.raises(InputError, match=rf"{METRICS_FILE}:2: "):
        read_metrics(tmp_path)


def test_read_metrics_keeps_a_complete_last_record_that_lost_its_newline(tmp_path):
    write_records(tmp_path, [1], tail=json.dumps({"step": 2}))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_a_terminated_last_line_that_is_not_a_record_is_corruption_not_a_torn_write(tmp_path):
    write_records(tmp_path, [1], tail="not json\n")
    with pytest.raises(InputError, match=rf"{METRICS_FILE}:2: "):
        read_metrics(tmp_path)


def test_resuming_keeps_the_records_up_to_the_checkpoint_and_drops_a_torn_last_line(tmp_path, warnings):
    write_records(tmp_path, range(1, 7), tail='{"step": 7, "loss": 0.')
    logger = MetricsLogger(tmp_path, tensorboard=False, resume_step=4)
    logger.log({"step": 5, "loss": 0.5})
    logger.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert "torn" in warnings.text


def test_resuming_with_a_torn_line_in_the_middle_is_a_clear_error(tmp_path):
    write_records(tmp_path, [1], tail='{"step": 2\n' + json.dumps({"step": 3}) + "\n")
    with pytest.raises(InputError, match=rf"{METRICS_FILE}:2: "):
        MetricsLogger(tmp_path, tensorboard=False, resume_step=3)


def test_the_resume_rewrite_of_the_metrics_is_atomic(tmp_path, monkeypatch):
    write_records(tmp_path, range(1, 9))
    before = (tmp_path / METRICS_FILE).read_text()

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("os.fsync", disk_full)
    with pytest.raises(OSError):
        MetricsLogger(tmp_path, tensorboard=False, resume_step=4)
    assert (tmp_path / METRICS_FILE).read_text() == before  # the old file, whole
    assert [p.name for p in tmp_path.iterdir()] == [METRICS_FILE]  # no temporary file left
