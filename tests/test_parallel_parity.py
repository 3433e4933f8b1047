"""One GRPO step gives the same numbers in every parallel layout
(torchtitan_grpo.distributed.parallel), on CPU over gloo with real torchrun ranks (the
same file runs on GPUs over NCCL, one GPU per rank, where launches needing
more GPUs than there are skip).

A fixed batch (tokens, masks, advantages, rollout log-probs; uneven lengths
and an odd sample count, so DP ranks get different numbers of samples and TP
needs padding) goes through micro-batched forward/backward with the GRPO loss
normalised by *global* counts, TorchTitan's grad-norm clipping and one AdamW
step. Each layout is compared with a single process on: the batch loss, the
grad norm, every full gradient (Adam's first step hides a gradient scale,
clipping too, so the gradients are compared directly), every parameter after
the step, and the HF-named tensors that would be pushed to the servers.

Models (tiny, fp32): qwen3 untied, qwen3 tied (``tie_word_embeddings``) and
llama3. Layouts: FSDP dp_shard=2, TP=2, DDP dp_replicate=2 and PP=2 (1F1B)
in one 2-rank launch; HSDP 2x2, FSDP 2 x TP 2, PP 2 x FSDP 2 (GPipe) and
PP 2 x TP 2 (1F1B) in one 4-rank launch.

Pipeline layouts run the trainer itself (``trainer.build_policy`` and
``trainer.train_step``: the GRPO loss goes through the pipeline schedule on
the last stage), so besides the numbers above every rank's step metrics are
compared with a single-process ``train_step``; stage tensors are gathered
from all stages by their FQNs.

Run as a script to print the measured table (docs/PARITY.md)::

    python tests/test_parallel_parity.py                      # fp32, as the tests
    python tests/test_parallel_parity.py --dtype bfloat16     # bf16 compute

``--dtype bfloat16`` measures the same table with every layout and the single
process computing in bf16 (fp32 master weights, gradients, optimizer and
loss; see :func:`tests.rank_cases._bf16_compute`). It reports, it asserts
nothing: bf16 is far from the tests' 1e-5, which stay fp32.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.rank_cases import (  # noqa: E402
    LAYOUTS,
    MAX_NEW_TOKENS,
    MAX_NORM,
    PAD,
    PP_SCHEDULES,
    TOL,
    _METRICS,
    _device,
    _full,
    _gathered_hf,
    compare,
    fixed_batch,
    job_config,
    run_case,
    run_step_case,
    run_torchrun,
    step_job_config,
    write_models,
)

DTYPES = ("float32", "bfloat16")  # compute dtype of the table; the tests run float32
MODELS = ("qwen3", "qwen3_tied", "llama3")
LAUNCHES = {2: ("fsdp", "tp", "ddp", "pp"), 4: ("hsdp", "fsdp_tp", "pp_fsdp", "pp_tp")}
EMPTY_RANK_LAYOUT = "pp_fsdp"  # also steps once with a DP rank that has no samples
CHECKPOINT_LAYOUT = "pp"  # also saves and resumes a checkpoint of the stages
if torch.cuda.is_available():  # one GPU per rank
    LAUNCHES = {n: names for n, names in LAUNCHES.items() if n <= torch.cuda.device_count()}


# ------------------------------------------------- pipeline step checks


def run_empty_rank_step(model_dir: str, model_name: str, layout_name: str, world_size: int) -> list[dict]:
    """One ``train_step`` on one sample, on DP rank 0: the other DP ranks have
    none and every rank steps padding-only micro-batches (a pipeline needs at
    least one per stage). Returns every rank's metrics."""
    import torch.distributed as dist

    from torchtitan_grpo.distributed import parallel
    from torchtitan_grpo.train import trainer

    cfg = step_job_config(model_name, layout_name)
    d = trainer.Dist(dist.get_rank(), world_size, int(os.environ.get("LOCAL_RANK", "0")), _device())
    policy = trainer.build_policy(cfg, model_dir, d)
    batch = fixed_batch()[:1]
    dp_rank, _ = parallel.data_parallel_rank_and_degree(policy.parallel_dims)
    local = batch if dp_rank == 0 else []
    metrics = trainer.train_step(policy, local, cfg.grpo, 1.0, MAX_NEW_TOKENS, len(batch),
                                 sum(len(s.completion_ids) for s in batch), PAD, d)
    every = [None] * world_size
    dist.all_gather_object(every, metrics)
    return every


