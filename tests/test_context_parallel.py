"""Context parallelism (torchtitan_grpo.distributed.context_parallel) against one process.

One torchrun launch of 2 ranks runs CP 2 alone (the sequence of every
micro-batch split over both ranks; FSDP over the CP ranks, as TorchTitan
lays CP out), and on CPU the suite's 4-rank launch runs CP 2 x TP 2 (each TP
rank's heads ringed over its CP pair) and CP 2 x PP 2 (the pipeline's stages
on CP pairs; the KL case without its KL term, which PP refuses). CP 2 x FSDP 2
is not launched. Each case
builds the policy (``trainer.build_policy``) and takes one
``trainer.train_step`` on the parity tests' fixed batch (7 samples of uneven
lengths, micro-batches of 2, each padded to a multiple of 2 x cp); the loss,
grad norm, every full gradient (as clipping sees it), the weights after AdamW
and the entropy metric must equal the single process's (fp32, <= TOL).
The cases cover every ``grpo.loss_agg``, the full-logits and the chunked
log-prob head, token and sequence IS weights, the KL reference's forward and
tied embeddings.

On CPU the ring attention runs through the CPU flash kernel routed by
``enable_cpu_ring_attention`` (gloo); on GPUs (one per rank) through
PyTorch's own CUDA ring kernels (``scripts/device_cp.sh``).

Alone (scripts/device_cp.sh): ``python tests/test_context_parallel.py models
--out DIR`` writes the checkpoints and prints the ``--model`` flags; ``worker
--out DIR FLAGS`` under torchrun x2, then ``check --out DIR FLAGS``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402

import torchtitan_grpo  # noqa: E402,F401  (before torchtitan)

torch.set_num_threads(1)

TOL = 4e-6  # fp32: sharded and whole GEMMs sum in other orders (1.25e-6 apart after a step on a Xeon without AVX-512)
CP = 2
WITH_CP = {"tp": 2, "pp": 2}  # the 4-rank launch: CP 2 x TP 2, then CP 2 x PP 2
# name -> (model, loss_agg, logprob_chunk_tokens, is_correction, kl_coef)
CASES = {
    "seq_mean_token_mean": ("qwen3", "seq_mean_token_mean", 0, "none", 0.0),
    "token_mean_chunked": ("qwen3", "token_mean", 8, "token", 0.0),
    "sum_norm_kl_tied": ("qwen3_tied", "seq_mean_token_sum_norm", 0, "sequence", 0.1),
}


def write_models(root: str) -> dict[str, str]:
    from torchtitan_grpo.models.demo_assets import TinyQwen3, ensure_tiny_qwen3

    return {"qwen3": ensure_tiny_qwen3(os.path.join(root, "qwen3")),
            "qwen3_tied": ensure_tiny_qwen3(os.path.join(root, "qwen3_tied"),
                                            TinyQwen3(tie_word_embeddings=True, seed=1))}


def case_config(name: str, cp: int, extra: tuple[str, ...] = (), tp: int = 1, pp: int = 1, kl_off: bool = False):
    from tests.rank_cases import MICRO_BATCH, job_config

    model, loss_agg, chunk, is_mode, kl = CASES[name]
    kl = 0.0 if kl_off else kl
    return job_config(model, (1, 1, tp, pp), (
        "--job.custom_config_module", "torchtitan_grpo.config.job_config",
        "--parallelism.context_parallel_degree", str(cp),
        "--grpo.micro_batch_size", str(MICRO_BATCH),
        "--grpo.loss_agg", loss_agg,
        "--grpo.logprob_chunk_tokens", str(chunk),
        "--grpo.is_correction", is_mode,
        "--grpo.kl_coef", str(kl),
        "--lr_scheduler.warmup_steps", "1",
        *extra))


def run_case(model_dir: str, name: str, cp: int, world_size: int, tp: int = 1, pp: int = 1,
             kl_off: bool = False) -> dict:
    """``build_policy`` + one ``train_step``; full tensors of what matters (a collective)."""
    import torch.distributed as dist

    from tests.rank_cases import MAX_NEW_TOKENS, PAD, _device, _gathered, fixed_batch
    from torchtitan_grpo.train import trainer

    device = _device()
    rank = dist.get_rank() if world_size > 1 else 0
    d = trainer.Dist(rank, world_size, int(os.environ.get("LOCAL_RANK", "0")), device)
    cfg = case_config(name, cp, tp=tp, pp=pp, kl_off=kl_off)
    policy = trainer.build_policy(cfg, model_dir, d)
    seen: list[int] = []  # sequence lengths the embedding saw: T / cp under CP
    embeddings = policy.model.tok_embeddings  # None on a later pipeline stage (rank 0 holds the first)
    hook = embeddings.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1])) if embeddings else None
    grads: dict[str, torch.Tensor] = {}
    clip = trainer._clip_grad_norm

    def snapshot_then_clip(p):
        grads.update(_gathered(p, grads=True))
        return clip(p)

    batch = fixed_batch()
    trainer._clip_grad_norm = snapshot_then_clip
    try:
        metrics = trainer.train_step(policy, batch, cfg.grpo, 1.0, MAX_NEW_TOKENS, len(batch),
                                     sum(len(s.completion_ids) for s in batch), PAD, d)
    finally:
        trainer._clip_grad_norm = clip
        if hook is not None:
            hook.remove()
    return {"metrics": metrics, "grads": grads, "params": _gathered(policy), "seen": seen}


def rank_models(root: str) -> dict[str, str]:
    """The checkpoints of :func:`run_ranks` (tests/multirank.py writes them before its launch)."""
    return write_models(root)


def run_ranks(out_dir: str, model_dirs: dict[str, str]) -> None:
    """In an initialised group of CP ranks (CP x TP on 4): every case, rank 0 saves it."""
    import torch.distributed as dist

    world = dist.get_world_size()
    layouts = {"": {}} if world == CP else {k: {k: n} for k, n in WITH_CP.items()}  # "tp": {"tp": 2}, ...
    for prefix, layout in layouts.items():
        for name, case in CASES.items():
            t0 = time.perf_counter()
            result = run_case(model_dirs[case[0]], name, CP, world, **layout, kl_off="pp" in layout)
            result["seconds"] = time.perf_counter() - t0
            if dist.get_rank() == 0:  # the first pipeline stage: the embedding's lengths are seen here
                torch.save(result, os.path.join(out_dir, f"{prefix}_{name}.pt" if prefix else f"{name}.pt"))
    dist.barrier()


def _worker(out_dir: str, model_dirs: dict[str, str]) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from tests.rank_cases import _device

    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=300))
    try:
        run_ranks(out_dir, model_dirs)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """Every case's single-process result, and CP 2's: on CPU from the
    suite's shared 2-rank launch (tests/multirank.py), else from one torchrun
    x2 of this file's own."""
    from tests.rank_cases import run_torchrun

    error = None
    if not torch.cuda.is_available():
        shared = request.getfixturevalue("multirank_launched")
        dirs = shared.model_dirs
        try:
            out = shared.extra("test_context_parallel")
        except pytest.fail.Exception as e:  # reported by every test that reads the launch
            out, error = None, str(e)
    else:
        root = tmp_path_factory.mktemp("context_parallel")
        dirs = write_models(str(root / "models"))
        out = root / "results"
        out.mkdir()
        try:
            run_torchrun(CP, [os.path.abspath(__file__), "worker", "--out", str(out),
                              *[f"--model={k}={v}" for k, v in dirs.items()]], 600)
        except RuntimeError as e:  # reported by every test that reads the launch
            error = str(e)
    refs = {name: run_case(dirs[case[0]], name, 1, 1) for name, case in CASES.items()}
    refs.update({f"no_kl_{name}": run_case(dirs[case[0]], name, 1, 1, kl_off=True)
                 for name, case in CASES.items() if case[4]})
    return refs, out, error


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max(float((a[k].cpu() - b[k].cpu()).abs().max()) for k in a)


