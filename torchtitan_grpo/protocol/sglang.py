"""SGLang 0.5.x weight-update control plane (see PROTOCOLS.md): request bodies
the weight push sends and the built-in server reads. Generation requests and
their parsing are the client pool's (``fleet.sglang``)."""

from __future__ import annotations

from typing import Any

GROUP_NAME = "weight_update_group"
"""SGLang's default weight-update group name."""


def init_group_request(master_address: str, master_port: int, rank_offset: int, world_size: int,
                       group_name: str, backend: str) -> dict[str, Any]:
    """Body of POST /init_weights_update_group."""
    return {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}


def update_request(names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, *,
                   flattened: bool, flush_cache: bool, weight_version: str | None) -> dict[str, Any]:
    """Body of POST /update_weights_from_distributed (``flattened``: one uint8
    bucket per request, SGLang's ``flattened_bucket`` load format)."""
    return {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": flush_cache, "abort_all_requests": False, "weight_version": weight_version,
            "load_format": "flattened_bucket" if flattened else None}


# ---- LoRA adapters (docs/PROTOCOL_NOTES.md, "LoRA adapter routes"); a server started with --enable-lora

LOAD_LORA_ADAPTER = "/load_lora_adapter"
UNLOAD_LORA_ADAPTER = "/unload_lora_adapter"
LOAD_LORA_ADAPTER_FROM_TENSORS = "/load_lora_adapter_from_tensors"
ADAPTER_FIELD = "lora_path"
"""The /generate field that picks a loaded adapter, by its ``lora_name``."""


def load_lora_adapter_request(lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
    """Body of POST /load_lora_adapter: a peft folder (adapter_config.json +
    adapter_model.safetensors) the server can read, served as ``lora_name``."""
    return {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}


def unload_lora_adapter_request(lora_name: str) -> dict[str, Any]:
    """Body of POST /unload_lora_adapter."""
    return {"lora_name": lora_name}


def load_lora_adapter_from_tensors_request(lora_name: str, config_dict: dict[str, Any], serialized_tensors: str,
                                           pinned: bool = False, load_format: str | None = None) -> dict[str, Any]:
    """Body of POST /load_lora_adapter_from_tensors. ``serialized_tensors`` is
    SGLang's ``MultiprocessingSerializer.serialize(tensors, output_str=True)``:
    torch multiprocessing handles (same host only), which the built-in server
    refuses to unpickle."""
    body: dict[str, Any] = {"lora_name": lora_name, "config_dict": config_dict,
                            "serialized_tensors": serialized_tensors, "pinned": pinned}
    if load_format is not None:
        body["load_format"] = load_format
    return body


def name_adapter(body: dict[str, Any], lora_name: str) -> dict[str, Any]:
    """A /generate body that runs on the adapter ``lora_name`` (a copy)."""
    return {**body, ADAPTER_FIELD: lora_name}
