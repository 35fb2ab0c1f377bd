"""benchmarks/serve_abuse.py runs end to end on a tiny checkpoint in a few seconds and writes
its figures: each maximal request's status and /health latency, the mixed traffic's latencies,
statuses and slow clients closed, RSS over time."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_the_abuse_benchmark_runs_and_writes_its_figures(checkpoint, tmp_path):
    out = tmp_path / "serve_abuse.json"
    proc = subprocess.run([sys.executable, "benchmarks/serve_abuse.py", "--checkpoint", str(checkpoint), "--seconds",
                           "3", "--valid-clients", "2", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert {"command", "commit", "date", "machine"} <= set(result)
    statuses = {name: r["status"] for name, r in result["maximal"]["requests"].items()}
    assert statuses == {"longest text tokenized": 400, "largest body (integers in an ignored field)": 200,
                        "most turns": 400}
    mixed = result["mixed"]
    assert mixed["valid_chat"]["count"] > 0 and mixed["valid_errors"] == {}
    assert set(mixed["oversize_statuses"]) == {"413"}
    assert mixed["slow_head_clients"]["count"] > 0 and mixed["slow_head_clients"]["closed_after_max_s"] < 2.0 + 5
    assert len(mixed["rss_mb"]) >= 3 and result["goals"]["still_serves"]
    assert "mixed traffic" in proc.stdout
