"""Import torchtitan on machines without triton.

``torchtitan/__init__.py`` imports the float8 quantization module, which
imports the MoE package, whose ``kernels`` module does ``import triton`` at
module level. CPU machines have no triton (and a 286 MB wheel to run dense
models on a CPU is a poor trade), so when triton is missing we register a
stand-in for that one module before torchtitan is imported. The stand-in
raises as soon as an MoE token permutation is actually requested, so nothing
silently runs a different code path. A global fake ``triton`` package would
be worse: ``torch._dynamo`` probes for it.
"""

from __future__ import annotations

import importlib.util
import sys
import types

_KERNELS = "torchtitan.models.moe.kernels"


def _missing(*_args, **_kwargs):
    raise RuntimeError(
        "torchtitan's MoE kernels need triton, which is not installed here; "
        "`pip install triton` to train MoE models"
    )


def ensure_importable() -> None:
    """Make ``import torchtitan`` work whether or not triton is installed."""
    if _KERNELS in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stub = types.ModuleType(_KERNELS)
    stub.__doc__ = "Stand-in registered by torchtitan_grpo._titan (triton missing)."
    stub.generate_permute_indices = _missing
    stub.fill_indices_wrapper = _missing
    stub.__all__ = ["generate_permute_indices", "fill_indices_wrapper"]
    sys.modules[_KERNELS] = stub


ensure_importable()
