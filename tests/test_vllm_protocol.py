"""vLLM 0.33 protocol: client bodies and the built-in server's vLLM routes.

* Request bodies from ``fleet/vllm.py`` are validated against vLLM's own
  pydantic JSON schema (and their keys against its field list: the schema
  allows extra keys, so a renamed field would otherwise pass).
* One built-in server subprocess (tiny random Qwen3, CPU) answers
  /v1/completions (validated against vLLM's CompletionResponse schema, and
  compared with its own SGLang route) and takes real gloo pushes through the
  vLLM weight-transfer routes.
* The trainer side without a server (the packed receive, the update_info
  parser, vLLM's NCCL rendezvous against a fake worker): test_vllm_group.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
import urllib.parse
from pathlib import Path

import pytest
import torch

from tests.server_procs import CHAT_TEMPLATE, free_port, http_json, start_server, stop_server, write_chat_template
from torchtitan_grpo.fleet import vllm
from torchtitan_grpo.server.vllm_http import VLLMError
from torchtitan_grpo.server.routes.vllm_weights import GROUP_NAME
from torchtitan_grpo.fleet.types import MalformedResponse, SamplingParams
from torchtitan_grpo.weight_sync import vllm_group as vg
from torchtitan_grpo.weight_sync.buckets import dtype_name
from torchtitan_grpo.weight_sync.group import init_weight_group

torch.set_num_threads(1)
jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[1]
SCHEMA_FILE = Path(os.environ.get("VLLM_SCHEMA", Path(__file__).parent / "protocols" / "vllm-0.33-completions-schema.json"))
SCHEMAS = json.loads(SCHEMA_FILE.read_text())
REQUEST = jsonschema.Draft202012Validator(SCHEMAS["CompletionRequest"])
RESPONSE = jsonschema.Draft202012Validator(SCHEMAS["CompletionResponse"])
REQUEST_FIELDS = set(SCHEMAS["CompletionRequest"]["properties"])


def check_request(body: dict) -> dict:
    REQUEST.validate(body)
    unknown = set(body) - REQUEST_FIELDS
    assert not unknown, f"not CompletionRequest fields in vLLM 0.33: {unknown}"
    return body


# --------------------------------------------------------------------------- #
# HTTP and process helpers
# --------------------------------------------------------------------------- #


def http(url: str, path: str, body: dict | None = None, query: dict | None = None, method: str | None = None,
         timeout: float = 60, valid: bool = True) -> tuple[int, dict | list | None]:
    """POST ``body`` (GET when None and no method); return (status, JSON).
    ``valid=False`` sends a completions body vLLM's schema rejects (to test our 400s)."""
    if path == vllm.COMPLETIONS and body is not None and valid:
        check_request(body)
    data = json.dumps(body).encode() if body is not None else None
    method = method or ("POST" if data is not None else "GET")
    full = url + path + ("?" + urllib.parse.urlencode(query) if query else "")
    return http_json(full, data, method, timeout)


def post(url: str, path: str, body: dict | None = None, **kw) -> tuple[int, dict]:
    return http(url, path, body, method="POST", **kw)


def complete(url: str, body: dict, timeout: float = 60) -> dict:
    status, out = http(url, vllm.COMPLETIONS, body, timeout=timeout)
    assert status == 200, out
    RESPONSE.validate(out)
    return out


def assert_error(status_body: tuple[int, dict], code: int, *words: str) -> dict:
    status, body = status_body
    assert status == code, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    for w in words:
        assert w in err["message"] or w == err["param"], (w, err)
    return err


@pytest.fixture(scope="module")
def pool():
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        yield ex


PROMPT = [5, 6, 7, 8, 9]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
SEEDED = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=40, seed=11)


# --------------------------------------------------------------------------- #
# Client bodies
# --------------------------------------------------------------------------- #


def test_completions_request_is_a_vllm_request(model_dir):
    body = check_request(vllm.completions_request(PROMPT, 4, SEEDED, model_dir))
    assert body["prompt"] == PROMPT and body["n"] == 4 and body["max_tokens"] == 8 and body["seed"] == 11
    assert body["logprobs"] == 0 and body["return_token_ids"] and body["return_tokens_as_token_ids"]
    assert body["return_weight_versions"] and body["stop_token_ids"] == []
    assert "seed" not in vllm.completions_request(PROMPT, 1, GREEDY, model_dir)
    # the two checks bite: an SGLang name, a wrong type
    with pytest.raises(AssertionError, match="max_new_tokens"):
        check_request({**body, "max_new_tokens": 8})
    with pytest.raises(jsonschema.ValidationError):
        check_request({**body, "logprobs": "0"})
    with pytest.raises(jsonschema.ValidationError):
        check_request({**body, "return_weight_versions": None})


def test_control_plane_bodies():
    body = vllm.init_weight_transfer_request(3, 1, "10.0.0.1", 29500, packed=True, packed_buffer_size_bytes=1 << 20)
    assert body == {"init_info": {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1,
                                  "world_size": 3, "packed": True, "packed_buffer_size_bytes": 1 << 20,
                                  "packed_num_buffers": 2}}
    uid = vllm.init_weight_transfer_request(2, nccl_unique_id_b64="QUJD")["init_info"]
    assert uid["nccl_unique_id_b64"] == "QUJD" and "master_address" not in uid
    assert set(uid) <= vllm.INIT_INFO_KEYS and set(body["init_info"]) <= vllm.INIT_INFO_KEYS
    for bad in [dict(master_address="a", master_port=1, nccl_unique_id_b64="x"), dict(), dict(master_address="a"),
                dict(master_address="a", master_port=1, rank_offset=2)]:
        with pytest.raises(ValueError):
            vllm.init_weight_transfer_request(2, **bad)
    assert vllm.update_weights_request(["a"], ["bfloat16"], [(2, 3)]) == {
        "update_info": {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]]}}
    with pytest.raises(ValueError, match="bare name"):
        vllm.update_weights_request(["a"], ["torch.bfloat16"], [[1]])
    with pytest.raises(ValueError):
        vllm.update_weights_request(["a", "b"], ["float32"], [[1]])
    assert vllm.pause_query("wait") == {"mode": "wait"}
    with pytest.raises(ValueError):
        vllm.pause_query("retract")  # an SGLang mode
    assert vllm.finish_weight_update_request("7") == {"weight_version": "7"}
    assert vllm.finish_weight_update_request(None) == {}
    assert vllm.parse_weight_info({"weight_version": "3"}, "r") == "3"
    assert vllm.parse_world_size({"world_size": 4}, "r") == 4
    with pytest.raises(MalformedResponse, match="world_size"):
        vllm.parse_world_size({"world_size": 0}, "r")


