"""One completion with everything the loss needs: the unit a rollout source
hands the trainer. Its own module, free of the trainer's imports (TorchTitan,
the model), so that a rollout client process can build samples without them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Sample:
    """One completion with everything the loss needs (built on rank 0)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    rollout_logprobs: list[float]
    advantage: float
    reward: float
    finish_reason: str
    weight_versions: list[str]
    loss_mask: list[float] | None = None
    """Per completion token (aligned with ``completion_ids``): 1 = trained,
    0 = not trained (a tool result or an environment's reply inside a
    multi-turn trajectory; its rollout logprob is ignored). None trains every
    completion token. A multi-turn trajectory is ``prompt_ids`` = the tokens
    before its first trained token and ``completion_ids`` = the rest."""

    version_spans: list[tuple[str, int, int]] | None = None
    """``(version, start, end)`` over ``completion_ids`` when the engine reports
    per-token versions (a weight update landed mid-generation); with
    ``grpo.is_correction = "token"`` tokens too stale are masked out one by one
    (``offpolicy.select_samples``)."""

    routed_experts: Any = None
    """MoE router replay (``grpo.router_replay = "rollout"``): a numpy int16
    array ``[len(prompt_ids) + len(completion_ids) - 1, num_moe_layers, top_k]``
    of the expert ids the inference engine's router picked, for every input
    position the engine ran (the whole sequence but its last token, which was
    never fed back), layers in model order; a row of -1 where the engine gave
    no route (that position routes normally in the trainer). None: no routes."""

    @property
    def num_loss_tokens(self) -> float:
        """Tokens the loss sees (the token-count normaliser's share of this sample)."""
        return float(len(self.completion_ids)) if self.loss_mask is None else float(sum(self.loss_mask))
