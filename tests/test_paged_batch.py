"""The paged KV batch (issue 38): block bookkeeping, and the same tokens and
logprobs as the static batch (fp32, CPU), with and without retraction.

The tiny Qwen3 has 512 bytes of KV per position in fp32, so a pool of a few
blocks of 16 positions is a budget of ~1e-4 GiB: small enough that the
engine must retract and resume sequences.
"""

from __future__ import annotations

import random

import pytest
import torch

from torchtitan_grpo.server.engine.kv_pool import NULL_BLOCK, BlockPool, bytes_per_token
from torchtitan_grpo.server.engine.paged_batch import PagedBatch
from torchtitan_grpo.server.engine.requests import RequestError, SamplingParams
from torchtitan_grpo.server.engine.static_batch import StaticBatch
from tests.kv_stubs import Req as _Req, Seq as _Seq, scripted_decode

CPU = torch.device("cpu")
BS = 16


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().requires_grad_(False)


def _gib(blocks: int, model) -> float:
    """The --kv-cache-memory-gb that buys ``blocks`` blocks (the null one included)."""
    return blocks * BS * bytes_per_token(model, torch.float32) / 2**30


def _engine(model_dir: str, kind: str, **kw):
    from torchtitan_grpo.server.engine.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model_dir, dtype="float32", kv_cache=kind, **kw))
    eng.start()
    return eng


def _generate(eng, reqs) -> list:
    try:
        futs = [eng.submit(p, sp) for p, sp in reqs]
        return [r for f in futs for r in f.result(timeout=120)]
    finally:
        eng.shutdown()


def _same(got: list, want: list, atol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids
        torch.testing.assert_close(g.output_logprobs, w.output_logprobs, atol=atol, rtol=0)


def _requests(seed: int = 0) -> list:
    """Prompts on both sides of block boundaries, greedy, seeded sampling, n > 1."""
    g = random.Random(seed)
    prompt = lambda n: [g.randrange(3, 128) for _ in range(n)]  # noqa: E731
    return [(prompt(15), SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)),
            (prompt(16), SamplingParams(max_new_tokens=25, n=2, seed=3, ignore_eos=True)),
            (prompt(3), SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)),
            (prompt(33), SamplingParams(max_new_tokens=20, top_p=0.8, seed=4, ignore_eos=True)),
            (prompt(47), SamplingParams(max_new_tokens=35, temperature=0.0, ignore_eos=True))]


# ---- the allocator ----------------------------------------------------------- #


def test_block_pool_allocates_frees_and_refuses_misuse():
    pool = BlockPool(5, BS)
    assert pool.capacity == pool.num_free == 4
    a = pool.alloc(3)
    assert NULL_BLOCK not in a and len(set(a)) == 3 and pool.num_free == 1
    with pytest.raises(RuntimeError, match="2 blocks asked, 1 free"):
        pool.alloc(2)
    pool.free(a[:1])
    with pytest.raises(RuntimeError, match="freed but not allocated"):
        pool.free(a[:1])
    with pytest.raises(RuntimeError, match="freed but not allocated"):
        pool.free([NULL_BLOCK])
    assert sorted(pool.alloc(2)) == sorted(set(range(1, 5)) - set(a[1:]))


def test_no_block_leaks_across_random_admit_finish_retract_cycles(model):
    """Random prefills (admitted by :meth:`admissible`), decode steps, rows
    finishing and retracted: every block is owned by one row or free, and an
    emptied batch has them all free again."""
    batch = PagedBatch(model, CPU, slots=6, max_len=128, num_blocks=9, block_size=BS)
    rng = random.Random(0)
    queue: list[_Seq] = []

    def books() -> None:
        owned = [b for blocks in batch._blocks for b in blocks]
        assert len(owned) == len(set(owned)) and NULL_BLOCK not in owned
        assert len(owned) + batch.pool.num_free == batch.pool.capacity
        for ln, blocks in zip(batch._len, batch._blocks):
            assert len(blocks) * BS >= ln  # every cached position has a block
        table = batch._table[: len(batch.rows)]
        for row, blocks in zip(table.tolist(), batch._blocks):
            assert row[: len(blocks)] == blocks and not any(row[len(blocks):])
        assert not batch._table[len(batch.rows):].any()  # padding rows point at the null block

    retracted = 0
    with torch.no_grad():
        for _ in range(80):
            # Admitted as if each wanted one more token, then decoded for longer: the batch overcommits.
            queue += [_Seq(_Req([rng.randrange(3, 128) for _ in range(rng.randrange(1, 40))]),
                           params=SamplingParams(max_new_tokens=1)) for _ in range(rng.randrange(0, 3))]
            n = batch.admissible(queue)
            if n:
                batch.prefill(queue[:n])
                queue = queue[n:]
            books()
            if not batch.rows:
                continue
            back = batch.rows_to_retract()
            if back:  # what the engine does: the newest rows go back to the queue's head
                queue = batch.rows[-back:] + queue
                batch.keep(list(range(len(batch.rows) - back)))
                retracted += back
                books()
            for s in batch.rows:
                s.output_ids.append(rng.randrange(3, 128))
            if batch.rows:
                batch.decode(torch.tensor([s.output_ids[-1] for s in batch.rows]))
            books()
            done = [i for i, s in enumerate(batch.rows) if len(s.output_ids) >= 80 or rng.random() < 0.02]
            batch.keep([i for i in range(len(batch.rows)) if i not in done])
            books()
    assert retracted > 0, "the pool never ran out: the test did not exercise retraction"
    batch.keep([])
    assert batch.pool.num_free == batch.pool.capacity and not batch._table.any()


