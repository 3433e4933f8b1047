"""Measure the built-in server against SGLang's and vLLM's own request and
response validators (not part of the test suite: it needs vLLM and SGLang's
``api_types.py``, a few GB of packages; docs/CONFORMANCE.md has the recipe).

    python scripts/conformance.py --sglang-api-types PATH/sglang/api/v1/api_types.py

It writes the demo tiny model (with a chat template) to a temporary
directory, starts the built-in server on the CPU, sends every case of
``conformance_cases.py`` and checks, per case: the request body with the
engine's validator (accepts or refuses as the case says), the status the
server answers, and every response body or stream chunk with the engine's
response classes (plus the stream's framing: ``text/event-stream``, a final
``data: [DONE]``, the usage chunk when asked). It prints one row per
protocol (checks, passed, failed) and each failure with its reason; the
exit status is 1 when any check failed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import urllib.parse
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

import torchtitan_grpo  # noqa: E402,F401  (before anything imports torchtitan)
from conformance_cases import Case, sglang_cases, vllm_cases  # noqa: E402
from conformance_oracles import SGLangOracle, VLLMOracle  # noqa: E402


@dataclass
class Tally:
    """Checks of one protocol."""

    passed: int = 0
    chunks: int = 0
    """Stream chunks validated (inside the "chunks" checks)."""
    failures: list[str] = field(default_factory=list)
    notes: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))

    def check(self, case: str, what: str, fn: Callable[[], list[str] | None]) -> bool:
        """Run one check: ``fn`` raises on a violation and returns notes."""
        try:
            for n in fn() or []:
                self.notes[n].add(case)
        except Exception as e:  # the validators raise pydantic, msgspec or ValueError
            self.failures.append(f"{case} / {what}: {type(e).__name__}: {_one_line(e)}")
            return False
        self.passed += 1
        return True


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:300]


def post(url: str, path: str, body: dict, stream: bool) -> tuple[int, str, Any]:
    """(status, content type, parsed body) or, for an event stream, the list
    of ``data:`` payloads as sent (JSON decoded, ``[DONE]`` kept as a string)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    ctype = r.getheader("Content-Type", "")
    raw = r.read().decode()
    conn.close()
    if not ctype.startswith("text/event-stream"):
        return r.status, ctype, json.loads(raw) if raw else None
    events = []
    for block in raw.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return r.status, ctype, events


def get(url: str, path: str) -> Any:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("GET", path)
    r = conn.getresponse()
    body = json.loads(r.read().decode())
    conn.close()
    return body


def check_framing(case: Case, ctype: str, events: list) -> list[str]:
    """vLLM's and SGLang's SSE framing, and vLLM's usage chunk."""
    if not ctype.startswith("text/event-stream"):
        raise ValueError(f"content type {ctype!r}, not text/event-stream")
    if not events or events[-1] != "[DONE]" or "[DONE]" in events[:-1]:
        raise ValueError("the stream does not end with exactly one data: [DONE]")
    chunks = events[:-1]
    if not chunks:
        raise ValueError("no chunk before [DONE]")
    options = case.body.get("stream_options") or {}
    if case.protocol == "vllm" and options.get("include_usage"):
        last = chunks[-1]
        if last.get("choices") != [] or not isinstance(last.get("usage"), dict):
            raise ValueError("include_usage: the last chunk is not {choices: [], usage: {...}}")
    if case.protocol == "vllm" and not options.get("include_usage") and any(c.get("usage") for c in chunks):
        raise ValueError("usage sent without stream_options.include_usage")
    return []


def run_case(case: Case, url: str, sgl: SGLangOracle, vl: VLLMOracle, t: Tally) -> None:
    name = f"{case.path} {case.name}"

    def request() -> list[str]:
        try:
            notes = sgl.request(case.body) if case.protocol == "sglang" else vl.request(case.path, case.body)
        except Exception as e:
            if case.oracle_accepts:
                raise
            return []  # refused, as the case says
        if not case.oracle_accepts:
            raise ValueError("the validator accepts a body the case says it refuses")
        return [f"request field ignored by the validator: {n}" for n in notes]

    t.check(name, "request body", request)
    status, ctype, body = post(url, case.path, case.body, case.stream)
    if not t.check(name, "status", lambda: _expect_status(case, status, body)):
        return
    if status != 200:
        t.check(name, "error body", lambda: _error_notes(case, sgl, vl, body))
        return
    if not case.stream:
        t.check(name, "response", lambda: _response_notes(case, sgl, vl, body))
        return
    t.check(name, "stream framing", lambda: check_framing(case, ctype, body))
    # One check for all of a stream's chunks: how many there are depends on
    # how tokens fall into decode steps, and the counts should not.
    chunks = [c for c in body if c != "[DONE]"]
    t.chunks += len(chunks)
    t.check(name, "chunks", lambda: [n for i, c in enumerate(chunks) for n in _chunk_notes(case, sgl, vl, c, i)])


