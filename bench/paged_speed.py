"""Decode throughput of the built-in engine's paged KV cache at long lengths, against its roofline.

Each row: ``--seqs`` concurrent samples (n = 8 per prompt, as GRPO groups),
random ``--prompt-len`` prompts, ``new`` tokens each (``ignore_eos``,
temperature 1), on a random-weight model of ``--shape``, one timed run
(decode graphs are captured at engine start, before the clock). Printed:
tok/s, the pool, retractions, and the roofline:

  roofline tok/s = tokens / sum over decode steps of (weight bytes + KV bytes
                   read that step) / HBM bandwidth

where a step of B rows at context c reads B x c x (KV bytes per position).
The bandwidth is 2 x memory clock x bus width from torch's device properties
when it reports them, else a constant by name (H100 SXM 3.35 TB/s, H200 4.8
TB/s, as NVIDIA publishes them). A pool smaller than the rows' contexts
retracts: the roofline still assumes every row resident (the ideal).

``--hf-static`` adds a row per (seqs, new): transformers' generate on the same
checkpoint, prompts and lengths with its static cache (which transformers
compiles), timed on a second run after an untimed one of the same work, so
compilation is not in the figure (the engine's rows include their prefill
and no warm-up: they start with their graphs captured).

  python bench/paged_speed.py --shape qwen3-4b --seqs 64,128 --new 1024,4096,16384
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}
"""Bytes/s by device-name substring, when torch does not report the memory clock."""


def shape(name: str):
    from torchtitan_grpo.models.demo_assets import QWEN3_0_6B, TinyQwen3

    if name == "qwen3-0.6b":
        return TinyQwen3(**{**QWEN3_0_6B.__dict__, "max_position_embeddings": 40960})
    if name == "qwen3-4b":  # the HF release's config.json
        return TinyQwen3(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, intermediate_size=9728, vocab_size=151936, max_position_embeddings=40960,
                         tie_word_embeddings=True, rope_theta=1_000_000.0)
    return TinyQwen3(max_position_embeddings=40960)


def bandwidth() -> float:
    p = torch.cuda.get_device_properties(0)
    clock, bus = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
    if clock and bus:
        return 2 * clock * 1e3 * bus / 8  # clock in kHz, double data rate
    return next((v for k, v in BANDWIDTH.items() if k in torch.cuda.get_device_name()), 3.35e12)


def roofline(weight_bytes: int, kv_token_bytes: int, rows: int, prompt: int, new: int, bw: float) -> float:
    secs = sum(weight_bytes + rows * (prompt + t) * kv_token_bytes for t in range(new)) / bw
    return rows * new / secs


N_PER_PROMPT = 8
"""Samples per prompt, as a GRPO group."""


def make_prompts(seqs: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """The ``seqs / N_PER_PROMPT`` random prompts of a row (seeded: every row of
    the same shape, the engine's and transformers', gets the same ones)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist() for _ in range(seqs // N_PER_PROMPT)]


def run_row(model_dir: str, kv: str, seqs: int, prompt_len: int, new: int, gb: float, vocab: int) -> dict:
    from torchtitan_grpo.server.engine.engine import Engine, EngineConfig
    from torchtitan_grpo.server.engine.kv_pool import bytes_per_token
    from torchtitan_grpo.server.engine.requests import SamplingParams

    eng = Engine(EngineConfig(model_dir, device="cuda:0", dtype="bfloat16", max_batch_size=seqs, kv_cache=kv,
                              max_model_len=prompt_len + new + 8, kv_cache_memory_gb=gb))
    prompts = make_prompts(seqs, prompt_len, vocab)
    params = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True, n=N_PER_PROMPT)
    eng.start()
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        futs = [eng.submit(p, params) for p in prompts]
        tokens = sum(len(r.output_ids) for f in futs for r in f.result())
        secs = time.perf_counter() - t0
    finally:
        eng.shutdown()
    weights = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    kvb = bytes_per_token(eng.model, torch.bfloat16)
    out = {"tok/s": tokens / secs, "roofline": roofline(weights, kvb, seqs, prompt_len, new, bandwidth()),
           "seconds": secs, "retractions": getattr(eng, "retractions", 0),
           "pool GiB": getattr(eng._batch, "nbytes", 0) / 2**30,
           "late graphs": getattr(eng._batch, "late_captures", 0),
           "batch": type(eng._batch).__name__}  # what kv_cache "auto" picked
    del eng
    torch.cuda.empty_cache()
    return out


def hf_static_row(model_dir: str, seqs: int, prompt_len: int, new: int, vocab: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    rows = [p for p in make_prompts(seqs, prompt_len, vocab) for _ in range(N_PER_PROMPT)]
    ids = torch.tensor(rows).cuda()  # equal lengths: no padding
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              cache_implementation="static")
    try:
        secs = 0.0
        for _ in range(2):  # the first compiles and is not counted
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            torch.cuda.synchronize()
            secs = time.perf_counter() - t0
        tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    finally:
        del model
        torch.cuda.empty_cache()
    return {"tok/s": tokens / secs, "seconds": secs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=["qwen3-0.6b", "qwen3-4b", "tiny"])
    ap.add_argument("--seqs", default="64,128")
    ap.add_argument("--new", default="1024,4096,16384")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--kv-cache", default="paged", help="comma list: paged, static")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=0.0, help="paged pool (default: a fraction of free)")
    ap.add_argument("--hf-static", action="store_true", help="also transformers' compiled static-cache generate")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("paged_speed.py needs a GPU")
    from torchtitan_grpo.models.demo_assets import write_tiny_qwen3

    tmp = tempfile.mkdtemp(prefix="paged_speed_")
    s = shape(args.shape)
    model_dir = write_tiny_qwen3(os.path.join(tmp, "model"), s)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.shape} bf16, prompt {args.prompt_len}, "
          f"HBM {bandwidth() / 1e12:.2f} TB/s", flush=True)
    print("| kv | seqs | new | tok/s | roofline tok/s | % roofline | seconds | retractions | pool GiB | late graphs | batch |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |", flush=True)
    for kv in args.kv_cache.split(","):
        for seqs in (int(x) for x in args.seqs.split(",")):
            for new in (int(x) for x in args.new.split(",")):
                try:
                    r = run_row(model_dir, kv, seqs, args.prompt_len, new, args.kv_cache_memory_gb, s.vocab_size)
                    print(f"| {kv} | {seqs} | {new} | {r['tok/s']:,.0f} | {r['roofline']:,.0f} | "
                          f"{100 * r['tok/s'] / r['roofline']:.0f}% | {r['seconds']:.1f} | {r['retractions']} | "
                          f"{r['pool GiB']:.1f} | {r['late graphs']} | {r['batch']} |", flush=True)
                except Exception as e:  # noqa: BLE001 - one failing row must not hide the others
                    print(f"| {kv} | {seqs} | {new} | error: {type(e).__name__}: {str(e)[:160]} |", flush=True)
                    torch.cuda.empty_cache()
    if args.hf_static:
        for seqs in (int(x) for x in args.seqs.split(",")):
            for new in (int(x) for x in args.new.split(",")):
                try:
                    r = hf_static_row(model_dir, seqs, args.prompt_len, new, s.vocab_size)
                    print(f"| transformers static | {seqs} | {new} | {r['tok/s']:,.0f} | - | - | {r['seconds']:.1f} "
                          "| - | - | - |", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"| transformers static | {seqs} | {new} | error: {type(e).__name__}: {str(e)[:160]} |",
                          flush=True)
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