# ---- the same numbers as the static batch ------------------------------------- #


def test_paged_logits_equal_static_across_block_boundaries(model):
    """Batch level: prefill (a shared prompt, a resumed sequence with output),
    decode steps across block boundaries, rows leaving and joining: the paged
    batch's logits are the static batch's."""
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, 128, (n,), generator=g).tolist()  # noqa: E731
    shared = _Req(rand(15))
    first = [_Seq(shared, 0), _Seq(shared, 1), _Seq(_Req(rand(16))), _Seq(_Req(rand(2)), output_ids=rand(31))]
    late = rand(17)
    runs = {}
    for name, batch in (("static", StaticBatch(model, CPU, slots=6, max_len=96)),
                        ("paged", PagedBatch(model, CPU, slots=6, max_len=96, num_blocks=40))):
        runs[name] = scripted_decode(batch, first, late)
    for s, p in zip(runs["static"], runs["paged"]):
        torch.testing.assert_close(p, s, atol=1e-5, rtol=1e-5)


def test_engine_paged_generates_what_static_does(tiny_model_dir):
    static = _generate(_engine(tiny_model_dir, "static", max_batch_size=6, max_model_len=96), _requests())
    eng = _engine(tiny_model_dir, "paged", max_batch_size=6, max_model_len=96)
    assert eng.paged and eng.max_context == 96 and eng._batch.pool.capacity == 6 * 96 // BS
    _same(_generate(eng, _requests()), static)


@pytest.mark.parametrize("overlap", [False, True])
def test_small_pool_retracts_and_resumes_with_the_same_tokens(tiny_model_dir, model, overlap):
    """A pool of 12 blocks (192 positions) for ~450: sequences are retracted,
    resumed (before new ones) and still give the tokens and logprobs of an
    unconstrained run; a prompt + output that takes the whole pool, queued
    among the others, finishes too (nothing deadlocks)."""
    reqs = _requests(1) + [([7] * 100, SamplingParams(max_new_tokens=92, temperature=0.0, ignore_eos=True))]
    want = _generate(_engine(tiny_model_dir, "paged", max_batch_size=8, max_model_len=192,
                             overlap_schedule=overlap), reqs)
    from torchtitan_grpo.server.engine.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(tiny_model_dir, dtype="float32", kv_cache="paged", max_batch_size=8,
                              max_model_len=192, overlap_schedule=overlap, kv_cache_memory_gb=_gib(13, model)))
    assert eng._batch.pool.capacity == 12
    eng._batch.headroom_tokens = 0  # admit as soon as a context fits: the batch overcommits at once
    eng.start()
    got = _generate(eng, reqs)
    assert eng.retractions > 0, "the pool never ran out: nothing was retracted"
    _same(got, want)
    assert eng._batch.pool.num_free == 12


def test_moe_paged_logits_and_routes_equal_static():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from torchtitan_grpo.server.engine import moe_routes

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=32, moe_intermediate_size=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128)
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    runs = {}
    for name, batch in (("static", StaticBatch(hf, CPU, slots=4, max_len=64, routes=True)),
                        ("paged", PagedBatch(hf, CPU, slots=4, max_len=64, num_blocks=12, routes=True))):
        seqs = [_Seq(_Req([5, 9, 14, 3, 22, 7] * 3)), _Seq(_Req([40, 41, 42]))]
        with torch.no_grad():
            logits = batch.prefill(seqs)
            for _ in range(4):
                nxt = logits.argmax(-1)
                for s, t in zip(seqs, nxt.tolist()):
                    s.output_ids.append(t)
                logits = batch.decode(nxt)
        for s in seqs:
            s.output_ids.append(0)
        runs[name] = (logits, [moe_routes.assemble(s) for s in seqs])
    torch.testing.assert_close(runs["paged"][0], runs["static"][0], atol=1e-5, rtol=1e-5)
    for p, s in zip(runs["paged"][1], runs["static"][1]):
        assert p.shape == s.shape and (p == s).all()


# ---- limits ----------------------------------------------------------------- #


