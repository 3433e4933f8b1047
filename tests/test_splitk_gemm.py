"""The split-K skinny GEMM (issue 50) gives ``F.linear``'s result.

On a GPU the compiled kernel runs. On a CPU with triton installed it runs in
triton's interpreter, without being asked to: the interpreter needs
``TRITON_INTERPRET=1`` before triton is first imported (triton's own
``tl.zeros``, ``tl.sum``... are decorated then), which a pytest session that
imported the engine already is past, so one child process with the variable
set computes every case's output and the tests check them here. Run with the
variable set, they run in this process:

  python -m pytest -q tests/test_splitk_gemm.py
  TRITON_INTERPRET=1 python -m pytest -q tests/test_splitk_gemm.py

Shapes are tiny (the interpreter is slow). Without triton only the
pure-Python parts (configs, input checks, the switch) are tested.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import ROOT
from bench import splitk_gemm as sg
from bench.splitk_gemm import GemmConfig

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(sg.triton is None, reason="needs triton (on a CPU it runs in the interpreter)")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (rows, N, K, config): N never a multiple of block_n; K not of block_k nor of split_k x block_k
# except where said.
CASES = {
    "3rows-one-split": (3, 40, 100, GemmConfig(32, 32, 1, 4, 2)),
    "17rows-3-splits": (17, 72, 200, GemmConfig(32, 32, 3, 4, 2)),  # K: 96 + 96 + 8
    "one-row-splits-dropped": (1, 48, 64, GemmConfig(16, 16, 5, 4, 2)),  # 4 steps of K: 4 splits, not 5
    "even-K": (4, 50, 128, GemmConfig(32, 32, 2, 4, 2)),  # the unmasked K loop
    "default-config": (5, 70, 300, None),  # 64 x 128 tiles, 3 splits (sm count 132 on a CPU)
}


def _inputs(case: str, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    m, n, k, _ = CASES[case]
    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn((m, k), generator=g), torch.randn((n, k), generator=g)
    return x.to(DTYPES[dtype]).to(DEVICE), w.to(DTYPES[dtype]).to(DEVICE)


def _output(case: str, dtype: str) -> torch.Tensor:
    x, w = _inputs(case, dtype)
    return sg.linear(x, w, CASES[case][3])


def _all_outputs() -> dict[str, torch.Tensor]:
    """Every case's output, and the default-config case's a second time (the child's work)."""
    out = {f"{c}-{d}": _output(c, d) for c in CASES for d in DTYPES}
    out["again"] = _output("default-config", "bf16")
    return out


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> Callable[[str], torch.Tensor]:
    """``key -> linear's output``: computed here where the kernel runs, else by one child in the interpreter."""
    if sg.available(DEVICE):
        return lambda key: _output(*(("default-config", "bf16") if key == "again" else key.rsplit("-", 1)))
    path = tmp_path_factory.mktemp("skinny") / "outputs.pt"
    code = ("import sys, torch; from tests.test_splitk_gemm import _all_outputs; "
            "torch.save(_all_outputs(), sys.argv[1])")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    saved = torch.load(path)
    return saved.__getitem__


@needs_triton
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_linear_equals_f_linear(outputs, case, dtype):
    x, w = _inputs(case, dtype)
    out = outputs(f"{case}-{dtype}")
    assert out.shape == (x.shape[0], w.shape[0]) and out.dtype == x.dtype
    want = F.linear(x.float(), w.float()).cpu()  # the exact sums of the inputs as given
    if dtype == "fp32":
        torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-4)
    else:  # one rounding to bf16 of an fp32 sum in another order: torch's bf16 tolerance
        torch.testing.assert_close(out.float().cpu(), want, rtol=1.6e-2, atol=1e-5)


@needs_triton
def test_split_sums_are_deterministic(outputs):
    m, n, k, _ = CASES["default-config"]
    assert sg.splits(k, sg.default_config(m, n, k, 132))[0] > 1  # the workspace and the summing kernel ran
    assert torch.equal(outputs("again"), outputs("default-config-bf16"))


def test_bad_inputs_raise():
    x, w = torch.zeros((2, 64)), torch.zeros((32, 64))
    with pytest.raises(ValueError, match="contiguous"):
        sg.linear(x, w.t().contiguous().t())  # [N, K] with K's stride N: a transposed weight's view
    with pytest.raises(ValueError):
        sg.linear(x, w[:, :32].contiguous())
    with pytest.raises(ValueError):
        sg.linear(x, w.bfloat16())
    with pytest.raises(ValueError, match="rows"):
        sg.linear(torch.zeros((sg.MAX_ROWS + 1, 64)), w)


def test_available_and_its_switch(monkeypatch):
    monkeypatch.delenv("TORCHTITAN_GRPO_SKINNY_GEMM", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert sg.available(torch.device("cpu")) == (sg.triton is not None)
    monkeypatch.setenv("TORCHTITAN_GRPO_SKINNY_GEMM", "0")
    assert not sg.available(torch.device("cpu")) and not sg.available(torch.device("cuda", 0))
    monkeypatch.delenv("TORCHTITAN_GRPO_SKINNY_GEMM")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not sg.available(torch.device("cpu"))  # a CPU needs the interpreter


def test_default_config_fills_the_gpu_a_few_programs_per_sm():
    sms = 132
    for n, k in [(2560, 4096), (2560, 9728), (6144, 2560), (19456, 2560)]:  # Qwen3-4B's o, down, qkv, gate_up
        cfg = sg.default_config(64, n, k, sms)
        programs = -(-n // cfg.block_n) * sg.splits(k, cfg)[0]
        assert 2 * sms <= programs <= 4 * sms, (n, k, cfg)
    assert sg.default_config(64, 151936, 2560, sms).split_k == 1  # the LM head has tiles enough
    assert sg.splits(100, sg.default_config(1, 64, 100, sms)) == (1, 128)  # no more splits than K steps


def test_default_config_fits_an_h200s_shared_memory():
    for m in (1, 64, 128, 256):
        cfg = sg.default_config(m, 2560, 9728, 132)
        pipeline = cfg.num_stages * (max(16, 1 << (m - 1).bit_length()) + cfg.block_n) * cfg.block_k * 2
        assert pipeline <= 227 * 1024, (m, cfg)  # triton keeps num_stages copies of both tiles


def test_config_rejects_shapes_tl_dot_cannot_take():
    for bad in [(48, 64, 1, 4, 3), (64, 8, 1, 4, 3), (64, 64, 0, 4, 3), (64, 64, 1, 3, 3)]:
        with pytest.raises(ValueError):
            GemmConfig(*bad)


def test_bench_sweep_configs_fit_and_cut_k_differently():
    from bench import decode_gemm

    smem, sms = 227 * 1024, 132
    for rows in (64, 256):
        for name, k, n, _ in decode_gemm.gemms("4b"):
            cfgs = decode_gemm.splitk_configs(rows, n, k, sms, smem, "full")
            assert cfgs and len(decode_gemm.splitk_configs(rows, n, k, sms, smem, "quick")) <= 2
            for c in cfgs:
                assert c.split_k * c.block_k <= k
                assert decode_gemm.tile_smem(rows, c.block_n, c.block_k, c.num_stages) <= smem
            cuts = [(c.block_n, c.block_k, c.num_warps, c.num_stages, sg.splits(k, c)[0]) for c in cfgs]
            assert len(cuts) == len(set(cuts)), name  # no config timed twice
    assert decode_gemm.config_label(GemmConfig(64, 128, 8, 4, 3)) == "n64 k128 s8 w4/3"
