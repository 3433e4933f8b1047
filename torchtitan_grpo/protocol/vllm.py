"""vLLM's weight-transfer control plane (see PROTOCOLS.md): route paths,
request bodies and strict parsing of the replies, for the weight push (the
client) and the built-in server's vLLM routes alike. Completions and their
parsing are the client pool's (``fleet.vllm``, which re-exports these).

Two releases are spoken (:class:`Dialect`): 0.33, the default and what the
built-in server answers, and 0.26, the newest that runs on torch 2.11. A
replica's release is read once per connect from GET /version
(:func:`nearest_dialect`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from torchtitan_grpo.protocol.errors import need

PAUSE_MODES = ("abort", "wait", "keep")
"""abort: end in-flight requests; wait: let them finish; keep: freeze them.
abort and wait answer new requests with 503 until /resume."""
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30
DEFAULT_PACKED_NUM_BUFFERS = 2

# The keys vLLM 0.33's NCCLWeightTransferInitInfo accepts (it is built with
# ``cls(**init_info)``, so any other key is a 400). ``nccl_unique_id_b64`` is
# the store-free rendezvous: exclusive with master_address/master_port.
INIT_INFO_KEYS = frozenset(
    {
        "master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64",
        "packed", "packed_buffer_size_bytes", "packed_num_buffers",
    }
)
UPDATE_INFO_KEYS = frozenset({"names", "dtype_names", "shapes"})

# vLLM 0.26.0 (vllm/distributed/weight_transfer/nccl_common.py, nccl_engine.py,
# ipc_engine.py; each built with ``cls(**info)``, so any other key fails):
# its NCCLWeightTransferInitInfo has the rendezvous only, and packing is a
# field of every update (NCCLWeightTransferUpdateInfo), not of the init.
INIT_INFO_KEYS_0_26 = frozenset({"master_address", "master_port", "rank_offset", "world_size"})
UPDATE_INFO_KEYS_0_26 = frozenset(
    {"names", "dtype_names", "shapes", "packed", "packed_buffer_size_bytes", "packed_num_buffers"})
IPC_INIT_INFO_KEYS = frozenset()  # IPCWeightTransferInitInfo: no fields
IPC_UPDATE_INFO_KEYS = frozenset(
    {"names", "dtype_names", "shapes", "ipc_handles", "ipc_handles_pickled", "tensor_sizes", "packed"})
"""IPCWeightTransferUpdateInfo. Over HTTP only ``ipc_handles_pickled`` can
travel: base64 of ``pickle.dumps({gpu_uuid: reduce_tensor(buffer)[1]})``,
which the server unpickles only with VLLM_ALLOW_INSECURE_SERIALIZATION=1."""
INSECURE_SERIALIZATION_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"


@dataclass(frozen=True)
class Dialect:
    """What a vLLM release expects where the releases we speak differ."""

    release: str
    """"major.minor"."""
    init_info_keys: frozenset[str]
    """NCCL ``init_info`` keys it accepts."""
    update_info_keys: frozenset[str]
    """NCCL ``update_info`` keys it accepts."""
    packing_per_update: bool
    """``packed`` and the buffer sizes go in every update_info (0.26), not in
    init_info (0.33)."""
    finish_takes_version: bool
    """/finish_weight_update reads ``{"weight_version"}`` (0.33); 0.26 reads no body."""
    reports_version: bool
    """GET /weight_info exists (0.33). Without it the trainer's record of what
    it pushed is the only one."""
    has_shutdown: bool
    """POST /shutdown_weight_transfer_engine exists (0.33)."""


V0_33 = Dialect("0.33", INIT_INFO_KEYS, UPDATE_INFO_KEYS, packing_per_update=False, finish_takes_version=True,
                reports_version=True, has_shutdown=True)
V0_26 = Dialect("0.26", INIT_INFO_KEYS_0_26, UPDATE_INFO_KEYS_0_26, packing_per_update=True,
                finish_takes_version=False, reports_version=False, has_shutdown=False)
DIALECTS = (V0_26, V0_33)
VERSION = "/version"  # GET: {"version": "0.26.0"}


def parse_version(body: Any, replica: str) -> str:
    """The release string of GET /version."""
    need(isinstance(body, dict) and isinstance(body.get("version"), str), replica, "version",
         f"expected {{'version': str}}, got {str(body)[:200]}")
    return body["version"]


def nearest_dialect(version: str) -> tuple[Dialect, bool]:
    """The dialect to speak to a release (e.g. "0.26.0", "0.27.1.dev3+g..."),
    and whether it is one we know: else the nearest known by (major, minor),
    the older on a tie; an unparsable string gets the default, 0.33."""
    m = re.match(r"v?(\d+)\.(\d+)", version.strip())
    if m is None:
        return V0_33, False
    def rank(major: int | str, minor: int | str) -> int:  # releases on one line: 1.0 is past every 0.x
        return int(major) * 1000 + int(minor)

    at = rank(m[1], m[2])
    best = min(DIALECTS, key=lambda d: (abs(at - rank(*d.release.split("."))), rank(*d.release.split("."))))
    return best, rank(*best.release.split(".")) == at

# Route paths (all POST except the two GETs).
INIT_WEIGHT_TRANSFER = "/init_weight_transfer_engine"
PAUSE = "/pause"
RESUME = "/resume"
START_WEIGHT_UPDATE = "/start_weight_update"
UPDATE_WEIGHTS = "/update_weights"
FINISH_WEIGHT_UPDATE = "/finish_weight_update"
SHUTDOWN_WEIGHT_TRANSFER = "/shutdown_weight_transfer_engine"
WEIGHT_INFO = "/weight_info"  # GET
WORLD_SIZE = "/get_world_size"  # GET


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def init_weight_transfer_request(
    world_size: int,
    rank_offset: int = 1,
    master_address: str | None = None,
    master_port: int | None = None,
    *,
    nccl_unique_id_b64: str | None = None,
    packed: bool = False,
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
    dialect: Dialect = V0_33,
) -> dict[str, Any]:
    """Body of POST /init_weight_transfer_engine (NCCL engine).

    Rendezvous through the trainer's TCP store (``master_address`` +
    ``master_port``) or, vLLM 0.33 only, through an NCCL unique id minted by
    the trainer (``nccl_unique_id_b64``): exactly one of the two. 0.26 takes
    the packing in every update instead (``update_weights_request``).
    """
    if nccl_unique_id_b64 is not None and "nccl_unique_id_b64" not in dialect.init_info_keys:
        raise ValueError(f"vLLM {dialect.release} has no nccl_unique_id_b64 rendezvous: "
                         "give master_address and master_port")
    by_store = master_address is not None or master_port is not None
    if by_store == (nccl_unique_id_b64 is not None):
        raise ValueError("give master_address and master_port, or nccl_unique_id_b64 (not both)")
    if by_store and (master_address is None or master_port is None):
        raise ValueError("master_address and master_port go together")
    if not 0 < rank_offset < world_size:
        raise ValueError(f"rank_offset must be in [1, world_size={world_size}), got {rank_offset}")
    if packed_buffer_size_bytes <= 0 or packed_num_buffers < 1:
        raise ValueError("packed_buffer_size_bytes must be > 0 and packed_num_buffers >= 1")
    info: dict[str, Any] = {"rank_offset": rank_offset, "world_size": world_size}
    if not dialect.packing_per_update:
        info |= {"packed": packed, "packed_buffer_size_bytes": packed_buffer_size_bytes,
                 "packed_num_buffers": packed_num_buffers}
    if by_store:
        info |= {"master_address": master_address, "master_port": master_port}
    else:
        info["nccl_unique_id_b64"] = nccl_unique_id_b64
    return {"init_info": info}


def pause_query(mode: str = "abort") -> dict[str, str]:
    """Query string of POST /pause (the mode is not a body field)."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
    return {"mode": mode}


