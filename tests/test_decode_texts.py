"""The samples a step ends are decoded in one batch (requests.decode_texts), giving
exactly what decoding each one gives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from torchtitan_grpo.server.engine.requests import decode_ids, decode_texts


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from bench.engine_vs_vllm import write_tokenizer

    d = tmp_path_factory.mktemp("words")
    write_tokenizer(str(d), 500)  # 0 pad, 1 EOS (special), w2..w499
    return AutoTokenizer.from_pretrained(str(d))


class _Recording:
    """A tokenizer whose backend's ``decode_batch`` calls are counted."""

    def __init__(self, tok):
        self._tok, self.batches = tok, []
        outer = self

        class Backend:
            def decode_batch(self, seqs, skip_special_tokens):
                outer.batches.append((len(seqs), skip_special_tokens))
                return tok.backend_tokenizer.decode_batch(seqs, skip_special_tokens=skip_special_tokens)

        self.backend_tokenizer = Backend()

    def __getattr__(self, name):
        return getattr(self._tok, name)


def _seq(ids, skip=True):
    return SimpleNamespace(output_ids=ids, params=SimpleNamespace(skip_special_tokens=skip))


def test_one_batch_per_special_token_setting_and_the_same_texts(word_tokenizer):
    seqs = [_seq([5, 6, 1, 7]), _seq([1, 9], skip=False), _seq([]), _seq([12, 1], skip=False), _seq([8])]
    tok = _Recording(word_tokenizer)
    assert decode_texts(tok, seqs) == [decode_ids(word_tokenizer, s.output_ids, s.params.skip_special_tokens)
                                       for s in seqs] == ["w5 w6 w7", "<|endoftext|> w9", "", "w12 <|endoftext|>", "w8"]
    assert tok.batches == [(3, True), (2, False)]


def test_a_batch_the_backend_refuses_is_decoded_one_by_one(word_tokenizer):
    seqs = [_seq([5, 6]), _seq([10**7]), _seq([9])]  # an id outside the vocabulary
    assert decode_texts(word_tokenizer, seqs) == ["w5 w6", decode_ids(word_tokenizer, [10**7]), "w9"]


def test_no_tokenizer_and_tokenizers_with_clean_up_take_the_plain_path(word_tokenizer):
    assert decode_texts(None, [_seq([5]), _seq([6])]) == [None, None]
    tok = _Recording(word_tokenizer)
    tok.clean_up_tokenization_spaces = True  # transformers' own decode cleans up: no backend batch
    assert decode_texts(tok, [_seq([5]), _seq([6])]) == ["w5", "w6"] and tok.batches == []


def test_a_step_that_ends_requests_answers_them_and_no_longer_counts_them_as_load(tiny_model_dir):
    """Two requests end in one step: both are answered, with their texts, before the step's ended
    rows leave the batch (held here), and the engine's load already leaves those rows out (a
    router or a test reading it then sees no work that is over)."""
    import threading

    from torchtitan_grpo.server.engine.engine import Engine, EngineConfig
    from torchtitan_grpo.server.engine.requests import SamplingParams

    eng = Engine(EngineConfig(tiny_model_dir, dtype="float32", max_batch_size=4, kv_cache="static", max_model_len=32))
    gate, prune = threading.Event(), eng._prune

    def held() -> None:
        if any(s.finish is not None for s in eng._rows):
            gate.wait(60)
        prune()

    eng._prune = held
    eng.start()
    try:
        params = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0.0)
        futs = [eng.submit([5, 7, 9], SamplingParams(max_new_tokens=3, ignore_eos=True, n=2)),
                eng.submit([6, 8], params)]
        results = [r for f in futs for r in f.result(timeout=120)]
        assert len(eng._rows) == 3  # still in the batch: the prune waits on the gate
        assert eng.load() == {"num_reqs": 0, "num_waiting_reqs": 0, "num_running_seqs": 0, "num_tokens": 0,
                              "num_output_tokens": 0}
        assert [len(r.output_ids) for r in results] == [3, 3, 3]
        assert all(r.text == decode_ids(eng.tokenizer, r.output_ids) for r in results)
    finally:
        gate.set()
        eng.shutdown()
