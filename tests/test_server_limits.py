"""The built-in server's API key and debug knobs, in process.

The server (tiny random Qwen3 on CPU) runs on an event loop in a thread of
the test process, started from the command line a user would type
(``--api-key``, ``--debug-decode-delay-s 0``): no subprocess to wait for,
and the engine's decode-delay hook can be observed directly.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest
import torch

from tests.server_procs import in_process_server
from torchtitan_grpo.fleet import vllm
from torchtitan_grpo.server.engine.engine import Engine, EngineConfig
from torchtitan_grpo.server.engine.requests import SamplingParams
from torchtitan_grpo.server.app import engine_config, exposure_warning, parse_args

torch.set_num_threads(1)

KEY = "s3cret-key"


def call(url: str, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, Any]:
    """POST ``body`` (GET when None), with ``Authorization: Bearer key`` if given."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method="POST" if data is not None else "GET", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:  # a hang guard only
            status, payload = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    return status, (json.loads(payload) if payload else None)


class _Recorder:
    """Stands in for the engine's sleep: records each debug decode delay."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


@pytest.fixture(scope="module")
def keyed(model_dir) -> Iterator[tuple[str, _Recorder]]:
    """(url, decode-delay recorder) of a server started with an API key."""
    sleeps = _Recorder()

    def hook(engine: Engine) -> None:
        engine._debug_sleep = sleeps

    with in_process_server(["--model", model_dir, "--port", "0", "--api-key", KEY, "--debug-decode-delay-s", "0"],
                           hook) as (url, _):
        yield url, sleeps


GENERATE = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
# (path, body): generation and weight routes of both protocols; a body that
# would be refused for itself, so a 401 can only come from the key check.
GUARDED = [
    ("/generate", GENERATE),
    ("/update_weights_from_disk", {"model_path": "/nonexistent"}),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}),
    ("/init_weights_update_group", {}),
    ("/get_weights_by_name", {"name": "model.norm.weight"}),
    ("/pause_generation", {}),
    ("/model_info", None),
    (vllm.COMPLETIONS, {"prompt": [5, 6, 7], "max_tokens": 2}),
    (vllm.UPDATE_WEIGHTS, {"update_info": {}}),
    (vllm.INIT_WEIGHT_TRANSFER, {"init_info": {}}),
    (vllm.MODELS, None),
]


@pytest.mark.parametrize("key", [None, "wrong", KEY[:-1], KEY + "x", KEY.upper()], ids=repr)
def test_routes_of_both_protocols_need_the_key(keyed, key):
    url, _ = keyed
    for path, body in GUARDED:
        assert call(url, path, body, key) == (401, {"error": "Unauthorized"}), path


def test_the_key_opens_every_route_but_health_needs_none(keyed):
    url, _ = keyed
    for path in ("/health", "/health_generate"):
        assert call(url, path)[0] == 200, path
    status, out = call(url, "/generate", GENERATE, KEY)
    assert status == 200 and out["meta_info"]["completion_tokens"] == 3, out
    status, out = call(url, vllm.COMPLETIONS, {"prompt": [5, 6, 7], "max_tokens": 2}, KEY)
    assert status == 200 and out["usage"]["completion_tokens"] == 2, out
    assert call(url, "/model_info", None, KEY)[1]["weight_version"] == "default"
    # a weight route: past the key check it answers for itself
    assert call(url, "/begin_weight_update", {}, KEY) == (200, {"success": True, "message": "weight update session open"})
    status, out = call(url, "/update_weight_version", {"new_version": "v-keyed"}, KEY)
    assert status == 200 and out["success"], out
    status, out = call(url, "/end_weight_update", {}, KEY)
    assert status == 200 and out["success"], out
    assert call(url, vllm.WEIGHT_INFO, None, KEY) == (200, {"weight_version": "v-keyed"})


def test_debug_decode_delay_is_a_documented_cli_knob_that_does_nothing_at_0(keyed, model_dir, capsys):
    url, sleeps = keyed
    cfg = parse_args(["--model", model_dir, "--port", "0"])
    assert cfg.debug_decode_delay_s == 0.0 and engine_config(cfg).debug_decode_delay_s == 0.0
    slow = parse_args(["--model", model_dir, "--port", "0", "--debug-decode-delay-s", "0.25"])
    assert engine_config(slow).debug_decode_delay_s == 0.25
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit):
            parse_args(["--model", model_dir, "--port", "0", "--debug-decode-delay-s", bad])
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "DEBUG KNOB" in capsys.readouterr().out
    # The keyed server was started with --debug-decode-delay-s 0: its decode steps never wait.
    assert call(url, "/generate", GENERATE, KEY)[0] == 200
    assert sleeps.calls == []


def test_debug_decode_delay_waits_once_per_decode_step(model_dir):
    engine = Engine(EngineConfig(model_dir, debug_decode_delay_s=0.01))
    sleeps = _Recorder()
    engine._debug_sleep = sleeps
    engine.start()
    try:
        (out,) = engine.submit([5, 6, 7], SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)).result(60)
        # The prefill samples the first token, each of the 5 decode steps one more.
        assert len(out.output_ids) == 6 and sleeps.calls == [0.01] * 5
    finally:
        engine.shutdown()


@pytest.mark.parametrize("host, key, warns", [
    ("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False), ("127.0.0.2", None, False),
    ("0.0.0.0", None, True), ("::", None, True), ("10.1.2.3", None, True), ("node-7.cluster", None, True),
    ("0.0.0.0", "k", False),
])
def test_listening_beyond_loopback_without_a_key_is_warned_about(host, key, warns):
    argv = ["--model", "m", "--port", "0", "--host", host] + (["--api-key", key] if key else [])
    warning = exposure_warning(parse_args(argv))
    assert (warning is not None) == warns
    if warns:
        assert host in warning and "--api-key" in warning and "weights" in warning
