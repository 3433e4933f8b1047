"""The built-in server serves Qwen3-MoE and returns routed experts (issue 39).

A tiny Qwen3-MoE (fp32, char tokenizer) written here. The routes a greedy
generation returns, over SGLang's /generate and vLLM's /v1/completions and
/v1/chat/completions, on the dynamic and the static KV batch, equal the
expert ids transformers' own routers pick when the whole sequence is run in
one forward; the static batch's grouped-experts MLP gives HF's logits; the
field names are the engines' own; a request that cannot have routes is a 400
naming the field; a malformed routes field is one error naming it.
"""

from __future__ import annotations

import base64
import os

import numpy as np
import pytest
import requests
import torch

from torchtitan_grpo.protocol import route_codec
from torchtitan_grpo.fleet import sglang, vllm
from torchtitan_grpo.fleet.types import MalformedResponse, SamplingParams
from tests.kv_stubs import Req as _Req, Seq as _Seq

LAYERS, TOP_K, EXPERTS = 2, 2, 8
PROMPT = [5, 9, 14, 3, 22, 7]
CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from torchtitan_grpo.models.demo_assets import CHARS, write_tokenizer

    out = str(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe")
    cfg = Qwen3MoeConfig(
        vocab_size=len(CHARS) + 2, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=32, moe_intermediate_size=16, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True, max_position_embeddings=128, bos_token_id=None,
        eos_token_id=1, pad_token_id=0, tie_word_embeddings=False, torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # routers far from ties, experts of distinct sizes: every route is decided
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
            layer.mlp.experts.gate_up_proj.normal_(0.0, 0.2)
            layer.mlp.experts.down_proj.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def hf(moe_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval().requires_grad_(False)


def reference_routes(model, ids: list[int]) -> np.ndarray:
    """[len(ids), layers, top_k]: what each of transformers' routers picks in one forward over ``ids``."""
    picked: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _a, out: picked.append(out[-1]))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(picked, dim=1).numpy()


def same_routes(got: np.ndarray, want: np.ndarray) -> None:
    # The same experts per (position, layer); top-k's order among them is not part of a route.
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.sort(got, axis=-1), np.sort(want, axis=-1))


# ---- the static batch's grouped experts ------------------------------------ #


def test_static_batch_moe_logits_and_routes_match_hf(hf):
    from torchtitan_grpo.server.engine import moe_routes
    from torchtitan_grpo.server.engine.static_batch import StaticBatch, supports

    assert supports(hf) is None
    batch = StaticBatch(hf, torch.device("cpu"), slots=4, max_len=64, routes=True)
    seqs = [_Seq(_Req(PROMPT)), _Seq(_Req([40, 41, 42]))]
    logits = batch.prefill(seqs)
    for _ in range(3):
        nxt = logits.argmax(-1)
        for s, t in zip(seqs, nxt.tolist()):
            s.output_ids.append(t)
        logits = batch.decode(nxt)
    for row, s in zip(logits, seqs):
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([s.context()])).logits[0, -1]
        torch.testing.assert_close(row, want, atol=1e-5, rtol=1e-5)
        # The last token was fed, so every context position has its route.
        s.output_ids.append(0)
        same_routes(moe_routes.assemble(s), reference_routes(hf, s.context()[:-1]))


# ---- served over both protocols --------------------------------------------- #


@pytest.fixture(scope="module", params=["dynamic", "static"])
def moe_server(request, moe_dir):
    from tests.server_procs import in_process_server

    with in_process_server(["--model", moe_dir, "--port", "0", "--kv-cache", request.param,
                            "--enable-return-routed-experts", "--chat-template", CHAT]) as (url, _engine):
        yield url


GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def test_sglang_generate_routes_equal_hf(moe_server, hf):
    body = sglang.generate_request(PROMPT, 2, GREEDY, routes=True)
    assert body["return_routed_experts"] is True
    reply = requests.post(moe_server + "/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    raw = reply.json()
    assert isinstance(raw[0]["meta_info"]["routed_experts"], str)  # base64 of int32, SGLang's encoding
    for c in sglang.parse_generate(raw, 2, moe_server, route_shape=(LAYERS, TOP_K)):
        assert c.routed_experts.dtype == np.int16
        same_routes(c.routed_experts, reference_routes(hf, PROMPT + c.token_ids[:-1]))


def test_sglang_stream_carries_routes_in_its_final_chunk(moe_server, hf):
    import json

    body = {**sglang.generate_request(PROMPT, 1, GREEDY, routes=True), "stream": True}
    reply = requests.post(moe_server + "/generate", json=body, timeout=60)
    events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    *early, last = events
    assert all("routed_experts" not in e["meta_info"] for e in early)
    (c,) = sglang.parse_generate(last, 1, moe_server, route_shape=(LAYERS, TOP_K))
    same_routes(c.routed_experts, reference_routes(hf, PROMPT + c.token_ids[:-1]))


def test_vllm_completions_routes_equal_hf(moe_server, hf):
    body = vllm.completions_request(PROMPT, 1, GREEDY, "m", routes=True)
    reply = requests.post(moe_server + "/v1/completions", json={**body, "model": None}, timeout=60)
    assert reply.status_code == 200, reply.text
    raw = reply.json()
    assert len(raw["prompt_routed_experts"]) == len(PROMPT)  # the prompt's rows, on the response
    (choice,) = raw["choices"]
    assert len(choice["routed_experts"]) == len(choice["token_ids"]) - 1  # the last token was never fed
    (c,) = vllm.parse_completions(raw, 1, moe_server, route_shape=(LAYERS, TOP_K))
    same_routes(c.routed_experts, reference_routes(hf, PROMPT + c.token_ids[:-1]))


def test_vllm_chat_routes_cover_prompt_and_completion(moe_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    reply = requests.post(moe_server + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    raw = reply.json()
    usage = raw["usage"]
    assert len(raw["prompt_routed_experts"]) == usage["prompt_tokens"]
    assert len(raw["choices"][0]["routed_experts"]) == usage["completion_tokens"] - 1
    assert np.asarray(raw["choices"][0]["routed_experts"]).shape[1:] == (LAYERS, TOP_K)


# ---- refusals ---------------------------------------------------------------- #


def _refused(url: str) -> None:
    gen = requests.post(url + "/generate", json={"input_ids": PROMPT, "return_routed_experts": True}, timeout=60)
    assert gen.status_code == 400 and "return_routed_experts" in gen.text, gen.text
    body = vllm.completions_request(PROMPT, 1, GREEDY, "m", routes=True)
    cmpl = requests.post(url + "/v1/completions", json={**body, "model": None}, timeout=60)
    assert cmpl.status_code == 400 and "return_routed_experts" in cmpl.text, cmpl.text
    plain = requests.post(url + "/generate", json={"input_ids": PROMPT}, timeout=60).json()
    assert "routed_experts" not in plain["meta_info"]


def test_routes_without_the_flag_are_a_400(moe_dir):
    from tests.server_procs import in_process_server

    with in_process_server(["--model", moe_dir, "--port", "0"]) as (url, _engine):
        _refused(url)


def test_routes_of_a_dense_model_are_a_400(tiny_model_dir):
    from tests.server_procs import in_process_server

    with in_process_server(["--model", tiny_model_dir, "--port", "0", "--enable-return-routed-experts"]) as (url, _):
        _refused(url)


# ---- the clients: never trusting the field ---------------------------------- #


def _sglang_reply(routes) -> dict:
    return {"output_ids": [7, 8], "meta_info": {
        "output_token_logprobs": [[-0.1, 7], [-0.2, 8]], "finish_reason": {"type": "length"},
        "prompt_tokens": 3, "routed_experts": routes}}


def test_clients_refuse_malformed_routes():
    good = route_codec.encode_sglang(np.arange(4 * LAYERS * TOP_K).reshape(4, LAYERS, TOP_K))
    (c,) = sglang.parse_generate(_sglang_reply(good), 1, "http://r", route_shape=(LAYERS, TOP_K))
    assert c.routed_experts.shape == (4, LAYERS, TOP_K) and c.routed_experts[3, 1, 1] == 15
    bad = {
        "missing": None,
        "not base64": "@@@@",
        "ragged": base64.b64encode(b"\0" * 12).decode(),
        "wrong rows": route_codec.encode_sglang(np.zeros((3, LAYERS, TOP_K))),
        "huge id": route_codec.encode_sglang(np.full((4, LAYERS, TOP_K), 1 << 20)),
    }
    for why, value in bad.items():
        with pytest.raises(MalformedResponse, match=r"meta_info\.routed_experts") as e:
            sglang.parse_generate(_sglang_reply(value), 1, "http://r", route_shape=(LAYERS, TOP_K))
        assert "http://r" in str(e.value), why
    choice = {"index": 0, "token_ids": [7], "logprobs": {"token_logprobs": [-0.1]}, "finish_reason": "length",
              "weight_versions": [{"version": "v", "start": 0, "end": 1}], "routed_experts": [[[1, "2"], [3, 4]]]}
    with pytest.raises(MalformedResponse, match=r"routed_experts\[0\]"):
        vllm.parse_completions({"choices": [choice], "prompt_routed_experts": []}, 1, "http://r",
                               route_shape=(LAYERS, TOP_K))


def test_pool_backend_asks_for_routes_and_samples_carry_them(moe_dir):
    import json

    from torchtitan_grpo.fleet.pool import BACKENDS
    from torchtitan_grpo.fleet.route_backend import route_shape, with_routes

    with open(os.path.join(moe_dir, "config.json")) as f:
        shape = route_shape(json.load(f))
    assert shape == (LAYERS, TOP_K)
    for protocol in ("sglang", "vllm"):
        backend = with_routes(protocol, BACKENDS[protocol](), shape)
        assert backend.build(PROMPT, 1, GREEDY, "m")["return_routed_experts"] is True
    with pytest.raises(ValueError, match="router_replay"):
        route_shape({"num_hidden_layers": 2})


def test_scored_samples_carry_the_routes_and_refuse_misaligned_ones(moe_dir, tmp_path):
    import pickle

    from transformers import AutoTokenizer

    from torchtitan_grpo.fleet.route_backend import replay_shape
    from torchtitan_grpo.fleet.types import Completion
    from torchtitan_grpo.rollout.groups import GroupScorer

    assert replay_shape("off", moe_dir) is None and replay_shape("rollout", moe_dir) == (LAYERS, TOP_K)
    scorer = GroupScorer(AutoTokenizer.from_pretrained(moe_dir), lambda p, t, row: float(len(t)), group_size=2)
    routes = [np.full((len(PROMPT) + n - 1, LAYERS, TOP_K), n, dtype=np.int16) for n in (2, 3)]
    group = [Completion([7] * n, [-0.1] * n, "length", "v", ["v"], "http://r", routed_experts=r)
             for n, r in zip((2, 3), routes)]
    # Pickled as the rollout client process sends it to the trainer.
    scored = pickle.loads(pickle.dumps(scorer.score(0, {"prompt": "x"}, PROMPT, group)))
    for sample, want in zip(scored.samples, routes):
        np.testing.assert_array_equal(sample.routed_experts, want)
    group[0].routed_experts = routes[1]  # one row too many for its completion
    with pytest.raises(MalformedResponse, match="http://r.*routed_experts"):
        scorer.score(0, {"prompt": "x"}, PROMPT, group)
