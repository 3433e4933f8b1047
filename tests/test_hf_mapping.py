"""HF <-> TorchTitan mapping (torchtitan_grpo.models.hf_bridge): logits parity both ways.

Tiny fp32 models on CPU. Every parameter, norm weights included, is redrawn at
random before a comparison: default inits set all norms to 1, so a mapping
that swapped two norms would otherwise pass.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import torchtitan_grpo  # noqa: F401  (before torchtitan)
from torchtitan.models.llama3.model.args import RoPEScalingArgs
from torchtitan.models.llama3.model.model import FeedForward as Llama3FeedForward
from torchtitan_grpo.models.hf_bridge import build_model, hf_aliases, hf_state_dict, load_hf_config, load_hf_weights, model_args_from_hf, state_dict_adapter
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

torch.set_num_threads(1)

TOL = 1e-4
SEQ = 24
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
)
# What TorchTitan's llama3 applies by default (RoPEScalingArgs()).
TITAN_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
# A short original context so the scaling changes most frequencies within
# SEQ tokens: a mapping that dropped it would be far outside TOL.
STRONG_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}

CASES = {
    "qwen3-untied": ("qwen3", dict(head_dim=16, tie_word_embeddings=False, rope_theta=1e6)),
    "qwen3-tied": ("qwen3", dict(head_dim=16, tie_word_embeddings=True, rope_theta=1e6)),
    # Qwen3's head_dim is free: 4 heads x 24 != hidden 64.
    "qwen3-wide-heads": ("qwen3", dict(head_dim=24, tie_word_embeddings=False)),
    "llama3-titan-rope": (
        "llama3",
        dict(rope_parameters=TITAN_LLAMA3_ROPE, max_position_embeddings=16384),
    ),
    "llama3-strong-rope": (
        "llama3",
        dict(rope_parameters=STRONG_LLAMA3_ROPE, max_position_embeddings=256),
    ),
    "llama-plain-rope": ("llama3", dict(rope_theta=10000.0)),
}


def _hf_model(model_name: str, overrides: dict) -> torch.nn.Module:
    """A tiny transformers model, eager attention (an independent reference)."""
    kwargs = {"max_position_embeddings": 256, **TINY, **overrides}
    if model_name == "qwen3":
        config = Qwen3Config(**kwargs)
        cls = Qwen3ForCausalLM
    else:
        config = LlamaConfig(**kwargs)
        cls = LlamaForCausalLM
    config._attn_implementation = "eager"
    return cls(config).eval()


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter: norms in [0.5, 1.5], matrices N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():  # tied parameters appear once
            if param.dim() == 1:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


def _ids(seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (2, SEQ), generator=gen)


def _save_hf(
    tmp_path, case: str, seed: int = 0, **save_kwargs
) -> tuple[str, torch.nn.Module]:
    model_name, overrides = CASES[case]
    hf = _hf_model(model_name, overrides)
    _randomize(hf, seed)
    hf_dir = str(tmp_path / case)
    hf.save_pretrained(hf_dir, **save_kwargs)
    return hf_dir, hf


def _titan_from_hf(model_name: str, hf_dir: str):
    args = model_args_from_hf(model_name, load_hf_config(hf_dir), max_seq_len=64)
    model = build_model(model_name, args, "cpu")
    adapter = state_dict_adapter(model_name, args, hf_dir)
    load_hf_weights(model, adapter, hf_dir)
    return model.eval(), adapter


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_titan_logits_match(tmp_path, case):
    model_name = CASES[case][0]
    hf_dir, hf = _save_hf(tmp_path, case)
    titan, adapter = _titan_from_hf(model_name, hf_dir)
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids).logits
        got = titan(ids)
    assert got.shape == (2, SEQ, TINY["vocab_size"])
    assert ref.abs().max() > 0.5  # logits large enough for TOL to mean something
    assert _max_diff(got, ref) < TOL

    # Export gives back the checkpoint bit for bit, in a stable order.
    exported = hf_state_dict(titan, adapter)
    saved = load_file(os.path.join(hf_dir, "model.safetensors"))
    tied = CASES[case][1].get("tie_word_embeddings", False)
    assert ("lm_head.weight" in exported) is not tied
    assert exported.keys() == saved.keys() - ({"lm_head.weight"} if tied else set())
    for name, tensor in exported.items():
        assert torch.equal(tensor, saved[name]), name
    assert list(hf_state_dict(titan, adapter)) == list(exported)


@pytest.mark.parametrize("case", list(CASES))
def test_titan_to_hf_logits_match(tmp_path, case):
    model_name, overrides = CASES[case]
    hf = _hf_model(model_name, overrides)
    hf_config = hf.config.to_dict()
    args = model_args_from_hf(model_name, hf_config, max_seq_len=64)
    titan = build_model(model_name, args, "cpu").eval()
    _randomize(titan, seed=7)
    exported = hf_state_dict(titan, state_dict_adapter(model_name, args, None))

    result = hf.load_state_dict(exported, strict=False)
    assert result.unexpected_keys == []
    if overrides.get("tie_word_embeddings"):
        # The tied head is omitted on export; transformers keeps it tied.
        assert set(result.missing_keys) <= {"lm_head.weight"}
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    else:
        assert result.missing_keys == []
    ids = _ids(seed=3)
    with torch.no_grad():
        ref = titan(ids)
        got = hf(ids).logits
    assert ref.abs().max() > 0.5
    assert _max_diff(got, ref) < TOL


@pytest.mark.parametrize("case", ["qwen3-untied", "qwen3-tied", "llama-plain-rope"])
def test_push_export_follows_the_live_weights(case):
    """What a one-rank trainer pushes (``DirectPush.tensors``, which looks
    the HF names up once) equals a fresh ``hf_state_dict`` after the weights
    change in place, as an optimizer step changes them. qwen3's adapter only
    renames, so the export aliases the parameters; llama3's permutes wq/wk,
    so it is exported afresh every time."""
    from torchtitan_grpo.weight_sync.gather import DirectPush

    model_name, overrides = CASES[case]
    args = model_args_from_hf(model_name, _hf_model(model_name, overrides).config.to_dict(), max_seq_len=64)
    titan = build_model(model_name, args, "cpu")
    adapter = state_dict_adapter(model_name, args, None)
    _randomize(titan, seed=1)
    aliases = hf_aliases(titan, adapter)
    assert (aliases is None) is (model_name == "llama3")
    export = DirectPush([titan], adapter, None, sync=False)
    first = {k: v.clone() for k, v in export.tensors().items()}
    _randomize(titan, seed=2)  # in place, like optimizer.step()
    with torch.no_grad():
        next(titan.parameters()).add_(1.0)
    got, fresh = export.tensors(), hf_state_dict(titan, adapter)
    assert list(got) == list(fresh)
    assert all(torch.equal(got[k], fresh[k]) for k in fresh)
    assert any(not torch.equal(got[k], first[k]) for k in fresh)

    class Pusher:  # what DirectPush.snapshot hands the weights to
        def push(self, tensors, version, wait):
            self.got = (tensors, version, wait)
            return {"time/push_stall_s": 0.0}

    export.pusher = Pusher()
    m = export.snapshot(7)
    assert m["time/push_stall_s"] > 0  # the trainer's stall counts the export
    assert export.pusher.got[1:] == (7, False) and list(export.pusher.got[0]) == list(fresh)


def test_sharded_checkpoint_loads(tmp_path):
    hf_dir, hf = _save_hf(tmp_path, "qwen3-untied", max_shard_size="20KB")
    assert os.path.isfile(os.path.join(hf_dir, "model.safetensors.index.json"))
    assert len([n for n in os.listdir(hf_dir) if n.endswith(".safetensors")]) > 1
    titan, _ = _titan_from_hf("qwen3", hf_dir)
    ids = _ids()
    with torch.no_grad():
        assert _max_diff(titan(ids), hf(ids).logits) < TOL


def test_tied_checkpoint_with_lm_head_loads(tmp_path):
    """Older tied checkpoints also store lm_head.weight; it is ignored (as in
    transformers) because the output projection is the embedding."""
    hf_dir, hf = _save_hf(tmp_path, "qwen3-tied")
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    titan, _ = _titan_from_hf("qwen3", hf_dir)
    assert titan.output.weight is titan.tok_embeddings.weight
    ids = _ids()
    with torch.no_grad():
        assert _max_diff(titan(ids), hf(ids).logits) < TOL


def test_dropping_rope_scaling_is_detected(tmp_path):
    """Negative control: the parity check notices a RoPE that differs."""
    hf_dir, hf = _save_hf(tmp_path, "llama3-strong-rope")
    args = model_args_from_hf("llama3", load_hf_config(hf_dir), max_seq_len=64)
    assert args.rope_scaling_args.scaling_factor == 4.0
    args.rope_scaling_args = RoPEScalingArgs(scaling_factor=1.0)
    titan = build_model("llama3", args, "cpu").eval()
    load_hf_weights(titan, state_dict_adapter("llama3", args, hf_dir), hf_dir)
    ids = _ids()
    with torch.no_grad():
        assert _max_diff(titan(ids), hf(ids).logits) > 100 * TOL


@pytest.mark.parametrize(
    "dim,intermediate",
    [(4096, 14336), (2048, 8192), (64, 96), (64, 1000), (3072, 8192), (960, 2560)],
)
def test_llama3_ffn_width_is_exact(dim, intermediate):
    hf_config = {
        **TINY,
        "model_type": "llama",
        "hidden_size": dim,
        "num_attention_heads": 8,
        "intermediate_size": intermediate,
    }
    args = model_args_from_hf("llama3", hf_config, max_seq_len=8)
    with torch.device("meta"):
        ffn = Llama3FeedForward(
            args.dim, 4 * args.dim, args.multiple_of, args.ffn_dim_multiplier
        )
    assert ffn.w1.out_features == intermediate


def test_transformers4_config_format():
    """Top-level rope_theta + rope_scaling with "type" (pre-5 config.json)."""
    hf_config = {
        **TINY,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [7, 9],
    }
    args = model_args_from_hf("llama3", hf_config, max_seq_len=8)
    assert args.rope_theta == 500000.0
    assert args.rope_scaling_args.scaling_factor == 32.0
    assert args.eos_id == 7
    # A Qwen3 config without head_dim gets transformers' default of 128.
    qwen = model_args_from_hf("qwen3", {**TINY, "model_type": "qwen3"}, max_seq_len=8)
    assert qwen.head_dim == 128 and qwen.rope_theta == 10000.0


# --------------------------------------------------------------------------- #
# Errors name what is wrong
# --------------------------------------------------------------------------- #


def test_missing_dir(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="does not exist.*nope"):
        load_hf_config(missing)


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_hf_config(str(tmp_path))


def test_unparsable_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot parse .*config.json"):
        load_hf_config(str(tmp_path))


def test_no_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_hf_config(str(tmp_path))


def test_index_lists_missing_shard(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        load_hf_config(str(tmp_path))


@pytest.mark.parametrize(
    "rope_field,rope",
    [
        ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
        ("rope_scaling", {"type": "dynamic", "factor": 2.0}),
    ],
)
def test_llama_unsupported_rope_scaling(rope_field, rope):
    hf_config = {**TINY, "model_type": "llama", rope_field: rope}
    pattern = rf"{rope_field}.*'llama3'.*8\.0, 1\.0, 4\.0, 8192"
    with pytest.raises(ValueError, match=pattern):
        model_args_from_hf("llama3", hf_config)


def test_qwen3_rope_scaling_rejected():
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    hf_config = {**TINY, "model_type": "qwen3", "rope_parameters": rope}
    with pytest.raises(ValueError, match="rope_parameters.*'yarn'"):
        model_args_from_hf("qwen3", hf_config)


@pytest.mark.parametrize(
    "model_name,hf_config,pattern",
    [
        ("mistral", {"model_type": "mistral"}, "unsupported model name 'mistral'"),
        ("llama3", {"model_type": "qwen3"}, "model_type='qwen3'.*LlamaForCausalLM"),
        (
            "qwen3",
            {"model_type": "qwen3", "architectures": ["Qwen3MoeForCausalLM"]},
            "Qwen3MoeForCausalLM",
        ),
        ("qwen3", {"model_type": "qwen3", "attention_bias": True}, "attention_bias=True"),
        ("qwen3", {"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window"),
        ("llama3", {"model_type": "llama", "head_dim": 32}, "head_dim=32"),
        ("llama3", {"model_type": "llama", "mlp_bias": True}, "mlp_bias=True"),
    ],
)
def test_unsupported_configs(model_name, hf_config, pattern):
    with pytest.raises(ValueError, match=pattern):
        model_args_from_hf(model_name, {**TINY, **hf_config})


def test_checkpoint_name_mismatch_is_listed(tmp_path):
    hf_dir, _ = _save_hf(tmp_path, "llama3-strong-rope")
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    tensors["model.norm.weight"] = torch.ones(32)
    save_file(tensors, path, metadata={"format": "pt"})
    args = model_args_from_hf("llama3", load_hf_config(hf_dir), max_seq_len=64)
    model = build_model("llama3", args, "cpu")
    with pytest.raises(ValueError) as err:
        load_hf_weights(model, state_dict_adapter("llama3", args, hf_dir), hf_dir)
    message = str(err.value)
    assert "missing: model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected: model.layers.0.self_attn.q_proj.bias" in message
    assert "model.norm.weight (32,) != (64,)" in message


def test_a_pipeline_stage_loads_its_own_tensors_and_checks_the_whole(tmp_path):
    from torchtitan_grpo.models.hf_bridge import checkpoint_names, materialize
    from torchtitan_grpo.distributed.pipeline import split_stage

    hf_dir, _ = _save_hf(tmp_path, "llama3-strong-rope")
    args = model_args_from_hf("llama3", load_hf_config(hf_dir), max_seq_len=64)
    adapter = state_dict_adapter("llama3", args, hf_dir)
    reference = build_model("llama3", args, "cpu")
    load_hf_weights(reference, adapter, hf_dir)

    stage = build_model("llama3", args, "meta")
    whole = checkpoint_names(stage, adapter)
    stage = materialize(split_stage(stage, ["tok_embeddings", "layers.0"]), "cpu")
    load_hf_weights(stage, adapter, hf_dir, whole)
    own = dict(stage.named_parameters())
    assert sorted(own) == sorted(n for n in dict(reference.named_parameters()) if n.startswith(("tok_", "layers.0.")))
    for name, p in reference.named_parameters():
        if name in own:
            assert torch.equal(own[name], p), name  # llama's wq/wk permutation included

    # a tensor only the other stage needs is still required
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.norm.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing: model.norm.weight"):
        load_hf_weights(stage, adapter, hf_dir, whole)


# --------------------------------------------------------------------------- #
# DTensor parameters (FSDP2 over gloo, 2 ranks)
# --------------------------------------------------------------------------- #


FSDP_CASES = ["qwen3-untied", "qwen3-tied", "llama3-strong-rope"]


def _fsdp_cases(rank: int, world: int, jobs: list[tuple[str, str, str]]) -> None:
    """For each (hf_dir, model_name, out), in an initialised gloo group: load
    into a ``world``-way FSDP2 model, run it and export; rank 0 saves the
    results."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    for hf_dir, model_name, out in jobs:
        args = model_args_from_hf(model_name, load_hf_config(hf_dir), max_seq_len=64)
        model = build_model(model_name, args, "cpu").eval()
        fully_shard(model, mesh=mesh)
        params = dict(model.named_parameters())
        assert all(isinstance(p, DTensor) for p in params.values())
        adapter = state_dict_adapter(model_name, args, hf_dir)
        load_hf_weights(model, adapter, hf_dir)
        shard = params["tok_embeddings.weight"].to_local().clone()
        with torch.no_grad():
            logits = model(_ids())
        exported = hf_state_dict(model, adapter)
        if rank == 0:
            torch.save({"logits": logits, "exported": exported, "shard": shard}, out)
    dist.barrier()  # leave together: a peer gone early can abort this rank at exit


