"""torchtitan-grpo: GRPO post-training on TorchTitan with a wait-free weight push."""

from torchtitan_grpo import _titan  # noqa: F401  (must run before any torchtitan import)

__version__ = "0.1.0"
