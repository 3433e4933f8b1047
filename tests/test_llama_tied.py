"""Tied-embedding Llama (``tie_word_embeddings``: SmolLM2, Llama 3.2 1B/3B)
under ``model.name = "llama3"`` (torchtitan_grpo.models.llama3_tied).

A tiny tied ``LlamaForCausalLM`` (Llama-3.1 RoPE scaling, norms away from 1)
written by transformers is checked for: equal logits and one shared
parameter after loading; an HF export without ``lm_head.weight`` equal to
the HF model's state; one GRPO step under FSDP, TP and PP (2 ranks, gloo, one
torchrun for the three, the harness of tests/rank_cases.py) equal
to the single process; ``checkpoint.export_hf`` loading back in transformers
with equal logits.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402

import torchtitan_grpo  # noqa: E402,F401  (before torchtitan)
from tests.rank_cases import (  # noqa: E402
    MAX_NORM,
    PP_SCHEDULES,
    TOL,
    _METRICS,
    compare,
    run_case,
    run_step_case,
    write_llama,
)

torch.set_num_threads(1)

NAME = "llama3"  # the train spec: tied is a property of the checkpoint, not a new name
LAYOUTS = {"fsdp": (1, 2, 1), "tp": (1, 1, 2), "pp": (1, 1, 1, 2)}  # one 2-rank launch
SEQ = 24
ROPE = {  # a short original context: the scaling changes most frequencies within SEQ
    "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64, "rope_theta": 10000.0,
}


def write_tied_llama(path: str) -> str:
    """A tiny tied LlamaForCausalLM checkpoint (+ the demo tokenizer) at ``path``."""
    return write_llama(path, seed=3, tie_word_embeddings=True, rope_parameters=ROPE)


def _hf(path: str):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    return hf.eval()


def _titan(path: str):
    from torchtitan_grpo.models import hf_bridge as hf_model

    args = hf_model.model_args_from_hf(NAME, hf_model.load_hf_config(path), max_seq_len=64)
    model = hf_model.build_model(NAME, args, "cpu")
    adapter = hf_model.state_dict_adapter(NAME, args, path)
    hf_model.load_hf_weights(model, adapter, path)
    return model.eval(), adapter


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory) -> str:
    return write_tied_llama(str(tmp_path_factory.mktemp("llama_tied") / "model"))


def test_loads_tied_with_transformers_logits(tied_dir):
    from safetensors.torch import load_file

    from torchtitan_grpo.models.llama3_tied import TiedLlama3Transformer

    assert "lm_head.weight" not in load_file(os.path.join(tied_dir, "model.safetensors"))
    titan, _ = _titan(tied_dir)
    assert isinstance(titan, TiedLlama3Transformer)
    assert titan.output.weight is titan.tok_embeddings.weight
    hf = _hf(tied_dir)
    with torch.no_grad():
        ref, got = hf(_ids()).logits, titan(_ids())
    assert ref.abs().max() > 0.5  # large enough for the tolerance to mean something
    assert (got - ref).abs().max() <= 1e-5


def test_hf_state_dict_round_trip(tied_dir):
    from torchtitan_grpo.models.hf_bridge import hf_state_dict

    titan, adapter = _titan(tied_dir)
    exported = hf_state_dict(titan, adapter)
    hf_state = _hf(tied_dir).state_dict()
    assert torch.equal(hf_state["lm_head.weight"], hf_state["model.embed_tokens.weight"])
    assert "lm_head.weight" not in exported
    assert exported.keys() == hf_state.keys() - {"lm_head.weight"}
    for name, tensor in exported.items():
        assert torch.equal(tensor, hf_state[name]), name  # wq/wk permuted back exactly
    # an old tied checkpoint that also stores lm_head.weight: the embedding wins
    titan_sd = adapter.from_hf({**exported, "lm_head.weight": torch.zeros(128, 64)})
    assert torch.equal(titan_sd["output.weight"], titan_sd["tok_embeddings.weight"])


def test_untied_llama_keeps_torchtitans_classes():
    from torchtitan.models.llama3.model.model import Transformer
    from torchtitan_grpo.models import hf_bridge as hf_model
    from torchtitan_grpo.models.llama3_tied import TiedLlama3Transformer

    config = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 192,
              "num_hidden_layers": 1, "num_attention_heads": 4}
    for tied in (False, True):
        args = hf_model.model_args_from_hf(NAME, {**config, "tie_word_embeddings": tied}, 16)
        model = hf_model.build_model(NAME, args, "meta")
        assert isinstance(model, Transformer)
        assert isinstance(model, TiedLlama3Transformer) is tied
        assert (model.output.weight is model.tok_embeddings.weight) is tied
        names = hf_model.checkpoint_names(model, hf_model.state_dict_adapter(NAME, args, None))
        assert ("lm_head.weight" in names) is not tied


def test_smollm2_shape_builds_on_meta():
    """SmolLM2-135M's config.json shape: 134,515,008 parameters, as
    transformers counts them (the tied head counted once)."""
    from torchtitan_grpo.models import hf_bridge as hf_model

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 576,
              "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
              "intermediate_size": 1536, "vocab_size": 49152, "rope_theta": 100000.0,
              "tie_word_embeddings": True, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}
    args = hf_model.model_args_from_hf(NAME, config)
    model = hf_model.build_model(NAME, args, "meta")
    assert model.layers["0"].feed_forward.w1.out_features == 1536
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_export_hf_loads_in_transformers(tied_dir, tmp_path):
    """``checkpoint.export_hf`` of a tied llama policy whose weights moved:
    no lm_head.weight, and transformers re-ties it to the same logits."""
    from safetensors.torch import load_file

    from tests.rank_cases import step_job_config
    from torchtitan_grpo.train import trainer
    from torchtitan_grpo.train.checkpoint import export_hf

    d = trainer.Dist(0, 1, 0, torch.device("cpu"))
    policy = trainer.build_policy(step_job_config(NAME, "single"), tied_dir, d)
    with torch.no_grad():  # the export must follow the live weights, not the files
        policy.model.tok_embeddings.weight.mul_(1.5)
    out = export_hf(policy, tied_dir, str(tmp_path / "export"), d)
    assert "lm_head.weight" not in load_file(os.path.join(out, "model.safetensors"))
    hf = _hf(out)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    policy.model.eval()
    with torch.no_grad():
        ref, got = policy.model(_ids()), hf(_ids()).logits
    assert (got - _hf(tied_dir)(_ids()).logits).abs().max() > 1e-2  # the change was exported
    assert (got - ref).abs().max() <= 1e-5


# ------------------------------------------------------------- parity


def rank_models(root: str) -> dict[str, str]:
    """The checkpoint of :func:`run_ranks` (tests/multirank.py writes it before its launch)."""
    return {"llama_tied": write_tied_llama(os.path.join(root, "llama_tied"))}


def run_ranks(out_dir: str, model_dirs: dict[str, str]) -> None:
    """In an initialised 2-rank group: one GRPO step per layout, rank 0 saves it."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    for layout, dims in LAYOUTS.items():
        if layout in PP_SCHEDULES:  # the trainer's own pipeline step
            result = run_step_case(model_dirs["llama_tied"], NAME, layout, world)
        else:
            result = run_case(model_dirs["llama_tied"], NAME, dims, world)
        if rank == 0:
            torch.save(result, os.path.join(out_dir, f"{layout}.pt"))
    dist.barrier()  # leave together: a peer gone early can abort this rank at exit


