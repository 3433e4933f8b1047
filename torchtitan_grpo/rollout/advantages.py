"""Group-relative advantages.

Rewards arrive as ``[P, G]``: ``P`` prompts, ``G`` completions sampled for each.
A completion's advantage is its reward relative to the other completions of
the same prompt, so no value network is needed.
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-completion advantages ``[P, G]`` from rewards ``[P, G]``.

    ``scale_by_std=True`` (GRPO): ``(r - mean_g) / (std_g + eps)``, where
    ``std_g`` is the *sample* standard deviation of the group (Bessel's
    correction, divisor ``G - 1``), as in the GRPO paper's implementations.
    ``scale_by_std=False`` (Dr. GRPO): ``r - mean_g``; dividing by the std
    up-weights groups that are almost all right or almost all wrong.

    A group whose rewards are all equal gets all-zero advantages (it carries
    no learning signal). With ``G == 1`` every advantage is 0.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [P, G], got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if not scale_by_std:
        return centred
    if rewards.shape[-1] < 2:
        # The sample std of one value is undefined (NaN); the centred value is 0.
        return centred
    std = rewards.std(dim=-1, keepdim=True, unbiased=True)
    return centred / (std + eps)


def constant_group_mask(rewards: torch.Tensor, atol: float = 0.0) -> torch.Tensor:
    """``bool[P]``: True for groups whose rewards are all equal (within ``atol``).

    Such groups have zero advantage; trainers count them (a high fraction means
    the task is too easy or too hard) and may drop them (DAPO's dynamic sampling).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [P, G], got shape {tuple(rewards.shape)}")
    spread = rewards.amax(dim=-1) - rewards.amin(dim=-1)
    return spread <= atol


__all__ = ["constant_group_mask", "group_advantages"]
