"""The push's HTTP control plane: replies read one way for both ways of
sending, and the pipelined connection against real HTTP servers (aiohttp,
as the built-in server runs, and hand-written replies for what aiohttp never
sends: chunked bodies, a server that cuts the connection)."""

import asyncio
import json

import pytest
from aiohttp import web

from torchtitan_grpo.weight_sync.control import PipelinedConnection, PushError, read_reply


def test_read_reply_names_the_route_and_keeps_the_replicas_message():
    assert read_reply("http://r/x", 200, '{"success": true, "message": "ok"}') == {"success": True, "message": "ok"}
    assert read_reply("http://r/x", 200, "") == {}
    with pytest.raises(FileNotFoundError, match="http://r/begin"):
        read_reply("http://r/begin", 404, "not found")
    with pytest.raises(PushError, match=r"POST http://r/u -> HTTP 400: shape mismatch for 'w'"):
        read_reply("http://r/u", 400, '{"success": false, "message": "shape mismatch for \'w\'"}')
    with pytest.raises(PushError, match=r"HTTP 200: refused"):
        read_reply("http://r/u", 200, '{"success": false, "message": "refused"}')
    with pytest.raises(PushError, match=r"HTTP 500: <html>oops"):
        read_reply("http://r/u", 500, "<html>oops")


def _run(coro):
    return asyncio.run(coro)


async def _aiohttp_server(app: web.Application):
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def test_requests_written_at_once_are_handled_and_answered_in_order():
    """Three requests written before any reply: the server takes them one at
    a time in the written order even though the first is the slowest, on one
    connection; errors, query strings and bodies arrive as sent."""
    handled: list[str] = []
    peers: set = set()

    async def handler(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        handled.append(f"{request.path}?{request.query_string}")
        peers.add(request.transport.get_extra_info("peername"))
        if request.path == "/slow":
            await asyncio.sleep(0.3)  # the next requests are already queued behind this one
        if request.path == "/refuse":
            return web.json_response({"success": False, "message": "no session"}, status=400)
        return web.json_response({"path": request.path, "body": body})

    async def main():
        app = web.Application()
        app.router.add_post("/{name}", handler)
        runner, url = await _aiohttp_server(app)
        conn = PipelinedConnection(url)
        await conn.open(5)
        try:
            a = conn.post("/slow", {"k": [1, 2]})
            b = conn.post("/refuse", None, params={"mode": "wait"})
            c = conn.post("/fast", json.dumps({"x": "é"}).encode())  # already encoded
            assert not conn.usable(30)  # replies still due
            out_a = await a
            with pytest.raises(PushError, match=r"POST http://127\.0\.0\.1:\d+/refuse -> HTTP 400: no session"):
                await b
            out_c = await c
            assert conn.usable(30) and not conn.usable(0)
            return out_a, out_c
        finally:
            conn.close()
            await runner.cleanup()

    out_a, out_c = _run(main())
    assert out_a == {"path": "/slow", "body": {"k": [1, 2]}}
    assert out_c == {"path": "/fast", "body": {"x": "é"}}
    assert handled == ["/slow?", "/refuse?mode=wait", "/fast?"]
    assert len(peers) == 1


async def _raw_server(replies: list[bytes], then_close: bool):
    """Reads requests and answers each with the next of ``replies``; closes
    the connection after the last when ``then_close``."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        for reply in replies:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            writer.write(reply)
            await writer.drain()
        if then_close:
            writer.close()
        else:
            await reader.read()  # until the client goes

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_chunked_and_interim_replies_are_read_and_a_cut_connection_fails_what_is_left():
    body = json.dumps({"message": "ok"}).encode()
    chunked = (b"HTTP/1.1 100 Continue\r\n\r\n"
               b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"%x\r\n" % 5 + body[:5] + b"\r\n" + b"%x;ext=1\r\n" % (len(body) - 5) + body[5:] + b"\r\n"
               + b"0\r\n\r\n")
    plain = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body

    async def main():
        server, url = await _raw_server([chunked, plain], then_close=True)
        conn = PipelinedConnection(url + "/prefix/")
        await conn.open(5)
        try:
            futs = [conn.post(p, {}) for p in ("/a", "/b", "/c")]
            results = await asyncio.gather(*futs, return_exceptions=True)
            late = conn.post("/d", {})
            with pytest.raises(PushError, match=r"/prefix/d: ConnectionError: the replica closed the connection"):
                await late
            assert not conn.usable(30)
            return results
        finally:
            conn.close()
            server.close()

    a, b, c = _run(main())
    assert a == {"message": "ok"} and b == {"message": "ok"}
    assert isinstance(c, PushError) and "/prefix/c" in str(c) and "closed the connection" in str(c)


def test_a_reply_that_is_not_http_fails_every_waiting_request():
    async def main():
        server, url = await _raw_server([b"SSH-2.0-OpenSSH\r\n\r\n"], then_close=False)
        conn = PipelinedConnection(url)
        await conn.open(5)
        try:
            futs = [conn.post("/x", {}), conn.post("/y", {})]
            return await asyncio.gather(*futs, return_exceptions=True)
        finally:
            conn.close()
            server.close()

    x, y = _run(main())
    assert isinstance(x, PushError) and "not an HTTP/1.1 reply" in str(x) and "/x" in str(x)
    assert isinstance(y, PushError) and "/y" in str(y)


def test_only_http_urls_are_taken():
    with pytest.raises(ValueError, match="https://r:1"):
        PipelinedConnection("https://r:1")
