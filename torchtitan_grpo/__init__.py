"""torchtitan-grpo: GRPO post-training on TorchTitan with a wait-free weight push.

Packages by concern, lowest first: ``config`` and ``protocol``; ``models``;
``distributed``; ``lora``; ``train``; ``weight_sync``; ``fleet`` and
``server`` (the two sides of inference); ``rollout``. At the root:
``session`` (rank 0's inference side wired together for ``grpo_train.py``,
the top: nothing imports it) and shared helpers any package may use
(``aio``, ``net``, ``jsonfast``, ``reasons``, ``metrics``, ``stopping``, ``_titan``).

May import: config, models, distributed, lora, train, weight_sync, protocol, fleet, rollout.
"""

from torchtitan_grpo import _titan  # noqa: F401  (must run before any torchtitan import)

__version__ = "0.1.0"
