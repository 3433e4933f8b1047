"""The KVBatch contract: what any KV batch the engine runs on must compute.

Every implementation listed in ``IMPLEMENTATIONS`` runs the same tests on the
tiny Qwen3 in fp32 on CPU: each logit row a batch returns must equal the
plain HF forward of that row's whole context on its own, whatever else
shares the batch (other lengths, rows that left, rows that joined late).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Sequence

import pytest
import torch

from torchtitan_grpo.server.engine.batch import DynamicBatch, KVBatch, make_batch
from torchtitan_grpo.server.engine.static_batch import StaticBatch
from torchtitan_grpo.server.engine.requests import SamplingParams, _Request, _Sequence

ATOL = 1e-4
CPU = torch.device("cpu")

IMPLEMENTATIONS: dict[str, Callable[[Any, int], KVBatch]] = {
    "dynamic": lambda model, size: DynamicBatch(model, CPU, size, int(model.config.pad_token_id or 0)),
    "static": lambda model, size: StaticBatch(model, CPU, size, max_len=128),
}
"""name -> (model, sequences it must hold) -> an empty batch."""


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().requires_grad_(False)


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def make(request, model) -> Callable[..., KVBatch]:
    """``make(size=8)``: an empty batch of the implementation under test."""
    return lambda size=8: IMPLEMENTATIONS[request.param](model, size)


@pytest.fixture
def rand(model) -> Callable[[int], list[int]]:
    g = torch.Generator().manual_seed(0)
    return lambda n: torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()


def _seq(prompt: list[int], output: Sequence[int] = (), index: int = 0, req: _Request | None = None) -> _Sequence:
    req = req or _Request("r", list(prompt), SamplingParams(), 0, concurrent.futures.Future())
    s = _Sequence(req, index, None, output_ids=list(output))
    req.seqs.append(s)
    return s


def _reference(model, ctx: list[int]) -> torch.Tensor:
    """The HF forward of ``ctx`` alone: the logits after its last token."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ctx])).logits[0, -1]


def _check(model, logits: torch.Tensor, seqs: list[_Sequence]) -> None:
    assert logits.shape == (len(seqs), model.config.vocab_size)
    for row, s in zip(logits, seqs):
        torch.testing.assert_close(row.float(), _reference(model, s.context()), atol=ATOL, rtol=0)


def _step(batch: KVBatch, tokens: list[int]) -> torch.Tensor:
    """One decode step as the engine runs it: each row's token joins its
    output (it was sampled), then the batch is fed it."""
    assert len(tokens) == len(batch.rows)
    for s, t in zip(batch.rows, tokens):
        s.output_ids.append(t)
    with torch.no_grad():
        return batch.decode(torch.tensor(tokens, device=CPU))


def _prefill(batch: KVBatch, seqs: list[_Sequence]) -> torch.Tensor:
    with torch.no_grad():
        return batch.prefill(seqs)


def test_prefill_and_decode_equal_the_hf_forward(model, make, rand):
    batch = make()
    assert batch.rows == [] and batch.room() == 8
    shared = _seq(rand(5))
    sibling = _seq(shared.req.prompt_ids, index=1, req=shared.req)
    retracted = _seq(rand(4), output=rand(6))  # back from a retract: prompt + output prefilled
    seqs = [shared, _seq(rand(9)), sibling, retracted]
    _check(model, _prefill(batch, seqs), seqs)
    assert batch.rows == seqs and batch.room() == 4
    assert sibling.cached_tokens == 5  # it shared the first sample's prefill
    for _ in range(4):
        _check(model, _step(batch, rand(len(batch.rows))), batch.rows)
    batch.clear()
    assert batch.rows == [] and batch.room() == 8
    again = [_seq(rand(3))]  # a cleared batch is reusable
    _check(model, _prefill(batch, again), again)


@pytest.mark.parametrize("idx", [[0, 2], [2, 0], [1]])
def test_keep_then_decode_equals_a_fresh_batch_of_the_kept_rows(model, make, rand, idx):
    batch = make()
    seqs = [_seq(rand(n)) for n in (7, 3, 11)]
    _prefill(batch, seqs)
    for _ in range(3):
        _step(batch, rand(len(batch.rows)))
    kept = [batch.rows[i] for i in idx]
    batch.keep(idx)
    assert batch.rows == kept and batch.room() == 8 - len(idx)
    tokens = rand(len(idx))
    out = _step(batch, tokens)

    # The same contexts in a batch of their own, fed the same tokens.
    fresh = make()
    copies = [_seq(s.req.prompt_ids, s.output_ids[:-1]) for s in kept]
    _prefill(fresh, copies)
    torch.testing.assert_close(out, _step(fresh, tokens), atol=ATOL, rtol=0)
    _check(model, out, kept)
    # And it goes on decoding correctly.
    _check(model, _step(batch, rand(len(idx))), batch.rows)


