"""experiments/bench_paged.py refuses a compilation cache that already holds programs: its "cold"
warm-up would load them instead of compiling."""

import sys

import pytest


def test_a_non_empty_compilation_cache_is_refused(tmp_path, monkeypatch, capsys):
    from experiments import bench_paged

    (tmp_path / "some-program").write_bytes(b"x")
    monkeypatch.setattr(sys, "argv", ["bench_paged", "--quick", "--compilation-cache", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        bench_paged.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--compilation-cache {tmp_path}: expected a missing or empty directory" in err
