"""The engines' own validators, wrapped for ``conformance.py``.

SGLang: ``sglang/api/v1/api_types.py`` (generated msgspec codecs, the same
file SGLang 0.5.23's ``/generate`` contract gate decodes every body with),
loaded by path from the unpacked wheel. vLLM: the pydantic models of
``vllm.entrypoints.openai.{completion,chat_completion}.protocol`` and
``vllm.entrypoints.serve.engine.protocol`` (vLLM 0.33.0), imported normally.

Each oracle method raises on a violation and returns the keys the validator
ignored (fields it does not know), which the report lists as notes: both
validators accept unknown keys, so a misspelt field would pass silently.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any


def load_sglang_types(path: str) -> Any:
    """SGLang's generated ``api_types`` module, loaded from a file (it needs only msgspec)."""
    spec = importlib.util.spec_from_file_location("sglang_api_v1_types", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (msgspec resolves the string annotations through it)
    spec.loader.exec_module(mod)
    return mod


class SGLangOracle:
    """SGLang 0.5.23's /generate contract: requests, responses, stream chunks, errors."""

    name = "sglang"

    def __init__(self, api_types_path: str):
        self.t = load_sglang_types(api_types_path)
        import msgspec

        self._fields = lambda cls: {f.encode_name for f in msgspec.structs.fields(cls)}

    def _ignored(self, cls: Any, obj: Any, where: str) -> list[str]:
        return [f"{where}{k}" for k in obj if k not in self._fields(cls)] if isinstance(obj, dict) else []

    def request(self, body: dict) -> list[str]:
        """Decode as SGLang's server does before admitting a /generate body
        (``api_contract.generate_contract_error``); unknown sampling keys are errors there."""
        self.t.GenerateRequest.from_json_value(body)
        return self._ignored(self.t.GenerateRequest, body, "")

    def response(self, body: Any) -> list[str]:
        """One ``GenerateResponse``, or a prompt-major array of them (batch, n > 1)."""
        items = body if isinstance(body, list) else [body]
        notes: list[str] = []
        for it in items:
            self.t.GenerateResponse.from_json_value(it)
            notes += self._ignored(self.t.GenerateResponse, it, "")
            notes += self._ignored(self.t.GenerateMetaInfo, it.get("meta_info"), "meta_info.")
        return sorted(set(notes))

    def chunk(self, obj: Any) -> list[str]:
        """A stream event: a cumulative ``GenerateResponse`` or a ``GenerateStreamError``."""
        if isinstance(obj, dict) and "error" in obj:
            self.t.GenerateStreamError.from_json_value(obj)
            if not isinstance(obj["error"], dict) or not isinstance(obj["error"].get("message"), str):
                raise ValueError("stream error event without error.message")
            return []
        return self.response(obj)

    def error(self, body: Any) -> list[str]:
        """SGLang answers a refused /generate in one of three shapes, by where
        it refused it: the contract gate ``{"error": "<text>"}``, the engine
        ``{"error": {"message": ...}}`` (``GenerateStreamError``), FastAPI's
        validation ``{"object": "error", "message", "type", "code"}``. The
        api_types file defines only the second; any of the three passes, and
        the shape's name ("gate", "engine", "fastapi") is returned."""
        if not isinstance(body, dict):
            raise ValueError(f"error body is not an object: {str(body)[:80]}")
        err = body.get("error")
        if isinstance(err, str):
            return ["gate"]
        if isinstance(err, dict):
            self.t.GenerateStreamError.from_json_value(body)
            if not isinstance(err.get("message"), str):
                raise ValueError("error.message missing")
            return ["engine"]
        if body.get("object") == "error" and isinstance(body.get("message"), str):
            self.t.ErrorBody.from_json_value(body)  # message: str, code: int
            return ["fastapi"]
        raise ValueError(f"not one of SGLang's error shapes: {str(body)[:120]}")

    def model_info(self, body: Any) -> list[str]:
        self.t.GetModelInfoResponse.from_json_value(body)
        return []

    def abort(self, request: dict, response: Any) -> list[str]:
        self.t.AbortRequest.from_json_value(request)
        self.t.AbortResponse.from_json_value(response)
        return []


def _extras(model: Any, where: str = "") -> list[str]:
    """Keys a pydantic model accepted without a field for them (``extra="allow"``), recursively."""
    from pydantic import BaseModel

    out = [f"{where}{k}" for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        v = getattr(model, name, None)
        for i, x in enumerate(v if isinstance(v, list) else [v]):
            if isinstance(x, BaseModel):
                out += _extras(x, f"{where}{name}[{i}]." if isinstance(v, list) else f"{where}{name}.")
    return out


def _generic(notes: list[str]) -> list[str]:
    """choices[0].x and choices[1].x are one note."""
    import re

    return sorted({re.sub(r"\[\d+\]", "[]", n) for n in notes})


class VLLMOracle:
    """vLLM 0.33.0's OpenAI models: completions and chat, requests, responses, chunks, errors."""

    name = "vllm"

    def __init__(self):
        from vllm.entrypoints.openai.chat_completion import protocol as chat
        from vllm.entrypoints.openai.completion import protocol as comp
        from vllm.entrypoints.serve.engine import protocol as base

        self.comp, self.chat, self.base = comp, chat, base

    def request(self, path: str, body: dict) -> list[str]:
        """Parse as vLLM's route does, then build its ``SamplingParams`` (where
        vLLM checks ranges: n >= 1, temperature >= 0, logprobs, ...)."""
        if path.endswith("/chat/completions"):
            req = self.chat.ChatCompletionRequest.model_validate(body)
            max_tokens = req.max_completion_tokens or req.max_tokens or 16
            req.to_sampling_params(max_tokens, {})
        else:
            req = self.comp.CompletionRequest.model_validate(body)
            req.to_sampling_params(req.max_tokens if req.max_tokens is not None else 16)
        return _generic(_extras(req))

    def response(self, path: str, body: Any) -> list[str]:
        cls = (self.chat.ChatCompletionResponse if path.endswith("/chat/completions")
               else self.comp.CompletionResponse)
        return _generic(_extras(cls.model_validate(body)))

    def chunk(self, path: str, obj: Any) -> list[str]:
        """A stream event; an error after the stream opened is vLLM's ``ErrorResponse``."""
        if isinstance(obj, dict) and "error" in obj and "choices" not in obj:
            return self.error(obj)
        cls = (self.chat.ChatCompletionStreamResponse if path.endswith("/chat/completions")
               else self.comp.CompletionStreamResponse)
        return _generic(_extras(cls.model_validate(obj)))

    def error(self, body: Any) -> list[str]:
        return _generic(_extras(self.base.ErrorResponse.model_validate(body)))

    def models(self, body: Any) -> list[str]:
        return _generic(_extras(self.base.ModelList.model_validate(body)))
