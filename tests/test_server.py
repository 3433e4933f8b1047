"""Built-in inference server over real HTTP, with real gloo weight pushes.

One server subprocess (tiny random Qwen3, CPU, one thread) serves the whole
module; the test process plays the trainer (rank 0 of the weight group).
Request bodies are validated against SGLang 0.5.23's OpenAPI schemas (it has
none for responses, so response shapes are checked against PROTOCOLS.md here,
with SGLang's own WeightVersionSpan schema for ``weight_versions``).
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from tests.server_procs import free_port, http_json, server_env, start_server
from torchtitan_grpo.weight_sync.buckets import TensorSpec, dtype_name, pack, plan_buckets
from torchtitan_grpo.weight_sync.group import init_weight_group

torch.set_num_threads(1)
jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[1]
OPENAPI = Path(os.environ.get("SGLANG_OPENAPI", Path(__file__).parent / "protocols" / "sglang-0.5.23-openapi.json"))
SPEC = json.loads(OPENAPI.read_text())

# Which request schema each route's body must satisfy.
REQUEST_SCHEMAS = {
    "/generate": "GenerateReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
}


def _validator(schema_name: str) -> "jsonschema.protocols.Validator":
    root = {"$ref": f"#/components/schemas/{schema_name}", "components": SPEC["components"]}
    return jsonschema.Draft202012Validator(root)


_VALIDATORS = {route: _validator(name) for route, name in REQUEST_SCHEMAS.items()}
_SPAN = _validator("WeightVersionSpan")

_LOGPROB = {"type": "array", "minItems": 3, "maxItems": 3,
            "prefixItems": [{"type": "number"}, {"type": "integer"}, {"type": ["string", "null"]}]}
SAMPLE_RESPONSE = {
    "type": "object",
    "required": ["text", "output_ids", "meta_info"],
    "properties": {
        "text": {"type": "string"},
        "output_ids": {"type": "array", "items": {"type": "integer"}},
        "meta_info": {
            "type": "object",
            "required": ["id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                         "weight_version", "e2e_latency"],
            "properties": {
                "id": {"type": "string"},
                "finish_reason": {"oneOf": [
                    {"type": "object", "required": ["type", "matched"], "properties": {"type": {"const": "stop"}}},
                    {"type": "object", "required": ["type", "length"],
                     "properties": {"type": {"const": "length"}, "length": {"type": "integer"}}},
                    {"type": "object", "required": ["type", "message"], "properties": {"type": {"const": "abort"}}},
                ]},
                "prompt_tokens": {"type": "integer"},
                "completion_tokens": {"type": "integer"},
                "cached_tokens": {"type": "integer"},
                "weight_version": {"type": "string"},
                "e2e_latency": {"type": "number"},
                "weight_versions": {"type": "array", "minItems": 2},
                "output_token_logprobs": {"type": "array", "items": _LOGPROB},
            },
        },
    },
}
_SAMPLE = jsonschema.Draft202012Validator(SAMPLE_RESPONSE)


def check_sample(s: dict) -> dict:
    _SAMPLE.validate(s)
    meta = s["meta_info"]
    assert meta["completion_tokens"] == len(s["output_ids"])
    if "output_token_logprobs" in meta:
        assert [t for _, t, _ in meta["output_token_logprobs"]] == s["output_ids"]
    for span in meta.get("weight_versions", []):
        _SPAN.validate(span)
    return s


# --------------------------------------------------------------------------- #
# HTTP and process helpers
# --------------------------------------------------------------------------- #


def http(url: str, path: str, body: dict | None = None, timeout: float = 60, raw: bytes | None = None,
         valid: bool = True):
    """POST ``body`` (GET when None); return (status, parsed JSON or None).

    ``valid=False`` sends a body SGLang's schema rejects (to test our 400s)."""
    if body is not None and path in _VALIDATORS and raw is None and valid:
        _VALIDATORS[path].validate(body)  # what we send is a valid SGLang request
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    return http_json(url + path, data, "POST" if data is not None else "GET", timeout)


def generate(url: str, body: dict, timeout: float = 60):
    status, out = http(url, "/generate", body, timeout)
    assert status == 200, out
    for s in out if isinstance(out, list) else [out]:
        check_sample(s)
    return out


def wait_until(cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def load(url: str) -> dict:
    return http(url, "/get_load")[1][0]


# --------------------------------------------------------------------------- #
# Fixtures
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def pool():
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        yield ex


def recompute_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / scale, dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34], [40]]
# Keep sampling on the 95 one-character tokens (ids 2..96) so text and ids line up.
NO_SPECIAL = {str(i): -100.0 for i in [0, 1, *range(97, 128)]}


# --------------------------------------------------------------------------- #
# Generation
# --------------------------------------------------------------------------- #


def test_request_schemas_reject_what_sglang_rejects():
    # The validation used by every request below is not vacuous.
    with pytest.raises(jsonschema.ValidationError):
        _VALIDATORS["/update_weights_from_distributed"].validate({"names": ["a"], "dtypes": ["float32"]})
    with pytest.raises(jsonschema.ValidationError):
        _VALIDATORS["/pause_generation"].validate({"mode": "sleep"})
    with pytest.raises(jsonschema.ValidationError):
        _SPAN.validate({"version": "v1", "start": 0})


def test_generate_single_prompt_fields(server):
    out = generate(server, {"input_ids": PROMPTS[0], "return_logprob": True,
                            "sampling_params": {"max_new_tokens": 6, **GREEDY}})
    assert isinstance(out, dict)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 7 and meta["completion_tokens"] == 6 and meta["cached_tokens"] == 0
    assert meta["weight_version"] == "default" and "weight_versions" not in meta
    assert all(lp <= 0 and text is None for lp, _, text in meta["output_token_logprobs"])
    # text in, text out (char-level tokenizer: one token per character)
    out = generate(server, {"text": "hello", "return_logprob": True, "return_text_in_logprobs": True,
                            "sampling_params": {"max_new_tokens": 3, **GREEDY}})
    assert out["meta_info"]["prompt_tokens"] == 5
    assert all(isinstance(text, str) for _, _, text in out["meta_info"]["output_token_logprobs"])
    # a batch of one is still a batch: list reply
    assert isinstance(generate(server, {"input_ids": [PROMPTS[1]], "sampling_params": {"max_new_tokens": 1}}), list)


def test_batch_and_n_are_prompt_major(server):
    body = {"input_ids": [PROMPTS[1], PROMPTS[0]], "rid": ["a", "b"],
            "sampling_params": {"max_new_tokens": 5, "n": 3, "temperature": 1.0, "sampling_seed": 7,
                                "ignore_eos": True}}
    out = generate(server, body)
    assert len(out) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 3, 3, 7, 7, 7]
    assert [o["meta_info"]["id"] for o in out] == ["a_0", "a_1", "a_2", "b_0", "b_1", "b_2"]
    assert [o["meta_info"]["cached_tokens"] for o in out] == [0, 3, 3, 0, 7, 7]  # one shared prefill
    assert len({tuple(o["output_ids"]) for o in out[:3]}) > 1  # samples differ...
    assert [o["output_ids"] for o in generate(server, body)] == [o["output_ids"] for o in out]  # ...reproducibly
    # per-prompt sampling params
    out = generate(server, {"input_ids": [PROMPTS[1], PROMPTS[0]],
                            "sampling_params": [{"max_new_tokens": 2, **GREEDY}, {"max_new_tokens": 4, **GREEDY}]})
    assert [o["meta_info"]["completion_tokens"] for o in out] == [2, 4]


