"""Per-token log-prob arrays of the OpenAI replies written as JSON text, from
pieces each token id's text gives once per engine.

A reply with log-probs names every output token: at 256 samples x 1,024
tokens that is 262k tokens, and building an object (or even two dict
lookups by string) per token took most of the time between the last token
and the last reply (issue 50). Here each id's encoded pieces (its name, its
UTF-8 bytes, its name's length) sit in a list indexed by the id, made on
first use from :meth:`Engine.token_texts`; a reply is one list lookup per
token, the log-probs encoded in one call, and one join. Only without top
log-probs (each position names just the sampled token) and with orjson's
fragments (``jsonfast.Fragment``); otherwise the routes build objects.

The text each function returns parses to exactly the objects the routes'
object path builds (tests/test_jsonfast.py).

The server makes the pieces of its whole vocabulary before it is ready
(:func:`prepare`: 0.5 CPU-s and 25-33 MB a kind for Qwen3's 151,936 ids on a
2-core CPU), so no reply pays for ids new to it: on a 2-core CPU 256 chat
samples of 128 random tokens build in 76 ms over new ids and 14 ms over known
ones (bench/reply_cost.py), and a random-weight model keeps meeting new ids.
Made instead by a thread at the first reply (766ec4c), that thread held the
GIL from the engine's worker, whose prefill then took 140-350 ms (runs 153-155).
Tables made later (``return_tokens_as_token_ids``' kinds, an engine without
``vocab_size``) are filled as replies meet ids.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any, Sequence

from torchtitan_grpo import jsonfast
from torchtitan_grpo.fleet import vllm as proto

logger = logging.getLogger(__name__)

FLOOR = -9999.0
"""Log-probs below this (-inf) are written as it: -inf is not JSON."""

_CACHES: "weakref.WeakKeyDictionary[Any, dict[tuple[str, bool], list]]" = weakref.WeakKeyDictionary()
"""engine -> (kind, tokens as ids) -> list indexed by token id of that kind's pieces (None: not made yet).
Per engine: another engine in the process may have another tokenizer."""


def clear_caches() -> None:
    """Forget every engine's pieces (benchmarks' cold runs)."""
    _CACHES.clear()


def utf8(s: str) -> list[int]:
    """A token string's ``bytes`` field: its UTF-8 byte values (unencodable surrogates replaced)."""
    return list(s.encode("utf-8", errors="replace"))


def token_name(token_id: int, text: str | None, as_id: bool) -> str:
    """A token as vLLM's logprobs name it: its text, or ``"token_id:<id>"``
    with ``return_tokens_as_token_ids`` (or when it has no text)."""
    return f"{proto.TOKEN_ID_PREFIX}{token_id}" if as_id or text is None else text


def floored(logprobs: list[float]) -> list[float]:
    """``logprobs`` with -inf raised to :data:`FLOOR` (NaN kept: orjson writes it as null)."""
    if not logprobs or min(logprobs) >= FLOOR:  # a NaN min fails the test and takes the copy: same values
        return logprobs
    return [max(lp, FLOOR) for lp in logprobs]


def _encoded_values(logprobs: list[float]) -> list[bytes]:
    """Each log-prob's JSON text, encoded in one call."""
    return jsonfast.dumps(floored(logprobs))[1:-1].split(b",") if logprobs else []


FILL_CHUNK = 4096
"""Ids :func:`prepare` makes per call of :meth:`Engine.token_texts` (bounds the tokenizer call)."""


def _make(engine: Any, table: list, ids: list[int], as_ids: bool, make: Any) -> None:
    """Make the pieces of ``ids`` (distinct, not made yet) into ``table``."""
    texts = engine.token_texts(ids)  # also when named by id: chat's bytes are the text's
    for t, text in zip(ids, texts):
        table[t] = make(t, token_name(t, text, as_ids), text)


