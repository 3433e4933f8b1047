"""Request plumbing of the built-in server, shared by both protocols' routes.

* Bodies (:func:`read_json`): each route reads at most its
  :class:`BodyLimits` share (413 past it, refused from ``Content-Length``
  before a byte is read), a body that is not UTF-8 JSON is a 400 naming the
  body, and a large body is parsed on a worker thread so ``/health`` answers
  meanwhile.
* Fields (:func:`get_field`): a field of the wrong JSON type is a
  :class:`BadRequest` naming it (the app turns it into SGLang's 400 shape;
  the vLLM routes have their own, ``vllm_http.field``).
* Replies (:func:`gc_paused`, :func:`json_reply`): a large reply is built
  with the cyclic garbage collector held off and encoded by ``jsonfast``
  (orjson where installed).
* The API key (:func:`authorized`, :data:`OPEN_PATHS`), handlers that must
  run to completion (:func:`shielded`), and the weight-update knobs both
  protocols share (:func:`ack_posted`, :func:`debug_update_delay`).

Nothing here knows a route; every route module imports from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator

from aiohttp import web

from torchtitan_grpo import jsonfast


def json_reply(data: Any, status: int = 200) -> web.Response:
    """``web.json_response`` with :mod:`torchtitan_grpo.jsonfast`'s encoder: a generation reply with
    log-probs is one object per token, and the standard encoder took longer than building it."""
    return web.Response(body=jsonfast.dumps(data), status=status, content_type="application/json")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


JSON_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (is_int, "an integer"),
    "num": (is_num, "a number"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
}
"""JSON type name -> (check, how an error message says it)."""


class BadRequest(Exception):
    """Turns into HTTP 400 ``{"object": "error", "message": ...}`` (SGLang's shape)."""


def get_field(body: dict, key: str, kind: str, default: Any = None, required: bool = False, where: str = "") -> Any:
    """Read ``body[key]`` checking its JSON type; None/absent gives ``default``."""
    name = f"{where}{key}"
    if key not in body or body[key] is None:
        if required:
            raise BadRequest(f"missing required field {name!r}")
        return default
    v = body[key]
    ok, expected = JSON_KINDS[kind]
    if not ok(v):
        raise BadRequest(f"field {name!r} must be {expected}, got {json.dumps(v)[:80]}")
    return float(v) if kind == "num" else v


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Hold the cyclic garbage collector off while a reply is built.

    A logprobs reply is one container per token (a chat reply at 64 x 1,024
    tokens: 131k dicts and lists), and every 700 new containers start a
    collection that also walks the server's long-lived objects (the model,
    torch, the tokenizer): on CPU that was 60 % of building the chat reply.
    The reply holds no cycles, so nothing is left for the collector; it runs
    again afterwards. Process-wide, so it is only re-enabled if it was on."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def result(success: bool, message: str, **extra: Any) -> web.Response:
    """SGLang's reply to a control route: 200 ``{"success": true, ...}`` or 400."""
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


# --------------------------------------------------------------------------- #
# Request bodies
# --------------------------------------------------------------------------- #

MiB = 1 << 20
_CONTROL_BODY = 1 * MiB
"""Control routes (pause, sessions, groups, versions): a few fields each."""
_WEIGHT_BODY = 256 * MiB
"""Weight-update metadata: per tensor a name, dtype and shape (~100 B), or a
pickled shared-memory / CUDA IPC handle in base64 (~1 KB); a 100k-tensor
checkpoint stays well under this. Also the cap of every other limit."""
_BYTES_PER_PROMPT_TOKEN = 32
"""JSON bytes one prompt token may take: an id (``"151643, "``: 8) or its text
(a few characters, up to 6 bytes each as a ``\\u`` escape) with headroom."""
_PARSE_OFF_LOOP = 256 * 1024
"""Bodies past this many bytes are parsed on a worker thread (a few ms of
``json.loads`` on the event loop would hold /health and every other route)."""