def test_greedy_is_deterministic_and_batching_invisible(server, pool):
    sp = {"max_new_tokens": 12, **GREEDY}
    single = [generate(server, {"input_ids": p, "return_logprob": True, "sampling_params": sp}) for p in PROMPTS]
    batched = generate(server, {"input_ids": PROMPTS, "return_logprob": True, "sampling_params": sp})
    # concurrent requests that join a batch already decoding (different lengths)
    long = pool.submit(generate, server, {"input_ids": PROMPTS[0], "return_logprob": True,
                                          "sampling_params": {"max_new_tokens": 120, **GREEDY}})
    wait_until(lambda: load(server)["num_output_tokens"] > 3, what="the long request to decode")
    joined = list(pool.map(lambda p: generate(server, {"input_ids": p, "return_logprob": True,
                                                       "sampling_params": sp}), PROMPTS[1:]))
    assert not long.done()  # the short ones joined a batch that was still decoding
    long = long.result()
    assert long["output_ids"][:12] == single[0]["output_ids"]
    for ref, got in zip(single, batched):
        assert got["output_ids"] == ref["output_ids"]
    for ref, got in zip(single[1:], joined):
        assert got["output_ids"] == ref["output_ids"]
        ref_lp = [x[0] for x in ref["meta_info"]["output_token_logprobs"]]
        got_lp = [x[0] for x in got["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(ref_lp, got_lp)) < 1e-5
    greedy_n = generate(server, {"input_ids": PROMPTS[2], "sampling_params": {**sp, "n": 2}})
    assert greedy_n[0]["output_ids"] == greedy_n[1]["output_ids"]


def test_logprobs_match_transformers_forward(server, hf_model):
    for temperature in (0.0, 0.7):
        out = generate(server, {"input_ids": PROMPTS[:2], "return_logprob": True,
                                "sampling_params": {"max_new_tokens": 16, "temperature": temperature, "n": 2,
                                                    "top_p": 0.9, "top_k": 50, "ignore_eos": True}})
        for o, prompt in zip(out, [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2):
            got = [x[0] for x in o["meta_info"]["output_token_logprobs"]]
            ref = recompute_logprobs(hf_model, prompt, o["output_ids"], temperature)
            assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-4, temperature


def test_stop_conditions(server):
    base = generate(server, {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 10, **GREEDY}})
    ids = base["output_ids"]
    tok = ids[3]
    out = generate(server, {"input_ids": PROMPTS[0],
                            "sampling_params": {"max_new_tokens": 10, **GREEDY, "stop_token_ids": [tok]}})
    assert out["output_ids"] == ids[: ids.index(tok) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    # EOS (id 1) forced by a logit bias: stops unless ignore_eos; min_new_tokens holds it off
    eos = {"max_new_tokens": 3, "temperature": 0, "logit_bias": {"1": 100.0}}
    out = generate(server, {"input_ids": PROMPTS[0], "sampling_params": eos})
    assert out["output_ids"] == [1] and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 1}
    out = generate(server, {"input_ids": PROMPTS[0], "sampling_params": {**eos, "ignore_eos": True}})
    assert out["output_ids"] == [1, 1, 1] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    out = generate(server, {"input_ids": PROMPTS[0], "sampling_params": {**eos, "max_new_tokens": 5, "min_new_tokens": 2}})
    assert len(out["output_ids"]) == 3 and out["output_ids"][-1] == 1 and 1 not in out["output_ids"][:2]
    # stop strings (tokenizer side): output cut at the match, text trimmed
    base = generate(server, {"text": "abc", "sampling_params": {"max_new_tokens": 12, **GREEDY,
                                                                "logit_bias": NO_SPECIAL}})
    stop = base["text"][4:6]
    out = generate(server, {"text": "abc", "sampling_params": {"max_new_tokens": 12, **GREEDY, "stop": [stop],
                                                               "logit_bias": NO_SPECIAL}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert base["text"].startswith(out["text"]) and stop not in out["text"]
    assert base["output_ids"][: len(out["output_ids"])] == out["output_ids"]


def test_client_disconnect_aborts_its_generation(server, pool):
    long = {"input_ids": [40], "sampling_params": {"max_new_tokens": 500, **GREEDY}}
    host, port = server.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    payload = json.dumps(long).encode()
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    wait_until(lambda: load(server)["num_reqs"] == 1, what="the first request to run")
    kept = pool.submit(generate, server, long)
    wait_until(lambda: load(server)["num_reqs"] == 2, what="both requests to run")
    sock.close()
    # The abandoned one leaves the batch long before the kept one (same length) is done.
    wait_until(lambda: load(server)["num_reqs"] == 1, what="the abandoned request to be aborted")
    assert load(server)["num_output_tokens"] < 450
    assert kept.result(timeout=60)["meta_info"]["completion_tokens"] == 500


def test_truncation_extremes_reduce_to_greedy(server):
    base = generate(server, {"input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": 8, **GREEDY}})
    for extra in ({"top_k": 1}, {"top_p": 1e-9}, {"min_p": 1.0}):
        out = generate(server, {"input_ids": PROMPTS[2], "return_logprob": True,
                                "sampling_params": {"max_new_tokens": 8, "temperature": 1.3, "ignore_eos": True, **extra}})
        assert out["output_ids"] == base["output_ids"], extra
        # logprobs come from the untruncated distribution (a truncated one would say 0)
        assert all(lp < -0.01 for lp, _, _ in out["meta_info"]["output_token_logprobs"]), extra


def test_bad_requests_are_400_naming_the_field(server):
    status, body = http(server, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_tokens": 4}})
    assert status == 400 and body["object"] == "error" and "max_tokens" in body["message"]
    status, body = http(server, "/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": -1}})
    assert status == 400 and "temperature" in body["message"]
    status, body = http(server, "/generate", {"sampling_params": {"max_new_tokens": 1}})
    assert status == 400 and "'text' and 'input_ids'" in body["message"]
    # both given: SGLang uses the ids (a text of "x" would be one character token)
    status, body = http(server, "/generate", {"input_ids": [1, 2, 3], "text": "x",
                                              "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and body["meta_info"]["prompt_tokens"] == 3, body
    status, body = http(server, "/generate", {"input_ids": [1, 100000]})
    assert status == 400 and "100000" in body["message"]
    status, body = http(server, "/generate", {"input_ids": [[1], [2]], "sampling_params": [{}]})
    assert status == 400 and "sampling_params" in body["message"]
    status, body = http(server, "/generate", None, raw=b"{not json")
    assert status == 400 and "JSON" in body["message"]
    status, body = http(server, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                              "world_size": 2}, raw=b'{"master_port": 1}')
    assert status == 400 and "master_address" in body["message"]


# --------------------------------------------------------------------------- #
# Bounded and strict requests (issue 27)
# --------------------------------------------------------------------------- #

MB = 1 << 20


def _post_until_answered(url: str, path: str, headers: dict[str, str],
                         chunks: Iterator[bytes]) -> tuple[int, dict, socket.socket]:
    """POST a body chunk by chunk, sending no more once a reply is readable;
    returns (status, JSON reply, the still open connection)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)  # a hang guard only
    head = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
            *(f"{k}: {v}" for k, v in headers.items())]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    for chunk in chunks:
        if select.select([sock], [], [], 0)[0]:
            break
        sock.sendall(chunk)
    reply = sock.makefile("rb")
    status = int(reply.readline().split()[1])
    length = 0
    while line := reply.readline().strip():
        key, _, value = line.decode().partition(":")
        if key.lower() == "content-length":
            length = int(value)
    return status, json.loads(reply.read(length)), sock


def test_a_100mb_body_is_refused_unread_and_health_keeps_answering(server):
    """A 100 MB /generate body: 413 from its declared length, answered while
    99 of its 100 MB were never sent (so nothing waited for, buffered or
    tokenised them); /health answers meanwhile and the server lives on."""
    junk = b"\xff" * MB  # not even UTF-8
    status, body, sock = _post_until_answered(server, "/generate", {"Content-Length": str(100 * MB)}, iter([junk]))
    try:
        assert status == 413 and body["object"] == "error" and "larger than this route takes" in body["message"]
        assert http(server, "/health", timeout=10)[0] == 200  # the upload's connection still open
    finally:
        sock.close()
    # Chunked (no declared length): read only until it passes the route's limit.
    framed = (f"{MB:x}\r\n".encode() + junk + b"\r\n" for _ in range(100))
    status, body, sock = _post_until_answered(server, "/generate", {"Transfer-Encoding": "chunked"}, framed)
    try:
        assert status == 413 and "larger than this route takes" in body["message"], body
        assert http(server, "/health", timeout=10)[0] == 200
    finally:
        sock.close()
    assert http(server, "/health", timeout=10)[0] == 200
    generate(server, {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 2, **GREEDY}})


def test_bodies_and_fields_of_the_wrong_type_are_400_naming_them(server):
    def refused(body: dict | None, *words: str, raw: bytes | None = None, path: str = "/generate") -> None:
        status, out = http(server, path, body, raw=raw, valid=False)
        assert status == 400 and out["object"] == "error", (words, status, out)
        for w in words:
            assert w in out["message"], (w, out["message"])

    binary = bytes(range(256)) * 64  # byte 128 is no UTF-8
    refused(None, "request body is not UTF-8", "byte 128", raw=binary)
    refused(None, "request body is not UTF-8", raw=binary, path="/init_weights_update_group")
    refused(None, "must be a JSON object", raw=b"[1, 2]")
    refused(None, "nested too deeply", raw=b"[" * 100_000)
    refused(None, "not valid JSON", raw=b'{"input_ids": [' + b"1" * 5000 + b"]}")
    p = PROMPTS[1]
    refused({"text": 5}, "field 'text' must be a string")
    refused({"input_ids": p, "sampling_params": 3}, "sampling_params must be an object")
    refused({"input_ids": p, "sampling_params": ""}, "sampling_params must be an object")
    # SGLang's request validation takes booleans only: "yes" is refused, not read as true.
    refused({"input_ids": p, "return_logprob": "yes"}, "field 'return_logprob' must be a boolean")
    refused({"input_ids": [p, p], "return_logprob": [True, 1]}, "field 'return_logprob[1]' must be a boolean")
    refused({"input_ids": [p, p], "return_logprob": [True]}, "'return_logprob' has 1 entries for 2 prompt(s)")
    refused({"input_ids": p, "return_text_in_logprobs": 1}, "'return_text_in_logprobs' must be a boolean")
    refused({"input_ids": p, "stream": "no"}, "field 'stream' must be a boolean")
    refused({"input_ids": p, "rid": 7}, "field 'rid' must be a string")
    refused({"input_ids": p, "top_logprobs_num": "2"}, "'top_logprobs_num' must be an integer")
    refused({"input_ids": p, "logprob_start_len": "0"}, "'logprob_start_len' must be an integer")
    refused({"input_ids": p, "sampling_params": {"sampling_seed": 2**70}}, "sampling_seed", "64-bit")
    refused({"input_ids": p, "sampling_params": {"n": 10**9}}, "sampling_params.n must be an integer in [1, 4096]")
    # Prompts are bounded by the context before they are scanned or tokenised
    # (tiny model: 512 tokens, so at most 32 * 512 characters of text).
    refused({"text": "a" * 20_000}, "field 'text' has 20000 characters", "not tokenised")
    refused({"text": ["ab", "a" * 20_000]}, "field 'text[1]' has 20000 characters")
    refused({"input_ids": [5] * 600}, "field 'input_ids' has 600 tokens", "context is 512")
    refused({"input_ids": [p, [5] * 600]}, "field 'input_ids[1]' has 600 tokens")
    # A body past the off-loop threshold (whitespace counts) is parsed all the same.
    padded = b" " * (300 * 1024) + json.dumps({"input_ids": p, "sampling_params": {"max_new_tokens": 2}}).encode()
    status, out = http(server, "/generate", None, raw=padded)
    assert status == 200 and out["meta_info"]["completion_tokens"] == 2, out


def test_abort_request(server, pool):
    long = {"input_ids": PROMPTS[3], "rid": "to-abort", "sampling_params": {"max_new_tokens": 400, **GREEDY}}
    running = pool.submit(generate, server, long)
    wait_until(lambda: load(server)["num_output_tokens"] > 3, what="decoding")
    status, body = http(server, "/abort_request", {"rid": "to-abort"})
    assert status == 200 and body == {"success": True, "message": "aborted 1 request(s)"}, body
    out = running.result(timeout=60)
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["id"] == "to-abort"
    assert 0 < out["meta_info"]["completion_tokens"] < 400
    assert http(server, "/abort_request", {"rid": "no-such-request"})[1]["message"] == "aborted 0 request(s)"
    assert http(server, "/abort_request", {"abort_all": True})[1]["message"] == "aborted 0 request(s)"
    status, body = http(server, "/abort_request", {})
    assert status == 400 and "'rid' or 'abort_all'" in body["message"]
    status, body = http(server, "/abort_request", {"rid": 5})
    assert status == 400 and "field 'rid' must be a string" in body["message"]


def test_get_weights_by_name_errors(server):
    for query, words in [("name=model.no_such.weight", "unknown parameter 'model.no_such.weight'"),
                         ("truncate_size=2", "missing required field 'name'"),
                         ("name=model.norm.weight&truncate_size=two", "field 'truncate_size' must be an integer")]:
        status, body = http(server, f"/get_weights_by_name?{query}")
        assert status == 400 and words in body["message"], (query, body)
    for raw, words in [(b"{not json", "not valid JSON"), (b'{"name": 5}', "field 'name' must be a string"),
                       (b'{"name": "model.norm.weight", "truncate_size": "2"}', "'truncate_size' must be an integer")]:
        status, body = http(server, "/get_weights_by_name", None, raw=raw)
        assert status == 400 and words in body["message"], (raw, body)
    status, values = http(server, "/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 2})
    assert status == 200 and len(values) == 2


def test_update_from_disk_errors(server, model_dir, tmp_path):
    """A bad request shape is refused with nothing received (the session goes
    on); a path that yields no weights fails the session (it loads nothing)."""
    version = http(server, "/model_info")[1]["weight_version"]
    empty = tmp_path / "empty"
    empty.mkdir()
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 64)
    cases = [  # (body, words, whether the session fails)
        ({"model_path": str(tmp_path / "missing")}, "is not a directory", True),
        ({"model_path": str(empty)}, "no *.safetensors files", True),
        ({"model_path": str(corrupt)}, "cannot read weights", True),
        ({"model_path": model_dir, "load_format": "pt"}, "field 'load_format' must be null, 'auto' or 'safetensors'",
         False),
    ]
    for body, words, fails in cases:
        assert http(server, "/begin_weight_update", {})[1]["success"]
        status, out = http(server, "/update_weights_from_disk", body, valid=False)
        assert status == 400 and not out["success"] and words in out["message"], (words, out)
        status, out = http(server, "/end_weight_update", {})
        assert out["success"] != fails and (fails or "loaded 0 tensor(s)" in out["message"]), (words, out)
    assert http(server, "/begin_weight_update", {})[1]["success"]
    status, out = http(server, "/update_weights_from_disk", {"model_path": 5}, valid=False)
    assert status == 400 and "field 'model_path' must be a string" in out["message"]
    assert http(server, "/end_weight_update", {})[1]["success"]
    assert http(server, "/model_info")[1]["weight_version"] == version


# --------------------------------------------------------------------------- #
# Weight push over gloo
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("field, value, words", [
    ("names", ["model.norm.weight", None], ["field 'names[1]' must be a string"]),
    ("dtypes", ["float32", "torch.bfloat16"], ["field 'dtypes[1]' (tensor 'b')", "bare name 'bfloat16'"]),
    ("shapes", [[64], [2, -3]], ["field 'shapes[1]' (tensor 'b')", "non-negative"]),
    ("shapes", [[64], [2, True]], ["field 'shapes[1]' (tensor 'b')"]),
    ("names", ["a"], ["fields 'names', 'dtypes' and 'shapes' differ in length (1, 2, 2)"]),
])
def test_update_metadata_is_refused_naming_the_field(field, value, words):
    """SGLang's ``names``/``dtypes``/``shapes``, checked before any receive is posted."""
    from torchtitan_grpo.server.routes.sglang_weights import _Refused, _tensor_specs

    good = {"names": ["a", "b"], "dtypes": ["float32", "bfloat16"], "shapes": [[64], [2, 3]]}
    specs = _tensor_specs(**good)
    assert [(s.name, s.dtype, s.shape) for s in specs] == [("a", torch.float32, (64,)), ("b", torch.bfloat16, (2, 3))]
    with pytest.raises(_Refused) as e:
        _tensor_specs(**{**good, field: value})
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_weight_groups_coexist_beside_default_group():
    """Two groups in one process (the trainer serving two replicas), no default group."""
    ports = [free_port(), free_port()]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        peers = [ex.submit(init_weight_group, "127.0.0.1", p, 1, 2, "gloo", f"g{i}", 30) for i, p in enumerate(ports)]
        mine = [init_weight_group("127.0.0.1", p, 0, 2, "gloo", f"g{i}", 30) for i, p in enumerate(ports)]
        peers = [f.result(timeout=30) for f in peers]
        for step in range(3):
            for i in (1, 0):  # interleaved across groups
                value = torch.full((5,), float(10 * i + step))
                got = ex.submit(peers[i].broadcast, torch.zeros(5))
                mine[i].broadcast(value.clone())
                assert torch.equal(got.result(timeout=30), value)
    assert not torch.distributed.is_initialized()
    for g in mine + peers:
        g.close()
    with pytest.raises(Exception):  # no rank 0 ever comes: a clear failure, not a hang
        init_weight_group("127.0.0.1", free_port(), 1, 2, timeout_s=1.5)


def _push(pool, url, group, body: dict, tensors: list[torch.Tensor], probe: bool = False):
    """The trainer side: the HTTP call in flight while rank 0 broadcasts."""
    reply = pool.submit(http, url, "/update_weights_from_distributed", body)
    if probe:
        # The server now waits in its receive, off the event loop: HTTP still answers.
        time.sleep(0.3)
        assert http(url, "/health", timeout=5)[0] == 200
        assert http(url, "/model_info", timeout=5)[0] == 200
        assert not reply.done()
    for t in tensors:
        group.broadcast(t.contiguous(), src=0)
    return reply.result(timeout=60)


def _weights(url: str, name: str) -> torch.Tensor:
    status, values = http(url, f"/get_weights_by_name?name={name}&truncate_size=100000")
    assert status == 200, values
    return torch.tensor(values)


def test_gloo_weight_push(server, model_dir, pool, hf_model):
    from safetensors.torch import load_file

    original = load_file(os.path.join(model_dir, "model.safetensors"))
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "wg", "backend": "gloo"}
    reply = pool.submit(http, server, "/init_weights_update_group", init)
    group = init_weight_group("127.0.0.1", port, 0, 2, backend="gloo", group_name="wg", timeout_s=60)
    status, body = reply.result(timeout=60)
    assert status == 200 and body["success"], body
    status, body = http(server, "/init_weights_update_group", init)
    assert status == 400 and "already exists" in body["message"]

    g = torch.Generator().manual_seed(1)
    names = ["model.norm.weight", "model.layers.0.mlp.up_proj.weight"]
    new = {n: torch.randn(original[n].shape, generator=g) for n in names}
    upd = {"names": names, "dtypes": ["float32"] * 2, "shapes": [list(new[n].shape) for n in names],
           "group_name": "wg", "weight_version": "v1"}

    # Without a session: refused at once and nothing is received (the exchange
    # below would desynchronise if a receive had been posted).
    t0 = time.monotonic()
    status, body = http(server, "/update_weights_from_distributed", upd, timeout=10)
    assert status == 400 and not body["success"] and "begin_weight_update" in body["message"]
    assert time.monotonic() - t0 < 30  # no receive posted: no wait for the 300 s group timeout
    assert http(server, "/end_weight_update", {})[0] == 400
    assert http(server, "/begin_weight_update", {})[1]["success"]
    status, body = http(server, "/begin_weight_update", {})
    assert status == 400 and "already open" in body["message"]

    # per tensor: one broadcast per name, in order. Nothing is loaded before
    # /end_weight_update: the session's buckets become one version at once.
    status, body = _push(pool, server, group, upd, [new[n] for n in names], probe=True)
    assert status == 200 and body["success"], body
    assert torch.equal(_weights(server, "model.norm.weight"), original["model.norm.weight"])
    assert http(server, "/model_info")[1]["weight_version"] != "v1"
    status, body = http(server, "/end_weight_update", {})
    assert status == 200 and "loaded 2 tensor(s)" in body["message"], body
    for n in names:
        assert torch.equal(_weights(server, n), new[n])
    assert http(server, "/model_info")[1]["weight_version"] == "v1"
    out = generate(server, {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 2}})
    assert out["meta_info"]["weight_version"] == "v1"
    truncated = http(server, "/get_weights_by_name?name=model.layers.0.mlp.up_proj.weight&truncate_size=3")[1]
    assert torch.equal(torch.tensor(truncated), new[names[1]][:3])

    # flattened bucket: mixed dtypes in one uint8 broadcast (server casts to its fp32)
    bucket_tensors = {
        "model.layers.1.self_attn.q_norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(128, 64, generator=g).to(torch.bfloat16),
        "model.layers.1.mlp.down_proj.weight": torch.randn(64, 256, generator=g),
    }
    (bucket,) = plan_buckets([TensorSpec.of(n, t) for n, t in bucket_tensors.items()], 1 << 30)
    assert bucket[0].dtype == torch.float32  # itemsize order keeps offsets aligned
    flat = {"names": [s.name for s in bucket], "dtypes": [dtype_name(s.dtype) for s in bucket],
            "shapes": [list(s.shape) for s in bucket], "group_name": "wg", "weight_version": "v2",
            "load_format": "flattened_bucket", "flush_cache": True}
    assert http(server, "/begin_weight_update", {})[1]["success"]
    status, body = _push(pool, server, group, flat, [pack([bucket_tensors[s.name] for s in bucket])])
    assert status == 200 and body["success"], body
    assert http(server, "/end_weight_update", {})[1]["success"]
    for n, t in bucket_tensors.items():
        assert torch.equal(_weights(server, n), t.float())

    # The same bucket without a version, twice (parsed once, then kept): the
    # version comes with the end (our extension, in /model_info), and each
    # session loads its own bytes. A bad version there is refused by name and
    # leaves the session open.
    assert http(server, "/model_info")[1]["end_weight_version"] is True
    unversioned = {k: v for k, v in flat.items() if k != "weight_version"}
    for v, scale in (("v2b", 2.0), ("v2", 1.0)):
        assert http(server, "/begin_weight_update", {})[1]["success"]
        scaled = [bucket_tensors[s.name] * scale for s in bucket]
        status, body = _push(pool, server, group, unversioned, [pack(scaled)])
        assert status == 200 and body["success"], body
        status, body = http(server, "/end_weight_update", {"weight_version": 2}, valid=False)
        assert status == 400 and "weight_version" in body["message"], body
        status, body = http(server, "/end_weight_update", {"weight_version": v})
        assert status == 200 and body["success"], body
        assert http(server, "/model_info")[1]["weight_version"] == v
        for s_, t in zip(bucket, scaled):
            assert torch.equal(_weights(server, s_.name), t.float())

    # the pushed weights are the ones generating: compare with a local copy
    local = {k: v.clone() for k, v in hf_model.state_dict().items()}
    local.update(new)
    local.update({n: t.float() for n, t in bucket_tensors.items()})
    hf_model.load_state_dict(local)
    try:
        out = generate(server, {"input_ids": PROMPTS[0], "return_logprob": True,
                                "sampling_params": {"max_new_tokens": 8, **GREEDY}})
        ref = recompute_logprobs(hf_model, PROMPTS[0], out["output_ids"], 0.0)
        assert max(abs(a[0] - b) for a, b in zip(out["meta_info"]["output_token_logprobs"], ref)) <= 1e-4
        assert out["meta_info"]["weight_version"] == "v2"
    finally:
        hf_model.load_state_dict(original, strict=False)

    # refused after receiving: unknown name / wrong shape. The group stays in
    # step, and the session, whatever else it received, loads nothing.
    assert http(server, "/begin_weight_update", {})[1]["success"]
    fine = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[128, 64]], "group_name": "wg"}
    status, body = _push(pool, server, group, fine, [torch.zeros(128, 64)])
    assert status == 200 and body["success"], body
    bad = [("model.norm.weight", torch.zeros(64)), ("model.no_such.weight", torch.zeros(3))]
    body_bad = {"names": [n for n, _ in bad], "dtypes": ["float32"] * 2, "shapes": [[64], [3]],
                "group_name": "wg", "weight_version": "bad"}
    status, body = _push(pool, server, group, body_bad, [t for _, t in bad])
    assert status == 400 and not body["success"] and "model.no_such.weight" in body["message"]
    status, body = _push(pool, server, group, {**body_bad, "names": ["model.norm.weight"], "dtypes": ["float32"],
                                               "shapes": [[32]]}, [torch.zeros(32)])
    assert status == 400 and "model.norm.weight" in body["message"] and "shape" in body["message"]
    status, body = http(server, "/update_weights_from_distributed", {**upd, "dtypes": ["torch.float32"] * 2})
    assert status == 400 and "dtypes[0]" in body["message"]  # refused before any receive
    status, body = http(server, "/end_weight_update", {})
    assert status == 400 and "nothing loaded" in body["message"] and "model.no_such.weight" in body["message"]
    assert torch.equal(_weights(server, "model.norm.weight"), new["model.norm.weight"])
    assert torch.equal(_weights(server, "lm_head.weight"), bucket_tensors["lm_head.weight"].float())
    assert http(server, "/model_info")[1]["weight_version"] == "v2"

    # an abandoned session (the trainer destroys the group mid-version) loads nothing either
    assert http(server, "/begin_weight_update", {})[1]["success"]
    status, body = _push(pool, server, group, fine, [torch.zeros(128, 64)])
    assert status == 200 and body["success"], body
    assert http(server, "/destroy_weights_update_group", {"group_name": "wg"})[1]["success"]
    assert http(server, "/destroy_weights_update_group", {"group_name": "wg"})[0] == 400
    status, body = http(server, "/end_weight_update", {})
    assert status == 400 and "destroyed" in body["message"]
    assert torch.equal(_weights(server, "lm_head.weight"), bucket_tensors["lm_head.weight"].float())
    group.close()

    # disk path (same session rules) puts the checkpoint back for later tests
    assert http(server, "/update_weights_from_disk", {"model_path": model_dir})[0] == 400  # no session
    http(server, "/begin_weight_update", {})
    status, body = http(server, "/update_weights_from_disk", {"model_path": model_dir, "weight_version": "disk"})
    assert status == 200 and body["success"] and body["num_paused_requests"] == 0, body
    http(server, "/end_weight_update", {})
    for n in ["model.norm.weight", "lm_head.weight"]:
        assert torch.equal(_weights(server, n), original[n])
    assert http(server, "/model_info")[1]["weight_version"] == "disk"


