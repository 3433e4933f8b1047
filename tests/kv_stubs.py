"""Stand-ins for the engine's request and sequence, as the KV batches read
them (static_batch.py, paged_batch.py): enough to prefill and decode rows
without an engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan_grpo.inference.requests import SamplingParams


@dataclass
class Req:
    prompt_ids: list[int]


@dataclass(eq=False)
class Seq:
    req: Req
    index: int = 0
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    route_chunks: list | None = None
    params: SamplingParams = field(default_factory=lambda: SamplingParams(max_new_tokens=48))

    def context(self) -> list[int]:
        return self.req.prompt_ids + self.output_ids
