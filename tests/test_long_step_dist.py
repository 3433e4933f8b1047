"""bench/long_step_dist.py: the MFU arithmetic its table reports, the peak
looked up by device name, the layouts' [parallelism] keys."""

import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, ROOT)
from bench import long_step_dist as lsd  # noqa: E402


def test_model_flops_is_6_n_tokens_plus_causal_attention():
    n, layers, heads, head_dim, t, samples = 4_000_000_000, 36, 32, 128, 16384, 4
    dense = 6 * n * t * samples
    # per layer and sample: forward QK^T + AV = 4 T^2 H d, halved by the causal mask, x3 for fwd + bwd
    attention = 3 * (4 * t * t * heads * head_dim / 2) * layers * samples
    assert lsd.model_flops(n, layers, heads, head_dim, t, samples) == pytest.approx(dense + attention, rel=1e-12)


def test_row_mfu_and_tokens_per_second():
    r = {"oom": False, "ms": 2000.0, "peak": 40.04, "reserved": 44.0, "loss": 0.1, "grad_norm": 1.0}
    row = lsd.fmt_row("fsdp", 16384, 4, r, flops=1.978e15, n_gpus=2, peak=989e12)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:8] == ["fsdp", "16384", "4", "2.000", "32,768", "50.0", "40.0", "44.0"], cells
    assert cells[-1] == "ok"
    no_peak = lsd.fmt_row("fsdp", 16384, 4, r, flops=1.978e15, n_gpus=2, peak=None)
    assert no_peak.split("|")[6].strip() == "-"
    oom = lsd.fmt_row("fsdp_cp", 8192, 2, {"oom": True, "peak": 79.1, "reserved": 79.5}, 1e15, 2, 989e12)
    assert "OOM" in oom.split("|")[4] and oom.rstrip(" |").endswith("OOM")
    assert "skipped" in lsd.fmt_row("fsdp", 16384, 4, None, 1e15, 2, 989e12)


@pytest.mark.parametrize("name, tflops", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                          ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                          ("cpu", None)])
def test_peak_by_device_name(name, tflops):
    got = lsd.peak_flops(name)
    assert (got is None) if tflops is None else got == pytest.approx(tflops * 1e12)
    assert lsd.peak_flops(name, 500.0) == pytest.approx(500e12)


def test_layout_flags():
    assert lsd.layout_flags("fsdp", 2, 2) == ("--parallelism.data_parallel_shard_degree", "2",
                                              "--parallelism.context_parallel_degree", "1")
    assert lsd.layout_flags("fsdp_cp", 2, 2) == ("--parallelism.data_parallel_shard_degree", "1",
                                                 "--parallelism.context_parallel_degree", "2")
    assert lsd.layout_flags("fsdp_cp", 4, 2)[1] == "2"
    with pytest.raises(SystemExit, match="context_parallel_degree=2"):
        lsd.layout_flags("fsdp_cp", 3, 2)