def test_generation_between_buckets_runs_the_old_weights_whole(server, model_dir, pool):
    """A session's buckets are loaded together by /end_weight_update: a
    request served between two buckets (generation not paused) runs the old
    version, every weight of it, and the new version applies all at once."""
    from safetensors.torch import load_file

    original = load_file(os.path.join(model_dir, "model.safetensors"))
    port = free_port()
    reply = pool.submit(http, server, "/init_weights_update_group",
                        {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                         "group_name": "wg-half", "backend": "gloo"})
    group = init_weight_group("127.0.0.1", port, 0, 2, backend="gloo", group_name="wg-half", timeout_s=60)
    assert reply.result(timeout=60)[1]["success"]
    req = {"input_ids": PROMPTS[0], "return_logprob": True, "sampling_params": {"max_new_tokens": 6, **GREEDY}}
    old_version = http(server, "/model_info")[1]["weight_version"]
    before = generate(server, req)
    g = torch.Generator().manual_seed(7)
    buckets = [("lm_head.weight", torch.randn(original["lm_head.weight"].shape, generator=g) * 3),
               ("model.norm.weight", torch.randn(original["model.norm.weight"].shape, generator=g))]

    def send(name: str, t: torch.Tensor, version: str | None) -> None:
        body = {"names": [name], "dtypes": ["float32"], "shapes": [list(t.shape)], "group_name": "wg-half",
                "weight_version": version}
        status, out = _push(pool, server, group, body, [t])
        assert status == 200 and out["success"], out

    try:
        assert http(server, "/begin_weight_update", {})[1]["success"]
        send(*buckets[0], None)
        between = generate(server, req)
        assert between["output_ids"] == before["output_ids"]
        assert between["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
        assert between["meta_info"]["weight_version"] == old_version
        send(*buckets[1], "whole")
        assert http(server, "/end_weight_update", {})[1]["success"]
        after = generate(server, req)
        assert after["meta_info"]["weight_version"] == "whole"
        assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
        for name, t in buckets:
            assert torch.equal(_weights(server, name), t)
    finally:  # the checkpoint back, under its old version, for the other tests
        http(server, "/end_weight_update", {})
        assert http(server, "/begin_weight_update", {})[1]["success"]
        for i, (name, _) in enumerate(buckets):
            send(name, original[name], old_version if i == len(buckets) - 1 else None)
        assert http(server, "/end_weight_update", {})[1]["success"]
        assert http(server, "/destroy_weights_update_group", {"group_name": "wg-half"})[1]["success"]
        group.close()
    assert generate(server, req)["output_ids"] == before["output_ids"]


# --------------------------------------------------------------------------- #
# Pause / continue and versions
# --------------------------------------------------------------------------- #


def test_unpaused_update_waits_for_running_requests(server, model_dir, pool):
    before = http(server, "/model_info")[1]["weight_version"]
    running = pool.submit(generate, server, {"input_ids": PROMPTS[3], "sampling_params": {"max_new_tokens": 200, **GREEDY}})
    wait_until(lambda: load(server)["num_output_tokens"] > 3, what="decoding")
    http(server, "/begin_weight_update", {})
    status, body = http(server, "/update_weights_from_disk", {"model_path": model_dir, "weight_version": "after"})
    assert status == 200 and body["success"]  # received; loaded when the session ends
    ended = pool.submit(http, server, "/end_weight_update", {})
    # Applied only once the request had finished: every token is from the old version.
    out = running.result(timeout=60)
    assert out["meta_info"]["weight_version"] == before and "weight_versions" not in out["meta_info"]
    assert out["meta_info"]["completion_tokens"] == 200
    status, body = ended.result(timeout=60)
    assert status == 200 and body["success"], body
    assert http(server, "/model_info")[1]["weight_version"] == "after"


def test_pause_modes(server, pool):
    long = {"input_ids": PROMPTS[3], "sampling_params": {"max_new_tokens": 300, **GREEDY}}
    baseline = generate(server, long)["output_ids"]
    for mode in ("in_place", "retract"):
        version = http(server, "/model_info")[1]["weight_version"]
        running = pool.submit(generate, server, long)
        wait_until(lambda: load(server)["num_output_tokens"] > 3, what="decoding")
        status, body = http(server, "/pause_generation", {"mode": mode})
        assert status == 200 and body["success"], body
        frozen = load(server)["num_output_tokens"]
        waiting = pool.submit(generate, server, {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 2}})
        time.sleep(0.4)
        assert not running.done() and not waiting.done()  # paused, and new work waits (not rejected)
        assert load(server)["num_output_tokens"] == frozen
        assert http(server, "/health")[0] == 200 and http(server, "/health_generate")[0] == 200
        new_version = f"{version}-{mode}"
        assert http(server, "/update_weight_version", {"new_version": new_version, "abort_all_requests": False})[1]["success"]
        assert http(server, "/continue_generation", {})[1]["success"]
        out, late = running.result(timeout=60), waiting.result(timeout=60)
        assert out["output_ids"] == baseline  # same weights: resuming changes nothing
        spans = out["meta_info"]["weight_versions"]
        assert [s["version"] for s in spans] == [version, new_version]
        assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] == frozen and spans[1]["end"] == 300
        assert out["meta_info"]["weight_version"] == new_version
        assert late["meta_info"]["weight_version"] == new_version and "weight_versions" not in late["meta_info"]

    running = pool.submit(generate, server, long)
    wait_until(lambda: load(server)["num_output_tokens"] > 3, what="decoding")
    assert http(server, "/pause_generation", {})[1]["success"]  # default mode: abort
    out = running.result(timeout=30)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 300 and out["output_ids"] == baseline[: len(out["output_ids"])]
    assert http(server, "/continue_generation", {})[1]["success"]
    assert http(server, "/pause_generation", {"mode": "nap"}, valid=False)[0] == 400
    assert http(server, "/flush_cache", {})[1]["success"]


