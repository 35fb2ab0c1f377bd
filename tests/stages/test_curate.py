from lmforge.stages.curate import report


def test_the_lifecycle_report_links_the_curation_figure_by_its_own_name(tmp_path):
    stage_dir, run_dir = tmp_path / "curate", tmp_path / "lifecycle"
    stage_dir.mkdir()
    run_dir.mkdir()
    (stage_dir / "report.png").write_bytes(b"\x89PNG figure")
    stats = {"documents": 10, "kept": 8, "rejected": 2, "stages": {"length": {"in": 10, "rejected": 2, "reasons": {}}},
             "languages": {"all": {}, "kept": {}}, "dup_cluster_sizes": {}, "scores": {}}  # as run_curate returns
    lines = report(stats, stage_dir, run_dir / "curate-loss.png")
    assert "![curation statistics](curate-stats.png)" in lines
    assert (run_dir / "curate-stats.png").read_bytes() == b"\x89PNG figure"
    assert not (run_dir / "curate-loss.png").exists()  # curation has no loss curve