def check(ref: dict, got: dict, tp: int = 1, pp: int = 1) -> list[str]:
    """What differs between the single process (``ref``) and CP (``got``,
    with ``tp`` TP or ``pp`` PP ranks) beyond TOL; empty when they agree.
    Metrics relative beyond 1 (grad norm, entropy: sums of many fp32 terms)."""
    bad = []
    if not (abs(ref["metrics"]["loss"]) > 1e-3 and ref["metrics"]["grad_norm"] > 1e-3):
        bad.append("the reference step does not move")
    # each CP rank's forward saw half of each padded micro-batch (so the ring ran, not a copy);
    # on a GPU the chunks are padded to 32 positions, with TP to a multiple of its degree too
    # (parallel.seq_len_multiple)
    multiple = 2 * CP * tp * (32 if torch.cuda.is_available() else 1)
    if pp > 1:  # one padded length for the whole pipelined batch, a bucket of training.seq_len
        from torchtitan_grpo.distributed.pipeline import bucketed_seq_len

        want = bucketed_seq_len(max(ref["seen"]), 64, multiple)
        if not got["seen"] or any(g * CP != want for g in got["seen"]):
            bad.append(f"local lengths {got['seen']} for a {want}-position batch")
    elif len(got["seen"]) != len(ref["seen"]) or any(
            g * CP != r + (-r % multiple) for g, r in zip(got["seen"], ref["seen"])):
        bad.append(f"local lengths {got['seen']} for {ref['seen']}")
    for key in ("loss", "grad_norm", "entropy", "clip_fraction", "trainer_vs_rollout_logprob_max_abs_diff"):
        want, have = ref["metrics"][key], got["metrics"][key]
        if not abs(have - want) <= TOL * max(1.0, abs(want)):
            bad.append(f"{key} {have} vs {want}")
    for key in ("grads", "params"):
        diff = _max_diff(ref[key], got[key])
        # AdamW's first update is lr * g / (|g| + eps): where a gradient is near eps
        # the kernels' rounding (the ring's memory-efficient attention vs one process's
        # SDPA on a GPU; under PP, the padded batch's other summation order) is amplified
        # in the weights: 1.3e-6 on 2 x H200, 1.2e-6 for CP x PP on CPU, grads within 1.2e-7
        loose = torch.cuda.is_available() or pp > 1
        if not diff <= (5 * TOL if key == "params" and loose else TOL):
            bad.append(f"{key} max diff {diff:.3g}")
    return bad