# --------------------------------------------------------------------------- #
# Start-up failures
# --------------------------------------------------------------------------- #


def test_bad_model_dir_exits_nonzero(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    cases = [(tmp_path / "missing", "does not exist"), (broken, "cannot load model")]
    procs = [
        subprocess.Popen([sys.executable, "-m", "torchtitan_grpo.server", "--model", str(d),
                          "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=server_env(), cwd=REPO)
        for d, _ in cases
    ]
    for p, (d, expected) in zip(procs, cases):
        out, err = p.communicate(timeout=60)
        assert p.returncode != 0
        assert expected in err.decode() and str(d) in err.decode()
        assert b"ready" not in out


# --------------------------------------------------------------------------- #
# NCCL (GPU machines only)
# --------------------------------------------------------------------------- #


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and torch.distributed.is_nccl_available()),
    reason="needs 2 CUDA GPUs and NCCL",
)
def test_nccl_weight_push_two_gpus(model_dir, tmp_path, pool):
    """Trainer rank 0 on cuda:0, a bf16 server on cuda:1, SGLang's push sequence."""
    proc, url = start_server(model_dir, tmp_path / "gpu-server.log", "--device", "cuda:1", "--dtype", "bfloat16")
    try:
        out = generate(url, {"input_ids": PROMPTS, "return_logprob": True, "sampling_params": {"max_new_tokens": 8, **GREEDY}})
        assert http(url, "/model_info")[1]["device"] == "cuda:1"
        port = free_port()
        reply = pool.submit(http, url, "/init_weights_update_group",
                            {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                             "world_size": 2, "group_name": "nccl-wg", "backend": "nccl"})
        group = init_weight_group("127.0.0.1", port, 0, 2, backend="nccl", group_name="nccl-wg",
                                  timeout_s=120, device="cuda:0")
        status, body = reply.result(timeout=120)
        assert status == 200 and body["success"], body
        assert http(url, "/pause_generation", {"mode": "retract"})[1]["success"]
        assert http(url, "/begin_weight_update", {})[1]["success"]
        g = torch.Generator().manual_seed(3)
        names = ["model.norm.weight", "model.layers.0.self_attn.q_proj.weight"]
        shapes = [[64], [64, 64]]
        new = {n: torch.randn(sh, generator=g).to(torch.bfloat16) for n, sh in zip(names, shapes)}
        status, body = _push(pool, url, group, {"names": names, "dtypes": ["bfloat16"] * 2, "shapes": shapes,
                                                "group_name": "nccl-wg", "flush_cache": False},
                             [new[n].cuda(0) for n in names], probe=True)
        assert status == 200 and body["success"], body
        bucket_tensors = {"lm_head.weight": torch.randn(128, 64, generator=g).to(torch.bfloat16),
                          "model.layers.1.self_attn.k_norm.weight": torch.randn(16, generator=g)}
        (bucket,) = plan_buckets([TensorSpec.of(n, t) for n, t in bucket_tensors.items()], 1 << 20)
        flat = pack([bucket_tensors[sp.name].cuda(0) for sp in bucket])
        stream = torch.cuda.Stream(device=0)
        reply = pool.submit(http, url, "/update_weights_from_distributed",
                            {"names": [sp.name for sp in bucket], "dtypes": [dtype_name(sp.dtype) for sp in bucket],
                             "shapes": [list(sp.shape) for sp in bucket], "group_name": "nccl-wg",
                             "load_format": "flattened_bucket", "weight_version": "gpu-v1"})
        group.broadcast(flat, src=0, stream=stream)
        status, body = reply.result(timeout=120)
        assert status == 200 and body["success"], body
        assert http(url, "/end_weight_update", {})[1]["success"]
        assert http(url, "/continue_generation", {})[1]["success"]
        for n, t in {**new, **bucket_tensors}.items():
            assert torch.equal(_weights(url, n), t.to(torch.bfloat16).float()), n
        after = generate(url, {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 4, **GREEDY}})
        assert after["meta_info"]["weight_version"] == "gpu-v1"
        assert len(out) == len(PROMPTS)
        # ?ack=posted: answered with no byte sent, loaded at the end once they are in.
        bucket_tensors = {n: -t for n, t in bucket_tensors.items()}
        flat = pack([bucket_tensors[sp.name].cuda(0) for sp in bucket])
        assert http(url, "/begin_weight_update", {})[1]["success"]
        status, body = http(url, "/update_weights_from_distributed?ack=posted",
                            {"names": [sp.name for sp in bucket], "dtypes": [dtype_name(sp.dtype) for sp in bucket],
                             "shapes": [list(sp.shape) for sp in bucket], "group_name": "nccl-wg",
                             "load_format": "flattened_bucket", "weight_version": "gpu-v1"}, timeout=30)
        assert status == 200 and body["success"], body
        ended = pool.submit(http, url, "/end_weight_update", {})
        time.sleep(0.5)
        assert not ended.done()  # waits for the bytes
        group.broadcast(flat, src=0, stream=stream)
        assert ended.result(timeout=60)[1]["success"]
        for n, t in {**new, **bucket_tensors}.items():
            assert torch.equal(_weights(url, n), t.to(torch.bfloat16).float()), n
        # A transfer abandoned mid-bucket (the trainer stops sending): destroying
        # the group ends the replica's stuck NCCL receive at once, not at the
        # group timeout, and nothing of the session is loaded.
        assert http(url, "/begin_weight_update", {})[1]["success"]
        stuck = pool.submit(http, url, "/update_weights_from_distributed",
                            {"names": [sp.name for sp in bucket], "dtypes": [dtype_name(sp.dtype) for sp in bucket],
                             "shapes": [list(sp.shape) for sp in bucket], "group_name": "nccl-wg",
                             "load_format": "flattened_bucket", "weight_version": "gpu-v2"})
        time.sleep(2)  # the replica is now in its receive
        t0 = time.monotonic()
        assert http(url, "/destroy_weights_update_group", {"group_name": "nccl-wg"})[1]["success"]
        status, body = stuck.result(timeout=30)
        assert time.monotonic() - t0 < 20, "destroy waited for the receive's timeout"
        assert not body["success"] and "nccl-wg" in body["message"], body
        status, body = http(url, "/end_weight_update", {})
        assert not body["success"] and "nothing loaded" in body["message"], body
        for n, t in {**new, **bucket_tensors}.items():
            assert torch.equal(_weights(url, n), t.to(torch.bfloat16).float()), n
        assert http(url, "/model_info")[1]["weight_version"] == "gpu-v1"
        group.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (tmp_path / "gpu-server.log").read_text()[-3000:]


