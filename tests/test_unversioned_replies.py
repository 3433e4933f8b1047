"""A vLLM before 0.33 (0.26 is what the GPU machines run) leaves
``weight_versions`` out of its completions: the reply is accepted, and the
producer labels each sample with the version its group started under, so the
staleness filter sees a version instead of "unknown"."""

import pytest

from torchtitan_grpo.fleet.types import MalformedResponse
from torchtitan_grpo.fleet.vllm import parse_completions
from torchtitan_grpo.train.importance import select_samples
from torchtitan_grpo.rollout.producer import label_unversioned


def _reply(with_versions: object = None) -> dict:
    """Two choices as vLLM 0.26 answers ``logprobs=0, return_token_ids, return_tokens_as_token_ids``."""
    choices = []
    for k, ids in enumerate(([5, 6, 7], [8, 2])):
        c = {"index": k, "text": "", "token_ids": ids, "finish_reason": "length" if k == 0 else "stop",
             "logprobs": {"text_offset": [0] * len(ids), "token_logprobs": [-0.5] * len(ids),
                          "tokens": [f"token_id:{t}" for t in ids], "top_logprobs": None},
             "prompt_token_ids": [1, 2]}
        if with_versions is not None:
            c["weight_versions"] = with_versions
        choices.append(c)
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m", "choices": choices,
            "usage": {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}}


def test_a_reply_without_versions_is_labelled_with_the_groups_version():
    out = parse_completions(_reply(), 2, "http://vllm")
    assert [c.weight_versions for c in out] == [[], []]
    label_unversioned(out, 7)
    assert [c.weight_versions for c in out] == [["7"], ["7"]]
    assert [c.version_spans for c in out] == [[("7", 0, 3)], [("7", 0, 2)]]
    assert [c.weight_version for c in out] == ["7", "7"]


def test_labelled_samples_are_filtered_by_staleness_not_counted_unknown():
    out = parse_completions(_reply(), 2, "http://vllm")
    label_unversioned(out, 3)

    class S:  # what select_samples reads of a sample
        def __init__(self, c):
            self.weight_versions, self.version_spans = c.weight_versions, c.version_spans
            self.finish_reason, self.completion_ids, self.loss_mask = c.finish_reason, c.token_ids, None

    kept, m = select_samples([S(c) for c in out], current_version=6, max_staleness=2, mask_truncated=False)
    assert kept == [] and m["offpolicy/unknown_version"] == 0.0  # 3 versions old: dropped, not kept as "unknown"


def test_a_malformed_versions_field_is_still_refused():
    with pytest.raises(MalformedResponse, match="weight_versions"):
        parse_completions(_reply(with_versions="7"), 2, "http://vllm")
    body = _reply()
    body["choices"][0]["weight_versions"] = [{"version": "4", "start": 0, "end": 3}]
    assert parse_completions(body, 2, "http://vllm")[0].weight_versions == ["4"]
