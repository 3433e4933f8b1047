"""The engine's overlapped schedule (decode step k+1 launched before step k's
tokens are recorded on the host): on a GPU it is the default; here it is
forced on a CPU, where it must give exactly what the one-step-at-a-time
schedule gives."""

from __future__ import annotations

import pytest
import torch

from torchtitan_grpo.server.engine.engine import Engine, EngineConfig
from torchtitan_grpo.server.engine.requests import SamplingParams

# Ends of every kind, run ahead and its guards: rows that end by length at
# different steps, by a stop id, by the context (the static cache's 32
# positions, while other rows go on), n > 1, top logprobs, a greedy row, and
# rows whose next sampling needs their tokens on the host (penalties,
# min_new_tokens still pending), which turn run-ahead off while they live.
REQUESTS = [
    ([5, 9, 4, 7, 11], SamplingParams(max_new_tokens=12, n=2, seed=3, ignore_eos=True), 0),
    ([8, 3], SamplingParams(max_new_tokens=9, top_p=0.8, seed=4, ignore_eos=True), 2),
    ([6] * 9, SamplingParams(max_new_tokens=7, temperature=0.0, ignore_eos=True), 0),
    ([7] * 22, SamplingParams(max_new_tokens=40, seed=5, ignore_eos=True), 0),
    ([4, 4, 5], SamplingParams(max_new_tokens=15, seed=6, stop_token_ids=(17, 23, 31, 40)), 0),
    ([9, 2], SamplingParams(max_new_tokens=10, seed=7, repetition_penalty=1.3, ignore_eos=True), 0),
    ([3, 1, 4], SamplingParams(max_new_tokens=10, seed=8, min_new_tokens=6), 0),
]


def _run(model_dir: str, kv_cache: str, overlap: bool, device: str = "cpu") -> list:
    eng = Engine(EngineConfig(model_dir, device=device, dtype="float32", max_batch_size=16, kv_cache=kv_cache,
                              max_model_len=32, overlap_schedule=overlap))
    eng.start()
    try:
        futs = [eng.submit(p, sp, top_logprobs_num=k) for p, sp, k in REQUESTS]
        return [r for f in futs for r in f.result(timeout=120)]
    finally:
        eng.shutdown()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kv_cache", ["dynamic", "static"])
def test_overlapped_schedule_generates_what_the_serial_one_does(tiny_model_dir, kv_cache, device):
    """On CUDA: the overlap's real case (copies and events), static cache with
    CUDA graphs; fp32, so both schedules pick the same tokens."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on a device machine: docs/GPU_RUNS.md)")
    serial = _run(tiny_model_dir, kv_cache, False, device)
    overlapped = _run(tiny_model_dir, kv_cache, True, device)
    assert [r.finish_reason.kind for r in serial] == [r.finish_reason.kind for r in overlapped]
    assert "length" in {r.finish_reason.kind for r in serial}
    if kv_cache == "static":  # the 22-token prompt ended at the 32-position context
        assert len(serial[4].output_ids) == 10 and serial[4].finish_reason.kind == "length"
    for a, b in zip(serial, overlapped):
        assert b.output_ids == a.output_ids
        torch.testing.assert_close(b.output_logprobs, a.output_logprobs, atol=1e-5, rtol=0)
        assert (b.top_logprobs is None) == (a.top_logprobs is None)
        if a.top_logprobs:
            assert [[t for _, t in row] for row in b.top_logprobs] == [[t for _, t in row] for row in a.top_logprobs]


def test_a_version_set_while_a_step_is_in_flight_covers_that_step(tiny_model_dir):
    """The token in flight was computed before the version changed: it is in
    the old version's span (worker steps driven by hand, no thread)."""
    eng = Engine(EngineConfig(tiny_model_dir, dtype="float32", max_batch_size=4, overlap_schedule=True))
    eng.set_weight_version("v1")
    fut = eng.submit([5, 6, 7], SamplingParams(max_new_tokens=8, seed=1, ignore_eos=True))
    eng._prefill(eng._ready_to_step())
    for _ in range(3):
        eng._decode_step()
    (seq,) = eng._rows
    assert eng._inflight is not None and len(seq.output_ids) == 3  # 1 from prefill, 2 decodes; the 3rd in flight
    eng.set_weight_version("v2")
    while eng._rows:
        eng._decode_step()
    (out,) = fut.result(timeout=5)
    assert [(s.version, s.start, s.end) for s in out.weight_versions] == [("v1", 0, 4), ("v2", 4, 8)]