def test_adopt_decided_while_receiving_is_what_install_weights_would_decide():
    """``adoptable`` decides from an update's specs alone (the parameter's
    dtype, shape and device) what ``install_weights`` decides from the
    received tensors; with those flags the load only swaps or copies, and a
    session that received an update without flags checks at load time."""
    from torchtitan_grpo.server.engine.weights import PendingVersion, adoptable, install_weights
    from torchtitan_grpo.weight_sync.buckets import TensorSpec, unpack

    params = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16), "c": torch.zeros(5)}
    specs = [TensorSpec("a", torch.float32, (2, 3)), TensorSpec("b", torch.float32, (4,)),
             TensorSpec("c", torch.float32, (5,))]
    assert adoptable(params, specs, torch.device("cpu")) == [True, False, True]
    assert adoptable(params, specs, torch.device("meta")) == [False, False, False]  # another device: copied
    buf = torch.arange(15.0).view(torch.uint8)  # a flattened bucket as receive_weights gets it
    named = list(zip(["a", "b", "c"], unpack(buf, specs)))
    b_ptr = params["b"].data_ptr()
    install_weights(params, named, adoptable(params, specs, torch.device("cpu")))
    assert params["a"].data_ptr() == named[0][1].data_ptr() and params["c"].data_ptr() == named[2][1].data_ptr()
    assert params["b"].data_ptr() == b_ptr and params["b"].tolist() == [6.0, 7.0, 8.0, 9.0]  # cast in place
    with pytest.raises(ValueError):
        install_weights(params, named, [True])  # one flag per tensor

    class Recorder:
        def load_weights(self, named, version, checked, adopt):
            self.got = (named, version, checked, adopt)

    session, engine = PendingVersion(), Recorder()
    session.keep(named[:2], adopt=[True, False])
    session.keep([named[2]], "7", adopt=[True])
    session.load(engine)
    assert engine.got == (named, "7", True, [True, False, True])
    session.keep([("a", torch.ones(2, 3))])  # no flags for "a" now: decided at load time
    session.load(engine)
    assert engine.got[3] is None


