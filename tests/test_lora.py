"""LoRA (torchtitan_grpo.lora.adapters, lora_peft, lora_config): adapters on a frozen
base, merged weights for the push and the export, the peft export.

Tiny fp32 models on CPU, one process: the demo's tiny Qwen3 and an untied
tiny Llama written here (its wq/wk rows are permuted by TorchTitan's
state-dict adapter, which the peft export must repeat on B). Adapters get a
random, non-zero B before a comparison: a freshly initialised B is zero and
would make the adapted model equal to the base whatever the code did.
"""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

import torchtitan_grpo  # noqa: F401  (before torchtitan)
from torchtitan_grpo.lora import adapters as lora
from torchtitan_grpo.models import hf_bridge as hf_model
from torchtitan_grpo.train.sample import Sample

torch.set_num_threads(1)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "train_configs", "demo_cpu.toml")
SEQ = 16
ADAPTED = 7 * 2  # seven projections in each of two layers


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    """A tiny untied LlamaForCausalLM (GQA, norms away from 1)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("lora") / "llama")
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=1,
                         pad_token_id=0)
    torch.manual_seed(11)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def dirs(tiny_model_dir, llama_dir) -> dict[str, str]:
    return {"qwen3": tiny_model_dir, "llama3": llama_dir}


def _cfg(**kw):
    base = dict(enable=True, rank=4, alpha=8.0, dropout=0.0, target_modules=["wq", "wk", "wv", "wo", "w1", "w2", "w3"])
    return SimpleNamespace(**(base | kw))


def _titan(name: str, path: str):
    args = hf_model.model_args_from_hf(name, hf_model.load_hf_config(path), max_seq_len=64)
    model = hf_model.build_model(name, args, "cpu")
    adapter = hf_model.state_dict_adapter(name, args, path)
    hf_model.load_hf_weights(model, adapter, path)
    return model.eval(), adapter


@torch.no_grad()
def _randomise_adapters(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for m in lora.adapted_modules(model).values():
        m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * 0.3)
        m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.3)


def _ids() -> torch.Tensor:
    return torch.randint(2, 97, (2, SEQ), generator=torch.Generator().manual_seed(5))


# ------------------------------------------------------------ the module


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_adapter_forward_equals_merged_forward(dirs, name):
    """The adapted model's logits equal those of a plain model holding the
    merged weights; the live base weights are not modified by the merge."""
    model, _ = _titan(name, dirs[name])
    base_logits = model(_ids())
    names = lora.apply_lora(model, _cfg())
    assert len(names) == ADAPTED and names[0] == "layers.0.attention.wq"
    assert torch.equal(model(_ids()), base_logits)  # B = 0: the base model exactly
    _randomise_adapters(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = lora.merged_state(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    plain, _ = _titan(name, dirs[name])
    assert merged.keys() == plain.state_dict().keys()  # no adapter keys, every base key
    plain.load_state_dict(merged)
    with torch.no_grad():
        got, want = model(_ids()), plain(_ids())
    assert (got - base_logits).abs().max() > 0.1  # the adapters matter
    # fp32, two summation orders through two layers: 4e-6 seen on logits of size 0.6
    assert (got - want).abs().max() <= 1e-5
    # one projection: x W^T + s (x A^T) B^T against x (W + s B A)^T, to float precision
    wq = lora.adapted_modules(model)["layers.0.attention.wq"]
    x = torch.randn(8, wq.in_features, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        y, y_merged = wq(x), x @ merged["layers.0.attention.wq.weight"].T
    assert (y - y_merged).abs().max() <= 1e-6 * y.abs().max()


def test_only_adapters_train_and_the_loss_falls(tiny_model_dir):
    """Three GRPO steps on one batch with lora.enable: the optimizer holds A
    and B only, every base tensor stays bit-identical, every B moves off zero,
    and the loss falls."""
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.train.trainer import build_policy, init_distributed, train_step

    cfg = parse_config(["--job.config_file", DEMO, "--model.hf_assets_path", tiny_model_dir,
                        "--lora.enable", "--lora.rank", "4", "--lora.alpha", "8",
                        "--grpo.micro_batch_size", "4", "--grpo.is_correction", "none",
                        "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "1"])
    d = init_distributed()
    policy = build_policy(cfg, tiny_model_dir, d)
    adapters = lora.adapted_modules(policy.model)
    trained = [p for g in policy.optimizers.optimizers[0].param_groups for p in g["params"]]
    assert len(adapters) == ADAPTED
    assert {id(p) for p in trained} == {id(p) for m in adapters.values() for p in (m.lora_A, m.lora_B)}
    base = {k: v.detach().clone() for k, v in lora.merged_state(policy.model).items()}  # B = 0: the base
    A0 = {k: m.lora_A.detach().clone() for k, m in adapters.items()}

    g = torch.Generator().manual_seed(3)
    batch = []
    for i in range(4):
        ids = torch.randint(2, 97, (9,), generator=g).tolist()
        batch.append(Sample(ids[:3], ids[3:], [-math.log(128)] * 6, (-1.0) ** i, 0.0, "stop", ["0"]))
    ntok = sum(len(s.completion_ids) for s in batch)
    losses = [train_step(policy, batch, cfg.grpo, 1.0, 8, len(batch), ntok, 0, d)["loss"] for _ in range(3)]
    assert losses[2] < losses[0] - 1e-3, losses
    live = {k: v for k, v in policy.model.state_dict().items() if not k.endswith(("lora_A", "lora_B"))}
    assert live.keys() == base.keys()
    assert all(torch.equal(live[k], base[k]) for k in base), "a base weight changed"
    for k, m in adapters.items():
        assert m.lora_B.abs().max() > 0, k
        assert not torch.equal(m.lora_A, A0[k]), k


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_merged_hf_state_is_the_hand_merge(dirs, name):
    """merged_hf_state (and the one-rank push's tensors) equal W + alpha/r B A
    per adapted weight, merged by hand and named by the state-dict adapter;
    the other weights are the base's."""
    from torchtitan_grpo.weight_sync.gather import DirectPush

    model, adapter = _titan(name, dirs[name])
    base_hf = {k: v.clone() for k, v in hf_model.hf_state_dict(model, adapter).items()}
    lora.apply_lora(model, _cfg(target_modules=["wq", "wk", "w2"]))
    _randomise_adapters(model, seed=1)
    by_hand = {}
    for fqn, m in lora.adapted_modules(model).items():
        by_hand[f"{fqn}.weight"] = m.weight.detach() + 2.0 * (m.lora_B.detach() @ m.lora_A.detach())
    hand_hf = adapter.to_hf(by_hand)
    assert len(hand_hf) == 3 * 2
    got = lora.merged_hf_state(model, adapter)
    pushed = DirectPush([model], adapter, None, sync=True).tensors()
    assert got.keys() == base_hf.keys() == pushed.keys()
    for k, v in got.items():
        want = hand_hf.get(k, base_hf[k])
        assert torch.allclose(v, want, atol=1e-6, rtol=0), k
        assert torch.equal(pushed[k], v), k
        assert (k in hand_hf) == (not torch.equal(v, base_hf[k])), k


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_export_loads_in_transformers_and_peft(dirs, name, tmp_path):
    """export_hf with LoRA: the merged checkpoint gives our logits in
    transformers, and lora_adapter/ loaded by peft on the base gives them too
    (llama3: B of q_proj/k_proj permuted like the rows of wq/wk)."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from torchtitan_grpo.train.checkpoint import export_hf
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.lora.peft import ADAPTER_FOLDER
    from torchtitan_grpo.train.trainer import build_policy, init_distributed

    path = dirs[name]
    cfg = parse_config(["--job.config_file", DEMO, "--model.name", name, "--model.hf_assets_path", path,
                        "--lora.enable", "--lora.rank", "4", "--lora.alpha", "8"])
    d = init_distributed()
    policy = build_policy(cfg, path, d)
    _randomise_adapters(policy.model, seed=2)
    out = export_hf(policy, path, str(tmp_path / "export"), d)
    policy.model.eval()
    with torch.no_grad():
        ours = policy.model(_ids())

    def hf(p):
        return AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32, attn_implementation="eager").eval()

    base = hf(path)
    with torch.no_grad():
        assert (base(_ids()).logits - ours).abs().max() > 0.1  # the adapters matter
        assert (hf(out)(_ids()).logits - ours).abs().max() <= 1e-4
    folder = os.path.join(out, ADAPTER_FOLDER)
    config = json.load(open(os.path.join(folder, "adapter_config.json")))
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8, os.path.abspath(path))
    peft_model = PeftModel.from_pretrained(base, folder).eval()
    saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
    assert saved.keys() == get_peft_model_state_dict(peft_model).keys()
    assert len(saved) == 2 * ADAPTED and "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in saved
    with torch.no_grad():
        assert (peft_model(_ids()).logits - ours).abs().max() <= 1e-4
    wq = lora.adapted_modules(policy.model)["layers.0.attention.wq"]
    q_b = saved["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert torch.equal(saved["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"], wq.lora_A.detach())
    assert torch.equal(q_b, wq.lora_B.detach()) is (name == "qwen3")  # llama3: rows permuted


# ------------------------------------------------------------ config


@pytest.mark.parametrize("change, key", [
    ({"rank": 0}, "lora.rank"),
    ({"alpha": 0.0}, "lora.alpha"),
    ({"dropout": 1.0}, "lora.dropout"),
    ({"target_modules": []}, "lora.target_modules"),
    ({"target_modules": ["q_proj"]}, "lora.target_modules"),
    ({"target_modules": ["wq", "wq"]}, "lora.target_modules"),
    ({"tp": 2, "pp": 2}, "lora.enable"),  # TP alone is fine (test_lora_pp.py)
    ({"tp": 2, "dropout": 0.1}, "lora.dropout"),
    ({"base_dtype": "float16"}, "lora.base_dtype"),
    ({"last_save_in_hf": True}, "checkpoint.last_save_in_hf"),
])
def test_config_errors_name_the_key(change, key):
    from torchtitan_grpo.config.checks import _check, ConfigError
    from torchtitan_grpo.config.lora import LoRA, validate_lora

    lo = LoRA(enable=True, **{k: v for k, v in change.items() if k in LoRA.__dataclass_fields__})
    cfg = SimpleNamespace(lora=lo, parallelism=SimpleNamespace(tensor_parallel_degree=change.get("tp", 1),
                                                                pipeline_parallel_degree=change.get("pp", 1)),
                          checkpoint=SimpleNamespace(last_save_in_hf=change.get("last_save_in_hf", False),
                                                     hf_export=change.get("hf_export", False)))
    with pytest.raises(ConfigError, match=f"config key {key} "):
        validate_lora(cfg, _check)
    validate_lora(SimpleNamespace(**{**vars(cfg), "lora": LoRA(enable=False, rank=0)}), _check)  # off: unchecked


def test_cli_and_layout_refusal(tiny_model_dir):
    from torchtitan_grpo.config.parse import parse_config

    cfg = parse_config(["--job.config_file", DEMO, "--model.hf_assets_path", tiny_model_dir,
                        "--lora.enable", "--lora.target_modules", "wq,w2"])  # TorchTitan's list form
    assert cfg.lora.enable and cfg.lora.target_modules == ["wq", "w2"] and cfg.lora.rank == 16
    with pytest.raises(ValueError, match="lora.enable .* parallelism.context_parallel_degree = 2"):
        lora.check_layout(SimpleNamespace(data_parallel_shard_degree=2, context_parallel_degree=2))
    with pytest.raises(ValueError, match="lora.enable .*tensor_parallel_degree = 2 and pipeline_parallel_degree"):
        lora.check_layout(SimpleNamespace(tensor_parallel_degree=2, pipeline_parallel_degree=2))
    lora.check_layout(SimpleNamespace(data_parallel_shard_degree=2, tensor_parallel_degree=2))  # FSDP x TP: lora_tp
    lora.check_layout(SimpleNamespace(data_parallel_shard_degree=2, data_parallel_replicate_degree=2))  # HSDP: fine
    lora.check_layout(SimpleNamespace(pipeline_parallel_degree=2))  # PP: fine (lora_pp)
    model, _ = _titan("qwen3", tiny_model_dir)
    assert lora.apply_lora(model, _cfg(target_modules=["w2"])) == ["layers.0.feed_forward.w2",
                                                                   "layers.1.feed_forward.w2"]


# ------------------------------------------------------------ a real push


@pytest.mark.slow
def test_merged_push_reaches_a_builtin_server(server, tiny_model_dir):
    """The one-rank push (DirectPush over gloo, sync) of a LoRA policy: the
    built-in server then scores a prompt with the trainer's own log-probs."""
    from tests.server_procs import http_json
    from torchtitan_grpo.aio import LoopThread
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.train.trainer import build_policy, init_distributed
    from torchtitan_grpo.weight_sync.gather import trainer_push
    from torchtitan_grpo.weight_sync.pusher import Pusher, PushConfig

    cfg = parse_config(["--job.config_file", DEMO, "--model.hf_assets_path", tiny_model_dir,
                        "--lora.enable", "--lora.rank", "4", "--lora.alpha", "8"])
    d = init_distributed()
    policy = build_policy(cfg, tiny_model_dir, d)
    _randomise_adapters(policy.model, seed=4)
    prompt = _ids()[0].tolist()
    policy.model.eval()
    with torch.no_grad():
        logp = torch.log_softmax(policy.model(torch.tensor([prompt]))[0], dim=-1)
    want = torch.tensor([logp[t - 1, prompt[t]].item() for t in range(1, len(prompt))])

    def served() -> torch.Tensor:
        body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        status, out = http_json(server + "/generate", json.dumps(body).encode(), "POST", timeout=60)
        assert status == 200, out
        return torch.tensor([g[0] for g in out["meta_info"]["input_token_logprobs"][1:]])

    assert (served() - want).abs().max() > 1e-2  # the base still served
    loop = LoopThread()
    pusher = Pusher(loop, [server], PushConfig(mode="sync"), d.device)
    try:
        pusher.connect(initial_version=0)
        push = trainer_push(policy.model_parts, policy.adapter, policy.parallel_dims, d.device, pusher,
                            SimpleNamespace(mode="sync"))
        push.snapshot(1, wait=True)
        push.close()
    finally:
        pusher.close()
        loop.close()
    torch.testing.assert_close(served(), want, atol=1e-5, rtol=0)
