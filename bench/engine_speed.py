"""Generation speed of the built-in engine against transformers, one GPU, one process.

Workloads (random-weight model of a given shape, random prompts, every sample
forced to its full length with ``ignore_eos``, temperature 1):

  64x128   8 prompts x n=8, 128 new tokens
  256x512  32 prompts x n=8, 512 new tokens

Rows (each after one untimed warm-up of the same work, so graph capture and
compilation are not in the figure):

  server-http-<kv>   the built-in server over HTTP (SGLang /generate, one
                     request per prompt, all concurrent), --kv-cache <kv>
  engine-<kv>        its engine in this process (Engine.submit, same requests)
  ...-serial         either, with the overlapped schedule off
                     (--disable-overlap-schedule: each step's tokens reach
                     the host before the next step is launched)
  static-forward     the engine's static KV batch alone: prefill + decode
                     steps with argmax, no scheduler, no sampling (the ceiling)
  hf-dynamic         transformers generate, dynamic cache, eager, all rows at once
  hf-static          transformers generate, static cache (transformers compiles it)
  hf-generate-batch  transformers generate_batch (continuous batching, defaults)

Run on a GPU machine from the repo root:

  python bench/engine_speed.py --shape qwen3-0.6b --workloads 64x128,256x512

A row that fails prints its error in the table and the others go on.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

WORKLOADS = {"64x128": (8, 8, 128), "256x512": (32, 8, 512)}
ALL_ROWS = ("server-http-static", "server-http-static-serial", "server-http-dynamic", "engine-static",
            "engine-static-serial", "engine-dynamic", "static-forward", "hf-dynamic", "hf-static", "hf-generate-batch")


def make_prompts(n_prompts: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist() for _ in range(n_prompts)]


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    fn()  # warm-up: captures, compiles, allocator
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, tokens


# ---- the built-in engine ---------------------------------------------------- #


def engine_row(model_dir: str, kv: str, prompts, n: int, new: int, dtype: str, overlap: bool) -> Callable[[], int]:
    from torchtitan_grpo.server.engine.engine import Engine, EngineConfig
    from torchtitan_grpo.server.engine.requests import SamplingParams

    eng = Engine(EngineConfig(model_dir, device="cuda:0", dtype=dtype, max_batch_size=len(prompts) * n,
                              kv_cache=kv, max_model_len=len(prompts[0]) + new + 8,
                              overlap_schedule=None if overlap else False))
    eng.start()
    params = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True, n=n)

    def run() -> int:
        futs = [eng.submit(p, params) for p in prompts]
        return sum(len(r.output_ids) for f in futs for r in f.result())

    def close() -> None:
        eng.shutdown()
        print(f"  engine: {getattr(eng._batch, 'late_captures', 0)} decode graph(s) captured while generating",
              flush=True)

    run.close = close  # type: ignore[attr-defined]
    return run


def server_row(model_dir: str, kv: str, prompts, n: int, new: int, dtype: str, log_dir: str,
               overlap: bool) -> Callable[[], int]:
    import aiohttp

    from torchtitan_grpo.fleet.launcher import ServerSpec, start_servers, stop_process

    spec = ServerSpec(model_dir, device="cuda:0", dtype=dtype, extra_args=(
        "--kv-cache", kv, "--max-batch-size", str(len(prompts) * n),
        "--max-model-len", str(len(prompts[0]) + new + 8)) + (() if overlap else ("--disable-overlap-schedule",)))
    name = f"server-{kv}-{len(prompts) * n}x{new}" + ("" if overlap else "-serial")
    (srv,) = start_servers([spec], os.path.join(log_dir, name), timeout_s=300)
    body = lambda p: {"input_ids": p, "sampling_params": {  # noqa: E731
        "max_new_tokens": new, "temperature": 1.0, "n": n, "ignore_eos": True}}

    async def go() -> int:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            async def one(p):
                async with s.post(f"{srv.url}/generate", json=body(p)) as r:
                    r.raise_for_status()
                    out = await r.json()
                return sum(len(x["output_ids"]) for x in (out if isinstance(out, list) else [out]))
            return sum(await asyncio.gather(*(one(p) for p in prompts)))

    def run() -> int:
        return asyncio.run(go())

    def close() -> None:
        stop_process(srv.proc)
        # What the server logged about graph captures (at start, and any
        # during generation: each of those stalled the batch).
        for line in open(srv.log_path, errors="replace"):
            if "decode graph" in line:
                print("  server:", line.strip()[-110:], flush=True)

    run.close = close  # type: ignore[attr-defined]
    return run


def static_forward_row(model_dir: str, prompts, n: int, new: int, dtype: str) -> Callable[[], int]:
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from torchtitan_grpo.server.engine.static_batch import StaticBatch

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).cuda().eval()
    batch = StaticBatch(model, torch.device("cuda:0"), slots=len(prompts) * n, max_len=len(prompts[0]) + new + 8)

    def run() -> int:
        batch.clear()
        reqs = [SimpleNamespace(prompt_ids=p) for p in prompts]
        seqs = [SimpleNamespace(req=r, index=j, output_ids=[], cached_tokens=0,
                                context=lambda r=r: r.prompt_ids) for r in reqs for j in range(n)]
        with torch.no_grad():
            last = batch.prefill(seqs).argmax(-1)
            for _ in range(new - 1):
                last = batch.decode(last).argmax(-1)
        return len(seqs) * new

    return run


# ---- transformers ----------------------------------------------------------- #


def hf_rows(model_dir: str, prompts, n: int, new: int, dtype: str) -> dict[str, Callable[[], int]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).cuda().eval()
    rows = [p for p in prompts for _ in range(n)]  # equal lengths: no padding needed
    ids = torch.tensor(rows, device="cuda")
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)

    def generate(cache: str | None) -> Callable[[], int]:
        def run() -> int:
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), cache_implementation=cache, **kw)
            return int((out.shape[1] - ids.shape[1]) * out.shape[0])
        return run

    def batch() -> int:
        cfg = GenerationConfig(**kw, eos_token_id=None, pad_token_id=0)
        out = model.generate_batch(inputs=rows, generation_config=cfg, progress_bar=False)
        return sum(len(r.generated_tokens) for r in out.values())

    return {"hf-dynamic": generate(None), "hf-static": generate("static"), "hf-generate-batch": batch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=["qwen3-0.6b", "tiny"])
    ap.add_argument("--model-dir", default=None, help="an HF model dir (default: write a random one of --shape)")
    ap.add_argument("--workloads", default="64x128,256x512")
    ap.add_argument("--rows", default=",".join(ALL_ROWS))
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("engine_speed.py needs a GPU")

    tmp = tempfile.mkdtemp(prefix="engine_speed_")
    model_dir = args.model_dir
    if model_dir is None:
        from torchtitan_grpo.models.demo_assets import QWEN3_0_6B, TinyQwen3, write_tiny_qwen3

        model_dir = write_tiny_qwen3(os.path.join(tmp, "model"), QWEN3_0_6B if args.shape != "tiny" else TinyQwen3())
    vocab = int(__import__("json").load(open(os.path.join(model_dir, "config.json")))["vocab_size"])
    wanted = [r for r in args.rows.split(",") if r]
    table = []
    for wl in args.workloads.split(","):
        n_prompts, n, new = WORKLOADS[wl]
        prompts = make_prompts(n_prompts, args.prompt_len, vocab)
        hf = None
        for row in wanted:
            run = None
            try:
                overlap = not row.endswith("-serial")
                kv = row.removesuffix("-serial").rsplit("-", 1)[1]
                if row.startswith("server-http-"):
                    run = server_row(model_dir, kv, prompts, n, new, args.dtype, tmp, overlap)
                elif row == "static-forward":
                    run = static_forward_row(model_dir, prompts, n, new, args.dtype)
                elif row.startswith("engine-"):
                    run = engine_row(model_dir, kv, prompts, n, new, args.dtype, overlap)
                else:
                    hf = hf or hf_rows(model_dir, prompts, n, new, args.dtype)
                    run = hf[row]
                secs, tokens = timed(run)
                table.append((wl, row, f"{tokens / secs:,.0f}", f"{secs:.2f}", str(tokens)))
            except Exception as e:  # noqa: BLE001 - one failing row must not hide the others
                table.append((wl, row, "error", "-", f"{type(e).__name__}: {str(e)[:150]}"))
            finally:
                close = getattr(run, "close", None)
                if close is not None:
                    close()
            print(" | ".join(table[-1]), flush=True)
        del hf
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, model {args.shape}, {args.dtype}, "
          f"prompt {args.prompt_len} tokens")
    print("| workload | row | tok/s | seconds | tokens |\n| --- | --- | ---: | ---: | ---: |")
    for r in table:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