def _exported_mismatches(policy, model_dir: str, out_dir: str, d) -> dict:
    """``export_hf`` of the policy against the stages' united HF tensors:
    rank 0 reports how many tensors the export holds (``n_export``) and the
    names missing, extra or unequal (``bad_export``). A collective."""
    from safetensors.torch import load_file

    from torchtitan_grpo.train.checkpoint import export_hf

    export_hf(policy, model_dir, out_dir, d)
    expected = _gathered_hf(policy)
    if not d.is_main:
        return {}
    got = load_file(os.path.join(out_dir, "model.safetensors"))
    bad = sorted((got.keys() ^ expected.keys()) | {k for k in got.keys() & expected.keys()
                                                     if not torch.equal(got[k], expected[k])})
    return {"n_export": len(got), "bad_export": bad}


def run_checkpoint_roundtrip(model_dir: str, model_name: str, layout_name: str, world_size: int,
                             dump: str) -> dict:
    """Save after one ``train_step`` through our ``Checkpointer`` (TorchTitan's
    CheckpointManager over ``policy.model_parts``), load into a fresh policy.
    Returns, for this rank's stage tensors and optimizer tensors, how many
    were saved (``n_*``) and the names of those that came back unequal
    (``bad_*``). A collective."""
    import torch.distributed as dist

    from torchtitan_grpo.distributed import parallel
    from torchtitan_grpo.train import trainer
    from torchtitan_grpo.train.checkpoint import Checkpointer

    cfg = step_job_config(model_name, layout_name)
    cfg.job.dump_folder, cfg.checkpoint.enable, cfg.checkpoint.interval = dump, True, 1
    d = trainer.Dist(dist.get_rank(), world_size, int(os.environ.get("LOCAL_RANK", "0")), _device())
    policy = trainer.build_policy(cfg, model_dir, d)
    ckpt = Checkpointer(cfg, policy, d)
    batch = fixed_batch()
    dp_rank, dp_degree = parallel.data_parallel_rank_and_degree(policy.parallel_dims)
    trainer.train_step(policy, batch[dp_rank::dp_degree], cfg.grpo, 1.0, MAX_NEW_TOKENS, len(batch),
                       sum(len(s.completion_ids) for s in batch), PAD, d)
    ckpt.save(1, weight_version=1)
    ckpt.close()
    exported = _exported_mismatches(policy, model_dir, os.path.join(dump, "hf"), d)

    def tensors(p) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        model = {k: _full(v) for k, v in p.model.state_dict().items()}
        optim = {k: _full(v) for k, v in p.optimizers.state_dict().items() if torch.is_tensor(v)}
        return model, optim

    saved = tensors(policy)
    fresh = trainer.build_policy(cfg, model_dir, d)
    ckpt = Checkpointer(cfg, fresh, d)
    resumed = ckpt.load()
    loaded = tensors(fresh)
    ckpt.close()
    out = {"step": resumed.step if resumed else None, **exported}
    for kind, a, b in zip(("model", "optim"), saved, loaded):
        out[f"n_{kind}"] = len(a)
        out[f"bad_{kind}"] = sorted(k for k in a if k not in b or not torch.equal(a[k], b[k]))
    return out


# ---------------------------------------------------------------- workers


def _worker(out_dir: str, model_dirs: dict[str, str], layouts: list[str], dtype: str = "float32") -> None:
    """Under torchrun: every (model, layout) of this launch, results to out_dir.

    In bf16 mode (the table only) the checks that no table column reads (a
    rank without samples, the checkpoint round trip) are left out.
    """
    import torch.distributed as dist
    from datetime import timedelta

    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=300))
    try:
        run_layouts(out_dir, model_dirs, layouts, dtype)
        dist.barrier()  # leave together: a peer gone early can abort this rank at exit
    finally:
        dist.destroy_process_group()