def _metadata(names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]) -> dict[str, Any]:
    if not len(names) == len(dtype_names) == len(shapes):
        raise ValueError("names, dtype_names and shapes differ in length "
                         f"({len(names)}, {len(dtype_names)}, {len(shapes)})")
    bad = next((d for d in dtype_names if d.startswith("torch.")), None)
    if bad is not None:
        raise ValueError(f"dtype name {bad!r}: use the bare name, vLLM resolves it with getattr(torch, name)")
    return {"names": list(names), "dtype_names": list(dtype_names), "shapes": [[int(x) for x in s] for s in shapes]}


def update_weights_request(names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]], *,
                           dialect: Dialect = V0_33, packed: bool = False,
                           packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                           packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS) -> dict[str, Any]:
    """Body of POST /update_weights (NCCL engine). Dtype names are bare torch
    attribute names ("bfloat16"). On 0.33 whether the bytes come packed was
    fixed at init (the packing arguments are ignored); 0.26 reads it here."""
    info = _metadata(names, dtype_names, shapes)
    if dialect.packing_per_update:
        info |= {"packed": packed, "packed_buffer_size_bytes": packed_buffer_size_bytes,
                 "packed_num_buffers": packed_num_buffers}
    return {"update_info": info}


def ipc_init_request() -> dict[str, Any]:
    """Body of POST /init_weight_transfer_engine for the IPC engine (it has nothing to set up)."""
    return {"init_info": {}}


