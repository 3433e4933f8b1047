"""The ``[moe]`` section: options of mixture-of-experts models (Qwen3-MoE).

Kept out of ``config/job_config.py`` (one job per module). Router replay is
``grpo.router_replay``; expert parallelism is TorchTitan's
``parallelism.expert_parallel_degree``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MoE:
    """Mixture-of-experts training options (ignored by dense models)."""

    aux_loss_coef: float = 0.0
    """Weight of the router's auxiliary load-balancing loss. 0 (the RL
    default): the policy gradient alone moves the router, so routing changes
    between versions only as much as the policy does."""
