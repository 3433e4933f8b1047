"""What one prefill costs the built-in engine, by how many prompts it holds (issue 50).

Run 154's traces (``bench/server_trace.py``) showed prefills of 0.6B x 128-token
prompts taking 20-70 ms on an H200, and 100-400 ms when a burst was split into
two prefills of sizes the server had not met: several times the forward's
FLOPs. This drives the engine in-process on ``bench/engine_vs_vllm.py``'s model
files and prefills bursts of ``k`` requests of n=8 (``max_new_tokens=1``: the
prefill's own sample ends them, no decode step runs), each ``k`` of
``--contexts`` twice in a row (first: a size the process has not prefilled
yet; then again), under each SDPA setting of ``--sdpa``:

  default    torch's own choice
  flash / efficient / math / cudnn   that backend alone (the others disabled)

Per prefill: the engine's wall time (``Engine._prefill``), the CUDA caching
allocator's ``cudaMalloc`` calls and retries during it, and with ``--profile
K`` one torch-profiler table (CPU and CUDA, top ops by self CPU time) of the
first prefill of ``K`` contexts.

  python bench/prefill_cost.py --out OUT                      # one H200, 0.6B, ~40 s
  python bench/prefill_cost.py --device cpu --shape tiny --out OUT   # checks the script
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.engine_profile import warm_up_profiler  # noqa: E402
from bench.engine_vs_vllm import write_model  # noqa: E402
from bench.paged_speed import N_PER_PROMPT, make_prompts  # noqa: E402

BACKENDS = ("flash", "efficient", "math", "cudnn")


def set_sdpa(choice: str) -> None:
    """Enable only ``choice``'s SDPA backend (``default``: all, torch's order)."""
    import torch

    b = torch.backends.cuda
    setters = {"flash": b.enable_flash_sdp, "efficient": b.enable_mem_efficient_sdp, "math": b.enable_math_sdp,
               "cudnn": b.enable_cudnn_sdp}
    for name, enable in setters.items():
        enable(choice in ("default", name))


class PrefillTimer:
    """Wraps ``Engine._prefill``: each call's wall time, allocator counts, and one profile."""

    def __init__(self, engine: Any, cuda: bool):
        self.cuda, self.calls, self.profile_next, self.table = cuda, [], False, ""
        inner = engine._prefill

        def timed(seqs: list) -> None:
            import torch

            stats = torch.cuda.memory_stats if cuda else (lambda: {})
            before = stats()
            prof = None
            if self.profile_next:
                acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
                prof = torch.profiler.profile(activities=acts)
                prof.__enter__()
            t = time.perf_counter()
            inner(seqs)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t
            if prof is not None:
                prof.__exit__(None, None, None)
                self.table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60)
                self.profile_next = False
            after = stats()
            delta = lambda k: after.get(k, 0) - before.get(k, 0)  # noqa: E731
            self.calls.append({"rows": len(seqs), "ms": wall * 1e3, "mallocs": delta("num_device_alloc"),
                               "retries": delta("num_alloc_retries"), "profiled": prof is not None})

        engine._prefill = timed


def burst(engine: Any, prompts: list[list[int]]) -> None:
    """Queue every prompt (n=8, one new token) while the engine is paused, then let it run: one
    prefill; return once the engine is idle again (the futures resolve inside the prefill)."""
    from torchtitan_grpo.server.engine.requests import SamplingParams

    params = SamplingParams(max_new_tokens=1, temperature=1.0, ignore_eos=True, n=N_PER_PROMPT)
    engine.pause("in_place")
    futures = [engine.submit(p, params) for p in prompts]
    engine.resume()
    for f in futures:
        f.result(timeout=300)
    engine.pause("in_place")  # runs on the worker between steps: the prefill is over, and timed
    engine.resume()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="0.6b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--contexts", default="8,32,5,27,20,12,22,10,1,17",
                    help="prompts per burst, each run twice in a row (first visit, then repeat)")
    ap.add_argument("--sdpa", default="default,flash,efficient,math",
                    help="SDPA settings, one pass each: default, " + ", ".join(BACKENDS))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--profile", type=int, default=20, help="profile the first prefill of this many prompts (0: none)")
    ap.add_argument("--out", default="outputs/prefill_cost")
    args = ap.parse_args(argv)
    import torch

    from torchtitan_grpo.server.engine.engine import Engine, EngineConfig

    gpu = args.device != "cpu"
    ks = [int(x) for x in args.contexts.split(",")]
    os.makedirs(args.out, exist_ok=True)
    model_dir = os.path.join(tempfile.mkdtemp(prefix="prefill_cost_"), "model")
    _, vocab = write_model(model_dir, args.shape, args.device)
    prompts = make_prompts(max(ks) * N_PER_PROMPT, args.prompt_len, vocab)
    lines = [f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"{torch.cuda.get_device_name() if gpu else 'cpu'}, torch {torch.__version__}, shape {args.shape}, "
             f"prompts of {args.prompt_len} tokens, n={N_PER_PROMPT}, one new token; prefill ms = Engine._prefill's "
             "wall (synchronised), mallocs = cudaMalloc calls in it",
             "", "| sdpa | prompts | rows | first visit ms | repeat ms | mallocs first / repeat |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    print("\n".join(lines), flush=True)
    profiles = []
    if args.profile:
        warm_up_profiler(gpu)  # kineto's client starts on this thread, or the worker's profile fails
    for choice in args.sdpa.split(","):
        set_sdpa(choice)
        eng = Engine(EngineConfig(model_dir, device=args.device, dtype="bfloat16" if gpu else "float32",
                                  max_batch_size=max(ks) * N_PER_PROMPT, max_model_len=args.prompt_len + 16))
        timer = PrefillTimer(eng, gpu)
        eng.start()
        try:
            burst(eng, prompts[:1])  # first-request paths
            for k in ks:
                timer.profile_next = k == args.profile and choice in ("default",)
                for _ in range(2):
                    n0 = len(timer.calls)
                    burst(eng, prompts[:k])
                    if len(timer.calls) != n0 + 1:
                        raise RuntimeError(f"{k} prompts took {len(timer.calls) - n0} prefills, not one")
                first, again = timer.calls[-2:]
                row = (f"| {choice} | {k} | {first['rows']} | {first['ms']:.1f} | {again['ms']:.1f} | "
                       f"{first['mallocs']} / {again['mallocs']} |")
                lines.append(row)
                print(row, flush=True)
        except Exception as e:  # noqa: BLE001 - a backend that cannot run these shapes: say so, go on
            row = f"| {choice} | - | - | - | - | error: {type(e).__name__}: {str(e)[:160]} |"
            lines.append(row)
            print(row, flush=True)
        finally:
            eng.shutdown()
        if timer.table:
            profiles.append(f"profile, sdpa {choice}, first prefill of {args.profile} prompts:\n{timer.table}")
        del eng
        if gpu:
            torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n\n" + "\n\n".join(profiles)
    print("\n\n".join(profiles), flush=True)
    with open(os.path.join(args.out, "prefill_cost.md"), "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
