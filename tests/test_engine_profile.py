"""bench/engine_profile.py on a CPU: the whole script on the tiny shape, and
its trace summary on a hand-made GPU trace (kernels, launch calls, graph
replays, the bench's ranges) whose breakdown is known. No timing asserted."""

from __future__ import annotations

import json
import os
import sys

import pytest

import torchtitan_grpo  # noqa: F401  (before torchtitan)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import engine_profile as ep  # noqa: E402


def _x(name: str, cat: str, ts: float, dur: float, tid: int = 1, **args) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


def _gpu_trace() -> dict:
    """Four decode steps of 100 µs each (the first, holding the profiler's start, left out): a graph replay (a GEMM and an attention
    kernel) in the forward, then two sampling launches (log-softmax, exponential)
    and a device-to-host copy; the GPU is busy 60 µs of every 100."""
    events, corr = [], 0
    for k in range(4):
        t = 1000.0 + 100.0 * k
        events += [_x("profile:step", "user_annotation", t, 90), _x("profile:forward", "user_annotation", t + 1, 20),
                   _x("profile:sample", "user_annotation", t + 30, 20)]
        corr += 1
        events += [_x("cudaGraphLaunch", "cuda_runtime", t + 2, 5, correlation=corr),
                   _x("sm90_xmma_gemm_bf16", "kernel", t + 10, 20, tid=7, correlation=corr),
                   _x("flash_fwd_splitkv_kernel", "kernel", t + 30, 10, tid=7, correlation=corr)]
        for name, off, dur in (("cunn_SoftMaxForward<LogSoftMaxForwardEpilogue>", 40, 10),
                               ("vectorized_elementwise_kernel<exponential>", 50, 10)):
            corr += 1
            events += [_x("cudaLaunchKernel", "cuda_runtime", t + 31 + off / 10, 2, correlation=corr),
                       _x(name, "kernel", t + off, dur, tid=7, correlation=corr)]
        corr += 1
        events += [_x("cudaMemcpyAsync", "cuda_runtime", t + 45, 2, correlation=corr),
                   _x("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", t + 60, 10, tid=7, correlation=corr)]
    return {"traceEvents": events}


def test_summary_of_a_known_gpu_trace() -> None:
    s = ep.summarize(_gpu_trace())
    assert s["steps"] == 2 and s["step_us"] == pytest.approx(100.0)
    cats = s["by_category_us"]
    assert cats["GEMM"] == pytest.approx(20) and cats["attention"] == pytest.approx(10)
    assert cats["logprobs"] == pytest.approx(10) and cats["sampling"] == pytest.approx(10)
    assert cats["copies"] == pytest.approx(10) and cats["other"] == 0
    assert s["busy_us"] == pytest.approx(60) and s["idle_us"] == pytest.approx(40)
    assert s["kernels_per_step"] == pytest.approx(4)
    assert s["graph_launches_per_step"] == pytest.approx(1) and s["launch_calls_per_step"] == pytest.approx(3)
    assert s["graph_share_count"] == pytest.approx(0.5) and s["graph_share_time"] == pytest.approx(0.6)


def test_names_alone_classify_a_trace_without_the_bench_ranges() -> None:
    """vLLM's trace has no bench ranges: kernels go by name, steps by log-softmax kernels."""
    trace = _gpu_trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if not e["name"].startswith(ep.REGION)]
    s = ep.summarize(trace)
    assert s["steps"] == 3  # no range holds the profiler's start: every step counts
    assert s["by_category_us"]["sampling"] == pytest.approx(10)  # the exponential kernel, by its name
    assert s["by_category_us"]["logprobs"] == pytest.approx(10)


def test_the_script_on_a_cpu(tmp_path) -> None:
    rc = ep.main(["--cpu", "--out", str(tmp_path), "--seqs", "16", "--reply-lengths", "8", "--reply-seqs", "16"])
    assert rc == 0
    got = json.loads((tmp_path / "engine_profile.json").read_text())
    (row,) = got["decode"]
    assert row["status"] == "ok" and row["steps"] >= 1
    assert row["by_category_us"]["GEMM"] > 0 and row["by_category_us"]["logprobs"] > 0
    assert {r["route"] for r in got["replies"]} == {"generate", "completions", "chat"}
    assert "| per decode step |" in (tmp_path / "engine_profile.md").read_text()


def test_reply_cost_runs_every_route(capsys) -> None:
    from bench import reply_cost

    assert reply_cost.main(["--lengths", "8", "--seqs", "16", "--vocab", "256"]) == 0
    table = capsys.readouterr().out
    assert all(f"| {route} | 16 | 8 |" in table for route in ("generate", "completions", "chat"))
