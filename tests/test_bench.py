"""bench/gpu_check.py runs only where a GPU is lent, for minutes of scarce device time: its dry run on
CPU keeps it from rotting in between (the cheap parts here; every part with `--device cpu`)."""

from __future__ import annotations

import subprocess
import sys
import time

from conftest import ROOT

GPU_CHECK = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu"]


def test_gpu_check_dry_run_compares_kernels_packed_batches_and_attention(tmp_path):
    out = subprocess.run(
        [*GPU_CHECK, "--parts", "kernels,packed,attention", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    summary = out.stdout.split("# summary")[1]
    for impl in ("grouped_mm", "chunked", "bmm", "loop"):  # fp32 on CPU: every kernel equals the loop
        assert f"{impl}" in summary
    assert summary.count("rel. diff to loop 0.0e+00") == 4, summary
    assert "packed tiny batch" in summary and "cpu bf16 loss" in summary
    assert "banded, blocks of 32" in summary and "torch / ours: " in summary  # bench/attention.py ran
    assert (tmp_path / "kernels.log").is_file() and (tmp_path / "packed.log").is_file()


def test_gpu_check_stops_a_part_at_its_timeout_and_fails(tmp_path):
    start = time.perf_counter()
    out = subprocess.run(
        [*GPU_CHECK, "--parts", "torchrun", "--part-timeout", "3", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert time.perf_counter() - start < 30  # the torchrun part alone takes over a minute
    assert out.returncode == 1
    assert "part torchrun FAILED (stopped after 3 s)" in out.stdout


def test_gpu_check_rejects_unknown_parts(tmp_path):
    out = subprocess.run(
        [*GPU_CHECK, "--parts", "kernels,kernal", "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "unknown part(s) kernal" in out.stderr and "kernels" in out.stderr
    assert not list(tmp_path.iterdir())  # refused before any part ran