def ipc_update_weights_request(names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]],
                               tensor_sizes: Sequence[int], ipc_handles_pickled: str) -> dict[str, Any]:
    """Body of POST /update_weights for the IPC engine, packed: the tensors lie
    back to back from byte 0 of the buffer ``ipc_handles_pickled`` maps,
    ``tensor_sizes`` bytes each (the receiver splits by them and copies)."""
    info = _metadata(names, dtype_names, shapes)
    if len(tensor_sizes) != len(names) or any(int(n) < 0 for n in tensor_sizes):
        raise ValueError(f"tensor_sizes must be one byte count per name, got {len(tensor_sizes)} for {len(names)}")
    return {"update_info": info | {"packed": True, "tensor_sizes": [int(n) for n in tensor_sizes],
                                   "ipc_handles_pickled": ipc_handles_pickled}}


def finish_weight_update_request(weight_version: str | None, dialect: Dialect = V0_33) -> dict[str, Any] | None:
    """Body of POST /finish_weight_update: the version served from now on
    (0.33); None, no body, for a release that keeps no version (0.26)."""
    if not dialect.finish_takes_version:
        return None
    return {} if weight_version is None else {"weight_version": str(weight_version)}


def parse_weight_info(body: Any, replica: str) -> str:
    """The version a replica serves, from GET /weight_info."""
    need(isinstance(body, dict) and isinstance(body.get("weight_version"), str), replica, "weight_version",
          f"expected {{'weight_version': str}}, got {str(body)[:200]}")
    return body["weight_version"]


def parse_world_size(body: Any, replica: str) -> int:
    """Inference ranks behind a replica (TP*PP*DP), from GET /get_world_size:
    the trainer's group has world_size = 1 + the sum over replicas."""
    ws = body.get("world_size") if isinstance(body, dict) else None
    need(_is_int(ws) and ws >= 1, replica, "world_size", f"expected a positive integer, got {ws!r}")
    return ws


# ---- LoRA adapters (docs/PROTOCOL_NOTES.md, "LoRA adapter routes"): a server started with
# --enable-lora (and --max-lora-rank >= the adapter's rank) and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True

LOAD_LORA_ADAPTER = "/v1/load_lora_adapter"
UNLOAD_LORA_ADAPTER = "/v1/unload_lora_adapter"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
"""Environment variable without which vLLM does not mount the two routes."""
ADAPTER_FIELD = "model"
"""A generation request picks a loaded adapter by naming it as its ``model``."""


def load_lora_adapter_request(lora_name: str, lora_path: str) -> dict[str, Any]:
    """Body of POST /v1/load_lora_adapter: a peft folder the server can read."""
    return {"lora_name": lora_name, "lora_path": lora_path}


def unload_lora_adapter_request(lora_name: str) -> dict[str, Any]:
    """Body of POST /v1/unload_lora_adapter (``lora_int_id`` is optional and not sent)."""
    return {"lora_name": lora_name}


def name_adapter(body: dict[str, Any], lora_name: str) -> dict[str, Any]:
    """A /v1/completions (or chat) body that runs on the adapter ``lora_name`` (a copy)."""
    return {**body, ADAPTER_FIELD: lora_name}