# --------------------------------------------------------------------------- #
# /v1/completions on the built-in server
# --------------------------------------------------------------------------- #


def test_completions_follow_the_vllm_schema(server, model_dir):
    out = complete(server, vllm.completions_request(PROMPT, 3, SEEDED, model_dir))
    assert out["object"] == "text_completion" and out["model"] == model_dir
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    got = vllm.parse_completions(out, 3, server)
    assert len({tuple(c.token_ids) for c in got}) > 1  # n samples differ
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": sum(len(c.token_ids) for c in got),
                            "total_tokens": 5 + sum(len(c.token_ids) for c in got)}
    for c, raw in zip(got, out["choices"]):
        assert c.finish_reason == "length" and len(c.token_ids) == 8 and c.weight_versions == ["default"]
        assert raw["weight_versions"] == [{"version": "default", "start": 0, "end": 8}]
        assert raw["logprobs"]["tokens"] == [f"token_id:{t}" for t in c.token_ids]
        assert [list(d.values()) for d in raw["logprobs"]["top_logprobs"]] == [[x] for x in c.logprobs]
        assert raw["prompt_token_ids"] == PROMPT
    again = complete(server, vllm.completions_request(PROMPT, 3, SEEDED, model_dir))
    assert again["choices"][1]["token_ids"] == got[1].token_ids  # seeded: reproducible

    # several prompts, prompt-major; top-k logprobs; a stop token; a text prompt
    body = {"model": model_dir, "prompt": [PROMPT, [20, 21]], "n": 2, "max_tokens": 5, "temperature": 0,
            "logprobs": 2, "return_token_ids": True,
            "return_weight_versions": True, "ignore_eos": True}
    out = complete(server, body)
    assert [c["prompt_token_ids"] for c in out["choices"]] == [PROMPT, PROMPT, [20, 21], [20, 21]]
    assert len(vllm.parse_completions(out, 2, server, num_prompts=2)) == 4
    for c in out["choices"]:
        assert all(1 <= len(d) <= 3 for d in c["logprobs"]["top_logprobs"])  # sampled + top 2
        assert all(not t.startswith("token_id:") for t in c["logprobs"]["tokens"])  # decoded text
    greedy = out["choices"][0]["token_ids"]
    out = complete(server, {**body, "prompt": PROMPT, "n": 1, "stop_token_ids": [greedy[2]]})
    choice = out["choices"][0]
    assert choice["token_ids"] == greedy[: greedy.index(greedy[2]) + 1]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == greedy[2]
    out = complete(server, {"model": model_dir, "prompt": "abc", "max_tokens": 2, "temperature": 0})
    assert out["choices"][0]["logprobs"] is None and "token_ids" not in out["choices"][0]
    assert out["usage"]["prompt_tokens"] == 3  # char tokenizer

    # errors in vLLM's shape, naming the field
    assert_error(http(server, vllm.COMPLETIONS, {"prompt": PROMPT, "echo": True}), 400, "echo")
    assert_error(http(server, vllm.COMPLETIONS, {"prompt": PROMPT, "n": "2"}, valid=False), 400, "n")
    assert_error(http(server, vllm.COMPLETIONS, {"prompt": [PROMPT, []]}), 400, "prompt")
    assert_error(http(server, vllm.COMPLETIONS, {"prompt": [10**6]}), 400, "vocabulary")
    assert_error(http(server, vllm.COMPLETIONS, {"prompt": PROMPT, "model": "gpt-9"}), 404, "gpt-9")
    models = http(server, vllm.MODELS)[1]
    assert models["data"][0]["id"] == model_dir and models["object"] == "list"


def test_models_lists_every_name_completions_accept(server, model_dir):
    short = os.path.basename(os.path.normpath(model_dir))
    models = http(server, vllm.MODELS)[1]
    assert [m["id"] for m in models["data"]] == [model_dir, short]
    assert all(m["root"] == model_dir and m["max_model_len"] == 512 for m in models["data"])
    for name in (model_dir, short):
        out = complete(server, {"model": name, "prompt": PROMPT, "max_tokens": 1})
        assert out["model"] == name


def test_completions_strictness_and_bounds(server, model_dir):
    """vLLM's own request checks mirrored (stream_options needs stream), types
    and prompt sizes refused naming the field, bodies bounded, all in vLLM's
    error shape."""
    p = {"prompt": PROMPT, "max_tokens": 1}
    # vLLM refuses stream options on a request that does not stream ...
    assert_error(http(server, vllm.COMPLETIONS, {**p, "stream_options": {"include_usage": True}}), 400,
                 "stream_options", "'stream': true")
    assert_error(http(server, vllm.COMPLETIONS, {**p, "stream": False, "stream_options": {"include_usage": True}}),
                 400, "stream_options")
    assert_error(http(server, vllm.COMPLETIONS, {**p, "stream_options": "usage"}, valid=False), 400, "stream_options")
    complete(server, {**p, "stream_options": {}})  # ... but lets an empty one through, as vLLM does
    assert_error(http(server, vllm.COMPLETIONS, {**p, "model": 5}, valid=False), 400, "model", "a string")
    assert_error(http(server, vllm.COMPLETIONS, {**p, "seed": 2**70}, valid=False), 400, "seed", "64-bit")
    # prompts bounded by the context before they are tokenised or scanned
    assert_error(http(server, vllm.COMPLETIONS, {**p, "prompt": "a" * 20_000}), 400, "prompt", "not tokenised")
    assert_error(http(server, vllm.COMPLETIONS, {**p, "prompt": ["ab", "a" * 20_000]}), 400, "prompt[1]")
    assert_error(http(server, vllm.COMPLETIONS, {**p, "prompt": [5] * 600}), 400, "prompt", "context is 512")
    # bodies: too large (refused by its declared length), not UTF-8, not an object
    big = json.dumps({**p, "prompt": "a" * (3 << 20)}).encode()
    for raw, code, words in [(big, 413, "larger than this route takes"), (b"\xff" * 64, 400, "not UTF-8"),
                             (b"[]", 400, "must be a JSON object")]:
        assert_error(http_json(server + vllm.COMPLETIONS, raw, "POST", 60), code, words)
    assert_error(http_json(server + vllm.INIT_WEIGHT_TRANSFER, b"\xff", "POST", 60), 400, "not UTF-8")