def prepare(engine: Any) -> None:
    """Make every id's pieces of both kinds (ids named by their text) now: at server start-up,
    before the first request. Without orjson's fragments (the object path) or a vocabulary size
    there is nothing to make."""
    vocab = int(getattr(engine, "vocab_size", 0) or 0)
    if jsonfast.Fragment is None or not vocab:
        return
    try:
        for kind, make in (("chat", _chat_piece), ("name", _name_piece)):
            table = _table(engine, kind, False)
            for start in range(0, vocab, FILL_CHUNK):
                _make(engine, table, [t for t in range(start, min(start + FILL_CHUNK, vocab)) if table[t] is None],
                      False, make)
    except Exception as e:  # the server still starts: replies make the pieces they need
        logger.warning("making every token's reply pieces at start-up stopped (replies make them as needed): %s", e)


def _table(engine: Any, kind: str, as_ids: bool) -> list:
    """The engine's table of ``kind`` pieces, sized to its vocabulary (an engine without
    ``vocab_size``: grown as ids come)."""
    tables = _CACHES.setdefault(engine, {})
    table = tables.get((kind, as_ids))
    if table is None:
        table = tables[(kind, as_ids)] = [None] * int(getattr(engine, "vocab_size", 0) or 0)
    return table


def _pieces(engine: Any, kind: str, as_ids: bool, ids: Sequence[int], make: Any) -> list:
    """The pieces of each id in ``ids`` (in order), ``make(id, name, text)`` run once per engine
    for an id not seen before."""
    table = _table(engine, kind, as_ids)
    top = max(ids, default=-1)
    if top >= len(table):
        table.extend([None] * (top + 1 - len(table)))
    got = [table[t] for t in ids]
    if None in got:
        _make(engine, table, [t for t in dict.fromkeys(ids) if table[t] is None], as_ids, make)
        got = [table[t] for t in ids]
    return got


def _chat_piece(t: int, name: str, text: str | None) -> tuple[bytes, bytes]:
    # The token's bytes are its text's (None without one), also when it is named by its id.
    return (b'{"token":' + jsonfast.dumps(name) + b',"logprob":',
            b',"bytes":' + jsonfast.dumps(None if text is None else utf8(text)) + b',"top_logprobs":[]}')


def chat_content(engine: Any, output_ids: list[int], logprobs: list[float], as_ids: bool) -> bytes:
    """vLLM's ChatCompletionLogProbs ``content`` array without top log-probs:
    ``[{"token", "logprob", "bytes", "top_logprobs": []}, ...]`` as JSON text."""
    parts = _pieces(engine, "chat", as_ids, output_ids, _chat_piece)
    values = _encoded_values(logprobs)
    return b"[" + b",".join([h + v + tail for (h, tail), v in zip(parts, values)]) + b"]"


def _name_piece(t: int, name: str, text: str | None) -> tuple[bytes, bytes, int]:
    # Concatenated, not kept as orjson returns it: 92k names kept as returned took 15 x longer
    # to make (CPU, orjson 3.13) than copies made by a concatenation.
    encoded = jsonfast.dumps(name)
    return b"," + encoded, b"{" + encoded + b":", len(name)


def completion_logprobs(engine: Any, output_ids: list[int], logprobs: list[float], as_ids: bool,
                        offset: int = 0) -> bytes:
    """vLLM's completions ``logprobs`` object without top log-probs (each
    position's dict holds the sampled token alone): ``{"text_offset",
    "token_logprobs", "tokens", "top_logprobs"}`` as JSON text; offsets count
    from ``offset``."""
    parts = _pieces(engine, "name", as_ids, output_ids, _name_piece)
    values = _encoded_values(logprobs)
    offsets = list(itertools.accumulate((p[2] for p in parts), initial=offset))[:-1]
    return (b'{"text_offset":' + jsonfast.dumps(offsets)
            + b',"token_logprobs":[' + b",".join(values)
            + b'],"tokens":[' + b"".join([p[0] for p in parts])[1:]
            + b'],"top_logprobs":[' + b",".join([p[1] + v + b"}" for p, v in zip(parts, values)])
            + b"]}")
