"""torchtitan_grpo.jsonfast: the replies' encoder and the pool's decoder give
what the standard library gives, with orjson and without it."""

from __future__ import annotations

import json

import pytest

from torchtitan_grpo import jsonfast

REPLY = {"choices": [{"index": 0, "logprobs": {"content": [
    {"token": "w12", "logprob": -1.2345678901234567, "bytes": [119, 49, 50], "top_logprobs": []},
    {"token": "é✓", "logprob": -9999.0, "bytes": None, "top_logprobs": []}]}}],
    "meta_info": {"output_top_logprobs": [{5: -0.25, 7: -1.5}]}, "ok": True, "n": None}


@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "json"])
def test_round_trip_equals_the_standard_library(monkeypatch, fast):
    if fast and jsonfast.orjson is None:
        pytest.skip("orjson is not installed here")
    if not fast:
        monkeypatch.setattr(jsonfast, "orjson", None)
    raw = jsonfast.dumps(REPLY)
    assert isinstance(raw, bytes)
    # Integer keys become strings and floats keep every digit, as json writes them.
    assert json.loads(raw) == json.loads(json.dumps(REPLY)) == jsonfast.loads(raw)
    with pytest.raises(ValueError):
        jsonfast.loads(b'{"choices": [')


def test_a_non_finite_float_is_written_as_null_not_nan():
    if jsonfast.orjson is None:
        pytest.skip("orjson is not installed here")
    assert json.loads(jsonfast.dumps({"logprob": float("-inf")})) == {"logprob": None}
