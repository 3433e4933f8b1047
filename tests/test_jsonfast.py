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


@pytest.mark.parametrize("as_ids", [False, True], ids=["names", "as-ids"])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_the_log_prob_text_parses_to_the_objects_it_replaces(tmp_path, monkeypatch, route, as_ids):
    """Chat and completions log-probs without top entries are written as JSON text from per-id
    pieces (``logprob_json``, no object per token): parsed, the reply equals the one built an
    object per token, with a non-ASCII token, a token without text, a -inf log-prob, an empty
    completion, tokens named by id or not, and the per-engine pieces made or reused."""
    if jsonfast.Fragment is None:
        pytest.skip("orjson >= 3.9 is not installed here")
    from bench.engine_vs_vllm import write_tokenizer
    from bench.reply_cost import TextEngine, reply_builders, synthetic_results
    from torchtitan_grpo.server.routes import logprob_json

    write_tokenizer(str(tmp_path), 300)
    engine = TextEngine(str(tmp_path))
    plain_texts = engine.token_texts
    odd = {5: "é✓ \"q\"\n", 6: None}
    monkeypatch.setattr(engine, "token_texts", lambda ids: [odd.get(t, x) for t, x in zip(ids, plain_texts(ids))])
    samples = synthetic_results(8, 12, 300)
    samples[0].output_ids[:4] = [5, 6, 5, 7]
    samples[0].output_logprobs[1] = float("-inf")
    samples[1].output_ids, samples[1].output_logprobs = [], []
    build = reply_builders(engine, str(tmp_path), 12, as_ids=as_ids)[route]
    logprob_json.clear_caches()
    made = build(samples)["choices"][0]["logprobs"]
    assert isinstance(made["content"] if route == "chat" else made, jsonfast.Fragment)  # the text path ran
    cold = json.loads(jsonfast.dumps(build(samples)))
    warm = json.loads(jsonfast.dumps(build(samples)))
    monkeypatch.setattr(jsonfast, "Fragment", None)
    objects = json.loads(json.dumps(build(samples)))
    assert cold == warm == objects
    first, empty = (c["logprobs"] for c in objects["choices"][:2])
    if route == "chat":
        content = first["content"]
        assert content[1]["logprob"] == -9999.0 and content[1]["bytes"] is None
        assert content[0]["bytes"] == list("é✓ \"q\"\n".encode()) and empty["content"] == []
        assert content[0]["token"] == ("token_id:5" if as_ids else "é✓ \"q\"\n")
    else:
        assert first["token_logprobs"][1] == -9999.0 and first["tokens"][1] == "token_id:6"
        assert first["top_logprobs"][1] == {"token_id:6": -9999.0}
        assert first["text_offset"][:3] == [0, len(first["tokens"][0]), len(first["tokens"][0]) + len("token_id:6")]
        assert empty == {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}


class _VocabEngine:
    """An engine's vocabulary and token texts (``w<id>``), counting the ids asked for by thread."""

    def __init__(self, vocab_size: int):
        import threading

        self.vocab_size = vocab_size
        self.asked: dict[str, int] = {}
        self._lock = threading.Lock()

    def token_texts(self, ids):
        import threading

        with self._lock:
            name = threading.current_thread().name
            self.asked[name] = self.asked.get(name, 0) + len(ids)
        return [f"w{t}" for t in ids]


@pytest.mark.parametrize("kind", ["chat", "name"])
def test_prepare_makes_the_whole_vocabularys_pieces_before_any_reply(kind, monkeypatch):
    """The server's start-up makes every id's pieces (no thread beside the engine's worker later);
    a reply over ids never seen then asks the engine for none, and the pieces are those a reply
    makes. Without orjson's fragments (the object path) nothing is made."""
    from torchtitan_grpo.server.routes import logprob_json as lj

    engine = _VocabEngine(20_000)
    lj.prepare(engine)
    table = lj._CACHES[engine][(kind, False)]
    assert len(table) == 20_000 and None not in table
    asked = dict(engine.asked)
    build = (lambda ids: lj.chat_content(engine, ids, [-0.5] * len(ids), False)) if kind == "chat" else (
        lambda ids: lj.completion_logprobs(engine, ids, [-0.5] * len(ids), False))
    prepared = build([19_999, 12_345, 3])
    assert engine.asked == asked
    make = lj._chat_piece if kind == "chat" else lj._name_piece
    assert table[12_345] == make(12_345, "w12345", "w12345")
    lj.clear_caches()
    assert build([19_999, 12_345, 3]) == prepared  # made by the reply itself: the same text
    broken = _VocabEngine(9000)  # a tokenizer that fails part-way: the server still starts
    broken.token_texts = lambda ids: [f"w{t}" if t < 5000 else 1 / 0 for t in ids]
    lj.prepare(broken)
    chat = lj._CACHES[broken][("chat", False)]
    assert chat[4095] is not None and chat[4096] is None  # the first batch made, the one that failed not
    bare = _VocabEngine(100)
    monkeypatch.setattr(jsonfast, "Fragment", None)
    lj.prepare(bare)
    assert bare not in lj._CACHES and bare.asked == {}


def test_an_engine_without_a_vocabulary_size_grows_its_table_as_ids_come():
    from torchtitan_grpo.server.routes import logprob_json as lj

    engine = _VocabEngine(0)
    del engine.vocab_size
    lj.chat_content(engine, [5, 2], [-1.0, -2.0], False)
    assert len(lj._CACHES[engine][("chat", False)]) == 6
