"""An MoE version pushed by the trainer lands in the built-in server.

The trainer sends HF's per-expert checkpoint names (what SGLang and vLLM
load); transformers keeps the experts fused (``gate_up_proj``, ``down_proj``),
so the engine writes each tensor into its slice (``server/engine/expert_views.py``).
After a push of perturbed weights the server's log-probs are the trainer's.
"""

from __future__ import annotations

import pytest
import requests
import torch

import torchtitan_grpo  # noqa: F401  (before torchtitan)
from tests.server_procs import in_process_server
from torchtitan_grpo.models import hf_bridge as tm
from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.models.demo_assets import TinyQwen3Moe, write_tiny_qwen3
from torchtitan_grpo.server.engine.expert_views import expert_views
from torchtitan_grpo.weight_sync.pusher import Pusher, PushConfig

PROMPT = [5, 9, 14, 3, 22, 7]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return write_tiny_qwen3(str(tmp_path_factory.mktemp("models") / "moe"), TinyQwen3Moe(seed=3))


def _trainer(moe_dir: str):
    hf_config = tm.load_hf_config(moe_dir)
    args = tm.model_args_from_hf("qwen3", hf_config, 64)
    model = tm.build_model("qwen3", args, "cpu")
    adapter = tm.state_dict_adapter("qwen3", args, moe_dir)
    tm.load_hf_weights(model, adapter, moe_dir)
    return model, adapter


def test_expert_views_are_slices_of_the_fused_weights(moe_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    views = expert_views(hf)
    shape = TinyQwen3Moe()
    assert len(views) == shape.num_hidden_layers * shape.num_experts * 3
    from safetensors.torch import load_file
    import glob

    saved = {}
    for f in glob.glob(f"{moe_dir}/*.safetensors"):
        saved.update(load_file(f))
    for name, view in views.items():  # the checkpoint's per-expert tensors, as transformers fused them
        assert torch.equal(view, saved[name]), name


@pytest.mark.parametrize("kv_cache", ["dynamic", "static"])
def test_pushed_moe_weights_give_the_server_the_trainers_logprobs(moe_dir, kv_cache):
    model, adapter = _trainer(moe_dir)
    with torch.no_grad():  # a new version: every expert and router moves
        g = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "moe" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    tensors = tm.hf_state_dict(model, adapter)
    assert sum(".mlp.experts." in n for n in tensors) == 2 * 8 * 3  # per-expert names
    with in_process_server(["--model", moe_dir, "--port", "0", "--kv-cache", kv_cache]) as (url, engine):
        loop = LoopThread()
        pusher = Pusher(loop, [url], PushConfig(mode="sync", backend="gloo", protocol="sglang",
                                                master_address="127.0.0.1", deadline_s=120), torch.device("cpu"))
        try:
            pusher.connect(initial_version=0)
            pusher.push(tensors, 1, wait=True)
            assert pusher.status()[0]["admitted"], pusher.status()
        finally:
            pusher.close()
            loop.close()
        body = {"input_ids": PROMPT, "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}
        out = requests.post(url + "/generate", json=body, timeout=60).json()
        assert out["meta_info"]["weight_version"] == "1", out["meta_info"]
    ids = out["output_ids"]
    served = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + ids]))[0, len(PROMPT) - 1 : -1]
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
    assert logits.argmax(-1).tolist() == ids  # greedy under the pushed weights
    torch.testing.assert_close(served, want, atol=1e-4, rtol=0)