def run_layouts(out_dir: str, model_dirs: dict[str, str], layouts: list[str], dtype: str = "float32") -> None:
    """:func:`_worker`'s cases in a process group already started (also run
    by tests/multirank.py, in one launch with test_gather's cases)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    for layout in layouts:
        for model_name in MODELS:
            t0 = time.perf_counter()
            if layout in PP_SCHEDULES:  # the trainer's own pipeline step
                result = run_step_case(model_dirs[model_name], model_name, layout, world, dtype)
            else:
                result = run_case(model_dirs[model_name], model_name, LAYOUTS[layout], world, dtype)
            result["seconds"] = time.perf_counter() - t0
            if rank == 0:
                torch.save(result, os.path.join(out_dir, f"{model_name}-{layout}.pt"))
        if dtype != "float32":
            continue
        if layout == EMPTY_RANK_LAYOUT:
            every = run_empty_rank_step(model_dirs["qwen3"], "qwen3", layout, world)
            if rank == 0:
                torch.save(every, os.path.join(out_dir, f"empty-rank-{layout}.pt"))
        if layout == CHECKPOINT_LAYOUT:
            dump = os.path.join(out_dir, f"dump-{layout}")
            result = run_checkpoint_roundtrip(model_dirs["qwen3_tied"], "qwen3_tied", layout, world, dump)
            every = [None] * world
            dist.all_gather_object(every, result)
            if rank == 0:
                torch.save(every, os.path.join(out_dir, f"checkpoint-{layout}.pt"))


def launch(nproc: int, out_dir: str, model_dirs: dict[str, str], timeout: float = 600,
           dtype: str = "float32") -> str:
    """torchrun ``nproc`` ranks over this file's worker; returns the log."""
    return run_torchrun(nproc, [os.path.abspath(__file__), "worker", "--out", out_dir,
                                "--layouts", ",".join(LAUNCHES[nproc]), "--dtype", dtype,
                                *[f"--model={k}={v}" for k, v in model_dirs.items()]], timeout)


# ------------------------------------------------------------------ tests


def test_pad_to_multiple_only_appends_masked_positions():
    from torchtitan_grpo.distributed.parallel import pad_to_multiple
    from torchtitan_grpo.train.trainer import _pack

    tokens, mask, old, _ = _pack(fixed_batch()[:3], PAD, torch.device("cpu"))
    assert tokens.shape[1] % 2 == 1  # the fixture needs padding under TP=2
    t2, m2, o2 = pad_to_multiple(tokens, mask, old, 2, PAD)
    assert t2.shape[1] == tokens.shape[1] + 1 and m2.shape[1] == t2.shape[1] - 1
    assert torch.equal(t2[:, : tokens.shape[1]], tokens) and bool((t2[:, -1] == PAD).all())
    assert torch.equal(m2[:, : mask.shape[1]], mask) and float(m2[:, -1].abs().sum()) == 0.0
    assert torch.equal(o2[:, : old.shape[1]], old)
    assert pad_to_multiple(t2, m2, o2, 2, PAD)[0] is t2  # already a multiple: untouched


@pytest.mark.parametrize("key", ["expert_tensor_parallel_degree"])  # CP: test_context_parallel
def test_unsupported_parallelisms_are_rejected(key):
    from torchtitan_grpo.distributed.parallel import build_parallel_dims

    cfg = job_config("qwen3", (1, 1, 1))
    setattr(cfg.parallelism, key, 2)
    with pytest.raises(NotImplementedError, match=key):
        build_parallel_dims(cfg, 2, "cpu")


@pytest.mark.parametrize("setting, error, names", [
    ({"parallelism.pipeline_parallel_schedule": "Interleaved1F1B"}, ValueError,
     ["parallelism.pipeline_parallel_schedule"]),
    ({"parallelism.pipeline_parallel_schedule_csv": "schedule.csv"}, ValueError,
     ["parallelism.pipeline_parallel_schedule_csv"]),
    ({"grpo.kl_coef": 0.1}, NotImplementedError, ["grpo.kl_coef", "parallelism.pipeline_parallel_degree"]),
    ({"parallelism.data_parallel_replicate_degree": 2}, NotImplementedError,
     ["parallelism.data_parallel_replicate_degree", "parallelism.pipeline_parallel_degree"]),
    ({"parallelism.pipeline_parallel_layers_per_stage": 1}, ValueError,
     ["parallelism.pipeline_parallel_layers_per_stage"]),
    ({"parallelism.module_fqns_per_model_part": [["tok_embeddings", "layers.1"], ["layers.0", "norm", "output"]]},
     ValueError, ["parallelism.module_fqns_per_model_part"]),
])
def test_unsupported_pipeline_settings_are_rejected(setting, error, names):
    """PP settings the trainer cannot run fail at start-up naming their keys."""
    from torchtitan_grpo.distributed.pipeline import check_config, stage_module_names

    cfg = step_job_config("qwen3", "pp")
    for key, value in setting.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(error) as e:
        check_config(cfg, 2)  # what build_parallel_dims runs first
        stage_module_names(cfg, 2)  # checked when the stages are built
    for name in names:
        assert name in str(e.value), (name, str(e.value))