def test_request_that_can_never_fit_the_pool_is_a_400(tiny_model_dir, model):
    import requests as http

    from tests.server_procs import in_process_server

    gib = f"{_gib(9, model):.12f}"  # 8 blocks: 128 positions, max_model_len 192
    with in_process_server(["--model", tiny_model_dir, "--port", "0", "--kv-cache", "paged",
                            "--max-model-len", "192", "--kv-cache-memory-gb", gib]) as (url, eng):
        assert eng._batch.capacity == 128 and eng.max_context == 192
        with pytest.raises(RequestError, match=r"max_new_tokens \(max_tokens\) = 100: .* 150 KV positions"):
            eng.check_request([5] * 50, SamplingParams(max_new_tokens=100))
        eng.check_request([5] * 50, SamplingParams(max_new_tokens=78))  # 128 positions: fits
        r = http.post(f"{url}/generate", json={"input_ids": [5] * 130, "sampling_params": {"max_new_tokens": 4}},
                      timeout=60)
        assert r.status_code == 400 and "the prompt has 130 tokens" in r.json()["message"]
        r = http.post(f"{url}/v1/completions", json={"model": tiny_model_dir, "prompt": [5] * 50, "max_tokens": 100},
                      timeout=60)
        assert r.status_code == 400 and "max_tokens" in r.text


def test_max_model_len_past_2048_when_paged(tmp_path, model):
    from torchtitan_grpo.models.demo_assets import TinyQwen3, write_tiny_qwen3
    from torchtitan_grpo.server.engine.engine import Engine, EngineConfig

    long_dir = write_tiny_qwen3(str(tmp_path / "long"), TinyQwen3(max_position_embeddings=8192))
    base = dict(dtype="float32", kv_cache="paged", max_batch_size=2, kv_cache_memory_gb=_gib(300, model))
    eng = Engine(EngineConfig(long_dir, max_model_len=4096, **base))
    assert eng.max_context == 4096 and eng._batch.capacity == 299 * BS
    eng.check_request([5] * 3000, SamplingParams(max_new_tokens=1000))
    eng.start()
    try:
        (out,) = eng.submit([5, 6, 7] * 700, SamplingParams(max_new_tokens=20, ignore_eos=True)).result(timeout=120)
    finally:
        eng.shutdown()
    assert len(out.output_ids) == 20
    # Unset: the model's context, as far as the pool holds it.
    assert Engine(EngineConfig(long_dir, **base)).max_context == 299 * BS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a device machine: docs/GPU_RUNS.md)")
def test_cuda_graph_replay_equals_eager_and_retracts(tiny_model_dir, model):
    """On a GPU (bf16): the paged engine with its decode graphs gives what it
    gives without them, with and without a pool small enough to retract."""
    reqs = _requests(2)
    outs = {}
    for graphs, blocks in ((False, 0), (True, 0), (True, 13)):
        from torchtitan_grpo.server.engine.engine import Engine, EngineConfig

        eng = Engine(EngineConfig(tiny_model_dir, device="cuda:0", dtype="float32", kv_cache="paged",
                                  max_batch_size=8, max_model_len=192, cuda_graphs=graphs,
                                  kv_cache_memory_gb=_gib(blocks or 200, model)))
        assert not graphs or eng._batch._graphs, "no decode graph was captured"
        eng._batch.headroom_tokens = 0
        eng.start()
        outs[(graphs, blocks)] = _generate(eng, reqs)
        assert blocks == 0 or eng.retractions > 0
    # Another batch composition runs other GEMM shapes: fp32 on a GPU rounds differently.
    _same(outs[(True, 0)], outs[(False, 0)], atol=1e-4)
    _same(outs[(True, 13)], outs[(False, 0)], atol=1e-4)


def test_inference_kv_cache_paged_reaches_the_started_servers(tiny_model_dir):
    """[inference] kv_cache = "paged" and kv_cache_memory_gb become the started servers' flags."""
    import os

    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.session import server_engine_args

    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train_configs", "demo_cpu.toml")
    cfg = parse_config(["--job.config_file", demo, "--model.hf_assets_path", tiny_model_dir,
                        "--inference.kv_cache", "paged", "--inference.kv_cache_memory_gb", "1.5"])
    args = server_engine_args(cfg.inference)
    assert args[:2] == ("--kv-cache", "paged") and args[-2:] == ("--kv-cache-memory-gb", "1.5"), args
    # "auto" with a GiB budget: the servers get the budget too (auto then picks the pool on a GPU)
    cfg = parse_config(["--job.config_file", demo, "--model.hf_assets_path", tiny_model_dir,
                        "--inference.kv_cache", "auto", "--inference.kv_cache_memory_gb", "2"])
    assert server_engine_args(cfg.inference)[-2:] == ("--kv-cache-memory-gb", "2.0")
    cfg = parse_config(["--job.config_file", demo, "--model.hf_assets_path", tiny_model_dir,
                        "--inference.kv_cache", "static", "--inference.kv_cache_memory_gb", "2"])
    assert "--kv-cache-memory-gb" not in server_engine_args(cfg.inference)
    # max_model_len 0: the servers' context is the trainer's training.seq_len
    args = server_engine_args(cfg.inference, cfg.training.seq_len)
    assert args[args.index("--max-model-len") + 1] == str(cfg.training.seq_len) != "0"
    cfg = parse_config(["--job.config_file", demo, "--model.hf_assets_path", tiny_model_dir,
                        "--inference.max_model_len", "48"])
    args = server_engine_args(cfg.inference, cfg.training.seq_len)
    assert args[args.index("--max-model-len") + 1] == "48"
