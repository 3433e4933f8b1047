"""JSON encoding and decoding of generation replies, with orjson where it is installed.

A generation reply with log-probs is one JSON object per token: at 64
samples x 1,024 tokens a chat completion is ~6.5 MB of small objects. The
standard library's encoder took longer than building the reply
(docs/PERFORMANCE.md, "Building the OpenAI replies on the host"), and every
request of a batch finishes at about the same time, so the server encodes
them one after another while the GPU waits for the next batch. orjson (a
dependency) does the same in a tenth of the time; without it (an environment
that lacks the wheel) the standard library runs and nothing else changes.

Both sides use it: the server's reply routes (``server/httputil.json_reply``)
and the trainer's pool reading them (``fleet/pool.py``), so this module sits
below both, like ``net.py``.

Differences from ``json``: a non-finite float is written as ``null`` (``json``
writes ``NaN``, which is not JSON; the routes clamp log-probs first anyway),
and the separators are compact.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # the standard library's encoder then
    orjson = None

Fragment = getattr(orjson, "Fragment", None)
"""JSON text placed as is into what :func:`dumps` writes (orjson >= 3.9); None without it. A route
may build a large array's text itself where that beats one object per element."""

_OPTIONS = orjson.OPT_NON_STR_KEYS if orjson is not None else 0
"""Integer keys (token ids in SGLang's top-logprob maps) written as strings, as ``json`` writes them."""


def dumps(obj: Any) -> bytes:
    """``obj`` as UTF-8 JSON bytes."""
    if orjson is not None:
        return orjson.dumps(obj, option=_OPTIONS)
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def loads(raw: bytes | str) -> Any:
    """The JSON value of ``raw`` (``json.JSONDecodeError`` / ``ValueError`` when it is not JSON)."""
    if orjson is not None:
        return orjson.loads(raw)
    return json.loads(raw)
