"""Our sections of TorchTitan's JobConfig: ``[grpo]``, ``[rollout]``,
``[inference]`` and ``[weight_sync]``.

TorchTitan merges the ``JobConfig`` dataclass of this module into its own
when ``job.custom_config_module`` names it; ``parse_config`` injects that
argument so users never pass it. Every key has a default and a docstring, and
``validate`` checks them all at start-up with a message that names the key.
"""



import os
import sys
from dataclasses import dataclass, field
from typing import Literal

from torchtitan_grpo import _titan  # noqa: F401  (before torchtitan)

CONFIG_MODULE = "torchtitan_grpo.config"


@dataclass
class GRPO:
    group_size: int = 8
    """Completions sampled per prompt; advantages are normalised within a group."""

    prompts_per_step: int = 16
    """Prompts per optimizer step (the batch holds prompts_per_step * group_size samples)."""

    micro_batch_size: int = 32
    """Samples per forward/backward on one rank (gradients are accumulated; the
    loss normaliser is global, so this changes memory, never the gradient)."""

    clip_low: float = 0.2
    """Lower clip of the probability ratio: ratio >= 1 - clip_low."""

    clip_high: float = 0.2
    """Upper clip of the probability ratio: ratio <= 1 + clip_high (DAPO uses 0.28)."""

    loss_agg: Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"] = (
        "seq_mean_token_mean"
    )
    """How per-token losses become one number: GRPO's mean over sequences of
    per-sequence token means, DAPO's mean over all tokens, or Dr. GRPO's token
    sum over a constant length (rollout.max_new_tokens)."""

    scale_rewards: bool = True
    """Divide group-centred rewards by the group's std (GRPO); false centres only (Dr. GRPO)."""

    kl_coef: float = 0.0
    """Weight of a KL penalty to the initial policy (0 disables it and the reference model)."""

    kl_estimator: Literal["k1", "k3"] = "k3"
    """KL estimator used when kl_coef > 0."""

    filter_constant_groups: bool = False
    """Drop groups whose rewards are all equal (they carry no signal); they are counted either way."""

    tiny_model_if_missing: bool = False
    """If model.hf_assets_path has no config.json, write a tiny random Qwen3
    checkpoint and a character tokenizer there (demos and tests; nothing is downloaded)."""

    seed: int = 0
    """Seed for the prompt order, sampling seeds and model init."""


@dataclass
class Rollout:
    task: str = "digits"
    """Prompt source: "digits" (the built-in demo task) or "jsonl" (dataset_path + reward_fn)."""

    dataset_path: str = ""
    """Local .json/.jsonl/.parquet file of prompts (task = "jsonl"); nothing is downloaded."""

    prompt_key: str = "prompt"
    """Column of the dataset holding the prompt text."""

    reward_fn: str = ""
    """Reward function as "package.module:function", called as fn(prompt, completion, row) -> float.
    Empty: the task's own reward."""

    reward_timeout_s: float = 10.0
    """A reward call slower than this scores 0 (logged once); generation never waits longer."""

    max_new_tokens: int = 8
    """Completion length limit (tokens)."""

    temperature: float = 1.0
    """Sampling temperature; the trainer scales its logits by the same value."""

    top_p: float = 1.0
    """Nucleus sampling threshold (1 = off)."""

    top_k: int = -1
    """Top-k sampling (-1 = off)."""


