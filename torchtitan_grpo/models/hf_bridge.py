"""Bridge between HF checkpoint directories and TorchTitan models.

An HF directory (``config.json`` + ``*.safetensors`` + tokenizer files) is the
exchange format of this project: the trainer starts from one and the inference
engines read the same names. This module turns its config into TorchTitan model
args, builds the TorchTitan model, and moves weights both ways through the
train spec's own state-dict adapter, so the name/permutation logic stays
TorchTitan's and we only add the checks that make a mismatch loud.

Supported train specs: ``qwen3`` (dense ``Qwen3ForCausalLM``; ``Qwen3MoeForCausalLM``
through :mod:`torchtitan_grpo.models.qwen3_moe`) and ``llama3``
(``LlamaForCausalLM``; with ``tie_word_embeddings`` the model and adapter of
:mod:`torchtitan_grpo.models.llama3_tied`). Anything the TorchTitan model cannot express (biases,
sliding windows, other RoPE types, ...) raises instead of silently producing a
different network.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import distribute_tensor, DTensor

import torchtitan_grpo  # noqa: F401  (installs the triton shim before torchtitan)
from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs
from torchtitan.models.llama3.model.model import FeedForward as Llama3FeedForward
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
from torchtitan_grpo.models import qwen3_moe
from torchtitan_grpo.models.llama3_tied import TiedLlama3ModelArgs, TiedLlama3StateDictAdapter, TiedLlama3Transformer
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter
from torchtitan.protocols.train_spec import get_train_spec

__all__ = ["load_hf_config", "model_args_from_hf", "build_model", "materialize", "state_dict_adapter",
           "load_hf_weights", "checkpoint_names", "hf_state_dict", "hf_aliases"]

# train spec name -> (HF model_type, HF architecture class name)
_SUPPORTED = {
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "llama3": ("llama", "LlamaForCausalLM"),
}

_INDEX_FILE = "model.safetensors.index.json"
# transformers' LlamaConfig/Qwen3Config default when no theta is given at all
_HF_DEFAULT_ROPE_THETA = 10_000.0
# Qwen3Config's dataclass default: a config.json without head_dim gets 128 in
# transformers (not hidden_size // num_attention_heads), so we must too.
_QWEN3_DEFAULT_HEAD_DIM = 128
# Cap on how many names an error message lists.
_MAX_NAMES = 20


# --------------------------------------------------------------------------- #
# Config
# --------------------------------------------------------------------------- #


def _safetensors_files(hf_dir: str) -> list[str]:
    """Return the checkpoint's safetensors files, sorted.

    With a ``model.safetensors.index.json`` the index is authoritative (a
    directory may hold stray files); otherwise every ``*.safetensors`` counts.
    """
    index_path = os.path.join(hf_dir, _INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot read 'weight_map' from {index_path}: {e}") from e
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(hf_dir, n))]
        if missing:
            raise FileNotFoundError(
                f"{index_path} lists shards that are not in {hf_dir}: {missing}"
            )
    else:
        names = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(
            f"no *.safetensors weights (or {_INDEX_FILE}) in HF checkpoint dir {hf_dir}"
        )
    return [os.path.join(hf_dir, n) for n in names]


def load_hf_config(hf_dir: str) -> dict:
    """Read ``config.json`` of an HF checkpoint dir and check weights exist.

    Raises:
        FileNotFoundError: the dir, its config.json or its safetensors are missing.
        ValueError: config.json is not a JSON object.
    """
    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"HF checkpoint dir does not exist: {hf_dir}")
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"config.json not found in HF checkpoint dir {hf_dir}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except ValueError as e:
        raise ValueError(f"cannot parse {config_path} as JSON: {e}") from e
    if not isinstance(config, dict):
        kind = type(config).__name__
        raise ValueError(f"{config_path} must hold a JSON object, got {kind}")
    # Fail here rather than after a model was built: a config without weights
    # is almost always a half-copied or tokenizer-only directory.
    _safetensors_files(hf_dir)
    return config


def _check_architecture(model_name: str, hf_config: dict) -> None:
    """Raise unless ``hf_config`` describes the architecture of ``model_name``."""
    if model_name not in _SUPPORTED:
        raise ValueError(
            f"unsupported model name {model_name!r}; supported: {sorted(_SUPPORTED)}"
        )
    model_type, arch = _SUPPORTED[model_name]
    if model_name == "qwen3" and qwen3_moe.is_moe_config(hf_config):  # same train spec, MoE args
        model_type, arch = qwen3_moe.MODEL_TYPE, qwen3_moe.ARCHITECTURE
    got_type = hf_config.get("model_type")
    archs = hf_config.get("architectures") or []
    if got_type != model_type or (archs and arch not in archs):
        raise ValueError(
            f"config.json describes model_type={got_type!r} architectures={archs}, "
            f"but train spec {model_name!r} needs model_type={model_type!r} ({arch})"
        )


def _require(hf_config: dict, field: str, expected: Any, default: Any, why: str) -> None:
    """Raise if config.json's ``field`` (or its HF default) differs from ``expected``."""
    value = hf_config.get(field, default)
    if value != expected:
        raise ValueError(
            f"config.json field {field}={value!r} is not supported: {why} "
            f"(needs {field}={expected!r})"
        )


