"""experiments.transfer_real: the paper's figures scaled to the model, each process's peak
memory read from /proc (the runs take minutes: ``python -m experiments.transfer_real``)."""

import subprocess
import sys
import time

import pytest

from experiments import transfer_real


def test_the_paper_figures_scale_by_the_models_weights():
    p = transfer_real.paper_scaled("qwen3-0.6b-shapes")
    assert p["scale"] == pytest.approx(596_049_920 / 8.19e9)
    assert p["delta_mb_leb128"] == pytest.approx(202.0 * p["scale"])
    assert p["extract_s"] == pytest.approx(5.0 * p["scale"])
    assert p["transfer_s_at_1gbps"] == pytest.approx(p["delta_mb_leb128"] * 8e6 / 1e9)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_peak_memory_reports_each_child_process_by_its_id():
    code = "import numpy as np, time; a = np.ones(50_000_000); time.sleep(1.5)"
    with transfer_real.PeakMemory(every_s=0.1) as mem:
        child = subprocess.Popen([sys.executable, "-c", code, "--id", "memtest"])
        child.wait(timeout=60)
        time.sleep(0.2)
    assert 0.4 < mem.peak["memtest"] < 2.0  # 400 MB of ones, plus the interpreter
