"""models/gguf.py: a GGUF file -> an HF checkpoint directory. The GGUFs here are
written by the test from a tiny random HF Llama (2 layers, hidden 64, F32
tensors, a byte-level BPE vocabulary of 262 tokens), so the converted model
can be checked against the weights it came from."""

import json
import os
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from torchtitan_grpo.models.gguf import MARKER, convert_gguf, gguf_out_dir, main, resolve_model_dir

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1 (bos), 2 (eos, pad): SmolLM2's
MERGES = ["h e", "l l", "he ll"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HEADS, KV_HEADS = 4, 2


def _vocab() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = [bytes_to_unicode()[b] for b in range(256)]
    return SPECIALS + byte_chars + ["he", "ll", "hell"]


def _hf_model(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(_vocab()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a dropped norm weight shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q/k: per head, the even rotary rows then the
    odd ones (HF keeps the two halves); GGUF readers undo it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _write_gguf(path, model=None, arch: str = "llama", extra_tensor: np.ndarray | None = None) -> None:
    """A GGUF of ``model``'s weights (F32), with llama.cpp's metadata keys and tokenizer."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test llama")
    w.add_context_length(64)
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(16)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(_vocab()))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(_vocab())
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(_vocab()) - len(SPECIALS)))  # 3: control, 1: normal
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(TEMPLATE)
    if model is not None:
        for name, t in model.state_dict().items():
            a = t.float().numpy()
            if name == "model.embed_tokens.weight":
                gname = "token_embd.weight"
            elif name == "model.norm.weight":
                gname = "output_norm.weight"
            elif name == "lm_head.weight":
                if model.config.tie_word_embeddings:
                    continue
                gname = "output.weight"
            else:
                _, _, i, rest = name.split(".", 3)
                module = rest.rsplit(".", 1)[0]
                gname = f"blk.{i}.{_GGUF_NAMES[module]}.weight"
                if module == "self_attn.q_proj":
                    a = _rope_rows(a, HEADS)
                elif module == "self_attn.k_proj":
                    a = _rope_rows(a, KV_HEADS)
            w.add_tensor(gname, np.ascontiguousarray(a))
    if extra_tensor is not None:
        w.add_tensor("blk.0.extra.weight", extra_tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """(the HF model, its GGUF, the GGUF's float32 conversion)."""
    d = tmp_path_factory.mktemp("gguf")
    model = _hf_model(tied=True)
    src = d / "tiny-llama.gguf"
    _write_gguf(src, model)
    return model, str(src), convert_gguf(str(src), str(d / "hf"), dtype="float32")


def test_config_and_tokenizer_files(tied):
    _, _, out = tied
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (64, 2, 4, 2, 16, 262)
    assert cfg["rope_theta"] == 10000.0 and cfg["dtype"] == "float32"
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        tc = json.load(f)
    assert tc["chat_template"] == TEMPLATE
    assert (tc["eos_token"], tc["pad_token"], tc["bos_token"]) == ("<|im_end|>", "<|im_end|>", "<|im_start|>")
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied: stored once


def test_the_files_special_tokens_win_over_what_transformers_reads(tmp_path, monkeypatch):
    # transformers 5.17 (the GPU machines') read SmolLM2's eos as <|im_start|>, id 1, where the file
    # says 2: every rollout's stop token and the padding were then wrong there (runs 130-131).
    import transformers

    from torchtitan_grpo.models.gguf import convert_gguf

    original = transformers.AutoTokenizer.from_pretrained

    def misread(*args, **kwargs):
        tok = original(*args, **kwargs)
        tok.eos_token = tok.pad_token = "<|im_start|>"
        return tok

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", misread)
    src = tmp_path / "m.gguf"
    _write_gguf(src, _hf_model(tied=True))
    out = convert_gguf(str(src), str(tmp_path / "hf"), dtype="float32")
    monkeypatch.undo()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)


def test_transformers_loads_it_with_the_source_weights(tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, _, out = tied
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert tok.tokenize("hello") == ["hell", "o"]  # the merges are used
    assert ids[0, 0].item() == 1 and tok.eos_token_id == 2 and tok.pad_token_id == 2
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_reused_when_done_and_redone_when_the_source_changes(tied, tmp_path):
    import shutil

    src, out = str(tmp_path / "src.gguf"), str(tmp_path / "hf")
    shutil.copy(tied[1], src)
    convert_gguf(src, out)
    weights = os.path.join(out, "model.safetensors")
    first = os.stat(weights).st_mtime_ns, os.stat(weights).st_ino
    assert convert_gguf(src, out) == out
    assert (os.stat(weights).st_mtime_ns, os.stat(weights).st_ino) == first  # not rewritten

    _write_gguf(tmp_path / "new.gguf", _hf_model(tied=False))  # untied: the GGUF has output.weight
    os.replace(tmp_path / "new.gguf", src)  # same path, new file
    convert_gguf(src, out)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["tie_word_embeddings"] is False
    with open(os.path.join(out, MARKER)) as f:
        assert json.load(f)["size"] == os.path.getsize(src)
    from safetensors import safe_open

    with safe_open(weights, "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16  # the default dtype
    assert sorted(os.listdir(tmp_path)) == ["hf", "src.gguf"]  # no temporary folders left behind
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a folder that is not a conversion")
    with pytest.raises(ValueError, match="mine: exists and is not a GGUF conversion"):
        convert_gguf(src, str(tmp_path / "mine"))
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]


def _one_line_error(src, match: str) -> str:
    with pytest.raises(ValueError, match=match) as e:
        convert_gguf(str(src), str(src) + "-hf")
    msg = str(e.value)
    assert "\n" not in msg and str(src) in msg
    assert not os.path.exists(str(src) + "-hf")
    return msg


def test_unsupported_architecture_is_one_line(tmp_path):
    src = tmp_path / "qwen2.gguf"
    _write_gguf(src, arch="qwen2")
    msg = _one_line_error(src, r"general\.architecture = 'qwen2'")
    assert "'llama'" in msg and "'qwen3'" in msg


def test_undequantisable_tensor_type_is_one_line(tmp_path):
    src = tmp_path / "f64.gguf"
    _write_gguf(src, extra_tensor=np.zeros((4, 4), dtype=np.float64))
    _one_line_error(src, r"tensor type F64 \(e\.g\. blk\.0\.extra\.weight\)")


def test_missing_and_not_gguf_files_are_one_line(tmp_path, capsys):
    _one_line_error(tmp_path / "nope.gguf", "no such GGUF file")
    text = tmp_path / "model.gguf"
    text.write_text("not a gguf\n")
    _one_line_error(text, "not a GGUF file")
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "nope.gguf"), str(tmp_path / "out")])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_prepare_model_dir_hands_back_the_conversion(tied, tmp_path):
    from torchtitan_grpo.session import prepare_model_dir
    from torchtitan_grpo.train.trainer import Dist

    _, src, _ = tied
    dump = str(tmp_path / "run")
    cfg = SimpleNamespace(model=SimpleNamespace(hf_assets_path=src), job=SimpleNamespace(dump_folder=dump),
                          grpo=SimpleNamespace(tiny_model_if_missing=True))
    want = os.path.join(dump, "hf_from_gguf", "tiny-llama")
    # another rank does not convert: it is told where rank 0 writes
    assert resolve_model_dir(src, dump, convert=False) == want == gguf_out_dir(src, dump)
    assert not os.path.exists(want)
    out = prepare_model_dir(cfg, Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    assert out == want and os.path.isfile(os.path.join(out, "config.json"))
    assert resolve_model_dir("/some/hf/dir", dump) == "/some/hf/dir"


def test_config_accepts_a_gguf_path_that_exists(tied, tmp_path):
    from torchtitan_grpo.config.checks import ConfigError, _check_model_dir

    _, src, _ = tied
    _check_model_dir(SimpleNamespace(model=SimpleNamespace(hf_assets_path=src)))
    missing = str(tmp_path / "gone.gguf")
    with pytest.raises(ConfigError, match=r"model\.hf_assets_path.*gone\.gguf"):
        _check_model_dir(SimpleNamespace(model=SimpleNamespace(hf_assets_path=missing),
                                         grpo=SimpleNamespace(tiny_model_if_missing=True)))
