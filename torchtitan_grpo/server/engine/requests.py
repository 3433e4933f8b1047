"""Request, sampling and result types of the built-in engine.

The vocabulary shared by the engine, its batch and sampling code, and the
protocol routes: a route turns its JSON into :class:`SamplingParams`, the
engine answers with :class:`SampleResult`s. Nothing here runs a model, so
every other inference module may import it (it imports none of them).
"""

from __future__ import annotations

import concurrent.futures
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from torchtitan_grpo.server.engine import moe_routes

PAUSE_MODES = ("abort", "retract", "in_place")
DEFAULT_WEIGHT_VERSION = "default"
_GREEDY_EPS = 1e-6  # temperatures below this mean argmax, as in SGLang
PROMPT_CHARS_PER_TOKEN = 32
"""Bound on a text prompt's characters per token of context, checked before it
is tokenised: tokenising is linear in the text and a prompt that cannot fit
the context is refused anyway, so a 100 MB text must be refused by its length,
not after building its ids. Real text averages ~4 characters per token; a
prompt this bound refuses would need over 32 on average to fit."""
MAX_SAMPLES = 4096
"""Most samples (``n``) one request may ask for: each is a sequence object
built at submit time, so an unbounded ``n`` is unbounded memory."""
_INT64 = (-(1 << 63), (1 << 63) - 1)  # the range of a seed (vLLM's bound too)


