"""What the built-in server says about itself, and the extensions of SGLang's
and vLLM's weight-update routes a pusher may use once it has read that.

A real SGLang has no ``engine`` field in ``/model_info`` and a real vLLM no
``/model_info`` at all, so a replica is taken for the built-in server only
when it says so; each extension is then offered by a flag of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

API_KEY_ENV = "GRPO_API_KEY"
"""Environment variable that hands a started server its API key: a command
line is readable by every user of the host (``ps``), a process's environment
only by its owner."""

BUILTIN_ENGINE = "torchtitan-grpo"
"""What the built-in server's ``/model_info`` says in its ``engine`` field
(SGLang's and vLLM's have no such field): a pusher that sees it may rely on
the built-in server's own guarantees, e.g. that a session's end waits for the
update in flight."""

ACK_POSTED = {"ack": "posted"}
"""Query of an update request (SGLang's or vLLM's route): reply once the
receive is posted, not once the bytes have arrived."""

# The /model_info flags of the extensions.
SGLANG_ACK_POSTED = "update_ack_posted"
VLLM_ACK_POSTED = "vllm_update_ack_posted"
END_WEIGHT_VERSION = "end_weight_version"
"""SGLang's /end_weight_update takes ``weight_version``: the session's version."""


@dataclass(frozen=True)
class BuiltinTraits:
    """What a replica's ``/model_info`` says it takes."""

    builtin: bool = False
    """The built-in server: a session's end waits for the update in flight,
    and it handles pipelined requests in order."""
    ack_posted: bool = False
    """The update route of the protocol in use takes ``?ack=posted``."""
    end_version: bool = False
    """SGLang's session end takes the version (``END_WEIGHT_VERSION``)."""


def traits(model_info: Any, protocol: str) -> BuiltinTraits:
    """``model_info``: the JSON of GET /model_info (None if there is none);
    ``protocol``: "sglang" or "vllm", whose update route is asked about."""
    if not (isinstance(model_info, dict) and model_info.get("engine") == BUILTIN_ENGINE):
        return BuiltinTraits()
    ack_key = SGLANG_ACK_POSTED if protocol == "sglang" else VLLM_ACK_POSTED
    return BuiltinTraits(True, model_info.get(ack_key) is True, model_info.get(END_WEIGHT_VERSION) is True)


DELTA_ROUTE = "/update_weights_delta"
"""weight_sync.delta: the built-in server's route taking a version as changed
elements against the one it serves (``server/receive/delta.py``)."""