def _sglang_generate(url: str, p: SamplingParams) -> dict:
    sp = {"max_new_tokens": p.max_new_tokens, "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k}
    if p.seed is not None:
        sp["sampling_seed"] = p.seed
    status, out = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": sp, "return_logprob": True})
    assert status == 200, out
    return out


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_logprobs_equal_the_sglang_route(server, model_dir, params):
    sg = _sglang_generate(server, params)
    (c,) = vllm.parse_completions(complete(server, vllm.completions_request(PROMPT, 1, params, model_dir)), 1, server)
    assert c.token_ids == sg["output_ids"]
    ref = [x[0] for x in sg["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) <= 1e-5


def _valid_body() -> dict:
    choice = {"index": 0, "text": "", "finish_reason": "length", "token_ids": [4, 9],
              "logprobs": {"text_offset": [0, 9], "token_logprobs": [-0.5, -1.0],
                           "tokens": ["token_id:4", "token_id:9"],
                           "top_logprobs": [{"token_id:4": -0.5}, {"token_id:9": -1.0}]},
              "weight_versions": [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]}
    return {"id": "x", "object": "text_completion", "created": 0, "model": "m", "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}


@pytest.mark.parametrize("path, value, field_name", [
    (("choices", 0, "index"), 1, "choices[0].index"),
    (("choices", 0, "logprobs", "token_logprobs"), [-0.5], "choices[0].logprobs.token_logprobs"),
    (("choices", 0, "logprobs", "token_logprobs"), [-0.5, float("nan")], "choices[0].logprobs.token_logprobs[1]"),
    (("choices", 0, "logprobs", "tokens"), ["token_id:9", "token_id:4"], "choices[0].logprobs.tokens[0]"),
    (("choices", 0, "logprobs"), None, "choices[0].logprobs"),
    (("choices", 0, "finish_reason"), "error", "choices[0].finish_reason"),
    (("choices", 0, "token_ids"), None, "choices[0].token_ids"),
    (("choices", 0, "weight_versions"), None, "choices[0].weight_versions"),
    (("choices", 0, "weight_versions"), [{"version": "3", "start": 0, "end": 1}], "choices[0].weight_versions"),
    (("choices", 0, "weight_versions", 1, "start"), 0, "choices[0].weight_versions[1].start"),
    (("choices",), [], "choices"),
])
def test_parse_completions_rejects_malformed(path, value, field_name):
    good = _valid_body()
    RESPONSE.validate(good)
    (c,) = vllm.parse_completions(good, 1, "r1")
    assert (c.weight_version, c.weight_versions, c.logprobs) == ("4", ["3", "4"], [-0.5, -1.0])
    bad = json.loads(json.dumps(good))
    target = bad
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(MalformedResponse) as e:
        vllm.parse_completions(bad, 1, "r1")
    assert e.value.field_name == field_name and e.value.replica == "r1"


# --------------------------------------------------------------------------- #
# /v1/chat/completions and vLLM's native /generate body
# --------------------------------------------------------------------------- #

CHAT_FIELDS = {k: set(v) for k, v in json.loads(
    (Path(__file__).parent / "protocols" / "vllm-0.33-chat-fields.json").read_text()).items() if k != "_source"}
MESSAGES = [{"role": "user", "content": "3>"}]
RENDERED = "<user>3><assistant>"  # MESSAGES with the tests' CHAT_TEMPLATE
CHAR0 = 2  # the demo tokenizer: character c is token ord(c) - 32 + CHAR0


def _ids(text: str) -> list[int]:
    return [ord(c) - 32 + CHAR0 for c in text]


@pytest.fixture(scope="module")
def chat_server(model_dir, tmp_path_factory):
    """A built-in server that renders chats with CHAT_TEMPLATE (``--chat-template FILE``)."""
    d = tmp_path_factory.mktemp("chat-server")
    log = d / "server.log"
    proc, url = start_server(model_dir, log, "--chat-template", str(write_chat_template(d / "chat.jinja")))
    yield url
    stop_server(proc, log)


def check_chat_response(out: dict) -> dict:
    """Every key of the reply, at every level, is one of vLLM's field names."""
    assert set(out) <= CHAT_FIELDS["ChatCompletionResponse"], set(out) - CHAT_FIELDS["ChatCompletionResponse"]
    assert {"id", "object", "created", "model", "choices", "usage"} <= set(out) and out["object"] == "chat.completion"
    assert out["id"].startswith("chatcmpl-") and set(out["usage"]) <= CHAT_FIELDS["UsageInfo"]
    for c in out["choices"]:
        assert set(c) <= CHAT_FIELDS["ChatCompletionResponseChoice"], set(c)
        assert set(c["message"]) <= CHAT_FIELDS["ChatMessage"] and c["message"]["role"] == "assistant"
        if c["logprobs"] is not None:
            assert set(c["logprobs"]) <= CHAT_FIELDS["ChatCompletionLogProbs"]
            for e in c["logprobs"]["content"]:
                assert set(e) == CHAT_FIELDS["ChatCompletionLogProbsContent"]
                assert all(set(t) == CHAT_FIELDS["ChatCompletionLogProb"] for t in e["top_logprobs"])
    return out


def chat(url: str, body: dict, timeout: float = 60) -> dict:
    status, out = http(url, vllm.CHAT_COMPLETIONS, body, timeout=timeout)
    assert status == 200, out
    return check_chat_response(out)


class _Reads(dict):
    """A request body that records which of its keys the server reads."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


@pytest.fixture(scope="module")
def parse_engine(model_dir):
    """An engine that is never started: the routes only parse with it here."""
    from torchtitan_grpo.server.engine.engine import Engine
    from torchtitan_grpo.server.app import engine_config, parse_args

    return Engine(engine_config(parse_args(["--model", model_dir, "--port", "0"])))


def _chat_routes(engine, *args: str):
    from torchtitan_grpo.server.app import parse_args
    from torchtitan_grpo.server.routes.vllm_chat import ChatRoutes
    from torchtitan_grpo.server.vllm_http import PauseGate

    return ChatRoutes(engine, parse_args(["--model", engine.cfg.model_path, "--port", "0", *args]), PauseGate(engine))


def test_chat_template_options(parse_engine, tmp_path, capsys):
    """``--chat-template`` takes a file or the template itself (vLLM's flag);
    a request's own ``chat_template`` needs ``--trust-request-chat-template``."""
    from torchtitan_grpo.server.app import parse_args

    base = ["--model", "m", "--port", "0"]
    assert parse_args([*base, "--chat-template", str(write_chat_template(tmp_path / "t.jinja"))]).chat_template \
        == CHAT_TEMPLATE
    assert parse_args([*base, "--chat-template", CHAT_TEMPLATE]).chat_template == CHAT_TEMPLATE
    assert parse_args(base).chat_template is None
    with pytest.raises(SystemExit):
        parse_args([*base, "--chat-template", str(tmp_path / "missing.jinja")])
    assert "--chat-template" in capsys.readouterr().err
    body = {"messages": MESSAGES, "chat_template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"}
    with pytest.raises(VLLMError) as e:
        _chat_routes(parse_engine)._parse(body)
    assert e.value.param == "chat_template" and "--trust-request-chat-template" in e.value.message
    assert _chat_routes(parse_engine, "--trust-request-chat-template")._parse(body).prompt_text == "[3>]"
    # the server's template, else the tokenizer's (the demo tokenizer has none)
    assert _chat_routes(parse_engine, "--chat-template", CHAT_TEMPLATE)._parse(body | {"chat_template": None}) \
        .prompt_text == RENDERED
    with pytest.raises(VLLMError, match="no chat template"):
        _chat_routes(parse_engine)._parse({"messages": MESSAGES})


def test_chat_and_generate_read_only_vllm_field_names(parse_engine, model_dir):
    """The fields the routes read are vLLM's names (a misspelt name would be
    one vLLM clients never send, silently defaulted): recorded from a real
    parse of a body that sets every field the routes know."""
    from torchtitan_grpo.server.routes import vllm_chat, vllm_generate
    from torchtitan_grpo.server.vllm_http import PauseGate
    from torchtitan_grpo.server.routes.vllm_openai import sampling_params

    assert vllm_chat.KNOWN_FIELDS <= CHAT_FIELDS["ChatCompletionRequest"]
    assert vllm_generate.SAMPLING_FIELDS | set(vllm_generate._UNSUPPORTED) - {"stream"} <= CHAT_FIELDS["SamplingParams"]
    # the mapping /v1/completions, /v1/chat/completions and /generate share: names all three have
    body = _Reads({k: None for k in REQUEST_FIELDS | CHAT_FIELDS["ChatCompletionRequest"]})
    sampling_params(body, 1)
    assert body.read and body.read <= REQUEST_FIELDS & CHAT_FIELDS["ChatCompletionRequest"] & CHAT_FIELDS[
        "SamplingParams"], body.read - (REQUEST_FIELDS & CHAT_FIELDS["ChatCompletionRequest"])

    engine = parse_engine
    full = {"messages": MESSAGES, "model": model_dir, "n": 2, "max_tokens": 3, "max_completion_tokens": 2,
            "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.0, "stop": ["x"], "stop_token_ids": [3],
            "seed": 1, "ignore_eos": False, "min_tokens": 0, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
            "presence_penalty": 0.0, "logit_bias": {"5": 1.0}, "skip_special_tokens": True,
            "include_stop_str_in_output": False, "logprobs": True, "top_logprobs": 2, "add_generation_prompt": True,
            "add_special_tokens": False, "chat_template_kwargs": {}, "documents": [], "reasoning_effort": "low",
            "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none",
            "return_token_ids": True, "return_tokens_as_token_ids": True, "return_prompt_text": True,
            "return_weight_versions": True, "stream": False, "echo": False}
    body = _Reads(full)
    call = _chat_routes(engine, "--chat-template", CHAT_TEMPLATE)._parse(body)
    assert body.read <= CHAT_FIELDS["ChatCompletionRequest"], body.read - CHAT_FIELDS["ChatCompletionRequest"]
    assert set(full) <= body.read, set(full) - body.read  # every field it knows is read, under that name
    assert call.params.max_new_tokens == 2 and call.params.n == 2 and call.top_logprobs == 2  # completion's wins
    assert call.prompt_text == RENDERED and call.prompt == _ids(RENDERED)

    body = _Reads({"prompt": {"prompt_token_ids": PROMPT}, "n": 2, "max_tokens": 3, "temperature": 0.0,
                   "logprobs": 1, "seed": 3, "stop": [], "detokenize": True})
    call = vllm_generate.VLLMGenerateRoute(engine, PauseGate(engine))._parse(body)
    assert body.read <= CHAT_FIELDS["SamplingParams"] | {"prompt", "stream"}
    assert (call.prompt, call.params.max_new_tokens, call.logprobs, call.params.seed) == (PROMPT, 3, 1, 3)


def test_chat_completions_follow_vllm(chat_server, model_dir):
    body = {"model": model_dir, "messages": MESSAGES, "n": 3, "max_tokens": 5, "temperature": 1.0, "seed": 7,
            "logprobs": True, "top_logprobs": 2, "return_token_ids": True, "return_prompt_text": True}
    out = chat(chat_server, body)
    assert out["model"] == model_dir and [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["prompt_token_ids"] == _ids(RENDERED) and out["prompt_text"] == RENDERED
    n_out = sum(len(c["token_ids"]) for c in out["choices"])
    assert out["usage"] == {"prompt_tokens": len(RENDERED), "completion_tokens": n_out,
                            "total_tokens": len(RENDERED) + n_out, "prompt_tokens_details": None}
    for c in out["choices"]:
        ids, content = c["token_ids"], c["logprobs"]["content"]
        assert 1 <= len(ids) <= 5 and len(content) == len(ids)
        assert c["finish_reason"] == ("length" if len(ids) == 5 else "stop")
        for t, e in zip(ids, content):
            assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 2
            # vLLM: the first top_logprobs entry is the sampled token itself
            assert (e["top_logprobs"][0]["token"], e["top_logprobs"][0]["logprob"]) == (e["token"], e["logprob"])
            if 2 <= t < 97:  # a printable character: its text and its UTF-8 bytes
                assert e["token"] == chr(t - CHAR0 + 32) and e["bytes"] == [t - CHAR0 + 32]
        assert c["message"]["content"] == "".join(chr(t - CHAR0 + 32) for t in ids if 2 <= t < 97)
    assert chat(chat_server, body)["choices"] == out["choices"]  # seeded: reproducible

    # greedy: the same tokens and logprobs as /v1/completions on the rendered prompt
    greedy = {"messages": MESSAGES, "max_completion_tokens": 6, "max_tokens": 99, "temperature": 0,
              "logprobs": True, "return_token_ids": True, "return_tokens_as_token_ids": True,
              "return_weight_versions": True, "ignore_eos": True}
    (c,) = chat(chat_server, greedy)["choices"]
    ref = complete(chat_server, {"prompt": _ids(RENDERED), "max_tokens": 6, "temperature": 0, "logprobs": 0,
                                 "return_token_ids": True, "ignore_eos": True})["choices"][0]
    assert c["token_ids"] == ref["token_ids"] and len(c["token_ids"]) == 6  # max_completion_tokens wins
    assert [e["logprob"] for e in c["logprobs"]["content"]] == ref["logprobs"]["token_logprobs"]
    assert [e["token"] for e in c["logprobs"]["content"]] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(e["top_logprobs"] == [] for e in c["logprobs"]["content"])  # top_logprobs 0
    assert c["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
    # a stop token and a stop string end it there, as vLLM reports them
    stop_id = c["token_ids"][2]
    (s,) = chat(chat_server, {**greedy, "stop_token_ids": [stop_id]})["choices"]
    assert s["token_ids"] == c["token_ids"][: c["token_ids"].index(stop_id) + 1]
    assert (s["finish_reason"], s["stop_reason"]) == ("stop", stop_id)
    text = next(chr(t - CHAR0 + 32) for t in c["token_ids"][1:] if 2 < t < 97)
    (s,) = chat(chat_server, {**greedy, "stop": [text]})["choices"]
    assert (s["finish_reason"], s["stop_reason"]) == ("stop", text) and text not in s["message"]["content"]
    # not asked for: no token ids, no logprobs
    (s,) = chat(chat_server, {"messages": MESSAGES, "max_tokens": 2})["choices"]
    assert s["token_ids"] is None and s["logprobs"] is None and "weight_versions" not in s
    # a prefilled assistant turn continued (no generation prompt, no EOS after it)
    out = chat(chat_server, {"messages": MESSAGES + [{"role": "assistant", "content": "ab"}], "max_tokens": 1,
                             "continue_final_message": True, "return_prompt_text": True})
    assert out["prompt_text"] == RENDERED + "ab"
    # content as text parts; an unknown field is ignored, as vLLM ignores it
    out = chat(chat_server, {"messages": [{"role": "user", "content": [{"type": "text", "text": "3>"}]}],
                             "max_tokens": 1, "return_prompt_text": True, "max_new_tokens": 9})
    assert out["prompt_text"] == RENDERED and len(out["choices"][0]["message"]["content"]) <= 1


@pytest.mark.parametrize("patch, code, param", [
    ({"messages": "3>"}, 400, "messages"),
    ({"messages": [{"content": "3>"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content[0].type"),
    ({"max_tokens": "4"}, 400, "max_tokens"),
    ({"max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ({"n": "2"}, 400, "n"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"stop": 5}, 400, "stop"),
    ({"seed": 2**70}, 400, "seed"),
    ({"logprobs": 1}, 400, "logprobs"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"echo": True}, 400, "echo"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ({"tool_choice": "auto"}, 400, "tool_choice"),
    ({"chat_template": "{{ messages }}"}, 400, "chat_template"),
    ({"chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs.tokenize"),
    ({"continue_final_message": True, "add_generation_prompt": True}, 400, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "a" * 600}]}, 400, "messages"),
    ({"model": "gpt-9"}, 404, "model"),
])
def test_chat_refusals_name_the_field(chat_server, patch, code, param):
    err = assert_error(http(chat_server, vllm.CHAT_COMPLETIONS, {"messages": MESSAGES, "max_tokens": 2, **patch}),
                       code)
    assert err["param"] == param, err


def test_chat_without_a_template_is_a_400_naming_messages(server):
    """The demo tokenizer has no chat template and this server got none."""
    err = assert_error(http(server, vllm.CHAT_COMPLETIONS, {"messages": MESSAGES}), 400, "messages")
    assert "no chat template" in err["message"] and "--chat-template" in err["message"]


def test_native_generate_body_answers_as_vllm(server, model_dir):
    """The body atroposlib's VLLMServer posts to /generate, and its reply."""
    body = {"prompt": {"prompt_token_ids": PROMPT}, "logprobs": 0, "n": 2, "max_tokens": 4, "temperature": 0.0,
            "ignore_eos": True}
    status, out = post(server, vllm.GENERATE, body)
    assert status == 200, out
    assert set(out) == {"text", "prompt", "finish_reasons", "logprobs", "prompt_token_ids", "token_ids"}
    ref = complete(server, {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0,
                            "return_token_ids": True, "ignore_eos": True})["choices"][0]
    assert out["token_ids"] == [ref["token_ids"]] * 2 and out["prompt_token_ids"] == PROMPT
    assert out["finish_reasons"] == ["length", "length"] and len(out["text"]) == 2
    # per token [{"<id>": logprob}]: what atroposlib reads back as (id, logprob)
    for lps, ids in zip(out["logprobs"], out["token_ids"]):
        assert [int(next(iter(step[0]))) for step in lps] == ids
        assert [next(iter(step[0].values())) for step in lps] == ref["logprobs"]["token_logprobs"]
    # logprobs k: the sampled token first, then the top k; a text prompt is echoed; no logprobs: no ids
    status, out = post(server, vllm.GENERATE, {"prompt": "abc", "logprobs": 2, "max_tokens": 3})
    assert status == 200 and out["prompt"] == "abc", out
    assert all(1 <= len(step[0]) <= 3 and int(next(iter(step[0]))) == t
               for step, t in zip(out["logprobs"][0], out["token_ids"][0]))
    status, out = post(server, vllm.GENERATE, {"prompt": {"prompt": "abc"}, "max_tokens": 2})
    assert status == 200 and set(out) == {"text", "prompt", "finish_reasons"}, out
    # SGLang's body on the same path is still SGLang's
    status, out = post(server, vllm.GENERATE, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and "meta_info" in out, out
    # SamplingParams(**body): an unknown or unsupported field is a 400 naming it
    for patch, param in [({"max_new_tokens": 2}, "max_new_tokens"), ({"stream": True}, "stream"),
                         ({"prompt_logprobs": 1}, "prompt_logprobs"), ({"logprobs": 21}, "logprobs"),
                         ({"prompt": {"prompt_token_ids": []}}, "prompt.prompt_token_ids"),
                         ({"prompt": 5}, "prompt"), ({"temperature": "0"}, "temperature")]:
        err = assert_error(post(server, vllm.GENERATE, {**body, **patch}), 400)
        assert err["param"] == param, err


# --------------------------------------------------------------------------- #
# Pause / resume
# --------------------------------------------------------------------------- #


def _long_request(model_dir: str) -> dict:
    return vllm.completions_request([40, 41], 1, SamplingParams(max_new_tokens=400, temperature=0.0), model_dir) | \
        {"ignore_eos": True}


def _until(pred, what: str, timeout_s: float = 60.0) -> None:
    """A hang guard, not a speed check."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _wait_decoding(url: str) -> None:
    deadline = time.monotonic() + 30
    while http(url, "/get_load")[1][0]["num_output_tokens"] < 3:
        assert time.monotonic() < deadline, "the long request never started decoding"
        time.sleep(0.01)


def test_pause_modes(server, model_dir, pool):
    try:
        _pause_modes(server, model_dir, pool)
    finally:  # the module's server is shared: never leave it paused for the next test
        post(server, vllm.RESUME)


def _pause_modes(server, model_dir, pool):
    short = vllm.completions_request(PROMPT, 1, GREEDY, model_dir)
    # abort: the live request ends with finish_reason abort; new ones get 503 until /resume
    running = pool.submit(complete, server, _long_request(model_dir))
    _wait_decoding(server)
    assert post(server, vllm.PAUSE, query=vllm.pause_query("abort")) == (200, {"status": "paused"})
    (c,) = vllm.parse_completions(running.result(timeout=30), 1, server)
    assert c.finish_reason == "abort" and len(c.token_ids) < 400
    assert http(server, "/is_paused")[1] == {"is_paused": True}
    assert_error(http(server, vllm.COMPLETIONS, short), 503, "paused")
    # vLLM's other generation routes too (before anything else is checked)
    assert_error(http(server, vllm.CHAT_COMPLETIONS, {"messages": MESSAGES}), 503, "paused")
    assert_error(post(server, vllm.GENERATE, {"prompt": {"prompt_token_ids": PROMPT}}), 503, "paused")
    assert post(server, vllm.RESUME) == (200, {"status": "resumed"})
    complete(server, short)

    # wait: the live request finishes normally while new ones are refused
    running = pool.submit(complete, server, _long_request(model_dir))
    _wait_decoding(server)
    paused = pool.submit(post, server, vllm.PAUSE, query=vllm.pause_query("wait"))
    # once the pause has arrived, new requests are refused (polled: it arrives when it arrives)
    _until(lambda: http(server, vllm.COMPLETIONS, short)[0] == 503, "new requests to be refused")
    assert paused.result(timeout=60) == (200, {"status": "paused"})
    (c,) = vllm.parse_completions(running.result(timeout=60), 1, server)  # a hang guard (a loaded CI box)
    assert c.finish_reason == "length" and len(c.token_ids) == 400
    assert_error(http(server, vllm.COMPLETIONS, short), 503)
    post(server, vllm.RESUME)

    # keep: new requests queue instead of failing, and run after /resume
    assert post(server, vllm.PAUSE, query={"mode": "keep"})[0] == 200
    queued = pool.submit(complete, server, short)
    time.sleep(0.3)
    assert not queued.done()
    post(server, vllm.RESUME)
    assert vllm.parse_completions(queued.result(timeout=30), 1, server)[0].finish_reason == "length"
    assert_error(post(server, vllm.PAUSE, query={"mode": "retract"}), 400, "mode")
    assert http(server, "/is_paused")[1] == {"is_paused": False}


# --------------------------------------------------------------------------- #
# Weight transfer through the vLLM routes (real gloo broadcasts)
# --------------------------------------------------------------------------- #


def _weights(url: str, name: str) -> torch.Tensor:
    status, values = http(url, "/get_weights_by_name", query={"name": name, "truncate_size": 100000})
    assert status == 200, values
    return torch.tensor(values)


def _init(pool, url: str, **info) -> tuple:
    """The HTTP init in flight while the trainer joins as rank 0 (each waits for the other)."""
    port = free_port()
    body = vllm.init_weight_transfer_request(2, 1, "127.0.0.1", port, **info)
    reply = pool.submit(post, url, vllm.INIT_WEIGHT_TRANSFER, body)
    group = init_weight_group("127.0.0.1", port, 0, 2, backend="gloo", group_name=GROUP_NAME, timeout_s=60)
    assert reply.result(timeout=60) == (200, {"message": "Weight transfer initialized"})
    return group, body


def _update(pool, url: str, group, named: list, packed: bool, buffer_bytes: int = 1 << 30, empty: bool = False):
    specs = [(n, dtype_name(t.dtype), list(t.shape)) for n, t in named]
    body = vllm.update_weights_request(*zip(*specs)) if not empty else {"update_info": {}}
    reply = pool.submit(post, url, vllm.UPDATE_WEIGHTS, body)
    sent = vg.send_weights(group, named, packed, buffer_bytes)
    return reply.result(timeout=60), sent


def test_weight_push_through_vllm_routes(server, model_dir, pool):
    from safetensors.torch import load_file

    original = load_file(os.path.join(model_dir, "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    short = vllm.completions_request(PROMPT, 1, GREEDY, model_dir)
    before = complete(server, short)

    # refused before anything is received (a posted receive would desync the group)
    assert_error(post(server, vllm.START_WEIGHT_UPDATE), 400, "init_weight_transfer_engine")
    assert_error(post(server, vllm.UPDATE_WEIGHTS, vllm.update_weights_request(["x"], ["float32"], [[1]])), 400)
    assert_error(post(server, vllm.INIT_WEIGHT_TRANSFER, {"init_info": {"master_address": "127.0.0.1",
                 "master_port": 1, "rank_offset": 1, "world_size": 2, "group_name": "g"}}), 400, "group_name")
    assert_error(post(server, vllm.INIT_WEIGHT_TRANSFER, vllm.init_weight_transfer_request(
        2, nccl_unique_id_b64="QUJD")), 400, "nccl_unique_id_b64")
    assert_error(post(server, vllm.INIT_WEIGHT_TRANSFER, {"init_info": {"master_address": "127.0.0.1",
                 "master_port": 1, "rank_offset": 2, "world_size": 2}}), 400, "init_info.rank_offset")
    assert_error(post(server, vllm.INIT_WEIGHT_TRANSFER, {"init_info": {"master_address": "127.0.0.1",
                 "rank_offset": 1, "world_size": 2}}), 400, "init_info.master_port")

    # 1) per-tensor broadcasts: init -> pause(abort) -> start -> update -> finish(v1) -> resume
    group, init = _init(pool, server)
    assert_error(post(server, vllm.INIT_WEIGHT_TRANSFER, init), 400, "already initialized")
    assert post(server, vllm.PAUSE, query=vllm.pause_query("abort"))[0] == 200
    assert_error(http(server, vllm.COMPLETIONS, short), 503)  # 503 during pause(abort)
    t0 = time.monotonic()
    assert_error(post(server, vllm.UPDATE_WEIGHTS, vllm.update_weights_request(["x"], ["float32"], [[1]])), 400,
                 "start_weight_update")
    assert time.monotonic() - t0 < 30  # refused without posting a receive: no wait for the 60 s group timeout
    assert post(server, vllm.START_WEIGHT_UPDATE) == (200, {"message": "Weight update started"})
    assert_error(post(server, vllm.START_WEIGHT_UPDATE), 400, "already")
    assert_error(post(server, vllm.UPDATE_WEIGHTS, {"update_info": {"names": [], "dtype_names": [], "shapes": [],
                                                                     "packed": True}}), 400, "update_info.packed")
    assert_error(post(server, vllm.UPDATE_WEIGHTS, {"update_info": {
        "names": ["model.norm.weight"], "dtype_names": ["torch.float32"], "shapes": [[64]]}}), 400,
        "update_info.dtype_names[0]", "update_info.dtype_names")
    names = ["model.norm.weight", "model.layers.0.mlp.up_proj.weight"]
    v1 = [(n, torch.randn(original[n].shape, generator=g)) for n in names]
    reply, sent = _update(pool, server, group, v1, packed=False)
    assert reply == (200, {"message": "Weights updated"}) and sent == 2
    assert http(server, vllm.WEIGHT_INFO)[1] == {"weight_version": "default"}  # set by finish, not update
    assert post(server, vllm.FINISH_WEIGHT_UPDATE, vllm.finish_weight_update_request("1")) == \
        (200, {"message": "Weight update finished"})
    assert post(server, vllm.RESUME)[0] == 200
    assert vllm.parse_weight_info(http(server, vllm.WEIGHT_INFO)[1], server) == "1"
    for n, t in v1:
        assert torch.equal(_weights(server, n), t)
    (c,) = vllm.parse_completions(complete(server, short), 1, server)
    assert c.weight_versions == ["1"] and c.token_ids != before["choices"][0]["token_ids"]
    # the empty update_info reuses the previous metadata (vLLM 0.33)
    post(server, vllm.START_WEIGHT_UPDATE)
    v1b = [(n, t + 1) for n, t in v1]
    assert _update(pool, server, group, v1b, packed=False, empty=True)[0][0] == 200
    post(server, vllm.FINISH_WEIGHT_UPDATE, {})  # no version: keeps "1"
    assert http(server, vllm.WEIGHT_INFO)[1] == {"weight_version": "1"}
    assert torch.equal(_weights(server, names[0]), v1b[0][1])
    assert post(server, vllm.SHUTDOWN_WEIGHT_TRANSFER) == (200, {"message": "Weight transfer shut down"})
    group.close()
    assert_error(post(server, vllm.START_WEIGHT_UPDATE), 400, "init_weight_transfer_engine")

    # 2) packed: mixed dtypes, unaligned offsets, several chunks cut by the vLLM rule
    group, _ = _init(pool, server, packed=True, packed_buffer_size_bytes=3000)
    v2 = [("model.layers.1.self_attn.q_norm.weight", torch.randn(16, generator=g).to(torch.bfloat16)),
          ("model.norm.weight", torch.randn(64, generator=g)),
          ("lm_head.weight", torch.randn(128, 64, generator=g).to(torch.bfloat16)),
          ("model.layers.1.mlp.down_proj.weight", torch.randn(64, 256, generator=g))]
    post(server, vllm.PAUSE, query={"mode": "wait"})
    post(server, vllm.START_WEIGHT_UPDATE)
    reply, sent = _update(pool, server, group, v2, packed=True, buffer_bytes=3000)
    assert reply[0] == 200, reply
    assert sent == 2  # [32 B, 256 B, 16 KiB] closes past 3000 B, then [64 KiB]
    # refused after receiving (unknown name): the group stays in step, and the
    # round loads nothing, not even the update before it (all or nothing)
    bad = [("model.norm.weight", torch.zeros(64)), ("model.no_such.weight", torch.zeros(3))]
    reply, _ = _update(pool, server, group, bad, packed=True, buffer_bytes=3000)
    assert_error(reply, 400, "model.no_such.weight")
    assert_error(post(server, vllm.FINISH_WEIGHT_UPDATE, vllm.finish_weight_update_request("2")), 400,
                 "model.no_such.weight")
    assert http(server, vllm.WEIGHT_INFO)[1] == {"weight_version": "1"}
    assert torch.equal(_weights(server, names[0]), v1b[0][1])
    post(server, vllm.START_WEIGHT_UPDATE)
    reply, _ = _update(pool, server, group, v2, packed=True, buffer_bytes=3000)
    assert reply[0] == 200, reply
    assert http(server, vllm.WEIGHT_INFO)[1] == {"weight_version": "1"}  # loaded by finish, not before
    assert post(server, vllm.FINISH_WEIGHT_UPDATE, vllm.finish_weight_update_request("2"))[0] == 200
    post(server, vllm.RESUME)
    assert http(server, vllm.WEIGHT_INFO)[1] == {"weight_version": "2"}
    for n, t in v2:
        assert torch.equal(_weights(server, n), t.float()), n
    assert vllm.parse_completions(complete(server, short), 1, server)[0].weight_versions == ["2"]
    # the SGLang route sees the same model and version
    assert http(server, "/model_info")[1]["weight_version"] == "2"

    # put the checkpoint back for the other tests
    post(server, vllm.START_WEIGHT_UPDATE)
    restore = [(n, original[n]) for n in dict(v1) | dict(v2)]
    assert _update(pool, server, group, restore, packed=True, buffer_bytes=3000)[0][0] == 200
    post(server, vllm.FINISH_WEIGHT_UPDATE, vllm.finish_weight_update_request("default"))
    post(server, vllm.SHUTDOWN_WEIGHT_TRANSFER)
    group.close()
    assert complete(server, short)["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


def test_ack_posted_answers_a_packed_update_before_its_bytes(server, model_dir, pool):
    """``/update_weights?ack=posted`` (packed): answered once its receives are
    posted, before the trainer sends a byte; /finish_weight_update then
    waits for the bytes and loads the round. The same body the next version
    is answered as early (its acceptance remembered). A refused update is
    answered after its bytes, as without the parameter (the trainer is
    already sending them); a shutdown with receives posted and no bytes
    coming ends them, loading nothing."""
    from safetensors.torch import load_file

    original = load_file(os.path.join(model_dir, "model.safetensors"))
    g = torch.Generator().manual_seed(11)
    group, _ = _init(pool, server, packed=True, packed_buffer_size_bytes=3000)
    ack = {"ack": "posted"}
    names = [("model.layers.1.self_attn.q_norm.weight", torch.bfloat16, (16,)),
             ("model.norm.weight", torch.float32, (64,)),  # at an unaligned offset: copied out
             ("lm_head.weight", torch.bfloat16, (128, 64))]

    def version() -> list:
        return [(n, torch.randn(shape, generator=g).to(dt)) for n, dt, shape in names]

    def body(named: list) -> dict:
        return vllm.update_weights_request(*zip(*[(n, dtype_name(t.dtype), list(t.shape)) for n, t in named]))

    try:
        post(server, vllm.START_WEIGHT_UPDATE)
        assert_error(post(server, vllm.UPDATE_WEIGHTS, body(version()), query={"ack": "later"}), 400, "ack")
        for v in ("ack-1", "ack-2"):  # the second round: the same body, accepted before
            named = version()
            if v == "ack-2":
                post(server, vllm.START_WEIGHT_UPDATE)
            assert post(server, vllm.UPDATE_WEIGHTS, body(named), query=ack, timeout=20) == \
                (200, {"message": "Weights received, loaded at /finish_weight_update"})
            finished = pool.submit(post, server, vllm.FINISH_WEIGHT_UPDATE, vllm.finish_weight_update_request(v))
            time.sleep(0.3)
            assert not finished.done()  # the finish waits for the bytes
            assert vg.send_weights(group, named, True, 3000) == 1
            assert finished.result(timeout=60) == (200, {"message": "Weight update finished"})
            assert http(server, vllm.WEIGHT_INFO)[1] == {"weight_version": v}
            for n, t in named:
                assert torch.equal(_weights(server, n), t.float()), n
        # Refused (an unknown name): answered only after its bytes, and the round loads nothing.
        post(server, vllm.START_WEIGHT_UPDATE)
        bad = [("model.norm.weight", torch.zeros(64)), ("model.no_such.weight", torch.zeros(3))]
        reply = pool.submit(post, server, vllm.UPDATE_WEIGHTS, body(bad), query=ack)
        time.sleep(0.3)
        assert not reply.done()
        vg.send_weights(group, bad, True, 3000)
        assert_error(reply.result(timeout=60), 400, "model.no_such.weight")
        assert_error(post(server, vllm.FINISH_WEIGHT_UPDATE, vllm.finish_weight_update_request("ack-3")), 400)
        assert http(server, vllm.WEIGHT_INFO)[1] == {"weight_version": "ack-2"}
        # Receives posted, no bytes coming: the shutdown ends them at once.
        post(server, vllm.START_WEIGHT_UPDATE)
        assert post(server, vllm.UPDATE_WEIGHTS, body(version()), query=ack, timeout=20)[0] == 200
        t0 = time.monotonic()
        assert post(server, vllm.SHUTDOWN_WEIGHT_TRANSFER, timeout=20)[0] == 200
        assert time.monotonic() - t0 < 15
        assert http(server, vllm.WEIGHT_INFO)[1] == {"weight_version": "ack-2"}
    finally:
        group.close()
        post(server, vllm.SHUTDOWN_WEIGHT_TRANSFER)
        group, _ = _init(pool, server, packed=True)  # the checkpoint back for the other tests
        post(server, vllm.START_WEIGHT_UPDATE)
        restore = [(n, original[n]) for n, _, _ in names]
        assert _update(pool, server, group, restore, packed=True)[0][0] == 200
        post(server, vllm.FINISH_WEIGHT_UPDATE, vllm.finish_weight_update_request("default"))
        post(server, vllm.SHUTDOWN_WEIGHT_TRANSFER)
        group.close()


def test_debug_update_delay_slows_both_protocols(model_dir, tmp_path, pool):
    log = tmp_path / "slow.log"
    proc, url = start_server(model_dir, log, "--debug-update-delay-s", "0.6")
    try:
        t = [("model.norm.weight", torch.ones(64))]
        group, _ = _init(pool, url)
        post(url, vllm.START_WEIGHT_UPDATE)
        t0 = time.monotonic()
        assert _update(pool, url, group, t, packed=False)[0][0] == 200
        assert time.monotonic() - t0 >= 0.6
        post(url, vllm.FINISH_WEIGHT_UPDATE, {})
        post(url, vllm.SHUTDOWN_WEIGHT_TRANSFER)
        group.close()
        # SGLang's update from disk goes through the same knob
        assert post(url, "/begin_weight_update", {})[0] == 200
        t0 = time.monotonic()
        assert post(url, "/update_weights_from_disk", {"model_path": model_dir})[0] == 200
        assert time.monotonic() - t0 >= 0.6
    finally:
        stop_server(proc, log)


def test_completions_errors_name_the_refused_field(server, model_dir):
    """Issue 48 item 6: a sampling value the engine refuses names its own
    field (not "prompt"), also with several prompts, on /v1/completions and on
    vLLM's native /generate; a null body is "null", not Python's "NoneType"."""
    p = {"model": model_dir, "prompt": [5, 6, 7], "max_tokens": 2}
    for field, value, words in [("n", 0, "n must be"), ("temperature", -1.0, "temperature must be"),
                                ("top_p", 0.0, "top_p must be"), ("min_tokens", 5, "min_tokens must be")]:
        for prompt in ([5, 6, 7], [[5, 6, 7], [8, 9]]):
            err = assert_error(http(server, vllm.COMPLETIONS, {**p, "prompt": prompt, field: value}, valid=False),
                               400, words)
            assert err["param"] == field and not err["message"].startswith("prompt"), err
        err = assert_error(post(server, "/generate", {"prompt": {"prompt_token_ids": [5, 6]}, "max_tokens": 2,
                                                      field: value}), 400, words)
        assert err["param"] == field, err
    # the prompt's own faults still name the prompt
    assert assert_error(http(server, vllm.COMPLETIONS, {**p, "prompt": [[5], [10**6]]}), 400, "prompt 1")["param"] == "prompt"
    for raw, kind in [(b"null", "got null"), (b"[1]", "got an array"), (b'"x"', "got a string"), (b"3", "got a number")]:
        err = assert_error(http_json(server + vllm.COMPLETIONS, raw, "POST", 60), 400, "must be a JSON object", kind)
        assert "NoneType" not in err["message"], err


def test_completions_logprob_tokens_are_the_tokens_texts(server, chat_server, model_dir):
    """The logprob names a reply builds from each distinct token once
    (``token_names``) are each token's own text, in every place vLLM puts them."""
    out = complete(server, {"model": model_dir, "prompt": [5, 6, 7], "max_tokens": 6, "n": 3, "logprobs": 2,
                            "temperature": 1.0, "return_token_ids": True, "ignore_eos": True})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    for c in out["choices"]:
        lp = c["logprobs"]
        assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in c["token_ids"]], c
        assert all(lp["tokens"][i] in lp["top_logprobs"][i] and len(lp["top_logprobs"][i]) <= 3
                   for i in range(len(lp["tokens"]))), lp
    status, chat = post(chat_server, vllm.CHAT_COMPLETIONS, {
        "messages": MESSAGES, "max_completion_tokens": 5, "n": 2, "logprobs": True, "top_logprobs": 2,
        "return_token_ids": True, "ignore_eos": True})
    assert status == 200, chat
    for c in chat["choices"]:
        content = c["logprobs"]["content"]
        assert [e["token"] for e in content] == [tok.decode([t], skip_special_tokens=False) for t in c["token_ids"]]
        assert all(e["bytes"] == list(e["token"].encode()) and len(e["top_logprobs"]) == 2 for e in content)
        assert all(e["top_logprobs"][0]["token"] == e["token"] for e in content)  # the sampled token first