def _rope_config(hf_config: dict) -> tuple[dict, str, float]:
    """Return (RoPE dict, name of the config.json field holding it, theta).

    transformers 5 writes ``rope_parameters`` (theta inside it); checkpoints
    written by transformers 4 have ``rope_scaling`` plus a top-level
    ``rope_theta``. Both are read, with the same precedence as transformers.
    """
    field, rope = "rope_parameters", {}
    for name in ("rope_parameters", "rope_scaling"):
        if hf_config.get(name):
            field, rope = name, hf_config[name]
            break
    if not isinstance(rope, dict):
        raise ValueError(f"config.json field {field} must be an object, got {rope!r}")
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(
            f"config.json field {field} holds per-layer RoPE settings, which "
            "TorchTitan's dense models do not support"
        )
    theta = rope.get("rope_theta", hf_config.get("rope_theta", _HF_DEFAULT_ROPE_THETA))
    partial = rope.get(
        "partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0)
    )
    if partial != 1.0:
        raise ValueError(
            f"config.json partial_rotary_factor={partial} is not supported: "
            "TorchTitan rotates the whole head (needs 1.0)"
        )
    return rope, field, float(theta)


def _rope_type(rope: dict) -> str:
    # transformers 4 used the key "type" before "rope_type".
    return rope.get("rope_type", rope.get("type", "default"))


def _eos_id(hf_config: dict, fallback: int) -> int:
    """First EOS id of config.json (it may be a list), else ``fallback``."""
    eos = hf_config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return fallback if eos is None else int(eos)


def _common_checks(hf_config: dict) -> None:
    """Checks shared by the dense Qwen3 and Llama mappings."""
    _require(hf_config, "hidden_act", "silu", "silu", "TorchTitan's FFN is SwiGLU")
    _require(
        hf_config, "attention_bias", False, False, "TorchTitan's attention has no biases"
    )


def _qwen3_args(hf_config: dict, max_seq_len: int) -> Qwen3ModelArgs:
    _common_checks(hf_config)
    _require(
        hf_config,
        "use_sliding_window",
        False,
        False,
        "TorchTitan's qwen3 uses full attention in every layer",
    )
    rope, field, theta = _rope_config(hf_config)
    if _rope_type(rope) != "default":
        raise ValueError(
            f"config.json field {field} has rope_type={_rope_type(rope)!r}; TorchTitan's "
            "qwen3 applies plain RoPE only (needs rope_type 'default', no scaling)"
        )
    n_heads = hf_config["num_attention_heads"]
    defaults = Qwen3ModelArgs()
    return Qwen3ModelArgs(
        dim=hf_config["hidden_size"],
        n_layers=hf_config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf_config.get("num_key_value_heads") or n_heads,
        vocab_size=hf_config["vocab_size"],
        head_dim=hf_config.get("head_dim") or _QWEN3_DEFAULT_HEAD_DIM,
        hidden_dim=hf_config["intermediate_size"],
        norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        qk_norm=True,  # HF Qwen3 always has q_norm/k_norm
        max_seq_len=max_seq_len,
        attn_type="sdpa",
        attn_mask_type="causal",
        eos_id=_eos_id(hf_config, defaults.eos_id),
        enable_weight_tying=bool(hf_config.get("tie_word_embeddings", False)),
        moe_enabled=False,
    )


