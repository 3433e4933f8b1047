"""scripts/pretrain_moe.py (a small Qwen3-MoE pretrained on source files) and
bench/moe_mismatch.py's ``--model`` path, on CPU with a tiny shape and a
corpus of a few standard-library files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torchtitan_grpo  # noqa: E402,F401  (before torchtitan)

from scripts import pretrain_moe  # noqa: E402

STDLIB = ("argparse.py", "ast.py", "textwrap.py", "dataclasses.py", "shutil.py", "json/decoder.py",
          "json/encoder.py", "string.py")
ROUTING_KEYS = {"route_entropy", "load_entropy", "load_max_share", "load_min_share", "noise_flip", "bf16_flip",
                "topk_margin"}


def _corpus(path) -> str:
    """A few standard-library sources (about 350 kB) under ``path``."""
    lib = sysconfig.get_paths()["stdlib"]
    for name in STDLIB:
        dest = os.path.join(path, name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy(os.path.join(lib, name), dest)
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return _corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, corpus) -> tuple[str, dict]:
    """The tiny MoE, 30 steps: (checkpoint dir, its stats)."""
    out = str(tmp_path_factory.mktemp("moe"))
    stats = pretrain_moe.main(["--cpu-tiny", "--corpus", corpus, "--out", out])
    return out, stats


def test_loss_goes_down_and_transformers_loads_it(pretrained):
    out, stats = pretrained
    assert stats["model"] == "moe" and stats["train"]["steps"] == 30
    assert stats["val_loss_after"] < stats["val_loss_before"] - 1.0, stats["train"]["eval"]
    evals = [e["val_loss"] for e in stats["train"]["eval"]]
    assert evals == sorted(evals, reverse=True), evals  # held-out loss falls at every evaluation
    assert stats["transformers_max_abs_diff"] <= 1e-4  # fp32 both sides
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts_per_tok"] == 2
    assert stats["params_active"] < stats["params_total"]


def test_stats_json_has_the_routing_figures(pretrained):
    out, stats = pretrained
    with open(os.path.join(out, "pretrain_stats.json")) as f:
        saved = json.load(f)
    assert saved["val_loss_after"] == pytest.approx(stats["val_loss_after"])
    for when in ("routing_before", "routing_after"):
        r = saved[when]
        assert [layer["layer"] for layer in r["layers"]] == [0, 1]
        assert set(r["mean"]) == ROUTING_KEYS and ROUTING_KEYS <= set(r["layers"][0])
        assert 0 < r["mean"]["route_entropy"] <= r["uniform_entropy"] + 1e-6
        assert 0 <= r["mean"]["noise_flip"] <= 1 and 0 <= r["mean"]["bf16_flip"] <= 1
        assert r["mean"]["load_min_share"] <= 1 / 8 <= r["mean"]["load_max_share"]
    assert saved["data"]["val_files"] >= 1 and saved["data"]["train_files_read"] >= 1


def test_byte_tokenizer_is_the_training_encoding(pretrained):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pretrained[0])
    text = "def f(x):\n\treturn x  # caf\u00e9\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == pretrain_moe.encode_bytes(text.encode()).tolist()
    assert tok.decode(ids) == text and tok.eos_token_id == 1 and tok.pad_token_id == 0


def test_split_is_deterministic_and_disjoint(corpus):
    files = pretrain_moe.list_sources([corpus])
    train, held = pretrain_moe.split_files(files, 0.02)
    assert len(held) >= 1 and not set(train) & set(held) and len(train) + len(held) == len(STDLIB)
    assert pretrain_moe.split_files(list(reversed(files)), 0.02) == (train, held)


@pytest.mark.parametrize("argv, flag", [
    (["--corpus", "/nonexistent-corpus"], "--corpus"),
    (["--top-k", "9"], "--top-k"),
    (["--layers", "0"], "--layers"),
])
def test_bad_input_is_one_line_naming_the_flag(tmp_path, corpus, argv, flag):
    base = ["--cpu-tiny", "--out", str(tmp_path / "m"), "--corpus", corpus]
    with pytest.raises(SystemExit) as e:
        pretrain_moe.main(base + argv)
    msg = str(e.value.code)
    assert flag in msg and "\n" not in msg, msg


def _bench(model: str, corpus: str, work: str) -> tuple[dict[str, list[str]], str]:
    r = subprocess.run([sys.executable, "bench/moe_mismatch.py", "--model", model, "--prompts-from", corpus,
                        "--device", "cpu", "--server-device", "cpu", "--samples", "4", "--prompt-tokens", "16",
                        "--new-tokens", "8", "--reps", "0", "--work", work],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in r.stdout.splitlines() if line.startswith("| ") and "router replay" not in line}
    return rows, r.stdout


def test_mismatch_bench_on_the_pretrained_moe(pretrained, corpus, tmp_path):
    """fp32 on both sides: no mismatch, no extreme token, no route differing,
    replay off and on; the given checkpoint is left as it was."""
    before = os.path.getmtime(os.path.join(pretrained[0], "model.safetensors"))
    rows, out = _bench(pretrained[0], corpus, str(tmp_path))
    assert set(rows) == {"off", "rollout"}, out
    for row in rows.values():
        assert len(row) == 9, out
        assert float(row[0]) < 1e-4 and float(row[6]) == float(row[7]) == float(row[8]) == 0, out
    assert os.path.getmtime(os.path.join(pretrained[0], "model.safetensors")) == before


def test_mismatch_bench_on_a_dense_model(corpus, tmp_path):
    """The dense baseline: pretrained the same way, scored with replay off only."""
    stats = pretrain_moe.main(["--cpu-tiny", "--dense", "--steps", "5", "--corpus", corpus,
                               "--out", str(tmp_path / "dense")])
    assert stats["model"] == "dense" and stats["routing_after"] is None
    with open(tmp_path / "dense" / "config.json") as f:
        assert json.load(f)["intermediate_size"] == 2 * 32  # top_k x expert width: the MoE's active MLP
    rows, out = _bench(str(tmp_path / "dense"), corpus, str(tmp_path / "work"))
    assert set(rows) == {"off"} and float(rows["off"][0]) < 1e-4, out
    with open(tmp_path / "work" / "mismatch.json") as f:
        saved = json.load(f)
    assert saved["on"] is None and saved["off"]["extreme_1"] == 0
