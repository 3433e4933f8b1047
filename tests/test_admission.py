"""An idle engine admits a burst of requests as one prefill
(``server/engine/admission.py``), and a lone request is not kept waiting."""

from __future__ import annotations

import threading
import time

import pytest

from torchtitan_grpo.server.engine.admission import AdmissionWindow
from torchtitan_grpo.server.engine.engine import Engine, EngineConfig
from torchtitan_grpo.server.engine.requests import SamplingParams


def test_the_window_waits_for_a_quiet_gap_and_no_longer_than_its_cap():
    w = AdmissionWindow(window_ms=10.0, quiet_ms=2.0)
    w.note(True, now=100.000)
    assert w.hold(now=100.000) == pytest.approx(0.002)  # a lone request: the quiet gap only
    w.note(False, now=100.001)
    assert w.hold(now=100.0015) == pytest.approx(0.0015)  # each arrival restarts the gap
    for k in range(2, 20):  # a burst that keeps coming is admitted at the cap
        w.note(False, now=100.0 + k * 0.001)
    assert w.hold(now=100.0095) == pytest.approx(0.0005)
    assert w.hold(now=100.010) == 0.0
    w.note(True, now=200.0)  # a new burst starts its own window
    assert w.hold(now=200.0) == pytest.approx(0.002)
    assert w.hold(now=200.5) == 0.0
    off = AdmissionWindow(window_ms=0.0)
    off.note(True, now=1.0)
    assert off.hold(now=1.0) == 0.0


def _prefill_sizes(model_dir: str, window_ms: float, gate_s: float) -> tuple[list[int], list]:
    """Prefill sizes of 8 requests of n=2 queued by another thread while the engine is idle, and
    their results."""
    eng = Engine(EngineConfig(model_dir, dtype="float32", max_batch_size=16, kv_cache="static",
                              max_model_len=32, admission_window_ms=window_ms))
    eng._admission.quiet_s = gate_s  # a quiet gap no loaded box breaks, so the test reads the rule
    sizes: list[int] = []
    prefill = eng._prefill
    eng._prefill = lambda seqs: (sizes.append(len(seqs)), prefill(seqs))[1]
    eng.start()
    try:
        params = SamplingParams(max_new_tokens=3, n=2, seed=1, ignore_eos=True)
        futs: list = []

        def post() -> None:  # 50 ms apart: an engine admitting at once starts on the first
            for i in range(8):
                futs.append(eng.submit([5 + i, 7, 9], params))
                time.sleep(0.05)

        t = threading.Thread(target=post)
        t.start()
        t.join(60)
        return sizes, [r for f in futs for r in f.result(timeout=120)]
    finally:
        eng.shutdown()


def test_a_burst_into_an_idle_engine_is_one_prefill(tiny_model_dir):
    sizes, results = _prefill_sizes(tiny_model_dir, window_ms=30_000.0, gate_s=1.0)
    assert sizes == [16], sizes  # 8 requests x n=2, admitted together
    assert len(results) == 16 and all(len(r.output_ids) == 3 for r in results)
    sizes, _ = _prefill_sizes(tiny_model_dir, window_ms=0.0, gate_s=0.0)  # off: as they come
    assert len(sizes) > 1 and sum(sizes) == 16, sizes


def test_a_lone_request_is_admitted_after_the_quiet_gap(tiny_model_dir):
    eng = Engine(EngineConfig(tiny_model_dir, dtype="float32", max_batch_size=4, kv_cache="static",
                              max_model_len=32, admission_window_ms=600_000.0))
    eng._admission.quiet_s = 0.05
    eng.start()
    try:
        (r,) = eng.submit([5, 7], SamplingParams(max_new_tokens=2, ignore_eos=True)).result(timeout=120)
        assert len(r.output_ids) == 2  # not held for the 600 s window (the wait above is 120 s): the gap ended it
    finally:
        eng.shutdown()


def test_the_server_flag_reaches_the_engine_and_a_bad_value_is_one_line_naming_it(tiny_model_dir, capsys):
    from torchtitan_grpo.server.app import engine_config, parse_args

    base = ["--model", tiny_model_dir, "--port", "0"]
    assert engine_config(parse_args(base)).admission_window_ms == 40.0
    assert engine_config(parse_args([*base, "--admission-window-ms", "0"])).admission_window_ms == 0.0
    for bad in ("-1", "nan", "5000"):
        with pytest.raises(SystemExit):
            parse_args([*base, "--admission-window-ms", bad])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.endswith(f"--admission-window-ms must be in [0, 1000], got {float(bad)}"), err
