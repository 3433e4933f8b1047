"""The static-cache KV batch computes the HF model's logits (fp32, CPU).

Sequences of different lengths sit in one batch at different positions, share
a prompt's prefill, leave, and new ones join mid-flight: every logit row must
equal the HF forward of that row's whole context on its own.
"""

from __future__ import annotations

import pytest
import torch

from torchtitan_grpo.server.engine.static_batch import StaticBatch, supports
from tests.kv_stubs import Req as _Req, Seq as _Seq


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().requires_grad_(False)
    assert supports(m) is None
    return m


def _reference(model, ctx: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ctx])).logits[0, -1]


def _check(model, batch: StaticBatch, logits: torch.Tensor, seqs) -> None:
    assert logits.shape[0] == len(seqs)
    for row, s in zip(logits, seqs):
        torch.testing.assert_close(row, _reference(model, s.context()), atol=1e-4, rtol=1e-4)


def test_prefill_decode_leave_join_match_hf(model):
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    rand = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    batch = StaticBatch(model, torch.device("cpu"), slots=6, max_len=64)

    shared = _Req(rand(5))
    first = [_Seq(shared, 0), _Seq(shared, 1), _Seq(_Req(rand(9)))]
    with torch.no_grad():
        logits = batch.prefill(first)
    _check(model, batch, logits, first)
    assert first[1].cached_tokens == 5  # the second sample reused the first's prefill

    def decode_steps(k: int) -> None:
        for _ in range(k):
            last = torch.tensor(rand(len(batch.rows)))
            for s, t in zip(batch.rows, last.tolist()):
                s.output_ids.append(t)
            with torch.no_grad():
                out = batch.decode(last)
            _check(model, batch, out, batch.rows)

    decode_steps(3)
    batch.keep([0, 2])  # the middle row finishes; its slot frees
    assert batch.room() == 4
    decode_steps(2)
    joiner = [_Seq(_Req(rand(3)))]
    with torch.no_grad():
        _check(model, batch, batch.prefill(joiner), joiner)
    assert len(batch.rows) == 3
    # A retracted sequence comes back with output: its whole context is prefilled.
    back = _Seq(_Req(rand(4)), output_ids=rand(6))
    with torch.no_grad():
        _check(model, batch, batch.prefill([back]), [back])
    decode_steps(4)
    batch.clear()
    assert batch.room() == 6 and batch.rows == []


def test_prefill_attention_never_takes_cudnn(model, monkeypatch):
    """cuDNN's SDPA builds a plan per new prompt count (74-119 ms a new size on an H200, run 155):
    the prefill's attention runs with that backend off, and the setting is put back after."""
    import torch.nn.functional as F

    seen = []
    real = F.scaled_dot_product_attention

    def spy(*a, **k):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return real(*a, **k)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    batch = StaticBatch(model, torch.device("cpu"), slots=2, max_len=32)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    seqs = [_Seq(_Req([3, 4, 5]))]
    with torch.no_grad():
        logits = batch.prefill(seqs)
    assert len(seen) == model.config.num_hidden_layers and all(f == (False, True) for f in seen), seen
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    _check(model, batch, logits, seqs)


def test_full_batch_refuses_more(model):
    batch = StaticBatch(model, torch.device("cpu"), slots=2, max_len=32)
    with torch.no_grad():
        batch.prefill([_Seq(_Req([3, 4])), _Seq(_Req([5]))])
        with pytest.raises(RuntimeError, match="free slots"):
            batch.prefill([_Seq(_Req([6]))])