class BodyError(Exception):
    """A request body refused before (or while) it is parsed: HTTP ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class BodyLimits:
    """Most bytes a request body may have, per kind of route: each sized to
    what a legitimate request needs, so a huge body is refused before it is
    read, parsed or tokenised (aiohttp's own ``client_max_size`` is only the
    backstop: the largest of these)."""

    generate: int
    """/generate, /v1/completions and /v1/chat/completions."""
    control: int = _CONTROL_BODY
    weights: int = _WEIGHT_BODY
    """Weight updates: name lists, shapes, by-reference handles."""

    @classmethod
    def for_engine(cls, max_context: int, max_batch_size: int) -> BodyLimits:
        # A body holding more prompt tokens than the whole batch's context could
        # never run at once; batches of many short prompts fit all the same.
        tokens = max_batch_size * max_context
        return cls(generate=min(_CONTROL_BODY + tokens * _BYTES_PER_PROMPT_TOKEN, _WEIGHT_BODY))

    @property
    def largest(self) -> int:
        return max(self.generate, self.control, self.weights)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The raw body, at most ``limit`` bytes (else :class:`BodyError` 413).
    A declared ``Content-Length`` past the limit is refused before anything
    is read; a chunked body is read only until it passes the limit."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyError(413, f"request body of {declared} bytes is larger than this route takes ({limit} bytes)")
    parts: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            raise BodyError(413, f"request body is larger than this route takes ({limit} bytes)")
        parts.append(chunk)
    return b"".join(parts)


def parse_json_object(raw: bytes) -> dict:
    """A body as a JSON object (empty: ``{}``); :class:`BodyError` 400 naming
    what is wrong with the body otherwise."""
    if not raw or raw.isspace():  # (no stripped copy of a large body)
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"request body is not UTF-8 text (byte {e.start} is 0x{raw[e.start]:02x}); "
                             "send a JSON object") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise BodyError(400, "request body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and e.g. an integer of too many digits
        raise BodyError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BodyError(400, f"request body must be a JSON object, got {json_kind(body)}")
    return body


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words (``None`` is "null", not "NoneType")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {list: "an array", str: "a string"}.get(type(value), "a number")


async def off_loop_if_large(nbytes: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, on a worker thread when the body it works on has more
    than :data:`_PARSE_OFF_LOOP` bytes (parsing or tokenising megabytes on
    the event loop would stall /health and every other route meanwhile);
    inline otherwise (a thread hop costs more than a small body's parse)."""
    if nbytes > _PARSE_OFF_LOOP:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def parse_json_async(raw: bytes) -> dict:
    """:func:`parse_json_object`, on a worker thread for a large body."""
    return await off_loop_if_large(len(raw), parse_json_object, raw)


async def read_json(request: web.Request, limit: int) -> tuple[bytes, dict]:
    """(raw bytes, JSON object) of a body of at most ``limit`` bytes."""
    raw = await read_body(request, limit)
    return raw, await parse_json_async(raw)


async def json_body(request: web.Request, limit: int) -> dict:
    """A body of at most ``limit`` bytes as a JSON object (``BodyError`` otherwise)."""
    return (await read_json(request, limit))[1]


# --------------------------------------------------------------------------- #
# Handlers, the API key, weight-update knobs
# --------------------------------------------------------------------------- #

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def shielded(handler: Handler) -> Handler:
    """Handlers are cancelled when the client disconnects (so abandoned
    generations stop); a weight update or pause must not stop half-way."""

    async def run(request: web.Request) -> web.StreamResponse:
        return await asyncio.shield(handler(request))

    return run


OPEN_PATHS = frozenset({"/health", "/health_generate"})
"""Routes answered without the API key: liveness probes only. SGLang exempts
its /health* routes (and /metrics); vLLM's current middleware exempts /health
and a few read-only probes (/ping, /load, /version, /metrics, docs) and guards
everything else, weight transfer included (older vLLM guarded only /v1/*).
Here every other route of both protocols needs the key."""


def authorized(header: str | None, api_key: str) -> bool:
    """``Authorization: Bearer KEY``, compared in constant time (a plain ``==``
    returns at the first differing byte, which leaks the key's prefix)."""
    expected = f"Bearer {api_key}".encode()
    return hmac.compare_digest((header or "").encode("utf-8", "surrogateescape"), expected)


def ack_posted(request: web.Request) -> bool:
    """Our extension of both update routes: ``?ack=posted`` asks for the
    reply once the receive is posted, and the session's end
    (/end_weight_update, /finish_weight_update) then waits for the bytes.
    Without it the reply comes after the bytes, as from SGLang and vLLM.

    * SGLang's /update_weights_from_distributed: the metadata is checked
      before the post (refused, nothing posted), so a sender that broadcasts
      only after the reply can queue the next bucket behind the one in flight.
    * vLLM's /update_weights (packed): the sender broadcasts once the round
      is started, so the receive is always posted and a refused update is
      answered after its bytes, as without it; an accepted one is answered
      at once, and a pipelined /finish_weight_update is then handled while
      the bytes arrive instead of after them.

    Either way an update once accepted is not checked again. Raises
    ValueError naming the parameter for any other value."""
    ack = request.query.get("ack")
    if ack not in (None, "posted"):
        raise ValueError(f"query parameter 'ack' must be 'posted' or absent, got {ack!r}")
    return ack == "posted"


async def debug_update_delay(cfg: Any) -> None:
    """``--debug-update-delay-s``: a test knob that makes every weight update
    slow (its reply comes this much later: after the bytes, or with SGLang's
    ``?ack=posted`` after the post, so a trainer sends the next bucket or the
    session's end that much later) to simulate a lagging replica in fault
    tests and benchmarks. Never set it in production."""
    delay = getattr(cfg, "debug_update_delay_s", 0.0) or 0.0
    if delay > 0:
        await asyncio.sleep(delay)
