"""The requests ``conformance.py`` sends: both protocols, plain and streamed,
logprobs (output, top-k, prompt), ``n``, batches, stops, length limits,
chat, the bodies our own clients build, and refusals.

A case names what SGLang's or vLLM's validator must say of its body
(``oracle_accepts``) and the status the built-in server must answer. A body
the validator refuses must be refused by the server too (400); a body it
accepts may still be refused where the real engine refuses it after the
validator (context length, unknown model): ``after_validator`` says where.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan_grpo.fleet import sglang as sglang_client
from torchtitan_grpo.fleet import vllm as vllm_client
from torchtitan_grpo.fleet.types import SamplingParams

GENERATE, COMPLETIONS, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
PROMPT_IDS = [20, 19, 13, 19, 31]  # "21+1=" in the demo tokenizer (id = ord(c) - 30)
HUGE = 10**9


@dataclass
class Case:
    """One request and what the engines would do with it."""

    name: str
    path: str
    body: dict[str, Any]
    status: int = 200
    """What the built-in server must answer."""
    oracle_accepts: bool = True
    """What the engine's own validator says of ``body``."""
    after_validator: str = ""
    """For a refusal the validator cannot see: where the real engine refuses it."""
    sglang_error: str = ""
    """The error shape SGLang 0.5.23 answers this refusal with (see
    ``SGLangOracle.error``): "gate", "engine" or "fastapi"; a different one is a note."""

    @property
    def protocol(self) -> str:
        return "sglang" if self.path == GENERATE else "vllm"

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True


def _sp(**kw: Any) -> dict[str, Any]:
    return {"max_new_tokens": 8, "temperature": 0.0, **kw}


def sglang_cases() -> list[Case]:
    client = sglang_client.generate_request(
        PROMPT_IDS, 4, SamplingParams(max_new_tokens=8, temperature=1.0, top_k=-1, stop_token_ids=(1,), seed=3))
    return [
        Case("text, greedy", GENERATE, {"text": "12+3=", "sampling_params": _sp()}),
        Case("input_ids, output logprobs", GENERATE,
             {"input_ids": PROMPT_IDS, "sampling_params": _sp(), "return_logprob": True, "logprob_start_len": -1}),
        Case("prompt logprobs from 0, top 2, text", GENERATE,
             {"text": "7*8=", "sampling_params": _sp(), "return_logprob": True, "logprob_start_len": 0,
              "top_logprobs_num": 2, "return_text_in_logprobs": True}),
        Case("prompt logprobs from 2", GENERATE,
             {"input_ids": PROMPT_IDS, "sampling_params": _sp(), "return_logprob": True, "logprob_start_len": 2}),
        Case("n=3 seeded", GENERATE,
             {"text": "5-2=", "sampling_params": _sp(n=3, temperature=1.0, sampling_seed=7)}),
        Case("batch of 2 texts", GENERATE, {"text": ["1+1=", "2+2="], "sampling_params": _sp()}),
        Case("batch, per-prompt params and logprobs", GENERATE,
             {"input_ids": [PROMPT_IDS, PROMPT_IDS[:3]], "sampling_params": [_sp(), _sp(max_new_tokens=4)],
              "return_logprob": [True, False], "logprob_start_len": [0, -1], "rid": ["a1", "a2"]}),
        Case("stop strings, stop ids, no_stop_trim", GENERATE,
             {"text": "3+4=", "sampling_params": _sp(stop=["5", "9"], stop_token_ids=[1], no_stop_trim=True)}),
        Case("ignore_eos, min_new_tokens, penalties", GENERATE,
             {"text": "3+4=", "sampling_params": _sp(max_new_tokens=12, ignore_eos=True, min_new_tokens=4,
                                                      repetition_penalty=1.1, top_p=0.9, top_k=20, min_p=0.05)}),
        Case("max_new_tokens 0", GENERATE, {"text": "3+4=", "sampling_params": _sp(max_new_tokens=0)}),
        Case("stream", GENERATE, {"text": "9+9=", "sampling_params": _sp(), "stream": True}),
        Case("stream, logprobs with prompt logprobs", GENERATE,
             {"input_ids": PROMPT_IDS, "sampling_params": _sp(), "stream": True, "return_logprob": True,
              "logprob_start_len": 0, "top_logprobs_num": 1}),
        Case("stream, n=2", GENERATE,
             {"text": "8-1=", "sampling_params": _sp(n=2, temperature=1.0, sampling_seed=1), "stream": True}),
        Case("stream, batch of 2", GENERATE,
             {"text": ["1+1=", "2+2="], "sampling_params": _sp(max_new_tokens=4), "stream": True}),
        Case("client body: sglang.generate_request", GENERATE, client),
        Case("client body, streamed", GENERATE, {**client, "stream": True}),
        # Refusals.
        Case("unknown sampling key max_tokens", GENERATE, {"text": "1", "sampling_params": {"max_tokens": 4}},
             status=400, oracle_accepts=False, sglang_error="gate"),
        Case("temperature of the wrong type", GENERATE, {"text": "1", "sampling_params": {"temperature": "hot"}},
             status=400, oracle_accepts=False, sglang_error="gate"),
        Case("text of the wrong type", GENERATE, {"text": 5}, status=400, oracle_accepts=False,
             sglang_error="fastapi"),
        # SGLang refuses only neither input (GenerateReqInput._validate_inputs); given both, it uses input_ids.
        Case("both text and input_ids", GENERATE, {"text": "1", "input_ids": [20], "sampling_params": _sp()}),
        # SGLang's scheduler aborts logprob_start_len > prompt length, so == is accepted (no prompt rows).
        Case("logprob_start_len at the prompt's end", GENERATE,
             {"input_ids": PROMPT_IDS, "return_logprob": True, "logprob_start_len": len(PROMPT_IDS),
              "sampling_params": _sp()}),
        Case("max_new_tokens past the context", GENERATE, {"text": "1", "sampling_params": {"max_new_tokens": HUGE}},
             status=400, after_validator="tokenizer manager: input + max_new_tokens > context", sglang_error="engine"),
        Case("logprob_start_len past the prompt", GENERATE,
             {"text": "12", "return_logprob": True, "logprob_start_len": 50, "sampling_params": _sp()},
             status=400, after_validator="scheduler: logprob_start_len > prompt length (an abort, 400)",
             sglang_error="engine"),
    ]


