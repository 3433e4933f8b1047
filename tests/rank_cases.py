"""What the multi-rank tests share: tiny checkpoints, a fixed batch, job
configs, one GRPO step per layout, the bf16-compute helpers, full-tensor
gathers and comparisons, and the torchrun launcher.

``write_models`` (tiny qwen3, qwen3 tied and llama3 HF checkpoints),
``fixed_batch`` (seven samples of uneven lengths), ``job_config`` /
``step_job_config`` (TorchTitan configs for a layout of ``LAYOUTS``),
``run_case`` / ``run_step_case`` (one GRPO step, by hand or through
``trainer.train_step``, full tensors of what matters), ``_gathered`` /
``_gathered_hf`` (every stage's tensors by FQN), ``compare`` / ``max_diff``,
the bf16 helpers (``_bf16_fsdp_kept``, ``_bf16_compute``) and
``run_torchrun`` (``torchrun --standalone`` with the repo on PYTHONPATH).

Used by tests/test_parallel_parity.py (the layout parity; these were its own
helpers before), tests/multirank.py (the shared launches: the models and
torchrun), test_gather, test_llama_tied, test_chunked_logprobs,
test_lora_sharded, test_context_parallel and test_expert_parallel, and by
scripts/ep_parity_4ranks.py (``run_torchrun``) and scripts/device_env.sh
(``write_models``). Not a test file: pytest collects nothing here.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import torchtitan_grpo  # noqa: E402,F401  (before torchtitan)

torch.set_num_threads(1)
# fp32 means fp32 on GPUs too (the multi-rank tests run there over NCCL: scripts/device_parity.sh)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

TOL = 1e-5
PAD = 0
MICRO_BATCH = 2
MAX_NORM = 1.0
MAX_NEW_TOKENS = 8
# name -> (dp_replicate, dp_shard, tp[, pp]); the product is the launch's world size
LAYOUTS = {
    "fsdp": (1, 2, 1),
    "tp": (1, 1, 2),
    "ddp": (2, 1, 1),
    "pp": (1, 1, 1, 2),
    "hsdp": (2, 2, 1),
    "fsdp_tp": (1, 2, 2),
    "pp_fsdp": (1, 2, 1, 2),
    "pp_tp": (1, 1, 2, 2),
}
PP_SCHEDULES = {"pp": "1F1B", "pp_fsdp": "GPipe", "pp_tp": "1F1B"}
# pp_fsdp: 3 rows per micro-batch, so the DP rank with 3 samples pads one row
PP_MICRO_BATCH = {"pp_fsdp": 3}
# the step metrics compared with the single process's (pipeline layouts, test_llama_tied)
_METRICS = ("loss", "grad_norm", "clip_fraction", "entropy", "trainer_vs_rollout_logprob_max_abs_diff")


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


# --------------------------------------------------------------- fixtures


def write_llama(path: str, seed: int, **overrides) -> str:
    """A tiny LlamaForCausalLM checkpoint (+ the demo tokenizer) at ``path``, unless one is
    there: 2 layers of 64, 4 heads over 2 KV heads, vocabulary 128, norms away from 1;
    ``overrides`` change its config (tied embeddings, rope scaling)."""
    from torchtitan_grpo.models.demo_assets import write_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = LlamaConfig(**{
        **dict(vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=1,
               pad_token_id=0),
        **overrides,
    })
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from 1 so a mix-up cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


def write_models(root: str) -> dict[str, str]:
    """Tiny qwen3 (untied and tied) and llama3 HF checkpoints under ``root``."""
    from torchtitan_grpo.models.demo_assets import TinyQwen3, ensure_tiny_qwen3

    return {
        "qwen3": ensure_tiny_qwen3(os.path.join(root, "qwen3")),
        "qwen3_tied": ensure_tiny_qwen3(
            os.path.join(root, "qwen3_tied"), TinyQwen3(tie_word_embeddings=True, seed=1)
        ),
        "llama3": write_llama(os.path.join(root, "llama3"), seed=2),
    }


def fixed_batch():
    """Seven samples with uneven prompt/completion lengths, drawn from a fixed seed."""
    from torchtitan_grpo.train.trainer import Sample

    g = torch.Generator().manual_seed(1234)
    samples = []
    for i in range(7):
        n_prompt = 3 + i % 4
        n_completion = 2 + (3 * i) % 6
        ids = torch.randint(2, 97, (n_prompt + n_completion,), generator=g).tolist()
        # near the untrained model's log-probs (~ -log 128) so some ratios clip
        old = (-math.log(128) + 0.3 * torch.randn(n_completion, generator=g)).tolist()
        samples.append(Sample(ids[:n_prompt], ids[n_prompt:], old, 0.0, 0.0, "stop", []))
    adv = torch.randn(len(samples), generator=g)
    adv = (adv - adv.mean()) / adv.std()
    for s, a in zip(samples, adv.tolist()):
        s.advantage = a
    return samples


def _pp_degree(layout: tuple[int, ...]) -> int:
    return layout[3] if len(layout) > 3 else 1


def job_config(model_name: str, layout: tuple[int, ...], extra: tuple[str, ...] = (), dtype: str = "float32"):
    from torchtitan.config import ConfigManager

    dp_replicate, dp_shard, tp = layout[:3]
    if dtype == "bfloat16":  # the table's bf16 mode: FSDP computes in bf16 (see _bf16_compute)
        mixed_precision = "bfloat16"
    else:
        # CPU: TorchTitan's bf16 default on purpose, parallelize must switch
        # FSDP to fp32 there (bf16 compute would miss TOL by orders of magnitude)
        mixed_precision = "float32" if torch.cuda.is_available() else "bfloat16"
    return ConfigManager().parse_args([
        "--model.name", "qwen3" if model_name.startswith("qwen3") else model_name,
        "--parallelism.data_parallel_replicate_degree", str(dp_replicate),
        "--parallelism.data_parallel_shard_degree", str(dp_shard),
        "--parallelism.tensor_parallel_degree", str(tp),
        "--parallelism.pipeline_parallel_degree", str(_pp_degree(layout)),
        "--training.seq_len", "64",
        "--training.max_norm", str(MAX_NORM),
        "--training.mixed_precision_param", mixed_precision,
        "--optimizer.name", "AdamW",
        "--optimizer.lr", "1e-2",
        "--optimizer.weight_decay", "0.1",
        # Adam's first step is lr * g / (|g| + eps): with the default eps=1e-8
        # a gradient entry of ~1e-8 (float noise level) moves its weight by
        # O(lr), whatever its last bits are. eps=1e-4 keeps the step
        # layout-independent to ~1e-6 and still scale-sensitive.
        "--optimizer.eps", "1e-4",
        "--optimizer.implementation", "for-loop",
        "--activation_checkpoint.mode", "none",
        *extra,
    ])


def step_job_config(model_name: str, layout_name: str, dtype: str = "float32"):
    """``job_config`` plus our ``[grpo]`` section, for ``trainer.build_policy``
    and ``trainer.train_step`` (the pipeline layouts and their reference)."""
    extra = [
        "--job.custom_config_module", "torchtitan_grpo.config.job_config",
        "--grpo.micro_batch_size", str(PP_MICRO_BATCH.get(layout_name, MICRO_BATCH)),
        "--grpo.is_correction", "none",  # the ratio against the rollout logprobs, as run_case
        "--lr_scheduler.warmup_steps", "1",  # the full lr at the first step, as run_case
    ]
    if layout_name in PP_SCHEDULES:
        extra += ["--parallelism.pipeline_parallel_schedule", PP_SCHEDULES[layout_name]]
    layout = LAYOUTS.get(layout_name, (1, 1, 1))
    return job_config(model_name, layout, tuple(extra), dtype)


# ------------------------------------------------------------- bf16 compute
#
# How TorchTitan 0.2.2 gets bf16 compute from training.mixed_precision_param
# depends on the layout: layouts with FSDP (FSDP, HSDP, FSDP x TP, PP x FSDP)
# through fully_shard's MixedPrecisionPolicy (bf16 copies of the parameters
# for forward and backward, gradients reduced and kept in fp32), DDP and a
# single device through torch.autocast (its train loop's maybe_enable_amp),
# TP or PP without FSDP not at all (fp32, with a warning). Our trainer calls
# no maybe_enable_amp, so outside FSDP it computes in fp32.
#
# A table that mixed those schemes would measure the schemes, not the
# layouts: autocast keeps norms, softmax and the residual stream in fp32
# where FSDP's bf16 parameters make them bf16, a difference of the size of
# the layouts' own bf16 noise. So in bf16 mode every layout without FSDP,
# and the single process, computes as FSDP's mixed precision does: each
# forward runs on bf16 copies of the fp32 parameters (a tied weight cast
# once, as FSDP unshards it once), whose gradients flow back into the fp32
# parameters' .grad (:func:`_cast_parameters_in_forward`). The master
# weights, the gradient reductions, clipping, AdamW and the loss (on
# ``logits.float()``) stay fp32 everywhere.


@contextlib.contextmanager
def _bf16_fsdp_kept(dtype: str, device: torch.device):
    """bf16 mode on CPU: keep FSDP's ``mixed_precision_param`` as configured.

    ``parallel.apply_layout`` turns it to fp32 on CPU (for the fp32 tests,
    and since bf16 is slow there); the bf16 table runs on CPU too (gloo) and
    needs FSDP in bf16 as on GPUs. A no-op in fp32 mode and on GPUs.
    """
    if dtype == "float32" or device.type != "cpu":
        yield
        return
    from torchtitan_grpo.distributed import parallel

    original = parallel._job_config_for

    def keep_param_dtype(job_config, parallel_dims, device):
        cfg = original(job_config, parallel_dims, device)
        cfg.training.mixed_precision_param = job_config.training.mixed_precision_param
        return cfg

    parallel._job_config_for = keep_param_dtype
    try:
        yield
    finally:
        parallel._job_config_for = original


def _cast_parameters_in_forward(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every forward of ``module`` runs on ``dtype`` copies of its parameters.

    A forward pre-hook puts a cast of each parameter in its modules' slots
    (one cast per parameter object, so a tied weight stays one tensor); the
    forward hook puts the parameters back. The casts are differentiable: the
    gradient reaches each parameter's AccumulateGrad as fp32, where DDP's
    reducer and TP's gradient hooks wait. The slots are replaced in place, so
    the parameters keep their order (clipping and pushes iterate it).
    Registered after the layout's own hooks: DDP's pre-hook, which collects
    the parameters on first use, runs before the swap.
    """
    slots = [(m, name) for m in module.modules() for name, p in m._parameters.items() if p is not None]
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []

    def cast(_module, _args):
        copies: dict[int, torch.Tensor] = {}
        for m, name in slots:
            p = m._parameters[name]
            if id(p) not in copies:
                copies[id(p)] = p.to(dtype)
            swapped.append((m, name, p))
            m._parameters[name] = copies[id(p)]

    def restore(_module, _args, _output):
        while swapped:
            m, name, p = swapped.pop()
            m._parameters[name] = p

    module.register_forward_pre_hook(cast)
    module.register_forward_hook(restore)


