"""The weight push's HTTP control plane: how a route's reply is read, and a
pipelined HTTP/1.1 connection for the built-in server.

Every weight-update route answers JSON; 404 means the route does not exist
(SGLang before 0.5.23 has no update session) and anything else but a 200
with no ``"success": false`` is a refusal, reported with the replica's
message. ``read_reply`` is that rule, for both ways of sending.

``PipelinedConnection`` writes a transfer's requests one after the other on
one connection without waiting for the replies in between (HTTP/1.1
pipelining); the server handles them one at a time in the order they were
written and answers in that order. A push to the built-in server writes
SGLang's pause, begin and first update (vLLM's pause, start, update, finish
and resume) at once: what is a client round trip per request otherwise
becomes the server going from one handler to the next. Only the built-in
server gets this: its aiohttp server handles pipelined requests in order
(tested), while whatever stands in front of a real SGLang or vLLM (uvicorn,
a router, a proxy) was not tried with it.

``post`` sends one request on its own (through the transport's aiohttp
session), ``Requests`` is a transfer's way of posting (one by one, or on a
pipelined connection), and ``until`` / ``answered`` wait for replies so that
the first refusal among a transfer's requests ends that transfer.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
import urllib.parse

import aiohttp

from torchtitan_grpo.reasons import typed_reason


class PushError(RuntimeError):
    """A replica refused or failed a weight-update request."""


def read_reply(url: str, status: int, text: str, method: str = "POST") -> dict:
    """The JSON body of a weight-update route's reply to ``method url``.

    Raises ``FileNotFoundError`` on 404 (no such route) and :class:`PushError`
    with the replica's message when it refused (not 200, or ``"success": false``);
    a 401 also says which setting supplies the key."""
    if status == 404:
        raise FileNotFoundError(url)
    try:
        data = json.loads(text) if text else {}
    except ValueError:
        data = {"message": text[:300]}
    msg = data.get("message", text[:300]) if isinstance(data, dict) else text[:300]
    if status == 401:
        msg = (f"{msg} (the replica wants 'Authorization: Bearer <key>': "
               "the push's API key, PushConfig.api_key, is missing or not the replica's)")
    if status != 200 or (isinstance(data, dict) and data.get("success") is False):
        raise PushError(f"{method} {url} -> HTTP {status}: {msg}")
    return data if isinstance(data, dict) else {}


class PipelinedConnection:
    """One HTTP/1.1 connection to ``url`` (``http://host:port[/prefix]``) on
    which :meth:`post` writes a request at once, whatever is still unanswered,
    and returns a future of its reply (``read_reply``'s result or error).
    Replies come back in the order the requests were written.

    A connection that fails (closed by the server, a reply that is not HTTP)
    fails every unanswered request with a :class:`PushError` naming the
    route, and is not used again (``usable`` is False).

    ``headers`` are written with every request (e.g. ``Authorization``)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"pipelined requests need an http://host:port URL, got {url!r}")
        self.url = url.rstrip("/")
        self._host, self._port = parts.hostname, parts.port or 80
        self._prefix = parts.path.rstrip("/")
        self._host_header = parts.netloc
        self._extra_headers = ""
        for k, v in (headers or {}).items():
            if any(c in f"{k}{v}" for c in "\r\n"):  # it would end the header block early
                raise ValueError(f"header {k!r} contains a line break")
            self._extra_headers += f"{k}: {v}\r\n"
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._replies: asyncio.Task | None = None
        self._waiting: collections.deque[tuple[str, asyncio.Future]] = collections.deque()
        self._broken = ""
        self.last_used = 0.0

    async def open(self, timeout_s: float) -> None:
        self._reader, self._writer = await asyncio.wait_for(
            asyncio.open_connection(self._host, self._port), timeout_s)
        self._replies = asyncio.create_task(self._read_replies())
        self.last_used = time.monotonic()

    def usable(self, max_idle_s: float) -> bool:
        """Open, every request answered, and used within ``max_idle_s`` (a
        server closes idle connections; one about to be closed is not reused)."""
        return (self._writer is not None and not self._broken and not self._waiting
                and not self._reader.at_eof() and time.monotonic() - self.last_used < max_idle_s)

    def post(self, path: str, body: dict | bytes | None, params: dict | None = None) -> asyncio.Future:
        """Write ``POST path`` (JSON ``body``, an object or already encoded;
        query ``params``) now; the future resolves to its reply once every
        earlier request's has come."""
        url = self.url + path
        fut = asyncio.get_running_loop().create_future()
        if self._broken or self._writer is None:
            fut.set_exception(PushError(f"POST {url}: {self._broken or 'connection not open'}"))
            return fut
        target = self._prefix + path + ("?" + urllib.parse.urlencode(params) if params else "")
        data = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
        head = (f"POST {target} HTTP/1.1\r\nHost: {self._host_header}\r\n" + self._extra_headers
                + ("Content-Type: application/json\r\n" if body is not None else "")
                + f"Content-Length: {len(data)}\r\n\r\n")
        self._waiting.append((url, fut))
        self._writer.write(head.encode("latin-1") + data)
        self.last_used = time.monotonic()
        return fut

    async def _read_replies(self) -> None:
        try:
            while True:
                status, headers = await self._read_head()
                if status is None:  # the server closed the connection
                    raise ConnectionError("the replica closed the connection")
                text = (await self._read_body(status, headers)).decode("utf-8", "replace")
                if not self._waiting:
                    raise ConnectionError(f"a reply (HTTP {status}) to no request")
                url, fut = self._waiting.popleft()
                self.last_used = time.monotonic()
                if not fut.done():  # a cancelled request's reply is read and dropped
                    try:
                        fut.set_result(read_reply(url, status, text))
                    except Exception as e:  # noqa: BLE001 - the request's own error
                        fut.set_exception(e)
                if "close" in headers.get("connection", "").lower():
                    raise ConnectionError("the replica closed the connection after a reply")
        except asyncio.CancelledError:
            self._fail("connection closed")
            raise
        except Exception as e:  # noqa: BLE001 - reported on every request still waiting
            self._fail(typed_reason(e))

    async def _read_head(self) -> tuple[int | None, dict[str, str]]:
        while True:
            try:
                raw = await self._reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as e:
                if not e.partial:
                    return None, {}
                raise ConnectionError("the replica closed the connection in the middle of a reply") from None
            lines = raw.decode("latin-1").split("\r\n")
            version, _, rest = lines[0].partition(" ")
            if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
                raise ConnectionError(f"not an HTTP/1.1 reply: {lines[0][:80]!r}")
            status = int(rest[:3])
            headers = {}
            for line in lines[1:]:
                k, sep, v = line.partition(":")
                if sep:
                    headers[k.strip().lower()] = v.strip()
            if not 100 <= status < 200:  # an interim reply (100 Continue) precedes the real one
                return status, headers

    async def _read_body(self, status: int, headers: dict[str, str]) -> bytes:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            out = bytearray()
            while True:
                size = int((await self._reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
                if size == 0:
                    while await self._reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                        pass
                    return bytes(out)
                out += await self._reader.readexactly(size)
                await self._reader.readexactly(2)
        if "content-length" in headers:
            return await self._reader.readexactly(int(headers["content-length"]))
        if status in (204, 304):
            return b""
        headers["connection"] = "close"  # a body up to the end of the connection: nothing follows it
        return await self._reader.read()

    def _fail(self, why: str) -> None:
        self._broken = self._broken or why
        while self._waiting:
            url, fut = self._waiting.popleft()
            if not fut.done():
                fut.set_exception(PushError(f"POST {url}: {self._broken} before replying"))

    def close(self) -> None:
        """Close the connection; unanswered requests fail."""
        self._fail("connection closed")
        if self._replies is not None:
            self._replies.cancel()
        if self._writer is not None:
            self._writer.close()


async def post(session: aiohttp.ClientSession, url: str, body: dict | bytes | None, timeout_s: float,
               params: dict | None = None) -> dict:
    """POST ``body`` (JSON, as an object or already encoded) to ``url`` on a
    request of its own; ``read_reply``'s result."""
    kw = ({"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes)
          else {"json": body})
    async with session.post(url, params=params, timeout=aiohttp.ClientTimeout(total=timeout_s), **kw) as r:
        return read_reply(url, r.status, await r.text())


class Requests:
    """How one transfer posts its control requests. On a pipelined connection
    (``in_order``) each is written at once and the server handles them in
    that order; otherwise each is a request of its own, so one that must
    follow another is posted only after the other's reply (``ordered``).
    Either way ``post`` returns a future of the reply; a pipelined request
    has no timeout of its own (the transfer's deadline bounds it)."""

    def __init__(self, session: aiohttp.ClientSession, url: str, conn: PipelinedConnection | None = None):
        self.session, self.url, self.conn = session, url, conn

    @property
    def in_order(self) -> bool:
        return self.conn is not None

    def post(self, path: str, body: dict | bytes | None, timeout_s: float,
             params: dict | None = None) -> asyncio.Future:
        if self.conn is not None:
            return self.conn.post(path, body, params)
        return asyncio.ensure_future(post(self.session, self.url + path, body, timeout_s, params))

    async def ordered(self, reply: asyncio.Future | None) -> None:
        """Call before posting what must be handled after ``reply``'s request."""
        if reply is not None and self.conn is None:
            await reply


async def until(target: asyncio.Future, answers: list[asyncio.Future]) -> None:
    """Wait for ``target`` (a reply among ``answers``, or the broadcasts);
    the first failure of ``target`` or of any of ``answers`` meanwhile
    raises, and then ``target`` and every request still in flight are
    cancelled."""
    try:
        while True:
            for t in (target, *answers):
                if t.done() and t.exception() is not None:
                    raise t.exception()
            if target.done():
                return
            await asyncio.wait({target, *(a for a in answers if not a.done())},
                               return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        for t in answers:
            t.cancel()
        target.cancel()
        raise


async def answered(answers: list[asyncio.Future]) -> None:
    """Every reply of ``answers`` (the first failure raises and cancels the rest)."""
    try:
        await asyncio.gather(*answers)
    except BaseException:
        for t in answers:
            t.cancel()
        raise
