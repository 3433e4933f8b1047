"""Engine-neutral request and result types of the inference pool."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Shared with the weight push, which must not import inference: re-exported here.
from torchtitan_grpo.protocol.builtin import BUILTIN_ENGINE  # noqa: F401
from torchtitan_grpo.protocol.errors import MalformedResponse, need  # noqa: F401


@dataclass(frozen=True)
class SamplingParams:
    """What every backend understands; each maps it onto its own field names."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass
class Completion:
    """One sampled continuation of one prompt."""

    token_ids: list[int]
    logprobs: list[float]
    """Per-token logprob of each sampled token under the sampling distribution."""
    finish_reason: str
    """"stop" (EOS or a stop id), "length" (max_new_tokens) or "abort"."""
    weight_version: str
    """Version the replica served when the request finished."""
    weight_versions: list[str] = field(default_factory=list)
    """Every version that produced part of this completion (one element when it
    did not change mid-request)."""
    replica: str = ""
    version_spans: list[tuple[str, int, int]] = field(default_factory=list)
    """``(version, start, end)``: tokens ``[start, end)`` were sampled under
    ``version``; contiguous, covering every token. From the engine's per-token
    spans when it reports them (the built-in server, over both protocols),
    else one span of the version it reports (SGLang: the version serving when
    the request finished)."""
    routed_experts: Any = None
    """int16 ``[len(prompt) + len(token_ids) - 1, moe_layers, top_k]`` when routes
    were asked for (``protocol/route_codec.py``), else None."""


def is_logprob(x: Any) -> bool:
    """A finite number <= 0 (a little slack for rounding), not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x <= 1e-6


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_spans(spans: Any, n_tokens: int, replica: str, where: str) -> list[tuple[str, int, int]]:
    """``(version, start, end)`` of contiguous spans that cover ``[0, n_tokens)``
    (the vLLM choice's ``weight_versions``, and SGLang's ``meta_info.weight_versions``)."""
    need(isinstance(spans, list), replica, where,
          f"missing or not a list (was return_weight_versions sent?): {spans!r}")
    out: list[tuple[str, int, int]] = []
    pos = 0
    for k, s in enumerate(spans):
        at = f"{where}[{k}]"
        need(isinstance(s, dict), replica, at, "not an object {version,start,end}")
        v, start, end = s.get("version"), s.get("start"), s.get("end")
        need(isinstance(v, str), replica, f"{at}.version", f"not a string: {v!r}")
        need(_is_int(start) and start == pos, replica, f"{at}.start", f"expected {pos}, got {start!r}")
        need(_is_int(end) and end > start, replica, f"{at}.end", f"must be an integer > start {start}, got {end!r}")
        out.append((v, start, end))
        pos = end
    need(pos == n_tokens, replica, where, f"spans cover {pos} tokens, the choice has {n_tokens}")
    return out