@dataclass
class Inference:
    backend: Literal["builtin", "sglang", "vllm"] = "builtin"
    """Engine protocol spoken to the replicas; "builtin" also starts the servers."""

    urls: list[str] = field(default_factory=list)
    """Replica base URLs for externally started servers (sglang/vllm, or builtin started elsewhere)."""

    replica_file: str = ""
    """File with one replica URL per line, written by a launcher and re-read
    periodically (replicas may join); used in addition to urls."""

    model: str = ""
    """Model name sent in vLLM /v1/completions requests (vLLM's served model name)."""

    num_servers: int = 1
    """Built-in servers started by the trainer when urls is empty."""

    server_device: str = "cpu"
    """Device of started built-in servers: "cpu", "cuda" or "cuda:N"."""

    server_dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of started built-in servers."""

    server_threads: int = 1
    """torch threads per started built-in server (CPU)."""

    host: str = "127.0.0.1"
    """Interface the started servers bind to."""

    startup_timeout_s: float = 180.0
    """Time a started server may take to answer /health before the run fails."""

    request_timeout_s: float = 120.0
    """Per-request timeout of a generation call."""

    max_retries: int = 3
    """Attempts for one generation request (each on another replica when possible)."""


@dataclass
class WeightSync:
    mode: Literal["async", "sync", "off"] = "sync"
    """"async": the trainer snapshots the weights after each step and goes on
    while a sidecar pushes them (replicas may serve a version or two behind);
    "sync": push and wait for every admitted replica (on-policy baseline);
    "off": never push (replicas keep the initial weights; for measuring)."""

    transport: Literal["gloo", "nccl"] = "gloo"
    """Collective backend of the trainer-to-replica weight groups (nccl needs GPUs on both sides)."""

    bucket_size_mb: int = 256
    """Tensors are flattened into buckets of about this size (one broadcast each)."""

    num_staging_buffers: int = 2
    """Snapshots that may exist at once; when all are being sent, the trainer
    skips that step's snapshot instead of waiting (each costs one copy of the weights)."""

    replica_deadline_s: float = 60.0
    """A replica that has not received and loaded a version within this time is
    ejected from routing and readmitted only once it holds the newest version."""

    pause_mode: Literal["none", "abort", "retract", "in_place"] = "none"
    """How a replica treats running generations during an update (SGLang's
    /pause_generation mode); "none" lets the update wait for them to finish."""

    master_address: str = "127.0.0.1"
    """Address the trainer's weight-group stores listen on (reachable by every replica)."""

    init_timeout_s: float = 120.0
    """Time for a replica to join its weight group."""