def _worker(out_dir: str, model_dir: str) -> None:
    """Under torchrun (2 ranks, a launch of its own): :func:`run_ranks`."""
    import torch.distributed as dist
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    try:
        run_ranks(out_dir, {"llama_tied": model_dir})
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def parity(request, tmp_path_factory):
    """Single-process references, and every layout from 2 ranks: on CPU from
    the suite's shared 2-rank launch (tests/multirank.py), else from a
    2-rank torchrun of this file's own."""
    if not torch.cuda.is_available():
        launched = request.getfixturevalue("multirank_launched")
        model_dir, out = launched.model_dirs["llama_tied"], launched.extra("test_llama_tied")
    else:
        model_dir = request.getfixturevalue("tied_dir")
        out = tmp_path_factory.mktemp("llama_tied_parity")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.abspath(__file__), str(out), model_dir]
        path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, TOKENIZERS_PARALLELISM="false")
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    ref, ref_step = run_case(model_dir, NAME, (1, 1, 1), 1), run_step_case(model_dir, NAME, "single", 1)
    return ref, ref_step, {name: torch.load(out / f"{name}.pt", weights_only=False) for name in LAYOUTS}


def test_layouts_match_single_process(parity):
    ref, ref_step, got = parity
    assert ref["tied"] and ref["grad_norm"] > MAX_NORM and ref["moved"] > 1e3 * TOL  # not trivial
    assert compare(ref, ref_step)["params"] < TOL  # train_step is run_case's computation
    for layout, result in got.items():
        diffs = compare(ref, result)
        assert diffs["loss"] < TOL, (layout, diffs)
        assert diffs["grad_norm"] < TOL * max(1.0, ref["grad_norm"]), (layout, diffs)
        assert max(diffs[k] for k in ("grads", "params", "pushed")) < TOL, (layout, diffs)
        assert result["tied"], layout  # FSDP / TP kept one weight; PP mirrored it
        assert "lm_head.weight" not in result["pushed"], layout
    want = ref_step["metrics"][0]
    for rank, metrics in enumerate(got["pp"]["metrics"]):
        diffs = {k: abs(metrics[k] - want[k]) for k in _METRICS}
        assert max(diffs.values()) < TOL * max(1.0, want["grad_norm"]), (rank, diffs)
    assert math.isfinite(got["pp"]["loss"])


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