def _llama3_rope_scaling(hf_config: dict) -> tuple[RoPEScalingArgs, float]:
    """Map config.json's RoPE settings onto TorchTitan's llama3 scaling args.

    TorchTitan's llama3 always runs its Llama-3.1 frequency scaling, but the
    constants are model args, so an HF "llama3" rope maps 1:1. A config with
    no scaling maps to ``scaling_factor=1``, which leaves every frequency
    unchanged (the smoothing then mixes f and f). Other types cannot be
    expressed and raise.
    """
    rope, field, theta = _rope_config(hf_config)
    rope_type = _rope_type(rope)
    if rope_type == "default":
        return RoPEScalingArgs(scaling_factor=1.0), theta
    if rope_type != "llama3":
        raise ValueError(
            f"config.json field {field} has rope_type={rope_type!r}; TorchTitan's llama3 "
            "only implements Llama-3.1 scaling: needs rope_type 'llama3' (factor, "
            "low_freq_factor, high_freq_factor, original_max_position_embeddings; "
            "TorchTitan's defaults are 8.0, 1.0, 4.0, 8192) or no scaling"
        )
    try:
        args = RoPEScalingArgs(
            scaling_factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            # transformers falls back to max_position_embeddings the same way
            original_max_position_embeddings=int(
                rope.get(
                    "original_max_position_embeddings",
                    hf_config.get("max_position_embeddings"),
                )
            ),
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"config.json field {field} lacks a llama3 RoPE key: {e}") from e
    return args, theta


def _llama3_ffn_args(dim: int, intermediate_size: int) -> tuple[int, float | None]:
    """Pick (multiple_of, ffn_dim_multiplier) so TorchTitan's FFN width is exact.

    TorchTitan derives the width as ``int(2 * 4 * dim / 3)``, times the
    multiplier, rounded up to ``multiple_of``. With ``multiple_of`` equal to
    the target, any pre-rounding width in (0, target] rounds to the target;
    the multiplier is only needed to bring a larger default width down.
    """
    base = int(2 * 4 * dim / 3)
    multiplier = None if base <= intermediate_size else intermediate_size / base
    # Build the FFN on meta with TorchTitan's own code so a change in its
    # formula fails here, not as a shape error while loading weights.
    with torch.device("meta"):
        ffn = Llama3FeedForward(dim, 4 * dim, intermediate_size, multiplier)
    if ffn.w1.out_features != intermediate_size:
        raise ValueError(
            f"cannot express intermediate_size={intermediate_size} with TorchTitan's "
            f"llama3 FFN sizing for dim={dim} (got {ffn.w1.out_features})"
        )
    return intermediate_size, multiplier


def _llama3_args(hf_config: dict, max_seq_len: int) -> TransformerModelArgs:
    _common_checks(hf_config)
    _require(hf_config, "mlp_bias", False, False, "TorchTitan's FFN has no biases")
    dim, n_heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or dim // n_heads
    if head_dim * n_heads != dim:
        raise ValueError(
            f"config.json head_dim={head_dim} is not supported: TorchTitan's llama3 "
            f"uses hidden_size // num_attention_heads = {dim // n_heads}"
        )
    scaling, theta = _llama3_rope_scaling(hf_config)
    multiple_of, multiplier = _llama3_ffn_args(dim, hf_config["intermediate_size"])
    defaults = TransformerModelArgs()
    # transformers' LlamaConfig default is untied; tied checkpoints (SmolLM2,
    # Llama 3.2 1B/3B) get the tied variant of TorchTitan's llama3
    tied = bool(hf_config.get("tie_word_embeddings", False))
    args_cls = TiedLlama3ModelArgs if tied else TransformerModelArgs
    return args_cls(
        dim=dim,
        n_layers=hf_config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf_config.get("num_key_value_heads") or n_heads,
        vocab_size=hf_config["vocab_size"],
        multiple_of=multiple_of,
        ffn_dim_multiplier=multiplier,
        norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling_args=scaling,
        max_seq_len=max_seq_len,
        attn_type="sdpa",
        attn_mask_type="causal",
        eos_id=_eos_id(hf_config, defaults.eos_id),
    )


def model_args_from_hf(
    model_name: str, hf_config: dict, max_seq_len: int | None = None
) -> Qwen3ModelArgs | TransformerModelArgs:
    """Build TorchTitan model args that reproduce the HF model exactly.

    Args:
        model_name: train spec name, "qwen3" or "llama3".
        hf_config: the parsed config.json (see :func:`load_hf_config`).
        max_seq_len: length of the precomputed RoPE table; defaults to the
            config's ``max_position_embeddings``. Positions past it fail.

    Raises:
        ValueError: unsupported model name/architecture, or a config feature
            the TorchTitan model cannot express (named in the message).
    """
    _check_architecture(model_name, hf_config)
    if max_seq_len is None:
        max_seq_len = int(hf_config.get("max_position_embeddings", 4096))
    if model_name == "qwen3":
        args = _qwen3_args(hf_config, max_seq_len)
        return qwen3_moe.moe_model_args(args, hf_config) if qwen3_moe.is_moe_config(hf_config) else args
    return _llama3_args(hf_config, max_seq_len)


