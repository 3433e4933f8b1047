"""Qwen3-MoE on TorchTitan's MoE qwen3 (torchtitan_grpo.models.qwen3_moe) and router
replay (torchtitan_grpo.models.router_replay): logits parity with transformers, the
per-expert HF names both ways, replayed routes, the auxiliary loss.

A tiny fp32 Qwen3-MoE written by transformers; every parameter is redrawn at
random (router weights large, so that top-k choices are far from ties).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import torchtitan_grpo  # noqa: F401  (before torchtitan)
from torchtitan_grpo.models import qwen3_moe, router_replay
from torchtitan_grpo.models.hf_bridge import build_model, checkpoint_names, hf_state_dict, load_hf_config, load_hf_weights, model_args_from_hf, state_dict_adapter
from torchtitan_grpo.train.sample import Sample
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

torch.set_num_threads(1)

LAYERS, EXPERTS, TOP_K = 2, 4, 2
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True,
            max_position_embeddings=64, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """(checkpoint dir, transformers model) of one random tiny Qwen3-MoE."""
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 1.0 if "mlp.gate" in name else 0.2)
    out = str(tmp_path_factory.mktemp("tiny_moe"))
    hf.save_pretrained(out)
    return out, hf


@pytest.fixture(scope="module")
def loaded(hf_pair):
    """Our TorchTitan model loaded from the checkpoint, and its adapter."""
    hf_dir, _ = hf_pair
    args = model_args_from_hf("qwen3", load_hf_config(hf_dir))
    model = build_model("qwen3", args, "cpu")
    adapter = state_dict_adapter("qwen3", args, hf_dir)
    load_hf_weights(model, adapter, hf_dir)
    return model.eval(), adapter


def _tokens(rows: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (rows, length), generator=torch.Generator().manual_seed(1))


def _record_routes(model) -> tuple[list, list]:
    """Forward hooks on every router: the list of (layer, expert ids) it fills, and the handles."""
    seen, handles = [], []
    for layer, router in router_replay.moe_routers(model):
        handles.append(router.register_forward_hook(
            lambda _m, _i, out, layer=layer: seen.append((layer, out[1].detach().clone()))))
    return seen, handles


def _routes_of(seen, rows: int, length: int) -> torch.Tensor:
    return torch.stack([ids.reshape(rows, length, TOP_K) for _, ids in sorted(seen, key=lambda p: p[0])], dim=2)


def test_args_mapping(hf_pair):
    args = model_args_from_hf("qwen3", load_hf_config(hf_pair[0]))
    moe = args.moe_args
    assert args.moe_enabled and args.moe_inter_dim == 16 and args.head_dim == 8
    assert (moe.num_experts, moe.top_k, moe.route_norm, moe.score_func) == (EXPERTS, TOP_K, True, "softmax")
    assert moe.num_shared_experts == 0 and moe.load_balance_coeff is None and not moe.gate_bias
    assert not moe.score_before_experts and not moe.use_grouped_mm


def test_logits_match_transformers(hf_pair, loaded):
    _, hf = hf_pair
    model, _ = loaded
    tokens = _tokens()
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_hf_round_trip_per_expert_names(hf_pair, loaded):
    hf_dir, _ = hf_pair
    model, adapter = loaded
    on_disk = load_file(os.path.join(hf_dir, "model.safetensors"))
    exported = hf_state_dict(model, adapter)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in exported
    assert "model.layers.0.mlp.gate.weight" in exported
    assert exported.keys() == on_disk.keys() == checkpoint_names(model, adapter).keys()
    for name, tensor in on_disk.items():
        assert torch.equal(exported[name], tensor), name


def test_replaying_own_routes_is_exact(loaded):
    model, _ = loaded
    tokens = _tokens()
    seen, handles = _record_routes(model)
    with torch.no_grad():
        base = model(tokens)
    for h in handles:
        h.remove()
    own = _routes_of(seen, *tokens.shape)
    with torch.no_grad(), router_replay.replay(model, own.to(torch.int16)):
        again = model(tokens)
    assert torch.equal(base, again)


def test_replay_uses_exactly_the_given_routes(loaded):
    model, _ = loaded
    tokens = _tokens()
    rows, length = tokens.shape
    seen, handles = _record_routes(model)
    with torch.no_grad():
        base = model(tokens)
    own = _routes_of(seen, rows, length)
    seen.clear()
    # different experts everywhere (each a distinct pair), except row 1's first 5 positions: -1
    g = torch.Generator().manual_seed(2)
    given = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(rows * length * LAYERS)])
    given = given.reshape(rows, length, LAYERS, TOP_K)
    given[1, :5] = -1
    counts = []
    for _, router in router_replay.moe_routers(model):
        handles.append(router.register_forward_hook(lambda _m, _i, out: counts.append(out[2].clone())))
    with torch.no_grad(), router_replay.replay(model, given):
        replayed = model(tokens)
    for h in handles:
        h.remove()
    got = _routes_of(seen, rows, length)
    valid = given[..., 0] >= 0
    assert torch.equal(got[valid], given[valid])
    # layer 0 sees no replayed layer before it: its unrouted tokens pick what they picked without replay
    assert torch.equal(got[~valid][:, 0], own[~valid][:, 0])
    # the experts hit (tokens per expert, what the experts compute on) are those of the routes
    for layer, count in enumerate(counts):
        assert torch.equal(count, torch.bincount(got[:, :, layer].reshape(-1), minlength=EXPERTS))
    assert not torch.allclose(replayed, base, atol=1e-3)


def test_gate_gets_gradients_under_replay(loaded):
    model, _ = loaded
    tokens = _tokens()
    given = torch.zeros(*tokens.shape, LAYERS, TOP_K, dtype=torch.long)
    given[..., 1] = 1  # every token to experts 0 and 1
    model.zero_grad()
    with router_replay.replay(model, given):
        model(tokens).logsumexp(-1).sum().backward()
    for _, router in router_replay.moe_routers(model):
        grad = router.gate.weight.grad
        # the gate output at the replayed experts carries the gradient ...
        assert grad[:2].abs().sum() > 0
        # ... and with softmax over all experts, the others' logits get it too
        assert grad[2:].abs().sum() > 0
    model.zero_grad()


def test_replay_rejects_bad_routes(loaded):
    model, _ = loaded
    tokens = _tokens()
    bad_k = torch.zeros(*tokens.shape, LAYERS, TOP_K + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="top_3"):
        with router_replay.replay(model, bad_k):
            pass
    half = torch.zeros(*tokens.shape, LAYERS, TOP_K, dtype=torch.long)
    half[0, 0, 0, 0] = -1
    with pytest.raises(ValueError, match="all top_k experts or none"):
        with router_replay.replay(model, half):
            pass
    wrong_rows = torch.full((3, tokens.shape[1], LAYERS, TOP_K), -1)
    with pytest.raises(ValueError, match="set_chunk"), router_replay.replay(model, wrong_rows[:4].repeat(2, 1, 1, 1)):
        model(tokens)


def test_routes_tensor_follows_pack_layout():
    def sample(p: int, c: int, seed: int) -> Sample:
        s = Sample(list(range(p)), list(range(c)), [0.0] * c, 0.0, 0.0, "stop", [])
        s.routed_experts = np.random.default_rng(seed).integers(0, EXPERTS, (p + c - 1, LAYERS, TOP_K),
                                                                dtype=np.int16)
        return s

    a, b, none = sample(3, 4, 0), sample(2, 2, 1), Sample([1], [2], [0.0], 0.0, 0.0, "stop", [])
    routes = router_replay.routes_tensor([a, b, none], rows=4, length=9)
    assert routes.shape == (4, 9, LAYERS, TOP_K) and routes.dtype == torch.int16
    assert torch.equal(routes[0, :6], torch.from_numpy(a.routed_experts))
    assert (routes[0, 6:] == -1).all()  # the last token (never fed back) and padding
    assert torch.equal(routes[1, :3], torch.from_numpy(b.routed_experts)) and (routes[1, 3:] == -1).all()
    assert (routes[2:] == -1).all()
    packed = router_replay.routes_tensor([a, b], placements=[(0, 0), (0, 7)])
    assert packed.shape[:2] == (1, 11) and torch.equal(packed[0, 7:10], torch.from_numpy(b.routed_experts))
    assert router_replay.routes_tensor([none]) is None
    a.routed_experts = a.routed_experts[:-1]
    with pytest.raises(ValueError, match="sample 0: routed_experts has shape"):
        router_replay.routes_tensor([a])


@pytest.mark.parametrize("field,value", [("decoder_sparse_step", 2), ("mlp_only_layers", [1]),
                                         ("use_sliding_window", True), ("attention_bias", True)])
def test_refused_configs_name_the_field(hf_pair, field, value):
    config = {**load_hf_config(hf_pair[0]), field: value}
    with pytest.raises(ValueError, match=field) as err:
        model_args_from_hf("qwen3", config)
    assert "\n" not in str(err.value)


def test_aux_loss_matches_hand_computation(hf_pair, loaded):
    model, _ = loaded
    tokens = _tokens(rows=2, length=6)
    valid = torch.ones(tokens.shape, dtype=torch.bool)
    valid[1, 4:] = False  # padding
    logits = []
    handles = [router.gate.register_forward_hook(lambda _m, _i, out: logits.append(out.detach()))
               for _, router in router_replay.moe_routers(model)]
    qwen3_moe.enable_aux_loss(model)
    try:
        model(tokens)
        loss = qwen3_moe.aux_loss(model, valid)
    finally:
        qwen3_moe.enable_aux_loss(model, on=False)
        for h in handles:
            h.remove()
    # by hand: over (layer, real token) pairs, the share of top-k slots and the mean probability per expert
    keep = valid.reshape(-1).tolist()
    slots, prob, pairs = [0.0] * EXPERTS, [0.0] * EXPERTS, 0
    for layer_logits in logits:
        for t, row in enumerate(layer_logits.tolist()):
            if not keep[t]:
                continue
            pairs += 1
            z = [float(np.exp(v - max(row))) for v in row]
            p = [v / sum(z) for v in z]
            for e in sorted(range(EXPERTS), key=lambda e: -p[e])[:TOP_K]:
                slots[e] += 1
            prob = [acc + v for acc, v in zip(prob, p)]
    expected = EXPERTS * sum((s / pairs) * (q / pairs) for s, q in zip(slots, prob))
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert loss.requires_grad
    # and transformers' own function on its own router logits (same routing: the logits match)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    with torch.no_grad():
        router_logits = hf_pair[1](tokens, output_router_logits=True).router_logits
    theirs = load_balancing_loss_func(router_logits, EXPERTS, TOP_K, valid.float())
    assert loss.item() == pytest.approx(theirs.item(), rel=1e-5)


def test_demo_writer_moe(tmp_path):
    from torchtitan_grpo.models.demo_assets import main

    out = main([str(tmp_path / "m"), "--moe"])
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["model_type"] == "qwen3_moe" and os.path.isfile(os.path.join(out, "tokenizer.json"))
    args = model_args_from_hf("qwen3", load_hf_config(out))
    assert args.moe_enabled and args.moe_args.num_experts == 8


def test_micro_batch_chunks_take_their_rows(loaded):
    """PP micro-batches: a forward over rows [2, 4) with chunk 1 replays those rows' routes."""
    model, _ = loaded
    tokens = _tokens(rows=4, length=8)
    g = torch.Generator().manual_seed(3)
    given = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(4 * 8 * LAYERS)])
    given = given.reshape(4, 8, LAYERS, TOP_K)
    with torch.no_grad(), router_replay.replay(model, given):
        whole = model(tokens)
        router_replay.set_chunk(model, 1)
        second = model(tokens[2:])
    # Not bitwise: a batch of 2 rows and one of 4 may take differently blocked
    # GEMMs (3e-8 apart on a Xeon without AVX-512, 2026-11-29); a row replaying
    # another row's routes would be off by orders of magnitude more.
    torch.testing.assert_close(second, whole[2:], atol=1e-6, rtol=0)