@pytest.mark.parametrize("joiner_len", [2, 30])  # shorter, then longer, than the running rows
def test_a_sequence_joining_a_running_batch_gets_the_logits_it_gets_alone(model, make, rand, joiner_len):
    batch = make()
    if not batch.can_merge:
        pytest.skip("this batch admits new sequences only when empty")
    running = [_seq(rand(6)), _seq(rand(10))]
    _prefill(batch, running)
    for _ in range(3):
        _step(batch, rand(2))

    prompt = rand(joiner_len)
    joiner, alone = _seq(prompt), _seq(prompt)
    solo = make()
    torch.testing.assert_close(_prefill(batch, [joiner]), _prefill(solo, [alone]), atol=ATOL, rtol=0)
    assert batch.rows == running + [joiner]
    for _ in range(3):
        tokens = rand(3)
        out = _step(batch, tokens)
        torch.testing.assert_close(out[2:], _step(solo, tokens[2:]), atol=ATOL, rtol=0)
        _check(model, out, batch.rows)  # the rows already running are undisturbed too


def test_keeping_no_row_empties_the_batch(make, rand):
    batch = make(4)
    _prefill(batch, [_seq(rand(3)), _seq(rand(5))])
    batch.keep([])
    assert batch.rows == [] and batch.room() == 4


# ---- DynamicBatch specifics ------------------------------------------------ #


def test_make_batch_picks_by_kv_cache_and_device(model):
    from torchtitan_grpo.server.engine.engine import EngineConfig

    cfg = lambda **kw: EngineConfig("unused", max_batch_size=5, **kw)  # noqa: E731
    batch = make_batch(model, cfg(), CPU, 0)  # auto on CPU: dynamic
    assert isinstance(batch, DynamicBatch) and batch.room() == 5
    assert batch.can_merge  # plain full-attention layers: joining a running batch is allowed
    static = make_batch(model, cfg(kv_cache="static", max_model_len=40), CPU, 0)
    assert isinstance(static, StaticBatch) and static.room() == 5 and static.max_len == 40
    assert not static.graphs  # graphs only on a GPU
    own = model.config.max_position_embeddings
    assert make_batch(model, cfg(kv_cache="static"), CPU, 0).max_len == min(own, 2048)
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        make_batch(model, cfg(kv_cache="ring"), CPU, 0)


def test_auto_is_static_on_a_gpu_while_its_slots_fit_the_budget_else_paged(model, monkeypatch):
    """No GPU needed: the choice reads the device's free memory only
    (faked here), and allocates nothing."""
    from torchtitan_grpo.server.engine import batch as batch_mod
    from torchtitan_grpo.server.engine import kv_pool
    from torchtitan_grpo.server.engine.engine import EngineConfig

    cuda = torch.device("cuda", 0)
    per_token = kv_pool.bytes_per_token(model, torch.float32)
    cfg = lambda **kw: EngineConfig("unused", max_batch_size=8, **kw)  # noqa: E731
    free = {"bytes": 0}
    monkeypatch.setattr(kv_pool.torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 1 << 40))
    pick = lambda c: batch_mod.auto_kind(model, c, cuda, None)  # noqa: E731
    # 8 slots x 1,000 positions against 0.8 of the free memory (the pool's default share)
    need = 8 * 1000 * per_token
    free["bytes"] = int(need / 0.8) + 1024
    assert pick(cfg(max_model_len=1000)) == "static"
    free["bytes"] = int(need / 0.8) - 1024
    assert pick(cfg(max_model_len=1000)) == "paged"
    assert pick(cfg(max_model_len=1000, kv_cache_memory_fraction=0.5)) == "paged"
    free["bytes"] = 1 << 40
    assert pick(cfg(max_model_len=1000)) == "static"
    assert pick(cfg(max_model_len=1000, kv_cache_memory_gb=1.0)) == "paged"  # a GiB budget asks for the pool
    # unset max_model_len: the static default length (the model's context up to 2,048) is what is weighed
    free["bytes"] = int(8 * batch_mod.static_len(model, cfg()) * per_token / 0.8) - 1024
    assert pick(cfg()) == "paged"
    assert batch_mod.auto_kind(model, cfg(), CPU, None) == "dynamic"
    assert batch_mod.auto_kind(model, cfg(), cuda, "sliding-window layers") == "dynamic"
