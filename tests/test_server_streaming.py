"""The built-in server's streaming, prompt logprobs and context checks, in
process (one engine, the app on an event loop in a thread: no subprocess).

* ``"stream": true`` on SGLang's ``/generate`` and vLLM's ``/v1/completions``
  and ``/v1/chat/completions``: server-sent events in each engine's chunk
  shape, the same tokens and text as the unstreamed reply, chunks sent while
  the request still runs (the decode loop is held after the first token).
* Prompt logprobs (SGLang's ``input_token_logprobs``, vLLM's
  ``prompt_logprobs``) against a direct transformers forward.
* ``max_new_tokens`` / ``max_tokens`` past the context: the engines' 400.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from tests.server_procs import in_process_server, write_chat_template
from torchtitan_grpo.fleet import vllm
from torchtitan_grpo.server.engine.engine import Engine

torch.set_num_threads(1)

PROMPT = [5, 6, 7, 8, 9]
GREEDY = {"temperature": 0, "ignore_eos": True}
SCHEMAS = json.loads((Path(__file__).parent / "protocols" / "vllm-0.33-completions-schema.json").read_text())
CHAT_FIELDS = json.loads((Path(__file__).parent / "protocols" / "vllm-0.33-chat-fields.json").read_text())


@pytest.fixture(scope="module")
def live(model_dir, tmp_path_factory) -> Iterator[tuple[str, Engine]]:
    """(url, engine) of an in-process server with a chat template."""
    template = write_chat_template(tmp_path_factory.mktemp("chat") / "chat.jinja")
    with in_process_server(["--model", model_dir, "--port", "0", "--chat-template", str(template)]) as served:
        yield served


def _request(url: str, path: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                  headers={"Content-Type": "application/json"})


def post(url: str, path: str, body: dict) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(_request(url, path, body), timeout=120) as r:  # a hang guard only
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def events(resp) -> Iterator[Any]:
    """The ``data:`` payloads of an SSE reply, as they arrive; "[DONE]" as is."""
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    while line := resp.readline():
        line = line.decode().rstrip("\n")
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        yield data if data == "[DONE]" else json.loads(data)


def stream(url: str, path: str, body: dict) -> list[Any]:
    with urllib.request.urlopen(_request(url, path, {**body, "stream": True}), timeout=120) as r:
        out = list(events(r))
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1], out[-3:]
    return out[:-1]


# --------------------------------------------------------------------------- #
# Streaming
# --------------------------------------------------------------------------- #


def test_completions_stream_matches_the_unstreamed_reply(live):
    url, _ = live
    body = {"prompt": [PROMPT, PROMPT[:3]], "max_tokens": 12, "n": 2, "seed": 1, "logprobs": 1,
            "return_token_ids": True, "stop_token_ids": [3], **GREEDY}
    status, whole = post(url, vllm.COMPLETIONS, body)
    assert status == 200, whole
    chunks = stream(url, vllm.COMPLETIONS, {**body, "stream_options": {"include_usage": True}})
    *chunks, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    choice_fields = set(SCHEMAS["CompletionResponse"]["$defs"]["CompletionResponseChoice"]["properties"])
    for c in chunks:
        assert c["object"] == "text_completion" and c["id"] == chunks[0]["id"] and len(c["choices"]) == 1
        assert set(c) <= set(SCHEMAS["CompletionResponse"]["properties"]) and set(c["choices"][0]) <= choice_fields
    for want in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == want["index"]]
        assert "".join(m["text"] for m in mine) == want["text"]
        assert sum((m["token_ids"] for m in mine), []) == want["token_ids"]
        assert sum((m["logprobs"]["tokens"] for m in mine), []) == want["logprobs"]["tokens"]
        assert sum((m["logprobs"]["text_offset"] for m in mine), []) == want["logprobs"]["text_offset"]
        assert [m["finish_reason"] for m in mine] == [None] * (len(mine) - 1) + [want["finish_reason"]]
        assert mine[-1]["stop_reason"] == want["stop_reason"]
        assert mine[0]["prompt_token_ids"] == want["prompt_token_ids"]
        assert all(m["prompt_token_ids"] is None for m in mine[1:])


def test_chunks_leave_while_the_request_runs(live):
    """The first chunk (the prefill's token) arrives while decoding is held:
    tokens are streamed as the engine records them, not at the end."""
    url, engine = live
    go = threading.Event()
    engine.cfg.debug_decode_delay_s, engine._debug_sleep = 1e-9, lambda _s: go.wait(timeout=120)
    try:
        body = {"prompt": PROMPT, "max_tokens": 6, "return_token_ids": True, "stream": True, **GREEDY}
        with urllib.request.urlopen(_request(url, vllm.COMPLETIONS, body), timeout=120) as r:
            it = events(r)
            first = next(it)
            assert first["choices"][0]["token_ids"] and first["choices"][0]["finish_reason"] is None
            assert engine.num_live_requests() == 1  # still decoding, held by the test
            go.set()
            rest = list(it)
    finally:
        go.set()
        engine.cfg.debug_decode_delay_s = 0.0
    assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "length"
    assert len(first["choices"][0]["token_ids"]) + sum(len(c["choices"][0]["token_ids"]) for c in rest[:-1]) == 6


def test_chat_stream_matches_the_unstreamed_reply(live):
    url, _ = live
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9, "logprobs": True,
            "top_logprobs": 2, **GREEDY}
    status, whole = post(url, vllm.CHAT_COMPLETIONS, body)
    assert status == 200, whole
    chunks = stream(url, vllm.CHAT_COMPLETIONS, {**body, "stream_options": {"include_usage": True}})
    role, *deltas, usage = chunks
    assert role["object"] == "chat.completion.chunk"
    assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    got = [c["choices"][0] for c in deltas]
    assert all(set(c) <= set(CHAT_FIELDS["ChatCompletionResponse"]) for c in chunks)
    assert all(set(g) <= set(CHAT_FIELDS["ChatCompletionResponseChoice"]) | {"delta"} for g in got)
    assert "".join(g["delta"]["content"] for g in got) == whole["choices"][0]["message"]["content"]
    assert sum((g["logprobs"]["content"] for g in got), []) == whole["choices"][0]["logprobs"]["content"]
    assert got[-1]["finish_reason"] == whole["choices"][0]["finish_reason"] and "stop_reason" in got[-1]


def test_sglang_stream_is_cumulative_and_ends_as_the_unstreamed_reply(live):
    url, _ = live
    body = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 8, **GREEDY}}
    status, whole = post(url, "/generate", body)
    assert status == 200, whole
    chunks = stream(url, "/generate", body)
    for a, b in zip(chunks, chunks[1:]):  # each event is the sample so far
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"] and b["text"].startswith(a["text"])
        assert a["meta_info"]["finish_reason"] is None
        assert len(a["meta_info"]["output_token_logprobs"]) == a["meta_info"]["completion_tokens"]
    last = chunks[-1]
    assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert last["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
    # a batch: every event says which sample it is (prompt-major)
    batch = stream(url, "/generate", {"input_ids": [PROMPT, [20, 21]], "sampling_params": {"max_new_tokens": 3, "n": 2,
                                                                                            **GREEDY}})
    finals = {c["index"]: c for c in batch if c["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2, 3] and all(len(c["output_ids"]) == 3 for c in finals.values())


def test_stream_errors_before_it_starts_are_plain_400s(live):
    url, _ = live
    status, err = post(url, vllm.COMPLETIONS, {"prompt": PROMPT, "stream": True, "prompt_logprobs": 1})
    assert status == 400 and err["error"]["param"] == "prompt_logprobs", err
    status, err = post(url, vllm.COMPLETIONS, {"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": 1}})
    assert status == 400 and err["error"]["param"] == "stream_options.include_usage", err


# --------------------------------------------------------------------------- #
# Prompt logprobs
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def reference(model_dir):
    """log_softmax of a plain transformers forward over PROMPT: [T, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def test_sglang_input_token_logprobs_match_a_direct_forward(live, reference):
    url, _ = live
    want = [reference[t - 1, PROMPT[t]].item() for t in range(1, len(PROMPT))]
    body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 2, **GREEDY}}
    status, out = post(url, "/generate", body)
    assert status == 200, out
    got = out["meta_info"]["input_token_logprobs"]
    assert [g[1] for g in got] == PROMPT and got[0][0] is None and all(g[2] is None for g in got)
    torch.testing.assert_close(torch.tensor([g[0] for g in got[1:]]), torch.tensor(want), atol=1e-5, rtol=0)
    top = out["meta_info"]["input_top_logprobs"]
    assert top[0] is None and [t[1] for t in top[1]] == reference[0].topk(2).indices.tolist()
    status, out = post(url, "/generate", {**body, "logprob_start_len": 3, "return_text_in_logprobs": True})
    assert [g[1] for g in out["meta_info"]["input_token_logprobs"]] == PROMPT[3:]
    assert out["meta_info"]["input_token_logprobs"][0][2] is not None  # the token's text
    status, out = post(url, "/generate", {**body, "logprob_start_len": len(PROMPT)})
    assert status == 200 and out["meta_info"]["input_token_logprobs"] == [], out  # nothing from there on
    status, err = post(url, "/generate", {**body, "logprob_start_len": len(PROMPT) + 1})
    assert status == 400 and "logprob_start_len" in err["message"], err