def test_build_parallel_dims_checks_pipeline_settings():
    from torchtitan_grpo.distributed.parallel import build_parallel_dims

    cfg = step_job_config("qwen3", "pp")
    cfg.parallelism.pipeline_parallel_schedule = "ZBVZeroBubble"
    with pytest.raises(ValueError, match="parallelism.pipeline_parallel_schedule"):
        build_parallel_dims(cfg, 2, "cpu")


def test_one_gpu_trains_in_the_configured_precision():
    """TorchTitan's rule: autocast to training.mixed_precision_param on one
    device or DDP on a GPU; FSDP does its own; TP / PP without FSDP, CPU and
    "float32" stay float32 (no autocast)."""
    from types import SimpleNamespace

    from torchtitan_grpo.distributed.parallel import build_parallel_dims, mixed_precision

    cfg = job_config("qwen3", (1, 1, 1))
    one = build_parallel_dims(cfg, 1, "cpu")
    assert not one.fsdp_enabled and not one.tp_enabled and not one.pp_enabled
    amp = mixed_precision(cfg, one, "cuda:0")
    assert isinstance(amp, torch.autocast) and amp.device == "cuda", amp
    assert amp.fast_dtype == torch.bfloat16 and cfg.training.mixed_precision_param == "bfloat16"
    ddp = SimpleNamespace(fsdp_enabled=False, tp_enabled=False, pp_enabled=False)
    assert isinstance(mixed_precision(cfg, ddp, "cuda:0"), torch.autocast)
    for dims in (SimpleNamespace(fsdp_enabled=True, tp_enabled=False, pp_enabled=False),
                 SimpleNamespace(fsdp_enabled=False, tp_enabled=True, pp_enabled=False),
                 SimpleNamespace(fsdp_enabled=False, tp_enabled=False, pp_enabled=True)):
        assert not isinstance(mixed_precision(cfg, dims, "cuda:0"), torch.autocast), dims
    assert not isinstance(mixed_precision(cfg, one, "cpu"), torch.autocast)
    cfg.training.mixed_precision_param = "float32"
    assert not isinstance(mixed_precision(cfg, one, "cuda:0"), torch.autocast)


def test_parallelize_refuses_pipeline_layouts():
    from torchtitan_grpo.distributed.parallel import parallelize

    with pytest.raises(ValueError, match="pipeline_parallel_degree"):
        parallelize(torch.nn.Linear(2, 2), job_config("qwen3", LAYOUTS["pp"]), 2, "cpu")