def _fsdp_worker(rank: int, world: int, jobs: list[tuple[str, str, str]]) -> None:
    """:func:`_fsdp_cases` in a process pair of its own (GPU machines: the
    shared CPU launch below does not run there). One pair serves every job
    because starting one (importing torchtitan) costs seconds."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{jobs[0][2]}.store", rank=rank, world_size=world
    )
    try:
        _fsdp_cases(rank, world, jobs)
    finally:
        dist.destroy_process_group()


def rank_models(root: str) -> dict[str, str]:
    """The checkpoints of :func:`run_ranks` (tests/multirank.py writes them before its launch)."""
    from pathlib import Path

    return {f"hf_mapping-{case}": _save_hf(Path(root) / "hf_mapping", case)[0] for case in FSDP_CASES}


def run_ranks(out_dir: str, model_dirs: dict[str, str]) -> None:
    """On CPU, in the suite's shared 2-rank launch (tests/multirank.py): the
    FSDP2 cases without a process pair of their own."""
    import torch.distributed as dist

    jobs = [(model_dirs[f"hf_mapping-{c}"], CASES[c][0], os.path.join(out_dir, f"{c}.pt")) for c in FSDP_CASES]
    _fsdp_cases(dist.get_rank(), dist.get_world_size(), jobs)


def test_fsdp_dtensor_load_and_export(tmp_path, request):
    """2-way FSDP2 over gloo: each case loads its HF checkpoint into DTensor
    parameters, runs, and exports. On CPU its ranks are the suite's shared
    2-rank launch (tests/multirank.py: no process pair of its own to start);
    with CUDA (where that launch has no CPU extras) a spawned pair."""
    from transformers import AutoModelForCausalLM

    cases = FSDP_CASES
    if not torch.cuda.is_available():
        launched = request.getfixturevalue("multirank_launched")
        results = launched.extra("test_hf_mapping")
        jobs = [(launched.model_dirs[f"hf_mapping-{c}"], CASES[c][0], str(results / f"{c}.pt")) for c in cases]
    else:
        saved = {case: _save_hf(tmp_path, case)[0] for case in cases}
        jobs = [(saved[c], CASES[c][0], str(tmp_path / f"{c}.pt")) for c in cases]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_fsdp_worker, args=(r, 2, jobs)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        assert [p.exitcode for p in procs] == [0, 0]

    for (hf_dir, _, out), case in zip(jobs, cases):
        # the checkpoint the ranks loaded, as transformers loads it
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        result = torch.load(out)
        ckpt = load_file(os.path.join(hf_dir, "model.safetensors"))
        # Rank 0 holds the first half of the embedding rows (FSDP's Shard(0)).
        embed = ckpt["model.embed_tokens.weight"]
        assert torch.equal(result["shard"], embed[: embed.shape[0] // 2]), case
        with torch.no_grad():
            assert _max_diff(result["logits"], hf(_ids()).logits) < TOL, case
        if CASES[case][1].get("tie_word_embeddings"):
            ckpt.pop("lm_head.weight", None)  # export omits the tied head
        assert result["exported"].keys() == ckpt.keys(), case
        for name, tensor in result["exported"].items():
            assert torch.equal(tensor, ckpt[name]), (case, name)