def test_weight_updates_reach_the_fused_buffers(tiny_model_dir):
    """A copy into a parameter (what a weight update does) is seen at once and
    keeps captured graphs; a storage swap (an adopted receive buffer) is seen
    after ``weights_changed``, which re-fuses and drops the graphs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().requires_grad_(False)
    batch = StaticBatch(model, torch.device("cpu"), slots=2, max_len=32)
    q = model.model.layers[0].self_attn.q_proj.weight
    up = model.model.layers[-1].mlp.up_proj.weight
    seq = lambda: [_Seq(_Req([5, 9, 4, 7]))]  # noqa: E731
    with torch.no_grad():
        q.copy_(q * 1.5)
        up.add_(0.25)
        batch._graphs[(1, 128)] = ("graph", None)  # what a capture leaves
        batch.weights_changed()
        assert batch._graphs
        s = seq()
        _check(model, batch, batch.prefill(s), s)
        batch.clear()
        q.data = q.data * -1.0  # a swap: new storage
        batch.weights_changed()
        assert not batch._graphs
        s = seq()
        _check(model, batch, batch.prefill(s), s)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a device machine: docs/GPU_RUNS.md)")
def test_cuda_graph_replay_equals_eager_and_bf16_tracks_hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    dev = torch.device("cuda:0")
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).to(dev).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    vocab = m.config.vocab_size
    prompts = [torch.randint(3, vocab, (k,), generator=g).tolist() for k in (7, 3, 12)]
    runs = {}
    for graphs in (False, True):
        batch = StaticBatch(m, dev, slots=8, max_len=64, graphs=graphs)
        seqs = [_Seq(_Req(list(p))) for p in prompts]
        with torch.no_grad():
            last = batch.prefill(seqs).argmax(-1)
            outs = []
            for step in range(6):
                if step == 3:
                    batch.keep([0, 2])
                    last = last[[0, 2]]
                for s, t in zip(batch.rows, last.tolist()):
                    s.output_ids.append(t)
                logits = batch.decode(last)
                outs.append(logits.float().cpu())
                last = logits.argmax(-1)
        runs[graphs] = (outs, [s.context() for s in batch.rows])
        if graphs:
            assert batch._graphs, "no graph was captured"
    for eager, graphed in zip(runs[False][0], runs[True][0]):
        torch.testing.assert_close(graphed, eager, atol=0, rtol=0)  # the same kernels, replayed
    # bf16 against the HF forward of each final context: the tolerance bf16 allows.
    with torch.no_grad():
        for row, ctx in zip(runs[True][0][-1], runs[True][1]):
            ref = m(input_ids=torch.tensor([ctx], device=dev)).logits[0, -1].float().cpu()
            assert (row.log_softmax(-1) - ref.log_softmax(-1)).abs().max() < 0.1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (run on a device machine: docs/GPU_RUNS.md)")
def test_engine_on_a_second_gpu_captures_its_graphs_there(tiny_model_dir):
    """A server on cuda:1 starts with cuda:0 current: its decode graphs must
    be captured on cuda:1's stream (they were not, and start-up failed), and
    it generates what the same engine on cuda:0 does."""
    from torchtitan_grpo.server.engine.engine import Engine, EngineConfig
    from torchtitan_grpo.server.engine.requests import SamplingParams

    assert torch.cuda.current_device() == 0
    outs = {}
    for dev in ("cuda:0", "cuda:1"):
        eng = Engine(EngineConfig(tiny_model_dir, device=dev, dtype="bfloat16", max_batch_size=4, kv_cache="static",
                                  max_model_len=48, cuda_graphs=True))
        eng.start()
        try:
            assert eng.static_cache and eng._batch._graphs, "no decode graph was captured"
            futs = [eng.submit([5, 9, 4, 7], SamplingParams(max_new_tokens=16, n=2, seed=3, ignore_eos=True)),
                    eng.submit([8, 3], SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))]
            outs[dev] = [r.output_ids for f in futs for r in f.result(timeout=120)]
        finally:
            eng.shutdown()
    assert outs["cuda:1"] == outs["cuda:0"]


def test_engine_on_a_static_cache_generates_what_the_dynamic_one_does(tiny_model_dir):
    """Same requests (seeded sampling, n > 1, a top-p row, a greedy row) on
    both KV batches: the same tokens and logprobs; the static engine's context
    is its max_model_len (a longer prompt is refused, output stops there)."""
    from torchtitan_grpo.server.engine.engine import Engine, EngineConfig
    from torchtitan_grpo.server.engine.requests import RequestError, SamplingParams

    reqs = [([5, 9, 4, 7, 11], SamplingParams(max_new_tokens=12, n=2, seed=3)),
            ([8, 3], SamplingParams(max_new_tokens=9, top_p=0.8, seed=4)),
            ([6] * 9, SamplingParams(max_new_tokens=7, temperature=0.0))]
    outs = {}
    for kind in ("dynamic", "static"):
        eng = Engine(EngineConfig(tiny_model_dir, dtype="float32", max_batch_size=4, kv_cache=kind, max_model_len=24))
        eng.start()
        try:
            futs = [eng.submit(p, sp) for p, sp in reqs]
            outs[kind] = [r for f in futs for r in f.result(timeout=120)]
            if kind == "static":
                assert eng.static_cache and eng.max_context == 24
                with pytest.raises(RequestError, match="context is 24"):
                    eng.check_request(list(range(3, 27)), SamplingParams())
                (long,) = eng.submit([5] * 20, SamplingParams(max_new_tokens=50, ignore_eos=True)).result(timeout=120)
                assert long.finish_reason.kind == "length" and len(long.output_ids) == 4
        finally:
            eng.shutdown()
    for d, s in zip(outs["dynamic"], outs["static"]):
        assert s.output_ids == d.output_ids
        torch.testing.assert_close(s.output_logprobs, d.output_logprobs, atol=1e-4, rtol=0)


def test_config_keys_reach_the_launched_servers():
    """[inference] kv_cache / max_model_len are checked by name and become the
    started servers' --kv-cache / --max-model-len."""
    import os

    from torchtitan_grpo.config.checks import ConfigError
    from torchtitan_grpo.config.parse import parse_config

    demo = os.path.join(os.path.dirname(os.path.dirname(__file__)), "train_configs", "demo_cpu.toml")
    with pytest.raises(ConfigError, match=r"inference\.max_model_len"):
        parse_config(["--job.config_file", demo, "--inference.max_model_len", "1"])
    with pytest.raises(ConfigError, match=r"inference\.kv_cache = 'ring'"):  # a Literal: refused by name, one line
        parse_config(["--job.config_file", demo, "--inference.kv_cache", "ring"])
    cfg = parse_config(["--job.config_file", demo, "--inference.kv_cache", "static", "--inference.max_model_len", "96"])
    assert (cfg.inference.kv_cache, cfg.inference.max_model_len) == ("static", 96)
    from torchtitan_grpo.server.app import engine_config, parse_args

    srv = parse_args(["--model", "m", "--port", "0", "--kv-cache", "static", "--max-model-len", "96"])
    eng = engine_config(srv)
    assert (eng.kv_cache, eng.max_model_len, eng.cuda_graphs, eng.overlap_schedule) == ("static", 96, True, None)
    off = engine_config(parse_args(["--model", "m", "--port", "0", "--disable-overlap-schedule", "--no-cuda-graphs"]))
    assert (off.cuda_graphs, off.overlap_schedule) == (False, False)