def test_install_weights_adopts_fresh_buffers_and_copies_the_rest(tmp_path):
    """A received tensor of the parameter's dtype/shape/device becomes its
    storage (no copy; a tied alias follows); a cast or a strided view is
    copied; tensors read from disk never stay backed by the file."""
    from safetensors.torch import save_file

    from torchtitan_grpo.server.engine.weights import install_weights, read_safetensors_dir

    emb = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
    norm = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    params = {"embed.weight": emb, "lm_head.weight": emb, "norm.weight": norm}
    fresh = torch.arange(12.0).reshape(4, 3)
    install_weights(params, [("embed.weight", fresh)])
    assert params["lm_head.weight"].data_ptr() == fresh.data_ptr() and params["lm_head.weight"] is emb
    ptr = norm.data_ptr()
    install_weights(params, [("norm.weight", torch.tensor([1.5, 2.5, 3.5], dtype=torch.bfloat16))])
    assert norm.data_ptr() == ptr and norm.dtype == torch.float32 and norm.tolist() == [1.5, 2.5, 3.5]
    strided = torch.arange(6.0)[::2]
    install_weights(params, [("norm.weight", strided)])
    assert norm.data_ptr() == ptr and norm.tolist() == [0.0, 2.0, 4.0]

    path = tmp_path / "v1"
    path.mkdir()
    save_file({"norm.weight": torch.ones(1000)}, str(path / "model.safetensors"))
    (name, t), = read_safetensors_dir(str(path))
    with open(path / "model.safetensors", "r+b") as f:  # rewritten in place after the read
        f.seek(-4000, os.SEEK_END)
        f.write(b"\0" * 4000)
    assert name == "norm.weight" and float(t.sum()) == 1000.0