def vllm_cases(model: str) -> list[Case]:
    client = vllm_client.completions_request(
        PROMPT_IDS, 4, SamplingParams(max_new_tokens=8, temperature=1.0, top_k=-1, stop_token_ids=(1,), seed=3), model)
    m = {"model": model}
    msgs = [{"role": "user", "content": "what is 2+2?"}]
    return [
        Case("text prompt, greedy", COMPLETIONS, {**m, "prompt": "12+3=", "max_tokens": 8, "temperature": 0}),
        Case("token prompt, logprobs 0, token ids", COMPLETIONS,
             {**m, "prompt": PROMPT_IDS, "max_tokens": 8, "logprobs": 0, "return_token_ids": True,
              "return_tokens_as_token_ids": True, "return_weight_versions": True}),
        Case("logprobs 3", COMPLETIONS, {**m, "prompt": "7*8=", "max_tokens": 6, "logprobs": 3}),
        Case("n=3 seeded", COMPLETIONS, {**m, "prompt": "5-2=", "max_tokens": 6, "n": 3, "seed": 7}),
        Case("batch of 2 texts", COMPLETIONS, {**m, "prompt": ["1+1=", "2+2="], "max_tokens": 4}),
        Case("batch of 2 token prompts, n=2", COMPLETIONS,
             {**m, "prompt": [PROMPT_IDS, PROMPT_IDS[:2]], "max_tokens": 4, "n": 2, "return_token_ids": True}),
        Case("stop strings and ids", COMPLETIONS,
             {**m, "prompt": "3+4=", "max_tokens": 12, "stop": ["5", "9"], "stop_token_ids": [1],
              "include_stop_str_in_output": True}),
        Case("ignore_eos, min_tokens, penalties", COMPLETIONS,
             {**m, "prompt": "3+4=", "max_tokens": 10, "ignore_eos": True, "min_tokens": 3, "top_p": 0.9,
              "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.2}),
        Case("max_tokens null (up to the context)", COMPLETIONS,
             {**m, "prompt": "3+4=", "max_tokens": None, "stop_token_ids": [1, 20, 21, 22, 23, 24, 25]}),
        Case("prompt_logprobs 2", COMPLETIONS, {**m, "prompt": "7*8=", "max_tokens": 4, "prompt_logprobs": 2}),
        Case("stream", COMPLETIONS, {**m, "prompt": "9+9=", "max_tokens": 8, "stream": True}),
        Case("stream, include_usage", COMPLETIONS,
             {**m, "prompt": "9+9=", "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}),
        Case("stream, continuous usage, logprobs 1, n=2", COMPLETIONS,
             {**m, "prompt": "9+9=", "max_tokens": 6, "n": 2, "logprobs": 1, "stream": True,
              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
        Case("stream, batch, token ids", COMPLETIONS,
             {**m, "prompt": ["1+1=", "2+2="], "max_tokens": 4, "stream": True, "return_token_ids": True}),
        Case("client body: vllm.completions_request", COMPLETIONS, client),
        Case("client body, streamed", COMPLETIONS, {**client, "stream": True}),
        Case("chat, greedy", CHAT, {**m, "messages": msgs, "max_tokens": 8, "temperature": 0}),
        Case("chat, logprobs, top 2", CHAT, {**m, "messages": msgs, "max_tokens": 6, "logprobs": True,
                                             "top_logprobs": 2}),
        # Log-probs without top entries: the content array the route writes as one JSON fragment.
        Case("chat, logprobs, no top, n=2", CHAT, {**m, "messages": msgs, "max_tokens": 6, "logprobs": True, "n": 2}),
        Case("chat, n=2, max_completion_tokens, seed", CHAT,
             {**m, "messages": msgs, "max_completion_tokens": 6, "n": 2, "seed": 5}),
        Case("chat, stop strings", CHAT, {**m, "messages": msgs, "max_tokens": 12, "stop": ["4"]}),
        Case("chat, prompt_logprobs 1, token ids", CHAT,
             {**m, "messages": msgs, "max_tokens": 4, "prompt_logprobs": 1, "return_token_ids": True}),
        Case("chat, stream", CHAT, {**m, "messages": msgs, "max_tokens": 6, "stream": True}),
        Case("chat, stream, include_usage, logprobs", CHAT,
             {**m, "messages": msgs, "max_tokens": 6, "stream": True, "logprobs": True, "top_logprobs": 1,
              "stream_options": {"include_usage": True}}),
        Case("chat, stream, n=2, token ids", CHAT,
             {**m, "messages": msgs, "max_tokens": 4, "n": 2, "stream": True, "return_token_ids": True}),
        # Refusals.
        Case("stream_options without stream", COMPLETIONS,
             {**m, "prompt": "1", "stream_options": {"include_usage": True}}, status=400, oracle_accepts=False),
        Case("n=0", COMPLETIONS, {**m, "prompt": "1", "n": 0}, status=400, oracle_accepts=False),
        Case("negative temperature", COMPLETIONS, {**m, "prompt": "1", "temperature": -1}, status=400,
             oracle_accepts=False),
        Case("prompt missing", COMPLETIONS, {**m, "max_tokens": 4}, status=400, oracle_accepts=False),
        Case("max_tokens past the context", COMPLETIONS, {**m, "prompt": "1", "max_tokens": HUGE}, status=400,
             after_validator="renderer: max_tokens > max_model_len"),
        Case("unknown model", COMPLETIONS, {"model": "no-such-model", "prompt": "1"}, status=404,
             after_validator="serving: model not found"),
        Case("chat, top_logprobs without logprobs", CHAT, {**m, "messages": msgs, "top_logprobs": 2}, status=400,
             oracle_accepts=False),
        Case("chat, stream_options without stream", CHAT,
             {**m, "messages": msgs, "stream_options": {"include_usage": True}}, status=400, oracle_accepts=False),
        Case("chat, max_tokens past the context", CHAT, {**m, "messages": msgs, "max_tokens": HUGE}, status=400,
             after_validator="renderer: max_tokens > max_model_len"),
        Case("chat, messages missing", CHAT, {**m, "max_tokens": 4}, status=400, oracle_accepts=False),
    ]
