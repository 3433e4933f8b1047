"""What building a generation route's JSON reply costs on the host: the
built-in server's /generate, /v1/completions and /v1/chat/completions
builders on synthetic finished samples (no model, no GPU), issue 50.

For ``--seqs`` samples (requests of n=8, as ``bench/engine_vs_vllm.py`` sends
them) of each length, logprobs on (top 0), random token ids over a
vocabulary of ``--vocab`` (a random-weight model samples near uniformly, so
most ids are new to the engine's token-text cache): each route's builder as
its handler calls it (``httputil.gc_paused`` around it), then the encoding of
each reply by ``jsonfast.dumps`` (``httputil.json_reply``: orjson where
installed) and, as the baseline in the same run, by ``json.dumps`` (what
aiohttp's ``json_response``, the routes' encoder before, runs). "cold": the token-text
cache empty; "warm": best of 3 after. The tokenizer is
``bench/engine_vs_vllm.py``'s word-level one (token ``i`` is ``w<i>``).

  python bench/reply_cost.py --lengths 128,1024           # CPU, ~10 s
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torchtitan_grpo  # noqa: E402,F401  (before torchtitan)
from torchtitan_grpo import jsonfast  # noqa: E402
from torchtitan_grpo.server.routes import logprob_json  # noqa: E402

from bench.paged_speed import N_PER_PROMPT  # noqa: E402


def synthetic_results(seqs: int, new: int, vocab: int, seed: int = 0) -> list[Any]:
    """``seqs`` finished samples of ``new`` random tokens each (random-weight models sample near uniformly)."""
    import random

    from torchtitan_grpo.server.engine.requests import FinishReason, SampleResult

    rng = random.Random(seed)
    out = []
    for i in range(seqs):
        ids = [rng.randrange(2, vocab) for _ in range(new)]
        out.append(SampleResult(
            rid=f"r{i}", sample_index=i % N_PER_PROMPT, prompt_ids=list(range(2, 130)), output_ids=ids,
            output_logprobs=[-12.0 * rng.random() for _ in ids], top_logprobs=None,
            finish_reason=FinishReason("length", length=new), weight_version="0", weight_versions=None,
            cached_tokens=0, e2e_latency=1.0, text=" ".join(f"w{t}" for t in ids)))
    return out


class TextEngine:
    """What the reply builders read of an :class:`Engine`: its tokenizer, its
    token-text cache (the engine's own ``token_texts``) and its limits; no model."""

    def __init__(self, model_dir: str, max_context: int = 1 << 16, max_batch_size: int = 256):
        from types import SimpleNamespace

        from transformers import AutoTokenizer

        from torchtitan_grpo.server.engine.engine import Engine

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._token_texts: dict[int, str] = {}
        self.max_context = max_context
        self.cfg = SimpleNamespace(max_batch_size=max_batch_size)
        self._texts = Engine.token_texts

    def token_texts(self, token_ids: Any) -> list[str | None]:
        return self._texts(self, token_ids)


def reply_builders(engine: Any, model_dir: str, new: int, gc_pause: bool = True,
                   as_ids: bool = False) -> dict[str, Callable[[list[Any]], Any]]:
    """Each route's reply builder as its handler runs it on one request's samples
    (the collector held off, unless ``gc_pause`` is False: as before the handlers did);
    ``as_ids``: tokens named by id (``return_tokens_as_token_ids``)."""
    from types import SimpleNamespace

    from torchtitan_grpo.server.engine.requests import SamplingParams
    from torchtitan_grpo.server.httputil import gc_paused
    from torchtitan_grpo.server.routes import vllm_chat, vllm_openai
    from torchtitan_grpo.server.routes.sglang import SGLangGenerateRoutes
    from torchtitan_grpo.server.vllm_http import PauseGate

    cfg = SimpleNamespace(model=model_dir, chat_template=None, trust_request_chat_template=False)
    gen = SGLangGenerateRoutes.__new__(SGLangGenerateRoutes)
    gen.engine = engine
    comp = vllm_openai.OpenAIRoutes(engine, cfg, PauseGate(engine))
    chat = vllm_chat.ChatRoutes(engine, cfg, PauseGate(engine))
    params = SamplingParams(max_new_tokens=new, ignore_eos=True, n=N_PER_PROMPT)
    ccall = vllm_openai._CompletionCall(prompts=[[2]], params=params, logprobs=0, return_token_ids=False,
                                        tokens_as_ids=as_ids, return_weight_versions=False)
    hcall = vllm_chat._ChatCall(prompt=[2], prompt_text="", params=params, logprobs=True, top_logprobs=0,
                                return_token_ids=False, tokens_as_ids=as_ids, return_prompt_text=False,
                                return_weight_versions=False)

    def paused(fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        def run(rs: list[Any]) -> Any:
            if not gc_pause:
                return fn(rs)
            with gc_paused():
                return fn(rs)
        return run

    return {
        "generate": paused(lambda rs: [gen.sample_json(r, True, False) for r in rs]),
        "completions": paused(lambda rs: {"choices": [comp._choice(i, r, ccall) for i, r in enumerate(rs)]}),
        "chat": paused(lambda rs: {"choices": [chat._choice(i, r, hcall) for i, r in enumerate(rs)]}),
    }


def reply_rows(model_dir: str, vocab: int, seqs: int, lengths: list[int], repeats: int = 3,
               gc_pause: bool = True) -> list[dict]:
    """Host ms to build and encode every route's replies for ``seqs`` samples (requests of n=8), per
    length: as the routes do now (``jsonfast``: orjson, the chat content written as one fragment), and,
    the baseline of the same run, with the standard library (one object per token, ``json.dumps``)."""
    engine = TextEngine(model_dir)
    rows = []
    for new in lengths:
        results = synthetic_results(seqs, new, vocab)
        requests = [results[i:i + N_PER_PROMPT] for i in range(0, seqs, N_PER_PROMPT)]
        for route, build in reply_builders(engine, model_dir, new, gc_pause).items():
            engine._token_texts = {}
            logprob_json.clear_caches()
            t0 = time.perf_counter()
            replies = [build(rs) for rs in requests]
            cold = time.perf_counter() - t0
            warm = min(_timed(lambda: [build(rs) for rs in requests]) for _ in range(repeats))
            dumps = min(_timed(lambda: [jsonfast.dumps(r) for r in replies]) for _ in range(repeats))
            size = sum(len(jsonfast.dumps(r)) for r in replies)
            with _standard_library():
                std_replies = [build(rs) for rs in requests]
                std_build = min(_timed(lambda: [build(rs) for rs in requests]) for _ in range(repeats))
                std = min(_timed(lambda: [json.dumps(r) for r in std_replies]) for _ in range(repeats))
            rows.append({"route": route, "seqs": seqs, "new": new, "build_cold_ms": cold * 1e3,
                         "build_warm_ms": warm * 1e3, "dumps_ms": dumps * 1e3, "reply_mb": size / 1e6,
                         "us_per_token": (warm + dumps) / (seqs * new) * 1e6, "json_build_ms": std_build * 1e3,
                         "json_dumps_ms": std * 1e3, "us_per_token_json": (std_build + std) / (seqs * new) * 1e6})
    return rows


class _standard_library:
    """The routes without orjson: ``jsonfast`` falls back to ``json`` (no fragments)."""

    def __enter__(self) -> None:
        self.saved = jsonfast.orjson, jsonfast.Fragment
        jsonfast.orjson = jsonfast.Fragment = None

    def __exit__(self, *exc: object) -> None:
        jsonfast.orjson, jsonfast.Fragment = self.saved


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0



def reply_table(rows: list[dict]) -> str:
    cols = ("route", "seqs", "new", "build_cold_ms", "build_warm_ms", "dumps_ms", "reply_mb", "us_per_token",
            "json_build_ms", "json_dumps_ms", "us_per_token_json")
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return (f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}") if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,1024", help="new tokens per sample, comma-separated")
    ap.add_argument("--seqs", type=int, default=64, help=f"samples (multiple of {N_PER_PROMPT})")
    ap.add_argument("--vocab", type=int, default=151_936, help="vocabulary (Qwen3's by default)")
    ap.add_argument("--no-gc-pause", action="store_true", help="build with the collector on (the handlers before)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of each warm figure (the best is kept)")
    args = ap.parse_args(argv)
    from bench.engine_vs_vllm import write_tokenizer

    tok_dir = tempfile.mkdtemp(prefix="reply_cost_")
    write_tokenizer(tok_dir, args.vocab)
    rows = reply_rows(tok_dir, args.vocab, args.seqs, [int(x) for x in args.lengths.split(",") if x],
                      repeats=args.repeats, gc_pause=not args.no_gc_pause)
    print(f"encoder: {'orjson ' + jsonfast.orjson.__version__ if jsonfast.orjson else 'json (orjson not installed)'}")
    print(reply_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
