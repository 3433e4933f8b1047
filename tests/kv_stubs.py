"""Stand-ins for the engine's request and sequence, as the KV batches read
them (server/engine/static_batch.py, server/engine/paged_batch.py): enough to prefill and decode rows
without an engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan_grpo.server.engine.requests import SamplingParams


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


def scripted_decode(batch, first: list[Seq], late: list[int], steps: int = 20, keep: tuple = (0, 2, 3)) -> list:
    """Run one script on a KV batch and return each step's logits (copies: a
    graph replay returns views of its fixed output buffer): prefill copies of
    ``first``, greedy decode ``steps`` steps, the rows not in ``keep`` leaving
    after step 5 (row 1 by default), a ``late`` prompt joining after step 9."""
    import torch

    seqs = [Seq(s.req, s.index, list(s.output_ids)) for s in first]
    out = []
    with torch.no_grad():
        logits = batch.prefill(seqs)
        for step in range(steps):
            out.append(logits.clone())
            nxt = logits.argmax(-1)
            for s, t in zip(batch.rows, nxt.tolist()):
                s.output_ids.append(t)
            if step == 5:
                batch.keep(list(keep))
                nxt = nxt[list(keep)]
            logits = batch.decode(nxt)
            if step == 9:
                out.append(batch.prefill([Seq(Req(late))]))
                logits = torch.cat([logits, out[-1]])
    return out
