"""Engine-neutral request and result types of the inference pool."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


BUILTIN_ENGINE = "torchtitan-grpo"
"""What the built-in server's ``/model_info`` says in its ``engine`` field
(SGLang's and vLLM's have no such field): a pusher that sees it may rely on
the built-in server's own guarantees, e.g. that a session's end waits for the
update in flight."""


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


class MalformedResponse(ValueError):
    """A replica answered with a body that violates its protocol."""

    def __init__(self, replica: str, field_name: str, detail: str):
        super().__init__(f"malformed response from {replica}: field {field_name}: {detail}")
        self.replica, self.field_name = replica, field_name


def need(cond: bool, replica: str, field_name: str, detail: str) -> None:
    """Raise MalformedResponse naming ``field_name`` unless ``cond``."""
    if not cond:
        raise MalformedResponse(replica, field_name, detail)


def is_logprob(x: Any) -> bool:
    """A finite number <= 0 (a little slack for rounding), not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x <= 1e-6
