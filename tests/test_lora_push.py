"""Adapter push (weight_sync.lora_push = "adapter", issue 40): the trainer's
transport (weight_sync/adapter_push.py) against the built-in server's LoRA
routes (server/receive/lora.py), in this process, on the demo's tiny Qwen3.

Adapters get random, non-zero A and B: a zero B would leave the base and
make every comparison pass whatever the code did.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import torchtitan_grpo  # noqa: F401  (before torchtitan)
from torchtitan_grpo.protocol import sglang as sglang_proto
from torchtitan_grpo.protocol import vllm as vllm_proto

TARGETS = ("q_proj", "v_proj", "down_proj")
RANK, ALPHA = 4, 8.0
PROMPT = [3, 9, 14, 5, 22, 7, 11]


def _base(model_dir: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(model_dir, "model.safetensors"))


def _adapter(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """peft-named random A [r, in], B [out, r] on TARGETS of every layer."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in sorted(base.items()):
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in TARGETS:
            module = name[: -len(".weight")]
            out[f"base_model.model.{module}.lora_A.weight"] = torch.randn(RANK, w.shape[1], generator=g) * 0.2
            out[f"base_model.model.{module}.lora_B.weight"] = torch.randn(w.shape[0], RANK, generator=g) * 0.2
    return out


