"""Bytes and seconds per pushed version: full weights against the LoRA adapter alone.

    python bench/lora_push.py --shape qwen3-8b --ranks 16,64 [--full-backend ipc] [--reps 3]
    python bench/lora_push.py --cpu             # the tiny shape on CPU (what the tests run)

One process, one built-in server in it (``server.build_app`` on ``--device``),
a Qwen3 of the named shape with random weights (written once as bf16
safetensors under ``--work``). Per version, ``Pusher.push(wait=True)`` of

* ``full``: every weight (bf16), over ``--full-backend`` (ipc: same host,
  the server copies out of the staging buffer; disk; gloo);
* ``adapter r=R``: random rank-R adapters on q/k/v/o and gate/up/down of every
  layer (peft names), transport "adapter": a peft folder per version under
  ``--work`` and SGLang's ``/load_lora_adapter``, the server merging
  ``W0 + (alpha/r) B A`` into its copy of the base.

Prints one table row per kind: bytes per version, median seconds per version
(the push's wall time until the server serves it) and the ratio to full.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torchtitan_grpo  # noqa: E402,F401  (before torchtitan)
import torch  # noqa: E402

from torchtitan_grpo.models.demo_assets import TinyQwen3  # noqa: E402

SHAPES = {
    "tiny": TinyQwen3(),
    # config.json of the HF releases (random weights here)
    "qwen3-4b": TinyQwen3(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, intermediate_size=9728, vocab_size=151936, max_position_embeddings=4096,
                          tie_word_embeddings=True),
    "qwen3-8b": TinyQwen3(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, intermediate_size=12288, vocab_size=151936, max_position_embeddings=4096,
                          tie_word_embeddings=False),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_model(shape: TinyQwen3, out: str) -> str:
    """A random bf16 Qwen3 of ``shape`` (plus the demo's tokenizer), once."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dataclasses import asdict

    from torchtitan_grpo.models.demo_assets import write_tokenizer

    if os.path.exists(os.path.join(out, "config.json")):
        return out
    fields = asdict(shape)
    fields.pop("seed")
    cfg = Qwen3Config(**fields, bos_token_id=None, eos_token_id=1, pad_token_id=0, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out + ".tmp", safe_serialization=True)
    write_tokenizer(out + ".tmp")
    os.replace(out + ".tmp", out)
    return out


def adapter(base: dict[str, torch.Tensor], rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    out = {}
    for name, w in base.items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in TARGETS:
            m = name[: -len(".weight")]
            out[f"base_model.model.{m}.lora_A.weight"] = torch.randn(rank, w.shape[1], device=device) * 0.01
            out[f"base_model.model.{m}.lora_B.weight"] = torch.randn(w.shape[0], rank, device=device) * 0.01
    return out


def time_pushes(url: str, versions: list[dict], cfg, device: torch.device) -> tuple[int, list[float]]:
    from torchtitan_grpo.aio import LoopThread
    from torchtitan_grpo.weight_sync.pusher import Pusher

    loop = LoopThread()
    pusher = Pusher(loop, [url], cfg, device)
    times = []
    try:
        pusher.connect(initial_version=0)
        for v, tensors in enumerate(versions, start=1):
            t0 = time.perf_counter()
            pusher.push(tensors, v, wait=True)
            times.append(time.perf_counter() - t0)
            if not pusher.status()[0]["admitted"]:
                raise RuntimeError(f"replica ejected: {pusher.status()[0]['last_error']}")
        return pusher.bytes_per_version, times
    finally:
        pusher.close()
        loop.close()


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--ranks", default="16,64")
    p.add_argument("--reps", type=int, default=3, help="versions pushed per kind (the first one is not timed)")
    p.add_argument("--full-backend", default="ipc", choices=["ipc", "disk", "gloo"])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--work", default="outputs/bench_lora_push")
    p.add_argument("--cpu", action="store_true", help="the tiny shape on CPU, full push over disk")
    a = p.parse_args(argv)
    if a.cpu:
        a.shape, a.device, a.full_backend, a.ranks = "tiny", "cpu", "disk", "4"
    from safetensors.torch import load_file

    from tests.server_procs import in_process_server  # the in-process built-in server the tests use
    from torchtitan_grpo.weight_sync.pusher import PushConfig

    device = torch.device(a.device)
    model_dir = write_model(SHAPES[a.shape], os.path.join(a.work, a.shape))
    base = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            base.update(load_file(os.path.join(model_dir, f), device=str(device)))
    rows = []
    with in_process_server(["--model", model_dir, "--port", "0", "--device", a.device, "--dtype", "bfloat16",
                            "--kv-cache", "dynamic"]) as (url, _engine):
        folder = os.path.join(a.work, "pushed")
        shutil.rmtree(folder, ignore_errors=True)
        nbytes, times = time_pushes(url, [base] * (a.reps + 1), PushConfig(
            mode="sync", backend=a.full_backend, dtype=torch.bfloat16, disk_folder=folder, deadline_s=600,
            master_address="127.0.0.1"), device)
        rows.append({"kind": f"full ({a.full_backend})", "bytes": nbytes, "s": statistics.median(times[1:])})
        for rank in [int(r) for r in a.ranks.split(",")]:
            shutil.rmtree(folder, ignore_errors=True)
            versions = [adapter(base, rank, device) for _ in range(a.reps + 1)]
            config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
            nbytes, times = time_pushes(url, versions, PushConfig(
                mode="sync", backend="adapter", protocol="sglang", dtype=torch.bfloat16, disk_folder=folder,
                adapter_config=config, deadline_s=600), device)
            rows.append({"kind": f"adapter r={rank}", "bytes": nbytes, "s": statistics.median(times[1:])})
    full = rows[0]
    print(f"shape {a.shape} on {a.device}, {a.reps} timed versions each (median)")
    print("| kind | bytes/version | s/version | bytes vs full | time vs full |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kind']} | {r['bytes']:,} | {r['s']:.3f} | {r['bytes'] / full['bytes']:.4f} | "
              f"{r['s'] / full['s']:.3f} |")
    return rows


if __name__ == "__main__":
    main()
