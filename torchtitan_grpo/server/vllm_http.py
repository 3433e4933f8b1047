"""vLLM's HTTP conventions on the built-in server, shared by its vLLM routes
(``vllm_openai``, ``vllm_generate``, ``vllm_weights``): the error shape
``{"error": {"message", "type", "param", "code"}}``, typed fields whose
errors name them, the names the server answers to, and the pause gate that
makes generation routes answer 503 while paused (vLLM's ``/pause`` with
``mode=abort|wait``).
"""

from __future__ import annotations

import os
from typing import Any

from aiohttp import web

from torchtitan_grpo.server.engine.engine import Engine
from torchtitan_grpo.server.httputil import JSON_KINDS, BodyError, Handler
from torchtitan_grpo.server.engine.requests import RequestError, SampleResult, SamplingParams

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


class VLLMError(Exception):
    """Becomes ``{"error": {...}}`` with HTTP ``code``."""

    _TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestEntityTooLargeError",
              500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, code: int, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param

    def response(self) -> web.Response:
        err = {"message": self.message, "type": self._TYPES.get(self.code, "BadRequestError"),
               "param": self.param, "code": self.code}
        return web.json_response({"error": err}, status=self.code)


def bad(message: str, param: str | None = None) -> VLLMError:
    return VLLMError(400, message, param)


def vllm_api(handler: Handler) -> Handler:
    """Answer errors in vLLM's shape (the app's middleware would use SGLang's)."""

    async def run(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except VLLMError as e:
            return e.response()
        except BodyError as e:
            return VLLMError(e.status, str(e)).response()
        except RequestError as e:  # the engine refused a prompt or a parameter
            return bad(str(e)).response()

    return run


def field(body: dict, key: str, kind: str, default: Any = None, where: str = "") -> Any:
    """``body[key]`` checked against ``kind``; absent or null gives ``default``."""
    v = body.get(key)
    if v is None:
        return default
    ok, expected = JSON_KINDS[kind]
    if not ok(v):
        raise bad(f"'{where}{key}' must be {expected}, got {str(v)[:80]}", f"{where}{key}")
    return float(v) if kind == "num" else v


def served_names(model: str) -> list[str]:
    """The names the server answers to: the model path as given, then its
    last component (``/ckpt/Qwen3-0.6B/`` -> ``Qwen3-0.6B``), once each."""
    return list(dict.fromkeys([model, os.path.basename(os.path.normpath(model))]))


def check_model(body: dict, names: list[str]) -> None:
    """A ``model`` other than one of ``names`` is vLLM's 404."""
    model = field(body, "model", "str", None)
    if model is not None and model not in names:
        raise VLLMError(404, f"The model `{model}` does not exist.", "model")


class PauseGate:
    """vLLM's ``/pause`` as the generation routes see it: under ``abort`` and
    ``wait`` new requests get 503 until ``/resume`` (``keep`` lets them queue)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.mode: str | None = None
        """Pause mode (abort | wait) under which new requests get 503."""
        self.draining = False
        """mode=wait: the live requests are still finishing."""

    def rejecting(self) -> bool:
        # The gate holds while draining (mode=wait) and while the engine stays
        # paused; a resume through the SGLang route lifts it too.
        return self.mode is not None and (self.draining or self.engine.paused is not None)

    def check(self) -> None:
        """Raise vLLM's 503 while new generation requests are refused."""
        if self.rejecting():
            raise VLLMError(503, f"generation is paused (mode={self.mode}); retry after /resume")


def stop_reason(r: SampleResult, params: SamplingParams) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or stop token id that ended the
    sample; None for EOS, length or abort."""
    f = r.finish_reason
    if f.kind == "stop" and (isinstance(f.matched, str) or f.matched in params.stop_token_ids):
        return f.matched
    return None


def version_spans(r: SampleResult) -> list[dict]:
    """vLLM reports spans covering every output token, even when the version
    never changed (the engine records spans only on a change)."""
    if r.weight_versions:
        return [{"version": s.version, "start": s.start, "end": s.end} for s in r.weight_versions]
    n = len(r.output_ids)
    return [{"version": r.weight_version, "start": 0, "end": n}] if n else []
