"""A tiny HF-format Qwen3 checkpoint and tokenizer, written locally.

The demo and the tests need a real model directory (config.json, safetensors,
tokenizer files) but may download nothing. A character-level tokenizer keeps
the vocabulary small (97 tokens), so a randomly initialised model starts near
chance on the built-in task and can learn it by RL alone in minutes on a CPU.

Token ids: 0 ``<|pad|>``, 1 ``<|endoftext|>`` (EOS), then the 95 printable ASCII
characters 32..126 in order, one token per character.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

PAD, EOS = "<|pad|>", "<|endoftext|>"
CHARS = [chr(c) for c in range(32, 127)]

DEMO_MODEL_DIR = "./outputs/tiny-qwen3"
"""The demo configs' own ``model.hf_assets_path`` (relative to the working
directory): with :data:`DEMO_MOE_MODEL_DIR`, the only paths
``grpo.tiny_model_if_missing`` creates. A path the user gives is never
created; write a tiny model there first with
``python -m torchtitan_grpo.models.demo_assets DIR [--moe]``."""

DEMO_MOE_MODEL_DIR = "./outputs/tiny-qwen3-moe"
"""The MoE demo's (train_configs/demo_moe_cpu.toml) own path: what is written
there is always the tiny Qwen3-MoE, whoever asks (the path names the model)."""


def is_demo_model_dir(path: str) -> bool:
    """Whether ``path`` is one of the demos' own paths (however it is spelled)."""
    return os.path.abspath(path) in (os.path.abspath(DEMO_MODEL_DIR), os.path.abspath(DEMO_MOE_MODEL_DIR))


@dataclass
class TinyQwen3:
    """Shape of the generated model (kept tiny: CPU RL from scratch)."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 256
    vocab_size: int = 128  # >= 97 tokenizer ids; spare rows are never sampled once trained
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    rope_theta: float = 1_000_000.0
    seed: int = 0


@dataclass
class TinyQwen3Moe(TinyQwen3):
    """Shape of a tiny Qwen3-MoE (``Qwen3MoeForCausalLM``): every layer an MoE."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = True  # as Qwen3-30B-A3B


# Qwen3-0.6B's shape (config.json of the HF release), random weights: benchmarks' model of real size.
QWEN3_0_6B = TinyQwen3(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936, max_position_embeddings=4096,
                       tie_word_embeddings=True, rope_theta=1_000_000.0)


def write_tokenizer(out_dir: str) -> None:
    """Write tokenizer.json + tokenizer_config.json (loadable by transformers'
    AutoTokenizer and torchtitan's HuggingFaceTokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {PAD: 0, EOS: 1}
    vocab.update({c: i + 2 for i, c in enumerate(CHARS)})
    # BPE without merges is a plain character vocabulary; splitting into single
    # characters first keeps spaces as their own tokens.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([PAD, EOS])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": PAD,
                "bos_token": None,
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": 512,
            },
            f,
            indent=2,
        )


def write_tiny_qwen3(out_dir: str, shape: TinyQwen3 | None = None) -> str:
    """Write a randomly initialised tiny Qwen3ForCausalLM (``Qwen3MoeForCausalLM``
    for a :class:`TinyQwen3Moe` shape) plus tokenizer to ``out_dir`` and
    return it. Deterministic for a given ``shape.seed``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = shape or TinyQwen3()
    fields = asdict(shape)
    seed = fields.pop("seed")
    moe = isinstance(shape, TinyQwen3Moe)
    config_cls, model_cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen3Config, Qwen3ForCausalLM)
    config = config_cls(
        **fields,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
        rms_norm_eps=1e-6,
        attention_bias=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir)
    return out_dir


def ensure_tiny_qwen3(out_dir: str, shape: TinyQwen3 | None = None) -> str:
    """Create the tiny model at ``out_dir`` unless a config.json is already there.

    Several ranks may call this at once: each writes into its own temporary
    directory and the first rename wins, so nobody reads a half-written model.
    At :data:`DEMO_MOE_MODEL_DIR` a dense shape becomes the MoE one (same
    fields and seed): the start-up asks for the dense demo's shape whatever
    the path.
    """
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    shape = shape or TinyQwen3()
    if os.path.abspath(out_dir) == os.path.abspath(DEMO_MOE_MODEL_DIR) and not isinstance(shape, TinyQwen3Moe):
        shape = TinyQwen3Moe(**asdict(shape))
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{os.path.abspath(out_dir)}.tmp-{os.getpid()}"
    write_tiny_qwen3(tmp, shape)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)  # another rank won the race
    return out_dir


def main(argv: list[str] | None = None) -> str:
    """``python -m torchtitan_grpo.models.demo_assets DIR [--seed N] [--shape tiny|qwen3-0.6b] [--moe] [--force]``:
    write the model to DIR (kept if DIR already holds a config.json, unless
    ``--force``) and print DIR. Scripts and tests that train on a demo model
    at a path of their own call this first."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m torchtitan_grpo.models.demo_assets",
                                description="Write the demo's tiny random Qwen3 (or the Qwen3-0.6B shape, or a "
                                            "tiny Qwen3-MoE) and its character tokenizer to DIR.")
    p.add_argument("out_dir", metavar="DIR")
    p.add_argument("--seed", type=int, default=0, help="init seed (grpo.seed of the run that would write it)")
    p.add_argument("--shape", choices=("tiny", "qwen3-0.6b"), default="tiny")
    p.add_argument("--moe", action="store_true", help="a tiny Qwen3-MoE (8 experts, top 2) instead")
    p.add_argument("--force", action="store_true", help="overwrite a model already in DIR")
    a = p.parse_args(argv)
    base = QWEN3_0_6B if a.shape == "qwen3-0.6b" else TinyQwen3()
    if a.moe and a.shape != "tiny":
        p.error("--moe writes the tiny shape only")
    shape = (TinyQwen3Moe if a.moe else TinyQwen3)(**{**asdict(base), "seed": a.seed})
    out = write_tiny_qwen3(a.out_dir, shape) if a.force else ensure_tiny_qwen3(a.out_dir, shape)
    print(out)
    return out


if __name__ == "__main__":
    main()
