"""SGLang 0.5.x weight-update control plane (see PROTOCOLS.md): request bodies
the weight push sends and the built-in server reads. Generation requests and
their parsing are the client pool's (``inference.sglang``)."""

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