class RequestError(ValueError):
    """A request the engine cannot serve as asked (maps to HTTP 400)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field
        """The :class:`SamplingParams` field refused, when it is one (a route names it in its own words)."""


class WeightUpdateError(RuntimeError):
    """A weight update that was refused; the model was left unchanged."""


class ModelLoadError(RuntimeError):
    """The model directory is missing or cannot be loaded."""


# --------------------------------------------------------------------------- #
# Request / result types
# --------------------------------------------------------------------------- #


@dataclass
class SamplingParams:
    """How to sample one prompt (engine-neutral names; routes map theirs)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    """0 (or below 1e-6) means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) keeps the whole vocabulary."""
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    """Stop strings; need a tokenizer."""
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None
    """Per-request seed: sample j uses a generator derived from (seed, j), so a
    seeded request is reproducible whatever else is in the batch."""
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate(self, vocab_size: int) -> None:
        """Raise :class:`RequestError` naming the first bad field."""

        def bad(name: str, why: str) -> None:
            raise RequestError(f"sampling_params.{name} {why}", field=name)

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            bad("max_new_tokens", f"must be an integer >= 0, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            bad("top_k", f"must be -1 (all) or an integer >= 1, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.min_new_tokens, int) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            bad("min_new_tokens", f"must be in [0, max_new_tokens], got {self.min_new_tokens!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_SAMPLES:
            bad("n", f"must be an integer in [1, {MAX_SAMPLES}], got {self.n!r}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                bad("stop_token_ids", f"must hold token ids in [0, {vocab_size}), got {t!r}")
        for t in (self.logit_bias or {}):
            if not 0 <= t < vocab_size:
                bad("logit_bias", f"keys must be token ids in [0, {vocab_size}), got {t!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not _INT64[0] <= self.seed <= _INT64[1]):
            bad("sampling_seed", f"must be a 64-bit signed integer, got {self.seed!r}")


@dataclass
class FinishReason:
    """Why a sample ended."""

    kind: str
    """"stop" (EOS, stop token or stop string), "length" or "abort"."""
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


@dataclass
class VersionSpan:
    """Output tokens ``[start, end)`` were generated under weight ``version``."""

    version: str
    start: int
    end: int


@dataclass
class SampleResult:
    """One finished sample."""

    rid: str
    sample_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    top_logprobs: list[list[tuple[float, int]]] | None
    finish_reason: FinishReason
    weight_version: str
    """Version that produced the last token (the current one if none)."""
    weight_versions: list[VersionSpan] | None
    """Set only when the version changed while the sample had output."""
    cached_tokens: int
    e2e_latency: float
    text: str | None = None
    routed_experts: Any = None
    """int16 ``[len(prompt) + len(output) - 1, moe_layers, top_k]`` (``moe_routes.assemble``), or None."""


# --------------------------------------------------------------------------- #
# Internal per-sequence state
# --------------------------------------------------------------------------- #


@dataclass
class _Request:
    """One submitted prompt; its ``n`` samples are :class:`_Sequence`s."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    top_logprobs_num: int
    future: concurrent.futures.Future
    created: float = field(default_factory=time.monotonic)
    seqs: list["_Sequence"] = field(default_factory=list)
    remaining: int = 0
    on_token: Any = None
    """Called as ``on_token(seq)`` on the engine's worker (under its lock) each
    time a sample records a token, before its stop check; a streaming route
    copies the token out and returns at once."""


@dataclass(eq=False)
class _Sequence:
    """One live sample. A KV batch reads ``req``, ``index``, ``output_ids`` and
    :meth:`context` (and sets ``cached_tokens`` when it shares a prefill);
    sampling reads ``params`` and ``generator``; the engine writes the rest.
    Compared by identity (``eq=False``): it is a set member and a dict key."""

    req: _Request
    index: int
    generator: random.Random | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[float, int]]] | None = None
    finish: FinishReason | None = None
    end_version: str | None = None  # version when the sample finished
    stop_text: str | None = None
    cached_tokens: int = 0
    # (old_version, number of output tokens it produced), one per change.
    version_events: list[tuple[str, int]] = field(default_factory=list)
    route_chunks: list | None = None  # routed experts per run position (server/engine/moe_routes.py), when captured

    @property
    def params(self) -> SamplingParams:
        return self.req.params

    def context(self) -> list[int]:
        return self.req.prompt_ids + self.output_ids


def _sample_generator(seed: int | None, index: int) -> random.Random | None:
    """A seeded sample's own generator: one uniform per token (``server/engine/sampling.py``
    draws by inverse CDF), on the host, so seeded rows cost no device launches."""
    if seed is None:
        return None
    # Sample 0 uses the seed itself, so n=1 reproduces a standalone request.
    derived = seed if index == 0 else hash((seed, index)) & 0x7FFF_FFFF_FFFF_FFFF
    return random.Random(derived)


def _version_spans(events: list[tuple[str, int]], current: str, n_out: int) -> list[VersionSpan]:
    """Turn (old_version, tokens_so_far) change events into contiguous spans."""
    spans: list[VersionSpan] = []
    for version, end in events + [(current, n_out)]:
        end = min(end, n_out)
        start = spans[-1].end if spans else 0
        if end <= start:
            continue
        if spans and spans[-1].version == version:
            spans[-1].end = end
        else:
            spans.append(VersionSpan(version, start, end))
    return spans


def parse_stop(value) -> tuple[str, ...] | None:
    """The ``stop`` field of both protocols: absent, a string, or a list of
    strings (empty ones ignored). None when it is none of these."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(v for v in value if v)
    return None


def decode_ids(tokenizer: Any, ids: Sequence[int], skip_special: bool = True) -> str:
    """``ids`` as text ("" for ids outside the tokenizer's vocabulary)."""
    try:
        return tokenizer.decode(list(ids), skip_special_tokens=skip_special) or ""
    except Exception:
        return ""


def _fast_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer of a fast tokenizer without transformers' clean-up step (its own
    decode then gives what transformers' ``decode`` gives, without the per-call argument checks
    and conversions); None for any other."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return None if getattr(tokenizer, "clean_up_tokenization_spaces", True) else backend


def decode_each(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each id's text on its own, special tokens spelled out: what
    ``decode_ids(tokenizer, [t], skip_special=False)`` gives for every ``t``.
    A fast tokenizer without transformers' clean-up step is asked directly
    (its Rust ``decode``: ~10x less per id than transformers' ``decode``,
    which checks and converts its arguments on every call); any other, or an
    id the backend refuses, goes through :func:`decode_ids`."""
    backend = _fast_backend(tokenizer)
    if backend is None:
        return [decode_ids(tokenizer, [t], skip_special=False) for t in ids]
    out = []
    for t in ids:
        try:
            out.append(backend.decode([t], skip_special_tokens=False))
        except Exception:
            out.append(decode_ids(tokenizer, [t], skip_special=False))
    return out


def decode_texts(tokenizer: Any, seqs: Sequence[_Sequence]) -> list[str | None]:
    """Each sample's output text as :func:`decode_ids` gives it (None without a tokenizer). A
    fast tokenizer without transformers' clean-up step decodes them in one call of its Rust
    ``decode_batch``, which spreads them over the cores: a step often ends every sample of a
    burst, and 256 samples of 128 tokens took 12-16 ms one by one against 5.6 ms batched on a
    2-core CPU, on the engine's worker while the GPU waited. A batch the backend refuses (an
    id outside the vocabulary) is decoded one by one."""
    if tokenizer is None:
        return [None] * len(seqs)
    backend = _fast_backend(tokenizer)
    if backend is None or len(seqs) < 2:
        return [decode_ids(tokenizer, s.output_ids, s.params.skip_special_tokens) for s in seqs]
    out: list[str | None] = [None] * len(seqs)
    for skip in (True, False):
        idx = [i for i, s in enumerate(seqs) if bool(s.params.skip_special_tokens) == skip]
        if not idx:
            continue
        try:
            texts = backend.decode_batch([list(seqs[i].output_ids) for i in idx], skip_special_tokens=skip)
        except Exception:
            texts = [decode_ids(tokenizer, seqs[i].output_ids, skip) for i in idx]
        for i, text in zip(idx, texts):
            out[i] = text or ""
    return out


def sample_result(s: _Sequence, current_version: str, text: str | None) -> SampleResult:
    """What a finished (or aborted) sample returns; ``text``: its output decoded
    (:func:`decode_texts`; None without a tokenizer), trimmed here at a stop string."""
    n_out = len(s.output_ids)
    end_version = s.end_version or current_version
    spans = _version_spans(s.version_events, end_version, n_out) if s.version_events else None
    if text is not None and s.stop_text is not None and not s.params.no_stop_trim and s.stop_text in text:
        text = text[: text.find(s.stop_text)]
    return SampleResult(
        rid=s.req.rid if s.params.n == 1 else f"{s.req.rid}_{s.index}",
        sample_index=s.index,
        prompt_ids=s.req.prompt_ids,
        output_ids=list(s.output_ids),
        output_logprobs=list(s.logprobs),
        top_logprobs=s.top,
        finish_reason=s.finish,
        weight_version=spans[-1].version if spans else end_version,
        weight_versions=spans if spans and len(spans) > 1 else None,
        cached_tokens=s.cached_tokens,
        e2e_latency=time.monotonic() - s.req.created,
        text=text,
        routed_experts=moe_routes.assemble(s),
    )


def check_prompt(prompt_ids: Sequence[int], params: SamplingParams, max_context: int, vocab_size: int,
                 has_tokenizer: bool) -> None:
    """Raise :class:`RequestError` for a prompt (or sampling parameters) an
    engine of this context and vocabulary cannot serve."""
    if not prompt_ids:
        raise RequestError("the prompt is empty")
    # The length first: a prompt too long for the context is not worth scanning.
    if len(prompt_ids) >= max_context:
        raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {max_context}")
    bad = next((t for t in prompt_ids if not 0 <= int(t) < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    params.validate(vocab_size)
    if params.stop and not has_tokenizer:
        raise RequestError("sampling_params.stop needs a tokenizer, and this model directory has none")


def check_prompt_text(text: str, field: str, max_context: int) -> None:
    """Raise :class:`RequestError` naming ``field`` if ``text`` is longer than
    any prompt that fits ``max_context`` (:data:`PROMPT_CHARS_PER_TOKEN`)."""
    most = PROMPT_CHARS_PER_TOKEN * max_context
    if len(text) > most:
        raise RequestError(
            f"field {field!r} has {len(text)} characters, more than any prompt that fits the model's "
            f"context of {max_context} tokens ({most} characters at most); it was not tokenised"
        )