def _bf16_compute(module: torch.nn.Module, dtype: str, parallel_dims) -> None:
    """In bf16 mode, give a layout without FSDP FSDP's mixed-precision compute
    (section comment above); FSDP layouts have it from mixed_precision_param."""
    if dtype == "float32" or (parallel_dims is not None and parallel_dims.fsdp_enabled):
        return
    _cast_parameters_in_forward(module, getattr(torch, dtype))


# ------------------------------------------------------------ one GRPO step


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.full_tensor() if isinstance(t, DTensor) else t
    return t.detach().to("cpu", copy=True)


def run_case(model_dir: str, model_name: str, layout: tuple[int, int, int], world_size: int,
             dtype: str = "float32") -> dict:
    """Build, parallelise, run one GRPO step; full tensors of what matters.

    A collective under a layout: every rank calls it; all ranks return the
    same dict. ``dtype``: the compute dtype (the table's bf16 mode).
    """
    import torch.distributed as dist

    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan_grpo.models import hf_bridge as hf_model
    from torchtitan_grpo.distributed import parallel
    from torchtitan_grpo.train.loss import grpo_loss, token_logprobs
    from torchtitan_grpo.train.trainer import _pack

    device = _device()
    cfg = job_config(model_name, layout, dtype=dtype)
    name = cfg.model.name
    args = hf_model.model_args_from_hf(name, hf_model.load_hf_config(model_dir), max_seq_len=64)
    model = hf_model.build_model(name, args, device)
    adapter = hf_model.state_dict_adapter(name, args, model_dir)
    hf_model.load_hf_weights(model, adapter, model_dir)
    with _bf16_fsdp_kept(dtype, device):
        model, pdims = parallel.parallelize(model, cfg, world_size, device)
    _bf16_compute(model, dtype, pdims)
    model.train()
    optimizers = build_optimizers([model], cfg.optimizer, pdims)
    before = {n: _full(p) for n, p in model.named_parameters()}

    batch = fixed_batch()
    n_samples = len(batch)
    n_tokens = sum(len(s.completion_ids) for s in batch)
    dp_rank, dp_degree = parallel.data_parallel_rank_and_degree(pdims)
    local = batch[dp_rank::dp_degree]
    multiple = parallel.seq_len_multiple(pdims)

    n_micro = torch.tensor([max(1, -(-len(local) // MICRO_BATCH))], device=device)
    if world_size > 1:
        dist.all_reduce(n_micro, op=dist.ReduceOp.MAX)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for k in range(int(n_micro)):
        chunk = local[k * MICRO_BATCH : (k + 1) * MICRO_BATCH]
        tokens, mask, old, adv = _pack(chunk or local[:1], PAD, device)
        if not chunk:  # keeps the collectives in step, adds nothing
            mask = torch.zeros_like(mask)
        tokens, mask, old = parallel.pad_to_multiple(tokens, mask, old, multiple, PAD)
        logits = model(tokens)[:, :-1].float()
        logprobs = token_logprobs(logits, tokens[:, 1:])
        loss, _ = grpo_loss(logprobs, old, adv, mask, num_sequences=n_samples, num_tokens=n_tokens)
        loss.backward()
        loss_sum += loss.detach().double()
    group = parallel.data_parallel_group(pdims)
    if group is not None:
        dist.all_reduce(loss_sum, group=group)

    params = dict(model.named_parameters())
    grads = {n: _full(p.grad) for n, p in params.items()}
    norm = clip_grad_norm_([p for p in params.values() if p.grad is not None], MAX_NORM, foreach=True)
    norm = _full(norm)
    optimizers.step()
    optimizers.zero_grad()
    after = {n: _full(p) for n, p in params.items()}
    return {
        "loss": float(loss_sum),
        "grad_norm": float(norm),
        "grads": grads,
        "params": after,
        "moved": max_diff(before, after),
        "pushed": {k: v.to("cpu", copy=True) for k, v in hf_model.hf_state_dict(model, adapter).items()},
        "tied": parallel._is_tied(model),
    }


def _gathered(policy, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors (parameters, or their gradients) of every stage, by FQN.

    A collective: within a stage ``full_tensor`` gathers FSDP/TP shards, then
    the stages' dicts are exchanged over the world. The last stage's copy of
    a tied embedding must equal the first stage's and is dropped (the single
    process names that parameter once).
    """
    local = {n: _full(p.grad if grads else p) for n, p in policy.model.named_parameters()
             if not grads or p.grad is not None}
    if policy.pipeline is None:
        return local
    merged = _over_stages(local)
    if policy.pipeline.tied:
        mirror = merged.pop("output.weight")
        assert torch.equal(mirror, merged["tok_embeddings.weight"]), "tied copies differ between stages"
    return merged


def _gathered_hf(policy) -> dict[str, torch.Tensor]:
    """What a weight push sends: each rank's ``hf_state_dict`` of its own
    module (under PP: its stage, whose FQNs the adapter maps as for the whole
    model), united over the stages. A collective."""
    from torchtitan_grpo.models import hf_bridge as hf_model

    pushed = hf_model.hf_state_dict(policy.model, policy.adapter)
    local = {k: v.detach().to("cpu", copy=True) for k, v in pushed.items()}
    return local if policy.pipeline is None else _over_stages(local)


def _over_stages(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's ``local`` dict united (under PP: all stages' tensors)."""
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def run_step_case(model_dir: str, model_name: str, layout_name: str, world_size: int,
                  dtype: str = "float32") -> dict:
    """``trainer.build_policy`` + one ``trainer.train_step`` on the fixed batch.

    The pipeline layouts, and (``layout_name="single"``, one process) their
    reference for the step metrics. Returns what ``run_case`` does plus every
    rank's metrics (``metrics``: a list indexed by rank). A collective.
    """
    import torch.distributed as dist

    from torchtitan_grpo.distributed import parallel
    from torchtitan_grpo.train import trainer

    device = _device()
    cfg = step_job_config(model_name, layout_name, dtype)
    rank = dist.get_rank() if world_size > 1 else 0
    d = trainer.Dist(rank, world_size, int(os.environ.get("LOCAL_RANK", "0")), device)
    with _bf16_fsdp_kept(dtype, device):
        policy = trainer.build_policy(cfg, model_dir, d)
    _bf16_compute(policy.model, dtype, policy.parallel_dims)  # under PP: this rank's stage
    before = _gathered(policy)

    batch = fixed_batch()
    n_tokens = sum(len(s.completion_ids) for s in batch)
    dp_rank, dp_degree = parallel.data_parallel_rank_and_degree(policy.parallel_dims)
    grads: dict[str, torch.Tensor] = {}
    clip = trainer._clip_grad_norm

    def snapshot_then_clip(p):  # the gradients as clipping sees them
        grads.update(_gathered(p, grads=True))
        return clip(p)

    trainer._clip_grad_norm = snapshot_then_clip
    try:
        metrics = trainer.train_step(policy, batch[dp_rank::dp_degree], cfg.grpo, 1.0, MAX_NEW_TOKENS,
                                     len(batch), n_tokens, PAD, d)
    finally:
        trainer._clip_grad_norm = clip
    after = _gathered(policy)
    every = [metrics]
    if world_size > 1:
        every = [None] * world_size
        dist.all_gather_object(every, metrics)
    tied = policy.pipeline.tied if policy.pipeline is not None else parallel._is_tied(policy.model)
    return {
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "grads": grads,
        "params": after,
        "moved": max_diff(before, after),
        "pushed": _gathered_hf(policy),
        "tied": tied,
        "metrics": every,
    }


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for k in a:
        assert a[k].shape == b[k].shape, (k, a[k].shape, b[k].shape)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def compare(ref: dict, got: dict) -> dict[str, float]:
    return {
        "loss": abs(got["loss"] - ref["loss"]),
        "grad_norm": abs(got["grad_norm"] - ref["grad_norm"]),
        "grads": max_diff(ref["grads"], got["grads"]),
        "params": max_diff(ref["params"], got["params"]),
        "pushed": max_diff(ref["pushed"], got["pushed"]),
    }


# ---------------------------------------------------------------- torchrun


def run_torchrun(nproc: int, script_args: list[str], timeout: float) -> str:
    """``torchrun --standalone`` with ``nproc`` ranks over ``script_args`` (the
    script and its flags), one OpenMP thread each; returns the log, raises
    with its tail on a non-zero exit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *script_args]
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    # PYTHONFAULTHANDLER: a rank that dies on a signal (SIGSEGV in a C++
    # library) prints its Python stack, not only torchrun's exit code.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, TOKENIZERS_PARALLELISM="false",
               PYTHONFAULTHANDLER="1")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    log = r.stdout + r.stderr
    if r.returncode != 0:
        fault = log.find("Fatal Python error")  # a crashed rank's own stack, wherever the tail cuts
        head = f"{log[fault:fault + 4000]}\n[...]\n" if 0 <= fault < len(log) - 6000 else ""
        raise RuntimeError(f"torchrun x{nproc} failed (rc={r.returncode}):\n{head}{log[-6000:]}")
    return log