def test_ack_posted_answers_an_update_once_its_receive_is_posted(server, model_dir, pool):
    """``?ack=posted``: a flattened bucket is answered once its receive is
    posted, before the trainer sends a byte, so a trainer can queue the next
    bucket behind the one in flight; the session's end waits for the bytes.
    Its metadata is checked first: a refused bucket posts nothing (the group
    stays in step). Without the parameter the reply follows the bytes, as
    from SGLang. A group destroyed while bytes are due ends the session at
    once, loading nothing."""
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "posted", "backend": "gloo"}
    reply = pool.submit(http, server, "/init_weights_update_group", init)
    group = init_weight_group("127.0.0.1", port, 0, 2, backend="gloo", group_name="posted", timeout_s=60)
    assert reply.result(timeout=60)[1]["success"]
    g = torch.Generator().manual_seed(7)
    route = "/update_weights_from_distributed"

    def bucket(names_shapes: list, version: str | None = None) -> tuple[dict, torch.Tensor, dict]:
        tensors = [torch.randn(shape, generator=g) for _, shape in names_shapes]
        body = {"names": [n for n, _ in names_shapes], "dtypes": ["float32"] * len(tensors),
                "shapes": [list(s) for _, s in names_shapes], "group_name": "posted",
                "load_format": "flattened_bucket", "weight_version": version}
        return body, pack(tensors), dict(zip(body["names"], tensors))

    body1, flat1, new1 = bucket([("model.norm.weight", (64,))])
    body2, flat2, new2 = bucket([("lm_head.weight", (128, 64))], "posted-1")
    try:
        assert http(server, "/begin_weight_update", {})[1]["success"]
        status, out = http(server, route + "?ack=later", body1, timeout=20)
        assert status == 400 and "'ack'" in out["message"], out
        # Without ?ack: the reply waits for the bytes.
        waiting = pool.submit(http, server, route, body1)
        time.sleep(0.3)
        assert not waiting.done()
        group.broadcast(flat1, src=0)
        assert waiting.result(timeout=60)[1]["success"]
        # Refused first (a wrong shape): nothing posted, nothing to send.
        bad, _, _ = bucket([("model.norm.weight", (32,))])
        status, out = http(server, route + "?ack=posted", bad, timeout=20)
        assert status == 400 and "model.norm.weight" in out["message"] and "nothing received" in out["message"], out
        # A bucket its views could not be cut from (an fp32 tensor at byte 2): refused first too.
        odd = dict(body1, names=["lm_head.weight", "model.norm.weight"], dtypes=["bfloat16", "float32"],
                   shapes=[[1], [64]])
        status, out = http(server, route + "?ack=posted", odd, timeout=20)
        assert status == 400 and "starts at byte 2" in out["message"] and "nothing received" in out["message"], out
        assert http(server, "/end_weight_update", {})[0] == 400  # the session failed
        # Both answered with nothing sent: two receives posted, in order.
        assert http(server, "/begin_weight_update", {})[1]["success"]
        for body in (body1, body2):
            status, out = http(server, route + "?ack=posted", body, timeout=20)
            assert status == 200 and out["success"], out
        assert http(server, "/model_info")[1]["weight_version"] != "posted-1"
        ended = pool.submit(http, server, "/end_weight_update", {})
        time.sleep(0.3)
        assert not ended.done()  # the end waits for the bytes
        group.broadcast(flat1, src=0)  # the group is in step: the refused bucket posted nothing
        group.broadcast(flat2, src=0)
        status, out = ended.result(timeout=60)
        assert status == 200 and "loaded 2 tensor(s)" in out["message"], out
        for n, t in (new1 | new2).items():
            assert torch.equal(_weights(server, n), t)
        assert http(server, "/model_info")[1]["weight_version"] == "posted-1"

        # The trainer gives up with a receive posted and no bytes sent.
        assert http(server, "/begin_weight_update", {})[1]["success"]
        assert http(server, route + "?ack=posted", body1, timeout=20)[1]["success"]
        t0 = time.monotonic()
        assert http(server, "/destroy_weights_update_group", {"group_name": "posted"}, timeout=20)[1]["success"]
        status, out = http(server, "/end_weight_update", {}, timeout=20)
        assert status == 400 and "destroyed" in out["message"], out
        assert time.monotonic() - t0 < 15  # not the group's timeout
        assert http(server, "/model_info")[1]["weight_version"] == "posted-1"
    finally:
        group.close()
        # the checkpoint back for the other tests
        http(server, "/begin_weight_update", {})
        http(server, "/update_weights_from_disk", {"model_path": model_dir, "weight_version": "disk"})
        http(server, "/end_weight_update", {})


