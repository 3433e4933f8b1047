"""Loading the served model: an HF checkpoint directory to a model, a
tokenizer and the facts about them the engine serves by.

Separate from the engine because none of it concerns scheduling: it runs
once, before the worker starts, and its failures are the server's start-up
errors (:class:`ModelLoadError`), not a request's.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from torchtitan_grpo.server.engine.requests import ModelLoadError

logger = logging.getLogger(__name__)


def load_model(path: str, dtype: str, device: str) -> tuple[Any, Any]:
    """The causal LM in ``path`` (eval mode, no grads, on ``device``) and its
    tokenizer, or None for the tokenizer when the directory has none usable."""
    if not os.path.isdir(path):
        raise ModelLoadError(f"model directory {path!r} does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"model directory {path!r} has no config.json")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        hf_config = AutoConfig.from_pretrained(path)
        torch_dtype = resolve_dtype(dtype, hf_config)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except Exception as e:
        raise ModelLoadError(f"cannot load model from {path!r}: {type(e).__name__}: {e}") from e
    model.to(device).eval().requires_grad_(False)
    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # token-id-only serving is fine for RL
        logger.warning("no usable tokenizer in %s (%s): text input/output disabled", path, e)
    return model, tokenizer


def resolve_dtype(name: str, hf_config: Any) -> torch.dtype:
    """``EngineConfig.dtype`` as a torch dtype ("auto": the checkpoint's own)."""
    if name == "auto":
        d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(d, str):
            d = getattr(torch, d, None)
        return d if isinstance(d, torch.dtype) else torch.float32
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}")
    return getattr(torch, name)


def eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from config.json, generation_config.json (chat models often
    list extra end tokens only there) and, failing both, the tokenizer."""
    found: list[int] = []

    def add(v: Any) -> None:
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if x is not None and int(x) not in found:
                found.append(int(x))

    add(getattr(model.config, "eos_token_id", None))
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        add(getattr(gen, "eos_token_id", None))
    if not found and tokenizer is not None:
        add(tokenizer.eos_token_id)
    return tuple(found)
