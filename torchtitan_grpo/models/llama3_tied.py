"""TorchTitan's llama3 with tied input and output embeddings.

Small Llamas (SmolLM2, Llama 3.2 1B/3B) set ``tie_word_embeddings``: the
output projection *is* the token embedding, and their checkpoints hold no
``lm_head.weight``. TorchTitan 0.2.2's llama3 ``Transformer`` always has a
separate output matrix; its qwen3 model has the tie behind
``enable_weight_tying``. This module gives llama3 the same switch, so the
rest of the project (FSDP grouping and TP re-tie in
:mod:`torchtitan_grpo.distributed.parallel`, the pipeline's mirrored copy, the weight
push, the HF export) sees exactly what it sees for a tied qwen3: one
parameter under the two names ``tok_embeddings.weight`` and
``output.weight``.

:mod:`torchtitan_grpo.models.hf_bridge` picks these classes for ``model.name = "llama3"``
when config.json says ``tie_word_embeddings: true``; the train spec (its
``parallelize_fn`` included) stays TorchTitan's llama3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import torchtitan_grpo  # noqa: F401  (installs the triton shim before torchtitan)
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import Transformer
from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

__all__ = ["TiedLlama3ModelArgs", "TiedLlama3Transformer", "TiedLlama3StateDictAdapter"]

_EMBED = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"


@dataclass
class TiedLlama3ModelArgs(TransformerModelArgs):
    """llama3 model args plus the weight tie (the field name is qwen3's, which
    TorchTitan's FLOP count and our trainer read)."""

    enable_weight_tying: bool = True
    """``output.weight`` is ``tok_embeddings.weight`` (HF ``tie_word_embeddings``)."""


class TiedLlama3Transformer(Transformer):
    """llama3 ``Transformer`` whose output projection shares the embedding."""

    def __init__(self, model_args: TiedLlama3ModelArgs):
        super().__init__(model_args)
        self._tie()

    def _tie(self) -> None:
        # A pipeline stage may hold only one end (the other is None): then
        # there is nothing to tie here, the pipeline keeps the copies equal.
        if (self.model_args.enable_weight_tying and self.tok_embeddings is not None
                and self.output is not None):
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """TorchTitan's llama3 init on the tied pair.

        The tie is restored first: allocating a model built on meta
        (``to_empty``) or distributing its modules one by one (TP) can give
        ``output`` a tensor of its own. The shared matrix then ends with the
        output layer's truncated-normal init, as qwen3's tied init does.
        """
        self._tie()
        super().init_weights(buffer_device)


class TiedLlama3StateDictAdapter(Llama3StateDictAdapter):
    """TorchTitan's llama3 adapter (wq/wk permutation unchanged) without
    ``lm_head.weight``: ``to_hf`` drops it (the last pipeline stage's copy
    of the tied weight has no HF name), ``from_hf`` fills ``output.weight``
    from ``model.embed_tokens.weight``."""

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        hf_state_dict = super().to_hf(state_dict)
        if self.model_args.enable_weight_tying:
            hf_state_dict.pop(_LM_HEAD, None)
        return hf_state_dict

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.model_args.enable_weight_tying and _EMBED in hf_state_dict:
            # A stored lm_head.weight of a tied checkpoint is ignored, as
            # transformers ignores it: the head is the embedding.
            hf_state_dict = {**hf_state_dict, _LM_HEAD: hf_state_dict[_EMBED]}
        return super().from_hf(hf_state_dict)