def test_stage_split_keeps_fqns(tmp_path):
    """Each stage holds its modules under the whole model's FQNs, and the
    stages together hold every parameter once (twice for a tied embedding:
    once per end of the pipeline)."""
    from torchtitan_grpo.models import hf_bridge as hf_model
    from torchtitan_grpo.distributed.pipeline import split_stage, stage_module_names

    model_dirs = write_models(str(tmp_path))
    for model_name in MODELS:
        cfg = step_job_config(model_name, "pp")
        args = hf_model.model_args_from_hf(cfg.model.name, hf_model.load_hf_config(model_dirs[model_name]), 64)
        whole = dict(hf_model.build_model(cfg.model.name, args, "cpu").named_parameters())
        names = stage_module_names(cfg, args.n_layers)
        assert names == [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
        seen = []
        for keep in names:
            stage = split_stage(hf_model.build_model(cfg.model.name, args, "cpu"), keep)
            params = dict(stage.named_parameters())
            assert all(any(n == k or n.startswith(k + ".") for k in keep) for n in params), sorted(params)
            seen += list(params)
        tied = model_name == "qwen3_tied"
        assert sorted(seen) == sorted(list(whole) + (["output.weight"] if tied else [])), model_name


def test_bucketed_seq_len():
    from torchtitan_grpo.distributed.pipeline import bucketed_seq_len

    assert bucketed_seq_len(5, 64) == 8  # buckets of 64 / 8
    assert bucketed_seq_len(8, 64) == 8 and bucketed_seq_len(9, 64) == 16
    assert bucketed_seq_len(9, 64, multiple=3) == 9  # bucket 9: a multiple of the TP degree
    assert bucketed_seq_len(63, 100) == 65  # 13-token buckets
    assert bucketed_seq_len(57, 60, multiple=4) == 60  # capped at seq_len (64 would not fit)...
    assert bucketed_seq_len(57, 60, multiple=7) == 70  # ...unless TP cannot split seq_len evenly
    assert bucketed_seq_len(100, 100) == 100


def test_cpu_sdpa_strategy_is_registered_once():
    from torch.distributed.tensor import DTensor
    from torchtitan_grpo.distributed.parallel import register_cpu_sdpa_sharding

    register_cpu_sdpa_sharding()
    assert register_cpu_sdpa_sharding() is False  # already there: left alone
    funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in funcs
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default in funcs


@pytest.fixture(scope="module")
def parity(multirank_launched):
    """Single-process references, and the results of both launches: those
    run once per session with test_gather's cases (tests/multirank.py: each
    rank's start-up is paid once for both files), the same cases that
    ``launch`` runs."""
    launched = multirank_launched
    model_dirs = launched.model_dirs
    refs = {m: run_case(model_dirs[m], m, (1, 1, 1), 1) for m in MODELS}
    ref_steps = {m: run_step_case(model_dirs[m], m, "single", 1) for m in MODELS}
    return refs, launched.parity, launched.failed("parity"), ref_steps


def _launched(parity, layout: str, name: str):
    _, out, errors, _ = parity
    nproc = next((n for n, names in LAUNCHES.items() if layout in names), None)
    if nproc is None:
        pytest.skip(f"{layout} needs more GPUs than this machine has")
    if nproc in errors:
        pytest.fail(errors[nproc])
    return torch.load(out / name, weights_only=False)


def _result(parity, model_name: str, layout: str) -> tuple[dict, dict]:
    return parity[0][model_name], _launched(parity, layout, f"{model_name}-{layout}.pt")


def test_reference_step_is_not_trivial(parity):
    """The comparisons below mean something: every model's batch has a grad
    norm above the clip threshold, gradients far above TOL, and the step
    moves the weights by far more than TOL."""
    for model_name, ref in parity[0].items():
        assert ref["grad_norm"] > MAX_NORM, model_name
        assert max(float(g.abs().max()) for g in ref["grads"].values()) > 1e3 * TOL, model_name
        assert ref["moved"] > 1e3 * TOL, model_name
        assert ref["tied"] == (model_name == "qwen3_tied")
        metrics = parity[3][model_name]["metrics"][0]
        assert 0 < metrics["clip_fraction"] < 1 and metrics["entropy"] > 1, (model_name, metrics)


@pytest.mark.parametrize("model_name", MODELS)
def test_trainer_step_matches_reference_step(parity, model_name):
    """``train_step`` in one process is the computation of ``run_case``: the
    reference of the pipeline layouts' metrics is the reference of the rest."""
    diffs = compare(parity[0][model_name], parity[3][model_name])
    assert max(diffs.values()) < TOL, diffs


@pytest.mark.parametrize("layout", list(PP_SCHEDULES))
@pytest.mark.parametrize("model_name", MODELS)
def test_pipeline_metrics_on_every_rank(parity, model_name, layout):
    """Every rank (rank 0 is on the first stage, the loss on the last) reports
    the single process's step metrics."""
    got = _launched(parity, layout, f"{model_name}-{layout}.pt")["metrics"]
    ref = parity[3][model_name]["metrics"][0]
    assert len(got) == math.prod(LAYOUTS[layout])
    for rank, metrics in enumerate(got):
        diffs = {k: abs(metrics[k] - ref[k]) for k in _METRICS}
        assert max(diffs.values()) < TOL * max(1.0, ref["grad_norm"]), (rank, diffs)


def test_pipeline_checkpoint_resumes_every_stage(parity):
    """TorchTitan's CheckpointManager over the stages (``policy.model_parts``):
    each rank saves and loads its own stage's tensors and optimizer state; the
    HF export holds every stage's weights."""
    every = _launched(parity, CHECKPOINT_LAYOUT, f"checkpoint-{CHECKPOINT_LAYOUT}.pt")
    for rank, result in enumerate(every):
        assert result["step"] == 1, (rank, result)
        assert result["n_model"] > 5 and result["n_optim"] > 5, (rank, result)
        assert not result["bad_model"] and not result["bad_optim"], (rank, result)
    # export_hf gathers every stage: embeddings, 2 layers x 11 tensors, final
    # norm (tied: no lm_head.weight), equal to the stages' own HF tensors
    assert every[0]["n_export"] == 1 + 2 * 11 + 1 and not every[0]["bad_export"], every[0]


def test_pipeline_rank_without_samples(parity):
    """A DP rank with no samples steps padding micro-batches in step with the
    others (no deadlock), and every rank reports the same finite metrics."""
    every = _launched(parity, EMPTY_RANK_LAYOUT, f"empty-rank-{EMPTY_RANK_LAYOUT}.pt")
    assert len(every) == math.prod(LAYOUTS[EMPTY_RANK_LAYOUT])
    for metrics in every:
        assert all(math.isfinite(metrics[k]) for k in _METRICS), metrics
        assert {k: metrics[k] for k in _METRICS} == {k: every[0][k] for k in _METRICS}
    assert every[0]["grad_norm"] > 0 and every[0]["loss"] != 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model_name", MODELS)
def test_layout_matches_single_process(parity, model_name, layout):
    ref, got = _result(parity, model_name, layout)
    diffs = compare(ref, got)
    assert diffs["loss"] < TOL, diffs
    assert diffs["grad_norm"] < TOL * max(1.0, ref["grad_norm"]), diffs
    assert diffs["grads"] < TOL, diffs
    assert diffs["params"] < TOL, diffs
    assert diffs["pushed"] < TOL, diffs
    assert got["tied"] == ref["tied"]  # TP/FSDP kept one shared weight


# ------------------------------------------------------------------ table


def _metric_diff(ref_step: dict, got: dict) -> str:
    """Largest difference of any rank's step metrics from the single process's."""
    if "metrics" not in got:
        return "-"
    ref = ref_step["metrics"][0]
    return f"{max(abs(m[k] - ref[k]) for m in got['metrics'] for k in _METRICS):.1e}"


def table(dtype: str = "float32") -> str:
    """The parity table (docs/PARITY.md), its first line naming the compute dtype."""
    import tempfile

    where = f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}, nccl" if torch.cuda.is_available() \
        else "cpu, gloo"
    master = "" if dtype == "float32" else "; master weights, gradients, clipping, AdamW and loss in float32"
    rows = [f"compute dtype: {dtype}{master} ({where}; every layout and the single process)", "",
            "| layout | model | ranks | loss | grad norm | max abs grad diff | "
            "max abs param diff after AdamW step | max abs pushed weight diff | "
            "max abs step-metric diff, every rank | s/case |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as root:
        model_dirs = write_models(os.path.join(root, "models"))
        refs, ref_steps = {}, {}
        for m in MODELS:
            t0 = time.perf_counter()
            refs[m] = run_case(model_dirs[m], m, (1, 1, 1), 1, dtype)
            seconds = time.perf_counter() - t0
            ref_steps[m] = run_step_case(model_dirs[m], m, "single", 1, dtype)
            r = refs[m]
            rows.append(f"| single | {m} | 1 | {r['loss']:.9f} | {r['grad_norm']:.7f} | - | - | - | - | "
                        f"{seconds:.2f} |")
        out = os.path.join(root, "results")
        os.makedirs(out)
        for nproc in LAUNCHES:
            launch(nproc, out, model_dirs, dtype=dtype)
            for layout in LAUNCHES[nproc]:
                for m in MODELS:
                    got = torch.load(os.path.join(out, f"{m}-{layout}.pt"), weights_only=False)
                    d = compare(refs[m], got)
                    name = f"{layout} {LAYOUTS[layout]} {PP_SCHEDULES.get(layout, '')}".rstrip()
                    rows.append(
                        f"| {name} | {m} | {nproc} | {got['loss']:.9f} | "
                        f"{got['grad_norm']:.7f} | {d['grads']:.1e} | {d['params']:.1e} | "
                        f"{d['pushed']:.1e} | {_metric_diff(ref_steps[m], got)} | {got['seconds']:.2f} |")
    return "\n".join(rows)


def _main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", nargs="?", default="table", choices=["table", "worker"])
    p.add_argument("--out")
    p.add_argument("--layouts", default="")
    p.add_argument("--model", action="append", default=[])
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="compute dtype of every layout and the single process (master weights stay fp32)")
    a = p.parse_args(argv)
    if a.mode == "worker":
        dirs = dict(m.split("=", 1) for m in a.model)
        _worker(a.out, dirs, [x for x in a.layouts.split(",") if x], a.dtype)
    else:
        print(table(a.dtype))


if __name__ == "__main__":
    _main(sys.argv[1:])