def _expect_status(case: Case, status: int, body: Any) -> list[str]:
    if status != case.status:
        raise ValueError(f"answered {status}, expected {case.status}: {json.dumps(body)[:200]}")
    return []


def _error_notes(case: Case, sgl: SGLangOracle, vl: VLLMOracle, body: Any) -> list[str]:
    if case.protocol == "vllm":
        return vl.error(body)
    (shape,) = sgl.error(body)
    # Not a failure: the validators define no error shape; SGLang's depends on where it refused.
    return [] if shape == (case.sglang_error or shape) else [f"error shape {shape!r}; SGLang sends {case.sglang_error!r}"]


def _response_notes(case: Case, sgl: SGLangOracle, vl: VLLMOracle, body: Any) -> list[str]:
    notes = sgl.response(body) if case.protocol == "sglang" else vl.response(case.path, body)
    return [f"response field ignored by the validator: {n}" for n in notes]


def _chunk_notes(case: Case, sgl: SGLangOracle, vl: VLLMOracle, chunk: Any, i: int) -> list[str]:
    try:
        notes = sgl.chunk(chunk) if case.protocol == "sglang" else vl.chunk(case.path, chunk)
    except Exception as e:
        raise ValueError(f"chunk {i}: {type(e).__name__}: {_one_line(e)}") from None
    return [f"chunk field ignored by the validator: {n}" for n in notes]


def check_other_routes(url: str, sgl: SGLangOracle, vl: VLLMOracle, tallies: dict[str, Tally]) -> None:
    """The non-generating routes the validators define."""
    tallies["sglang"].check("GET /model_info", "response", lambda: sgl.model_info(get(url, "/model_info")))
    abort = {"rid": "no-such-request"}
    tallies["sglang"].check("POST /abort_request", "request and response",
                            lambda: sgl.abort(abort, post(url, "/abort_request", abort, False)[2]))
    tallies["vllm"].check("GET /v1/models", "response", lambda: vl.models(get(url, "/v1/models")))


def print_report(tallies: dict[str, Tally]) -> None:
    print(f"\n{'protocol':<10}{'checks':>8}{'passed':>8}{'failed':>8}{'chunks':>8}")
    for proto, t in tallies.items():
        total = t.passed + len(t.failures)
        print(f"{proto:<10}{total:>8}{t.passed:>8}{len(t.failures):>8}{t.chunks:>8}")
    for proto, t in tallies.items():
        for f in t.failures:
            print(f"FAIL {proto}: {f}")
    for proto, t in tallies.items():
        for note, cases in sorted(t.notes.items()):
            print(f"note {proto}: {note} ({len(cases)} case(s))")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sglang-api-types", required=True, help="sglang/api/v1/api_types.py from the sglang wheel")
    p.add_argument("--url", default=None, help="a running built-in server (default: start one on the demo model)")
    a = p.parse_args(argv)
    sgl, vl = SGLangOracle(a.sglang_api_types), VLLMOracle()
    tallies = {"sglang": Tally(), "vllm": Tally()}
    with tempfile.TemporaryDirectory() as tmp:
        proc = None
        url = a.url
        if url is None:
            from tests.server_procs import model_with_chat_template, start_server, stop_server
            from torchtitan_grpo.models.demo_assets import ensure_tiny_qwen3

            ensure_tiny_qwen3(f"{tmp}/tiny")
            model = model_with_chat_template(f"{tmp}/tiny", Path(tmp) / "model")
            proc, url = start_server(model, Path(tmp) / "server.log")
        try:
            served = get(url, "/v1/models")["data"][0]["id"]
            for case in [*sglang_cases(), *vllm_cases(served)]:
                run_case(case, url, sgl, vl, tallies[case.protocol])
            check_other_routes(url, sgl, vl, tallies)
        finally:
            if proc is not None:
                stop_server(proc, Path(tmp) / "server.log")
    print_report(tallies)
    # The weight-transfer bodies against the installed vLLM's dataclasses (both
    # releases' from sources: conformance_weights.py --source).
    from conformance_weights import check, fields_installed, installed_release

    release = installed_release()
    weights = check(release, fields_installed) if release else ["absent  vllm does not import here"]
    print("\n".join(f"weights {line}" for line in weights))
    return 1 if any(t.failures for t in tallies.values()) or any(w.startswith("DIFFERS") for w in weights) else 0


if __name__ == "__main__":
    sys.exit(main())
