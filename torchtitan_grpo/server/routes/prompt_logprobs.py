"""Prompt logprobs on the built-in server: SGLang's ``input_token_logprobs``
(``return_logprob`` with ``logprob_start_len`` >= 0) and vLLM's
``prompt_logprobs``.

One forward over the prompt with the engine's model and live weights
(:meth:`Engine.prompt_logits`, on a worker thread beside the decode loop):
position ``t``'s logprob is ``log_softmax(logits[t - 1])[prompt[t]]``, the
model's raw distribution (no temperature), as both engines compute prompt
logprobs; the first prompt token has none (None).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_grpo.server.routes import logprob_json

_ROWS = 256
"""log_softmax over the vocabulary this many positions at a time (a long
prompt's float32 logprobs at once would be prompt x vocab x 4 bytes)."""


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens 1..T-1 (token 0 has none)."""

    token_ids: list[int]
    logprobs: list[float]
    """[T - 1]: logprob of ``token_ids[t + 1]`` given ``token_ids[: t + 1]``."""
    ranks: list[int]
    """[T - 1]: 1 + how many vocabulary entries are more likely (vLLM's rank)."""
    top: list[list[tuple[float, int]]] | None
    """[T - 1] x k: the k most likely (logprob, token id) at each position."""
    weight_version: str


def compute(engine: Any, ids: list[int], top_k: int = 0) -> PromptLogprobs:
    """Prompt logprobs of ``ids`` (any thread: the forward holds the weights
    steady against a concurrent update)."""
    version = engine.weight_version
    logits = engine.prompt_logits(ids)[:-1]  # position t predicts token t + 1
    target = torch.tensor(ids[1:], device=logits.device)
    values, ranks, tops = [], [], []
    for start in range(0, logits.shape[0], _ROWS):
        lp = torch.log_softmax(logits[start:start + _ROWS].float(), dim=-1)
        chosen = lp.gather(1, target[start:start + _ROWS, None])
        values.append(chosen[:, 0])
        ranks.append((lp > chosen).sum(dim=-1) + 1)
        if top_k > 0:
            tv, ti = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
            tops += [list(zip(v, i)) for v, i in zip(tv.tolist(), ti.tolist())]
    cat = (lambda xs: torch.cat(xs).tolist()) if values else (lambda xs: [])
    return PromptLogprobs(token_ids=list(ids), logprobs=logprob_json.floored(cat(values)), ranks=cat(ranks),
                          top=tops if top_k > 0 else None, weight_version=version)


async def compute_all(engine: Any, prompts: list[list[int]], top_k: list[int]) -> list[PromptLogprobs]:
    """:func:`compute` for each prompt, off the event loop."""
    return [await asyncio.to_thread(compute, engine, p, k) for p, k in zip(prompts, top_k)]


# ---- SGLang ---------------------------------------------------------------- #


def sglang_meta(engine: Any, pl: PromptLogprobs, start: int, top_k: int, with_text: bool) -> dict:
    """SGLang's ``input_token_logprobs`` (and ``input_top_logprobs`` with
    ``top_logprobs_num``): ``[logprob, token_id, text | None]`` for prompt
    positions ``start``.. ; position 0's logprob is None."""
    tt = engine.token_text if with_text else (lambda _t: None)
    entries = [[None, pl.token_ids[0], tt(pl.token_ids[0])]]
    entries += [[lp, t, tt(t)] for lp, t in zip(pl.logprobs, pl.token_ids[1:])]
    meta: dict[str, Any] = {"input_token_logprobs": entries[start:]}
    if top_k > 0:
        tops = [None] + [[[lp, t, tt(t)] for lp, t in step] for step in pl.top or []]
        meta["input_top_logprobs"] = tops[start:]
    return meta


# ---- vLLM ------------------------------------------------------------------ #


def vllm_prompt_logprobs(engine: Any, pl: PromptLogprobs) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: None for the first token, then per position
    ``{token_id: {logprob, rank, decoded_token}}`` holding the prompt token
    first and the top k after it (each id once)."""
    out: list[dict | None] = [None]
    for step, token in enumerate(pl.token_ids[1:]):
        d = {str(token): _logprob(engine, pl.logprobs[step], pl.ranks[step], token)}
        for rank, (lp, t) in enumerate(pl.top[step] if pl.top else [], start=1):
            d.setdefault(str(t), _logprob(engine, max(lp, logprob_json.FLOOR), rank, t))
        out.append(d)
    return out


def _logprob(engine: Any, logprob: float, rank: int, token: int) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": engine.token_text(token)}
