"""The pool's backends asking for routed experts (``grpo.router_replay =
"rollout"``): every generation request carries ``return_routed_experts`` and
every reply's routes are decoded (``protocol/route_codec.py``) into
``Completion.routed_experts``. A reply without them, or with a malformed
field, is a :class:`MalformedResponse` naming the field and the replica."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from torchtitan_grpo.protocol import route_codec
from torchtitan_grpo.fleet import sglang


def with_routes(protocol: str, backend: Any, shape: tuple[int, int]) -> Any:
    """``backend`` (a ``pool.Backend`` speaking ``protocol``) asking for and
    reading the routes of a model with ``shape`` = (MoE layers, top_k)."""
    build = backend.build

    def build_with_routes(ids: list[int], n: int, params: Any, model: str) -> dict[str, Any]:
        return {**build(ids, n, params, model), route_codec.REQUEST_FIELD: True}

    if protocol == "vllm":
        from torchtitan_grpo.fleet import vllm

        def parse(body: Any, n: int, replica: str) -> list:
            return vllm.parse_completions(body, n, replica, route_shape=shape)
    else:  # sglang, builtin

        def parse(body: Any, n: int, replica: str) -> list:
            return sglang.parse_generate(body, n, replica, route_shape=shape)
    return dataclasses.replace(backend, build=build_with_routes, parse=parse)


def replay_shape(router_replay: str, hf_dir: str) -> tuple[int, int] | None:
    """``PoolConfig.route_shape`` for ``grpo.router_replay``: the served
    model's (MoE layers, top_k) from ``hf_dir``/config.json with "rollout",
    None with "off"."""
    if router_replay != "rollout":
        return None
    with open(os.path.join(hf_dir, "config.json")) as f:
        return route_shape(json.load(f))


def route_shape(hf_config: dict) -> tuple[int, int]:
    """(MoE layers, top_k) of an HF MoE config.json (Qwen3-MoE: every layer
    but ``mlp_only_layers`` and those off ``decoder_sparse_step``)."""
    layers, step = int(hf_config["num_hidden_layers"]), int(hf_config.get("decoder_sparse_step", 1) or 1)
    dense = set(hf_config.get("mlp_only_layers") or [])
    moe = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    if not moe or not hf_config.get("num_experts_per_tok"):
        raise ValueError("grpo.router_replay = 'rollout' needs a MoE model: config.json has no routed experts "
                         "(num_experts_per_tok, MoE layers)")
    return len(moe), int(hf_config["num_experts_per_tok"])