def _merged(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(base)
    for key, a in adapter.items():
        if ".lora_A." in key:
            module = key[len("base_model.model."): -len(".lora_A.weight")]
            b = adapter[key.replace(".lora_A.", ".lora_B.")]
            out[f"{module}.weight"] = torch.addmm(base[f"{module}.weight"], b, a, alpha=ALPHA / RANK)
    return out


def _config() -> dict:
    return {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(TARGETS),
            "use_rslora": False, "use_dora": False}


def _logprobs(engine) -> torch.Tensor:
    return torch.log_softmax(engine.prompt_logits(PROMPT).float(), dim=-1)


def _push(url: str, tensors_by_version: dict[int, dict], folder: str, **cfg):
    """A Pusher (sync) to ``url`` sending each version in turn; returns its transport."""
    from torchtitan_grpo.aio import LoopThread
    from torchtitan_grpo.weight_sync.pusher import Pusher, PushConfig

    loop = LoopThread()
    pusher = Pusher(loop, [url], PushConfig(mode="sync", disk_folder=folder, deadline_s=60, **cfg),
                    torch.device("cpu"))
    try:
        pusher.connect(initial_version=0)
        for v, tensors in tensors_by_version.items():
            pusher.push(tensors, v)
            assert pusher.status()[0]["admitted"], pusher.status()
        return pusher.transport
    finally:
        pusher.close()
        loop.close()


@pytest.fixture(scope="module")
def merged_reference(tiny_model_dir, tmp_path_factory):
    """Log-probs of a server that got version 1 as a merged full-weight push (disk)."""
    from tests.server_procs import in_process_server

    base = _base(tiny_model_dir)
    with in_process_server(["--model", tiny_model_dir, "--port", "0"]) as (url, engine):
        before = _logprobs(engine)
        _push(url, {1: _merged(base, _adapter(base, seed=1))}, str(tmp_path_factory.mktemp("merged")),
              backend="disk")
        assert engine.weight_version == "1"
        after = _logprobs(engine)
    assert (after - before).abs().max() > 1e-2  # the adapter changes the model
    return after


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_adapter_push_matches_a_merged_push_and_merges_onto_the_base(protocol, tiny_model_dir, merged_reference,
                                                                     tmp_path):
    from tests.server_procs import in_process_server
    from torchtitan_grpo.aio import LoopThread
    from torchtitan_grpo.fleet.pool import InferencePool, PoolConfig
    from torchtitan_grpo.fleet.types import SamplingParams
    from torchtitan_grpo.weight_sync.pusher import Pusher, PushConfig

    base = _base(tiny_model_dir)
    a1, a2 = _adapter(base, seed=1), _adapter(base, seed=2)
    with in_process_server(["--model", tiny_model_dir, "--port", "0"]) as (url, engine):
        loop = LoopThread()
        named: list[tuple[str, str]] = []
        pusher = Pusher(loop, [url], PushConfig(mode="sync", backend="adapter", protocol=protocol,
                                                disk_folder=str(tmp_path), adapter_config=_config(), deadline_s=60),
                        torch.device("cpu"))
        pusher.transport.on_adapter = lambda u, name: named.append((u, name))
        try:
            pusher.connect(initial_version=0)
            pusher.push(a1, 1)
            assert engine.weight_version == "1"
            torch.testing.assert_close(_logprobs(engine), merged_reference, atol=1e-5, rtol=0)
            pusher.push(a2, 2)
            assert pusher.status()[0]["admitted"] and pusher.status()[0]["version"] == 2
        finally:
            pusher.close()
            loop.close()
        assert engine.weight_version == "2"
        assert named == [(url, "grpo-lora-v1"), (url, "grpo-lora-v2")]
        # version 2 is W0 + scale B2 A2: merged onto the base, not onto version 1
        want = _merged(base, a2)
        state = engine.model.state_dict()
        for name, w in want.items():
            torch.testing.assert_close(state[name], w, atol=1e-6, rtol=0, msg=name)
        # each version's peft folder carries the adapter's config
        with open(os.path.join(tmp_path, "v2", "adapter_config.json")) as f:
            assert json.load(f)["r"] == RANK

        # the pool names the replica's adapter in its requests (vLLM refuses an unknown model name)
        async def generate(adapter: str):
            pool = InferencePool([url], PoolConfig(backend=protocol, model=tiny_model_dir, max_retries=1))
            pool.set_adapter(url, adapter)
            await pool.start()
            try:
                return await pool.generate(PROMPT, 2, SamplingParams(max_new_tokens=3, temperature=1.0))
            finally:
                await pool.close()

        out = asyncio.run(generate("grpo-lora-v2"))
        assert len(out) == 2 and all(c.weight_version == "2" for c in out)
        if protocol == "vllm":
            with pytest.raises(Exception, match="grpo-lora-v1"):  # unloaded: vLLM's 404 naming the model
                asyncio.run(generate("grpo-lora-v1"))


def test_route_bodies_and_adapter_fields_keep_the_engines_names():
    """The exact keys of SGLang's and vLLM's LoRA bodies (PROTOCOL_NOTES.md): a renamed field fails here."""
    assert (sglang_proto.LOAD_LORA_ADAPTER, sglang_proto.UNLOAD_LORA_ADAPTER,
            sglang_proto.LOAD_LORA_ADAPTER_FROM_TENSORS) == ("/load_lora_adapter", "/unload_lora_adapter",
                                                             "/load_lora_adapter_from_tensors")
    assert sglang_proto.load_lora_adapter_request("a", "/p") == {"lora_name": "a", "lora_path": "/p", "pinned": False}
    assert sglang_proto.unload_lora_adapter_request("a") == {"lora_name": "a"}
    assert set(sglang_proto.load_lora_adapter_from_tensors_request("a", {"r": 1}, "x")) == {
        "lora_name", "config_dict", "serialized_tensors", "pinned"}
    assert sglang_proto.name_adapter({"input_ids": [1]}, "a") == {"input_ids": [1], "lora_path": "a"}
    assert (vllm_proto.LOAD_LORA_ADAPTER, vllm_proto.UNLOAD_LORA_ADAPTER) == ("/v1/load_lora_adapter",
                                                                              "/v1/unload_lora_adapter")
    assert vllm_proto.load_lora_adapter_request("a", "/p") == {"lora_name": "a", "lora_path": "/p"}
    assert vllm_proto.unload_lora_adapter_request("a") == {"lora_name": "a"}
    assert vllm_proto.name_adapter({"model": "base", "prompt": [1]}, "a") == {"model": "a", "prompt": [1]}
    assert vllm_proto.RUNTIME_LORA_ENV == "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def test_a_bad_adapter_is_refused_in_one_line_and_the_previous_version_serves(tiny_model_dir, tmp_path):
    from safetensors.torch import save_file

    from tests.server_procs import http_json, in_process_server

    base = _base(tiny_model_dir)

    def folder(name: str, tensors: dict | None, config: dict | None = None) -> str:
        path = tmp_path / name
        path.mkdir()
        if tensors is not None:
            save_file(tensors, str(path / "adapter_model.safetensors"))
        if config is not None:
            (path / "adapter_config.json").write_text(json.dumps(config))
        return str(path)

    good = folder("good", _adapter(base, seed=3), _config())
    no_config = folder("no_config", _adapter(base, seed=4))
    stray = dict(_adapter(base, seed=5))
    stray["base_model.model.model.layers.0.self_attn.nope_proj.lora_A.weight"] = torch.zeros(RANK, 8)
    stray["base_model.model.model.layers.0.self_attn.nope_proj.lora_B.weight"] = torch.zeros(8, RANK)
    stray_path = folder("stray", stray, _config())

    def post(url, route, body):
        return http_json(url + route, json.dumps(body).encode(), "POST", timeout=60)

    with in_process_server(["--model", tiny_model_dir, "--port", "0"]) as (url, engine):
        status, out = post(url, "/load_lora_adapter", {"lora_name": "good", "lora_path": good, "weight_version": "7"})
        assert status == 200 and out["success"], out
        served = {k: v.clone() for k, v in engine.model.state_dict().items()}
        for route, body, expect in [
            ("/load_lora_adapter", {"lora_name": "x", "lora_path": no_config, "weight_version": "8"},
             "adapter_config.json: missing"),
            ("/load_lora_adapter", {"lora_name": "y", "lora_path": stray_path, "weight_version": "8"},
             "targets model.layers.0.self_attn.nope_proj, which this model lacks"),
            ("/v1/load_lora_adapter", {"lora_name": "z", "lora_path": str(tmp_path / "absent")},
             "is not a folder"),
            ("/load_lora_adapter", {"lora_name": "good", "lora_path": good}, "already loaded"),
        ]:
            status, out = post(url, route, body)
            message = out.get("error_message") or out.get("error", {}).get("message", "")
            assert status == 400 and expect in message and "\n" not in message, (route, out)
        status, out = post(url, "/load_lora_adapter_from_tensors",
                           {"lora_name": "t", "config_dict": _config(), "serialized_tensors": "x"})
        assert status == 400 and "/load_lora_adapter" in out["message"]
        assert engine.weight_version == "7"
        for k, v in engine.model.state_dict().items():
            assert torch.equal(v, served[k]), k
        # unloading the merged adapter puts the base back
        status, out = post(url, "/unload_lora_adapter", {"lora_name": "good"})
        assert status == 200 and out["loaded_adapters"] == {}
        for k, v in engine.model.state_dict().items():
            if k in base:
                assert torch.equal(v, base[k].to(v.dtype)), k


def test_adapter_push_needs_lora(tiny_model_dir):
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.config.checks import ConfigError

    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train_configs", "demo_cpu.toml")
    with pytest.raises(ConfigError, match="weight_sync.lora_push"):
        parse_config(["--job.config_file", demo, "--model.hf_assets_path", tiny_model_dir,
                      "--weight_sync.lora_push", "adapter"])


def test_demo_trains_lora_with_the_adapter_push_on_policy(tmp_path, tiny_model_dir):
    """The CPU demo with [lora] and weight_sync.lora_push = "adapter": each
    version travels as a peft folder, the built-in server merges it, and the
    next rollouts are the trainer's own policy (sync push, serial loop): a
    server left on the base or on a stale merge would show in the mismatch."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dump = str(tmp_path / "run")
    cmd = [sys.executable, os.path.join(root, "grpo_train.py"), "--job.config_file",
           os.path.join(root, "train_configs", "demo_cpu.toml"), "--model.hf_assets_path", tiny_model_dir,
           "--job.dump_folder", dump, "--training.steps", "3", "--lora.enable", "--lora.rank", "4",
           "--optimizer.lr", "0.05", "--weight_sync.lora_push", "adapter", "--weight_sync.mode", "sync",
           "--rollout.pipeline_depth", "0", "--rollout.reward_fn", "tests.reward_fixtures:varies_with_text"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [m["step"] for m in rows] == [1, 2, 3]
    assert any(m["grad_norm"] > 0 for m in rows[:-1]), rows  # the adapters moved
    for m in rows:
        assert m["trainer_vs_rollout_logprob_max_abs_diff"] <= 1e-4, m
        assert m["weight_version"] == m["step"] and m["push/replica0_version_lag"] == 0, m
    folders = sorted(os.listdir(os.path.join(dump, "pushed_weights")))
    assert folders and all(os.path.isfile(os.path.join(dump, "pushed_weights", v, "adapter_config.json"))
                           for v in folders), folders
