"""Routed experts on the wire (MoE router replay): SGLang's and vLLM's
encodings, written by the built-in server and read by the clients.

Shapes follow ``Sample.routed_experts``: ``[rows, num_moe_layers, top_k]``
expert ids, one row per input position the engine ran (prompt positions and
every decode input: ``len(prompt) + len(completion) - 1`` rows). The two
engines spell it differently (docs/PROTOCOL_NOTES.md, "Routed experts"):

- SGLang: ``meta_info["routed_experts"]`` is one base64 string of the whole
  array as little-endian int32, flattened; the reader reshapes it with the
  model's layer count and top-k.
- vLLM: the prompt's rows are ``prompt_routed_experts`` on the response, the
  completion's rows ``routed_experts`` on each choice, both nested integer
  lists ``[rows][layers][top_k]``.

Numpy only (a rollout client process imports this without torch). Nothing
read here is executed: a field is base64 or integers, or it is refused with
one :class:`MalformedResponse` naming the field and the replica.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from torchtitan_grpo.protocol.errors import MalformedResponse, need

SGLANG_FIELD = "routed_experts"
"""Request flag ``return_routed_experts``; reply ``meta_info.routed_experts``."""
REQUEST_FIELD = "return_routed_experts"
VLLM_PROMPT_FIELD = "prompt_routed_experts"
"""vLLM: the prompt's rows, on the response (one prompt per request)."""
VLLM_CHOICE_FIELD = "routed_experts"
"""vLLM: the completion's rows, on each choice."""
MISSING = -1
"""Expert id of a row the engine gave no route for."""


def encode_sglang(routes: np.ndarray) -> str:
    """``[rows, layers, top_k]`` ids -> SGLang's base64 of little-endian int32."""
    return base64.b64encode(np.ascontiguousarray(routes, dtype="<i4").tobytes()).decode("ascii")


def encode_vllm(routes: np.ndarray, prompt_len: int) -> tuple[list, list]:
    """``[rows, layers, top_k]`` ids -> (the prompt's rows, the completion's
    rows) as nested lists, split where vLLM splits them: at the prompt length."""
    arr = np.asarray(routes)
    return arr[:prompt_len].tolist(), arr[prompt_len:].tolist()


def decode_sglang(value: Any, layers: int, top_k: int, replica: str, where: str) -> np.ndarray:
    """SGLang's base64 string -> int16 ``[rows, layers, top_k]``."""
    need(isinstance(value, str), replica, where,
         f"missing or not a base64 string (was {REQUEST_FIELD} sent, and the server started with "
         f"--enable-return-routed-experts?): {str(value)[:80]!r}")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedResponse(replica, where, "not valid base64") from None
    per_row = 4 * layers * top_k
    need(len(raw) % per_row == 0, replica, where,
         f"{len(raw)} bytes is not a whole number of rows of {layers} layers x top-{top_k} int32 ids")
    arr = np.frombuffer(raw, dtype="<i4").reshape(-1, layers, top_k)
    return _checked(arr, replica, where)


def decode_vllm(prompt_part: Any, choice_part: Any, layers: int, top_k: int, replica: str,
                where: str) -> np.ndarray:
    """vLLM's two nested lists (the response's prompt rows, the choice's
    completion rows) -> int16 ``[rows, layers, top_k]``."""
    parts = []
    for value, at in ((prompt_part, VLLM_PROMPT_FIELD), (choice_part, where)):
        need(isinstance(value, list), replica, at,
             f"missing or not a list (was {REQUEST_FIELD} sent, and the server started with "
             f"--enable-return-routed-experts?)")
        parts.append(_nested(value, layers, top_k, replica, at))
    return _checked(np.concatenate(parts), replica, where)


def _nested(value: list, layers: int, top_k: int, replica: str, where: str) -> np.ndarray:
    for i, row in enumerate(value):
        ok = isinstance(row, list) and len(row) == layers and all(
            isinstance(e, list) and len(e) == top_k and all(type(x) is int for x in e) for e in row)
        need(ok, replica, f"{where}[{i}]", f"not {layers} layers x {top_k} integer expert ids")
    return np.asarray(value, dtype=np.int64).reshape(len(value), layers, top_k)


def _checked(arr: np.ndarray, replica: str, where: str) -> np.ndarray:
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        need(lo >= MISSING and hi <= np.iinfo(np.int16).max, replica, where,
             f"expert ids must be in [-1, 32767], got [{lo}, {hi}]")
    return arr.astype(np.int16)


def for_sample(routes: np.ndarray | None, prompt_len: int, completion_len: int, replica: str,
               where: str = SGLANG_FIELD) -> np.ndarray | None:
    """The routes of one completion as ``Sample.routed_experts``: exactly
    ``prompt_len + completion_len - 1`` rows (a reply with another count is
    refused: its rows would land on the wrong tokens)."""
    if routes is None:
        return None
    rows = max(prompt_len + completion_len - 1, 0)
    need(routes.shape[0] == rows, replica, where,
         f"{routes.shape[0]} rows for a prompt of {prompt_len} and a completion of {completion_len} tokens "
         f"(expected {rows})")
    return routes