# --------------------------------------------------------------------------- #
# Model and adapter
# --------------------------------------------------------------------------- #


def _classes(model_name: str, model_args: Any) -> tuple[type, type | None]:
    """(model class, state-dict adapter class) for ``model_args``: the train
    spec's, except tied llama3 args, whose classes TorchTitan lacks."""
    spec = get_train_spec(model_name)
    if model_name == "llama3" and isinstance(model_args, TiedLlama3ModelArgs):
        return TiedLlama3Transformer, TiedLlama3StateDictAdapter
    return spec.model_cls, spec.state_dict_adapter


def build_model(
    model_name: str,
    model_args: Qwen3ModelArgs | TransformerModelArgs,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Build the train spec's model on ``device`` with TorchTitan's random init.

    The model is created on meta (no allocation), materialised with
    ``to_empty`` and initialised by ``init_weights``, which also recomputes the
    non-persistent RoPE buffer on ``device``. Only parameters are cast to
    ``dtype``: llama3's RoPE buffer is complex64 and must stay so.
    """
    model_cls = _classes(model_name, model_args)[0]
    device = torch.device(device)
    with torch.device("meta"):
        model = qwen3_moe.prepare(model_cls(model_args))  # MoE routers: replayable, CPU-capable
    if dtype != torch.float32:
        # Assigning .data keeps Parameter identity, so tied weights stay tied.
        for param in model.parameters():
            param.data = param.data.to(dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    return model


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate a model built on meta (and possibly sharded since) on
    ``device``: each rank allocates only its own shards. Parameters get
    TorchTitan's random init, to be overwritten by :func:`load_hf_weights`;
    the non-persistent RoPE buffer is computed here."""
    device = torch.device(device)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    return model


def state_dict_adapter(
    model_name: str,
    model_args: Qwen3ModelArgs | TransformerModelArgs,
    hf_dir: str | None,
) -> BaseStateDictAdapter:
    """Return the train spec's HF state-dict adapter for ``model_args``."""
    adapter_cls = _classes(model_name, model_args)[1]
    if adapter_cls is None:
        raise ValueError(f"train spec {model_name!r} has no state_dict_adapter")
    return adapter_cls(model_args, hf_dir)


# --------------------------------------------------------------------------- #
# Weights
# --------------------------------------------------------------------------- #


def _read_safetensors(hf_dir: str) -> dict[str, torch.Tensor]:
    """Load every tensor of the checkpoint onto CPU."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(hf_dir):
        shard = load_file(path, device="cpu")
        clash = tensors.keys() & shard.keys()
        if clash:
            raise ValueError(f"{path} repeats tensors of another shard: {_names(clash)}")
        tensors.update(shard)
    return tensors


def _names(names: Iterable[str]) -> str:
    """Sorted, capped list of names for error messages."""
    names = sorted(names)
    shown = ", ".join(names[:_MAX_NAMES])
    more = len(names) - _MAX_NAMES
    return shown + (f" ... and {more} more" if more > 0 else "")


def _is_tied(model: nn.Module) -> bool:
    """Whether the output projection shares the embedding parameter."""
    params = model.state_dict(keep_vars=True)
    out, emb = params.get("output.weight"), params.get("tok_embeddings.weight")
    return out is not None and out is emb


def _check_hf_names(
    hf_tensors: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    hf_dir: str,
) -> None:
    """Raise listing missing, unexpected and wrongly shaped checkpoint tensors."""
    missing = expected.keys() - hf_tensors.keys()
    unexpected = hf_tensors.keys() - expected.keys()
    wrong_shape = [
        f"{k} {tuple(hf_tensors[k].shape)} != {tuple(expected[k].shape)}"
        for k in expected.keys() & hf_tensors.keys()
        if hf_tensors[k].shape != expected[k].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing: {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected: {_names(unexpected)}")
    if wrong_shape:
        problems.append(f"wrong shape: {_names(wrong_shape)}")
    if problems:
        raise ValueError(
            f"HF checkpoint {hf_dir} does not match the model; " + "; ".join(problems)
        )


def _copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into ``param``, sharded or not.

    For a DTensor every rank holds the same full tensor (all read the same
    files), so ``src_data_rank=None`` lets each rank cut its own shard with no
    communication, in the exact layout (e.g. FSDP's Shard(0)) of ``param``.
    """
    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        local = distribute_tensor(
            full, param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def checkpoint_names(model: nn.Module, adapter: BaseStateDictAdapter) -> dict[str, torch.Tensor]:
    """The HF names and shapes ``model`` needs, as shape-only meta tensors.

    The adapter converts meta tensors: no data moves, and the permutations
    and the tied-weight rule are exactly the ones used for real tensors."""
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta")
            for k, v in model.state_dict(keep_vars=True).items()}
    return adapter.to_hf(meta)


def load_hf_weights(model: nn.Module, adapter: BaseStateDictAdapter, hf_dir: str,
                    whole: dict[str, torch.Tensor] | None = None) -> None:
    """Load an HF checkpoint into ``model`` in place, strictly.

    Every parameter must be filled and every checkpoint tensor used; names
    that are missing, unexpected or of the wrong shape raise a ValueError
    listing them. Parameters may be plain tensors or DTensors (FSDP/TP); they
    are written in place, so optimizers and FSDP keep their references.

    ``whole``: ``model`` is one pipeline stage of an untied model whose
    :func:`checkpoint_names` these are; the checkpoint is checked against the
    whole model and only the stage's parameters are filled.

    With tied embeddings an ``lm_head.weight`` in the checkpoint is ignored,
    as transformers does: the output projection is the embedding.
    """
    hf_tensors = _read_safetensors(hf_dir)
    params = model.state_dict(keep_vars=True)
    expected = checkpoint_names(model, adapter) if whole is None else whole
    if _is_tied(model):
        hf_tensors.pop("lm_head.weight", None)
    _check_hf_names(hf_tensors, expected, hf_dir)

    titan = adapter.from_hf(hf_tensors)
    missing, unexpected = params.keys() - titan.keys(), titan.keys() - params.keys()
    if whole is not None:
        unexpected = set()  # the other stages' parameters
    if missing or unexpected:  # an adapter bug, not a checkpoint problem
        raise ValueError(
            f"adapter {type(adapter).__name__} produced a state dict that does not "
            f"match the model; missing: {_names(missing)}; "
            f"unexpected: {_names(unexpected)}"
        )
    done: set[int] = set()
    with torch.no_grad():
        for name, param in params.items():
            if id(param) in done:  # tied: second name of one parameter
                continue
            done.add(id(param))
            _copy_full(param, titan[name])


def hf_state_dict(
    model: nn.Module, adapter: BaseStateDictAdapter
) -> dict[str, torch.Tensor]:
    """Return the model's weights as full tensors under HF names.

    Keys follow the model's parameter order as mapped by the adapter, so
    every rank produces the same sequence. DTensors are gathered with
    ``full_tensor()``, a collective: all ranks of the mesh must call this.
    Unsharded tensors are returned detached but not copied (they alias the
    live parameters), except where the adapter permutes them (llama3 wq/wk).

    With tied embeddings there is no ``lm_head.weight`` key (the adapter
    drops it); HF loaders re-tie it from ``model.embed_tokens.weight``.
    """
    full: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}
    for name, param in model.state_dict(keep_vars=True).items():
        if id(param) not in gathered:  # gather a tied parameter once
            value = param.full_tensor() if isinstance(param, DTensor) else param
            gathered[id(param)] = value.detach()
        full[name] = gathered[id(param)]
    return adapter.to_hf(full)


def hf_aliases(model: nn.Module, adapter: BaseStateDictAdapter) -> list[tuple[str, nn.Parameter]] | None:
    """``(HF name, parameter)`` for every tensor :func:`hf_state_dict` exports,
    when each of them *is* a whole parameter of ``model`` (no DTensor, no
    permutation by the adapter: qwen3 on one rank); None otherwise.

    With this list an export is ``{name: p.detach() for name, p in ...}``: no
    ``state_dict()`` walk and no adapter renaming on every step (together a
    few ms of the trainer's host time per push). It stays true as long as the
    parameters are updated in place, which optimizers and checkpoint loads do.
    """
    exported = hf_state_dict(model, adapter)
    by_storage = {(p.data_ptr(), tuple(p.shape), p.stride(), p.dtype): p
                  for p in model.parameters() if not isinstance(p, DTensor)}
    out: list[tuple[str, nn.Parameter]] = []
    for name, t in exported.items():
        p = by_storage.get((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype))
        if p is None:  # a DTensor gathered, or a tensor the adapter rebuilt
            return None
        out.append((name, p))
    return out