def test_vllm_prompt_logprobs_match_a_direct_forward(live, reference):
    url, _ = live
    status, out = post(url, vllm.COMPLETIONS, {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2})
    assert status == 200, out
    got = out["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(PROMPT)
    for t, step in enumerate(got[1:], start=1):
        row = reference[t - 1]
        mine = step[str(PROMPT[t])]
        assert abs(mine["logprob"] - row[PROMPT[t]].item()) < 1e-5
        assert mine["rank"] == int((row > row[PROMPT[t]]).sum()) + 1
        top = row.topk(2).indices.tolist()
        assert set(step) == {str(PROMPT[t]), *map(str, top)}
        assert [step[str(i)]["rank"] for i in top if i != PROMPT[t]] == [r for r, i in enumerate(top, 1) if i != PROMPT[t]]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0}
    status, out = post(url, vllm.CHAT_COMPLETIONS, chat)
    assert status == 200 and out["prompt_logprobs"][0] is None and all(len(d) == 1 for d in out["prompt_logprobs"][1:])


# --------------------------------------------------------------------------- #
# max_new_tokens / max_tokens past the context
# --------------------------------------------------------------------------- #


def test_output_lengths_past_the_context_are_refused_as_the_engines_do(live):
    url, engine = live
    ctx = engine.max_context
    status, err = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10**9}})
    assert status == 400 and f"maximum context length of {ctx} tokens" in err["message"], err
    assert f"{len(PROMPT)} tokens from the input messages and {10**9} tokens for the completion" in err["message"]
    fits = ctx - len(PROMPT)
    status, err = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": fits + 1}})
    assert status == 400, err
    status, out = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})
    assert status == 200, out

    status, err = post(url, vllm.COMPLETIONS, {"prompt": PROMPT, "max_tokens": 10**9})
    assert status == 400 and err["error"]["param"] == "max_tokens", err
    status, err = post(url, vllm.COMPLETIONS, {"prompt": PROMPT, "max_tokens": fits + 1})
    assert status == 400 and err["error"]["param"] == "input_tokens", err
    assert err["error"]["message"].startswith(f"This model's maximum context length is {ctx} tokens. However, you "
                                              f"requested {fits + 1} output tokens")
    status, err = post(url, vllm.CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": "hi"}],
                                                    "max_completion_tokens": 10**9})
    assert status == 400 and err["error"]["param"] == "max_completion_tokens", err
