"""Two ways a decode step went wrong on a GPU (run 135), on CPU.

- A row that fills the static cache, with the step run ahead of its end
  (overlapped schedule), left its freed slot at position ``max_len``; a later
  step whose bucket covered that slot read past the rotary table (a CUDA
  device-side assert; on CPU an IndexError that failed every request of it).
- After a device-side assert the server kept answering /health with a CUDA
  context that could compute nothing: the engine now ends its worker on a
  device error and the server exits, so a supervisor restarts it.
"""

from __future__ import annotations

import threading

import pytest
import torch

from torchtitan_grpo.server.engine.engine import Engine, EngineConfig, device_broken
from torchtitan_grpo.server.engine.requests import RequestError, SamplingParams


def test_a_row_that_fills_the_static_cache_leaves_its_slot_usable(tiny_model_dir):
    eng = Engine(EngineConfig(tiny_model_dir, dtype="float32", max_batch_size=4, kv_cache="static",
                              max_model_len=32, overlap_schedule=True))
    eng.start()
    try:
        # 22 + 10 = 32 positions: the row ends at the cache's end while the other one goes on, so
        # the step run ahead of its end feeds it once more, to position 32. Its freed slot, left
        # there, failed the next step (the other request aborted after 10 tokens).
        full = eng.submit([7] * 22, SamplingParams(max_new_tokens=10, seed=1, ignore_eos=True))
        other = eng.submit([5, 6], SamplingParams(max_new_tokens=20, seed=2, ignore_eos=True))
        assert [len(r.output_ids) for f in (full, other) for r in f.result(timeout=120)] == [10, 20]
        # Three rows: slots 0-2, a step bucket of 4 that covers the freed slot.
        again = eng.submit([5, 6], SamplingParams(max_new_tokens=5, n=3, seed=3, ignore_eos=True)).result(timeout=120)
        assert [(r.finish_reason.kind, len(r.output_ids)) for r in again] == [("length", 5)] * 3
    finally:
        eng.shutdown()


def _engine_whose_decode_fails(tiny_model_dir, error: Exception) -> tuple[Engine, list]:
    eng = Engine(EngineConfig(tiny_model_dir, dtype="float32", max_batch_size=4))
    calls = {"n": 0}
    decode = eng._batch.decode

    def failing(last):
        calls["n"] += 1
        if calls["n"] == 3:
            raise error
        return decode(last)

    eng._batch.decode = failing
    fatal: list = []
    eng.on_fatal = fatal.append
    return eng, fatal


def test_a_device_error_ends_the_worker_and_says_so(tiny_model_dir):
    eng, fatal = _engine_whose_decode_fails(tiny_model_dir, RuntimeError(
        "CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."))
    eng.start()
    try:
        (r,) = eng.submit([5, 6, 7], SamplingParams(max_new_tokens=8, ignore_eos=True)).result(timeout=120)
        assert r.finish_reason.kind == "abort" and "CUDA error" in r.finish_reason.message
        eng._worker.join(timeout=60)
        assert not eng._worker.is_alive() and not eng.alive
        assert len(fatal) == 1 and device_broken(fatal[0])
        with pytest.raises(RequestError, match="the device failed"):
            eng.submit([5], SamplingParams(max_new_tokens=2))
    finally:
        eng.shutdown()


def test_a_step_error_that_is_not_the_devices_fails_its_requests_only(tiny_model_dir):
    eng, fatal = _engine_whose_decode_fails(tiny_model_dir, RuntimeError("a bad row"))
    eng.start()
    try:
        (r,) = eng.submit([5, 6, 7], SamplingParams(max_new_tokens=8, ignore_eos=True)).result(timeout=120)
        assert r.finish_reason.kind == "abort" and "a bad row" in r.finish_reason.message
        (ok,) = eng.submit([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True)).result(timeout=120)
        assert ok.finish_reason.kind == "length" and eng.alive and not fatal
    finally:
        eng.shutdown()


def test_device_broken_knows_the_accelerator_error():
    assert not device_broken(RuntimeError("shape mismatch")) and not device_broken(ValueError("x"))
    if hasattr(torch, "AcceleratorError"):
        try:
            err = torch.AcceleratorError("device-side assert triggered")
        except TypeError:  # a constructor this torch does not expose: nothing to check
            return
        assert device_broken(err)


_FAILING_SERVER = """
import sys
from torchtitan_grpo.server.engine import batch
real = batch.DynamicBatch.decode
calls = []
def decode(self, last):
    calls.append(1)
    if len(calls) == 2:
        raise RuntimeError("CUDA error: device-side assert triggered")
    return real(self, last)
batch.DynamicBatch.decode = decode
from torchtitan_grpo.server.app import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_server_exits_with_code_4_and_one_line_when_its_device_fails(tiny_model_dir, tmp_path):
    """The built-in server as a process, its second decode step failing as a CUDA device-side assert
    does: the request in flight is aborted, and the process exits by itself (code 4, one ``error:``
    line naming the failure) for a supervisor to restart, rather than answering /health on."""
    import json
    import select
    import subprocess
    import sys
    import urllib.request

    from tests.server_procs import REPO, server_env

    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-c", _FAILING_SERVER, "--model", tiny_model_dir, "--port", "0",
                             "--num-threads", "1"], stdout=subprocess.PIPE, stderr=open(log, "wb"),
                            env=server_env(), cwd=REPO)
    try:
        url = None
        while url is None and proc.poll() is None:  # hang guard: the wait below
            if select.select([proc.stdout], [], [], 120)[0]:
                line = proc.stdout.readline().decode()
                url = line.split()[1] if line.startswith("ready http://") else None
            else:
                break
        assert url, log.read_text()[-3000:]
        body = json.dumps({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})
        req = urllib.request.Request(url + "/generate", data=body.encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                reply = json.loads(r.read())
            assert reply["meta_info"]["finish_reason"]["type"] == "abort", reply
        except OSError:
            pass  # the process may close the connection as it exits: the exit below is what counts
        assert proc.wait(timeout=120) == 4, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    errors = [ln for ln in log.read_text().splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "the device failed (CUDA error: device-side assert triggered)" in errors[0], errors