def test_auto_pipeline_depth_is_serial_when_servers_share_a_float32_trainers_gpu(monkeypatch):
    import os

    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.config.job_config import pipeline_depth

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    demo = os.path.join(os.path.dirname(os.path.dirname(__file__)), "train_configs", "demo_cpu.toml")
    base = ["--job.config_file", demo, "--weight_sync.mode", "async", "--weight_sync.transport", "gloo"]
    assert pipeline_depth(parse_config(base)) == 1  # CPU servers, CPU trainer: as before
    assert pipeline_depth(parse_config(base + ["--inference.server_device", "cuda:0"])) == 0  # the demo: float32
    assert pipeline_depth(parse_config(base + ["--inference.server_device", "cuda:0",
                                               "--training.mixed_precision_param", "bfloat16"])) == 1
    assert pipeline_depth(parse_config(base + ["--inference.server_device", "cuda:1"])) == 1
    assert pipeline_depth(parse_config(base + ["--inference.server_device", "cuda:0",
                                               "--rollout.pipeline_depth", "1"])) == 1


def test_static_engine_copies_updates_into_the_parameters(tiny_model_dir):
    """Under a static cache a loaded version never swaps a parameter's storage
    (captured graphs read it): the values change, the addresses do not."""
    from torchtitan_grpo.server.engine.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(tiny_model_dir, dtype="float32", max_batch_size=2, kv_cache="static", max_model_len=32))
    name = "model.layers.0.self_attn.q_proj.weight"
    param = eng._tensors[name]
    ptr = param.data_ptr()
    new = torch.randn(param.shape)
    eng.load_weights([(name, new)], "v1")
    assert param.data_ptr() == ptr and torch.equal(param.detach(), new)
    assert eng.weight_version == "v1"