@dataclass
class JobConfig:
    """Merged into TorchTitan's JobConfig by its ConfigManager."""

    grpo: GRPO = field(default_factory=GRPO)
    rollout: Rollout = field(default_factory=Rollout)
    inference: Inference = field(default_factory=Inference)
    weight_sync: WeightSync = field(default_factory=WeightSync)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key."""


def _check(ok: bool, key: str, msg: str, value) -> None:
    if not ok:
        raise ConfigError(f"config key {key} = {value!r}: {msg}")


def validate(cfg) -> None:
    """Check every value of our sections (and the TorchTitan keys we rely on)."""
    g, r, i, w = cfg.grpo, cfg.rollout, cfg.inference, cfg.weight_sync
    _check(g.group_size >= 2, "grpo.group_size", "must be >= 2 (advantages are relative within a group)", g.group_size)
    _check(g.prompts_per_step >= 1, "grpo.prompts_per_step", "must be >= 1", g.prompts_per_step)
    _check(g.micro_batch_size >= 1, "grpo.micro_batch_size", "must be >= 1", g.micro_batch_size)
    _check(0 <= g.clip_low < 1, "grpo.clip_low", "must be in [0, 1)", g.clip_low)
    _check(g.clip_high >= 0, "grpo.clip_high", "must be >= 0", g.clip_high)
    _check(g.kl_coef >= 0, "grpo.kl_coef", "must be >= 0", g.kl_coef)
    _check(r.task in ("digits", "jsonl"), "rollout.task", 'must be "digits" or "jsonl"', r.task)
    if r.task == "jsonl":
        _check(bool(r.dataset_path), "rollout.dataset_path", 'is required when rollout.task = "jsonl"', r.dataset_path)
        _check(os.path.isfile(r.dataset_path), "rollout.dataset_path", "no such file", r.dataset_path)
        _check(bool(r.reward_fn), "rollout.reward_fn", 'is required when rollout.task = "jsonl"', r.reward_fn)
    if r.reward_fn:
        _check(r.reward_fn.count(":") == 1, "rollout.reward_fn", 'must look like "package.module:function"', r.reward_fn)
    _check(r.reward_timeout_s > 0, "rollout.reward_timeout_s", "must be > 0", r.reward_timeout_s)
    _check(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1", r.max_new_tokens)
    _check(r.temperature > 0, "rollout.temperature", "must be > 0 (GRPO needs sampled, not greedy, completions)", r.temperature)
    _check(0 < r.top_p <= 1, "rollout.top_p", "must be in (0, 1]", r.top_p)
    _check(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", "must be -1 (off) or >= 1", r.top_k)
    _check(i.backend == "builtin" or bool(i.urls) or bool(i.replica_file), "inference.urls",
           f"(or inference.replica_file) is required for backend {i.backend!r}: the trainer starts only built-in servers", i.urls)
    for u in i.urls:
        _check(u.startswith(("http://", "https://")), "inference.urls", f"{u!r} is not an http(s) URL", i.urls)
    _check(i.num_servers >= 1, "inference.num_servers", "must be >= 1", i.num_servers)
    _check(i.server_device == "cpu" or i.server_device.startswith("cuda"), "inference.server_device", 'must be "cpu", "cuda" or "cuda:N"', i.server_device)
    _check(i.startup_timeout_s > 0, "inference.startup_timeout_s", "must be > 0", i.startup_timeout_s)
    _check(i.request_timeout_s > 0, "inference.request_timeout_s", "must be > 0", i.request_timeout_s)
    _check(i.max_retries >= 1, "inference.max_retries", "must be >= 1", i.max_retries)
    _check(w.bucket_size_mb >= 1, "weight_sync.bucket_size_mb", "must be >= 1", w.bucket_size_mb)
    _check(w.init_timeout_s > 0, "weight_sync.init_timeout_s", "must be > 0", w.init_timeout_s)
    _check(w.num_staging_buffers >= 1, "weight_sync.num_staging_buffers", "must be >= 1", w.num_staging_buffers)
    _check(w.replica_deadline_s > 0, "weight_sync.replica_deadline_s", "must be > 0", w.replica_deadline_s)
    _check(w.transport == "gloo" or i.server_device != "cpu" or bool(i.urls), "weight_sync.transport",
           "nccl needs the built-in servers on a GPU (inference.server_device)", w.transport)
    _check(cfg.model.name in ("qwen3", "llama3"), "model.name", 'must be "qwen3" or "llama3"', cfg.model.name)
    if not g.tiny_model_if_missing:
        _check(
            os.path.isfile(os.path.join(cfg.model.hf_assets_path, "config.json")),
            "model.hf_assets_path",
            "must be an HF checkpoint directory with config.json (or set grpo.tiny_model_if_missing = true for a demo model)",
            cfg.model.hf_assets_path,
        )
    _check(cfg.training.steps >= 1, "training.steps", "must be >= 1", cfg.training.steps)


def parse_config(argv: list[str]):
    """Parse ``--job.config_file X.toml`` plus CLI overrides into a validated JobConfig.

    Our sections are merged in through ``--job.custom_config_module``; an
    unknown key or a malformed value exits with TorchTitan's (tyro's) message
    naming it, and a bad value of ours raises ConfigError naming the key.
    """
    from torchtitan.config import ConfigManager

    argv = list(argv)
    if not any(a.split("=")[0] in ("--job.custom_config_module", "--job.custom-config-module") for a in argv):
        argv += ["--job.custom_config_module", CONFIG_MODULE]
    _check_toml_keys(argv)
    cfg = ConfigManager().parse_args(argv)
    validate(cfg)
    return cfg


def _check_toml_keys(argv: list[str]) -> None:
    """Fail on an unknown section or key in the TOML file with a message that
    names it and the file (TorchTitan's own error for this is a long dump)."""
    import dataclasses

    from torchtitan.config import ConfigManager
    from torchtitan.config import JobConfig as TitanJobConfig

    path = None
    for k, a in enumerate(argv):
        key, _, val = a.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            path = val or (argv[k + 1] if k + 1 < len(argv) else None)
    if path is None:
        return
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} (--job.config_file) does not exist")
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from e
    merged = ConfigManager._merge_configs(TitanJobConfig, JobConfig)

    def walk(cls, values: dict, prefix: str) -> None:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name, value in values.items():
            if name not in fields:
                where = f"[{prefix}]" if prefix else "top level"
                known = ", ".join(sorted(fields))
                raise ConfigError(f"unknown config key {prefix + '.' if prefix else ''}{name} in {path!r} ({where}); known keys: {known}")
            ftype = fields[name].type
            sub = ftype if dataclasses.is_dataclass(ftype) else None
            if sub is None and isinstance(fields[name].default_factory, type) and dataclasses.is_dataclass(fields[name].default_factory):
                sub = fields[name].default_factory
            if sub is not None and isinstance(value, dict):
                walk(sub, value, f"{prefix}.{name}" if prefix else name)

    walk(merged, data, "")