def test_post_receive_check_first_posts_at_once_and_cuts_the_views_later():
    """What ``?ack=posted`` answers after: with ``check_first`` a flattened
    receive is posted before any view is cut (``cut`` left for the transfer
    thread, ``cut_views`` runs it once), ``wait`` delivers every tensor
    exactly, and a bucket whose views could not be cut, or that the check
    refuses, is refused with nothing posted."""
    from torchtitan_grpo.server.engine.requests import WeightUpdateError
    from torchtitan_grpo.server.engine.weights import post_receive

    g = torch.Generator().manual_seed(11)
    named = [("w.fp32", torch.randn(4, 3, generator=g)), ("b.bf16", torch.randn(5, generator=g).to(torch.bfloat16)),
             ("s.bf16", torch.randn((), generator=g).to(torch.bfloat16))]
    specs = [TensorSpec.of(n, t) for n, t in named]
    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        peer = ex.submit(init_weight_group, "127.0.0.1", port, 1, 2, "gloo", "cut-later", 30)
        trainer = init_weight_group("127.0.0.1", port, 0, 2, "gloo", "cut-later", 30)
        server = peer.result(timeout=30)
    try:
        odd = [TensorSpec("b", torch.bfloat16, (1,)), TensorSpec("w", torch.float32, (2,))]  # fp32 at byte 2
        with pytest.raises(WeightUpdateError, match="starts at byte 2"):
            post_receive(server, odd, True, check_first=True)

        def refuse(specs):
            raise WeightUpdateError("no such parameter")

        with pytest.raises(WeightUpdateError, match="no such parameter"):
            post_receive(server, specs, True, check=refuse, check_first=True)
        checked = []
        posted = post_receive(server, specs, True, check=checked.append, check_first=True)
        assert checked == [specs] and posted.named == [] and posted.cut is not None and posted.in_flight()
        assert posted.cut_views() and posted.cut is None and not posted.cut_views()
        assert [n for n, _ in posted.named] == [n for n, _ in named]
        trainer.broadcast(pack([t for _, t in named]), src=0)  # the first bytes since: nothing was posted before
        got = posted.wait()
    finally:
        trainer.close()
        server.close()
    for (name, sent), (_, t) in zip(named, got):
        assert t.dtype == sent.dtype and t.shape == sent.shape and torch.equal(t, sent), name


def test_update_weights_from_tensor_copies_from_the_senders_memory(server, model_dir, tmp_path):
    """SGLang's /update_weights_from_tensor: the body maps the sender's tensors
    (here shared-memory files; CUDA IPC on GPUs, tests/test_gpu_staging.py),
    the server copies them before it answers and loads them at the end. A
    body that is not a list of (name, tensor) pairs is refused naming the
    field, and a pickle that would run anything else is never run."""
    import pickle

    from safetensors.torch import load_file

    from torchtitan_grpo.weight_sync import ipc

    before = torch.multiprocessing.get_sharing_strategy()
    ipc.share_cpu_memory()
    try:
        original = load_file(os.path.join(model_dir, "model.safetensors"))
        mine = [(n, torch.full_like(t, 0.25).share_memory_()) for n, t in sorted(original.items())]
        entry = ipc.serialize(mine)
        body = {"serialized_named_tensors": [entry], "load_format": None, "weight_version": "ipc",
                "flush_cache": True, "abort_all_requests": False}
        status, out = http(server, "/update_weights_from_tensor", body)
        assert status == 400 and "begin_weight_update" in out["message"]  # no session, nothing received
        assert http(server, "/begin_weight_update", {})[1]["success"]
        status, out = http(server, "/update_weights_from_tensor", body)
        assert status == 200 and out["success"], out
        for _, t in mine:
            t.fill_(-1.0)  # answered: the sender may reuse its memory
        status, out = http(server, "/end_weight_update", {})
        assert status == 200 and out["success"], out
        assert http(server, "/model_info")[1]["weight_version"] == "ipc"
        for n in ["model.norm.weight", "lm_head.weight"]:
            assert set(_weights(server, n).flatten().tolist()) == {0.25}, n

        marker = tmp_path / "ran"

        class Evil:
            def __reduce__(self):
                return (os.system, (f"touch {marker}",))

        # (body, words of the refusal, whether the session fails: a refused
        # request shape receives nothing, refused content fails the version)
        bad = [
            ({"serialized_named_tensors": [entry, entry]}, "one entry per TP rank", False),
            ({"serialized_named_tensors": [entry], "load_format": "flattened_bucket"}, "field 'load_format'", False),
            ({"serialized_named_tensors": ["not base64!"]}, "entry 0 is not valid base64", True),
            ({"serialized_named_tensors": [5]}, "entry 0 must be a base64 string, got int", True),
            ({"serialized_named_tensors": [base64.b64encode(base64.b64decode(entry)[:40]).decode()]},
             "entry 0 cannot be unpickled into tensors", True),
            ({"serialized_named_tensors": [base64.b64encode(pickle.dumps(Evil())).decode()]},
             "entry 0 refers to posix.system, which is not part of a tensor's reduction", True),
            ({"serialized_named_tensors": [base64.b64encode(pickle.dumps({"a": 1})).decode()]},
             "must hold a list of (name, tensor) pairs", True),
            ({"serialized_named_tensors": [ipc.serialize([("no.such.weight", torch.zeros(2).share_memory_())])]},
             "unknown parameter 'no.such.weight'", True),
        ]
        for b, words, fails in bad:
            assert http(server, "/begin_weight_update", {})[1]["success"]
            status, out = http(server, "/update_weights_from_tensor", b, valid=False)
            assert status == 400 and not out["success"] and words in out["message"], (words, out)
            status, out = http(server, "/end_weight_update", {})
            assert out["success"] != fails and (fails or "loaded 0 tensor(s)" in out["message"]), (words, out)
        assert not marker.exists()
        assert http(server, "/model_info")[1]["weight_version"] == "ipc"
        assert set(_weights(server, "lm_head.weight").flatten().tolist()) == {0.25}

        # Put the checkpoint back for later tests.
        http(server, "/begin_weight_update", {})
        assert http(server, "/update_weights_from_disk", {"model_path": model_dir, "weight_version": "disk"})[1]["success"]
        http(server, "/end_weight_update", {})
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


def test_top_logprobs_of_a_mixed_batch_come_from_one_topk():
    """sampling.top_rows: rows asking for different k (and rows asking for
    none) in one step get exactly what a topk of their own row gives, from
    one topk over the rows that asked (issue 50: a topk and a host copy per
    row per step held the OpenAI routes with logprobs to a third of /generate)."""
    import random

    import torch

    from torchtitan_grpo.server.engine.requests import SamplingParams as EngineParams, _Request, _Sequence
    from torchtitan_grpo.server.engine.sampling import sample_tokens

    torch.manual_seed(0)
    ks = [0, 3, 1, 0, 5, 2]
    seqs = [_Sequence(_Request(f"r{i}", [1, 2], EngineParams(), k, None), 0, None) for i, k in enumerate(ks)]
    logits = torch.randn(len(ks), 300) * 3
    got = sample_tokens(logits, seqs, torch.device("cpu"), random.Random(0), ())
    logp = torch.log_softmax(logits, -1)
    assert sorted(got.top) == [i for i, k in enumerate(ks) if k]
    for i, k in enumerate(ks):
        if k:
            v, ix = logp[i].topk(k)
            assert got.top[i] == list(zip(v.tolist(), ix.tolist()))