@pytest.mark.parametrize("name", list(CASES))
def test_cp_step_matches_single_process(launched, name):
    refs, out, error = launched
    if error is not None:
        pytest.fail(error)
    assert check(refs[name], torch.load(out / f"{name}.pt", weights_only=False)) == []


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("other", list(WITH_CP))
def test_cp_with_tp_or_pp_step_matches_single_process(request, launched, other, name):
    """CP 2 x TP 2 and CP 2 x PP 2 (4 CPU ranks, the suite's 4-rank launch)
    against one process (without the KL term under PP, which refuses it)."""
    refs = launched[0]
    if torch.cuda.is_available():
        pytest.skip("CPU test (the suite's 4-rank gloo launch); on GPUs scripts/device_cp.sh runs CP alone")
    out = request.getfixturevalue("multirank_launched").extra("test_context_parallel", 4)
    ref = refs.get(f"no_kl_{name}", refs[name]) if other == "pp" else refs[name]
    got = torch.load(out / f"{other}_{name}.pt", weights_only=False)
    assert check(ref, got, **{other: WITH_CP[other]}) == []


@pytest.mark.parametrize("key, value", [("expert_parallel_degree", 2),
                                        ("context_parallel_load_balancer", "ptrr")])
def test_unsupported_cp_combinations_are_refused(key, value):
    from torchtitan_grpo.distributed.parallel import build_parallel_dims

    cfg = case_config("seq_mean_token_mean", CP)
    setattr(cfg.parallelism, key, value)
    cfg.parallelism.data_parallel_shard_degree = 2  # EP borrows dp_shard ranks (its own check comes first)
    with pytest.raises(NotImplementedError, match=f"parallelism.{key}"):
        build_parallel_dims(cfg, 8, "cpu")


def test_packed_micro_batches_are_refused_with_cp():
    from torchtitan_grpo.train import packing

    cfg = case_config("seq_mean_token_mean", CP, ("--grpo.micro_batch_tokens", "64"))
    with pytest.raises(ValueError, match="grpo.micro_batch_tokens.*context_parallel_degree"):
        packing.check_layout(cfg)


def _check(out_dir: str, model_dirs: dict[str, str]) -> int:
    """The worker's results against one process here; one line per case."""
    failed = 0
    for name, case in CASES.items():
        ref = run_case(model_dirs[case[0]], name, 1, 1)
        got = torch.load(os.path.join(out_dir, f"{name}.pt"), weights_only=False)
        bad = check(ref, got)
        failed += bool(bad)
        diffs = {k: abs(got["metrics"][k] - ref["metrics"][k]) for k in ("loss", "grad_norm")}
        print(f"{name}: {'FAIL ' + '; '.join(bad) if bad else 'PASS'} | loss diff {diffs['loss']:.2g} grad_norm "
              f"diff {diffs['grad_norm']:.2g} grads {_max_diff(ref['grads'], got['grads']):.2g} "
              f"params {_max_diff(ref['params'], got['params']):.2g} | cp step {got['seconds']:.1f} s")
    return failed


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["worker", "check", "models"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", action="append", default=[], help="NAME=DIR")
    a = parser.parse_args()
    if a.mode == "models":  # write the checkpoints under --out, print the --model flags
        print(" ".join(f"--model={k}={v}" for k, v in write_models(a.out).items()))
    elif a.mode == "worker":
        _worker(a.out, dict(m.split("=", 1) for m in a.model))
    else:
        sys.exit(1 if _check(a.out, dict(m.split("=", 1) for m in a.model)) else 0)
