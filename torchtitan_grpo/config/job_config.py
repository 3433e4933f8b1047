"""Our sections of TorchTitan's JobConfig: ``[rollout]``, ``[inference]`` and
``[weight_sync]`` here; ``[grpo]``, ``[eval]``, ``[lora]`` and ``[moe]`` from
their own modules (``config/grpo.py``, ...).

TorchTitan merges the ``JobConfig`` dataclass of this module into its own
when ``job.custom_config_module`` names it; ``parse_config`` (config/parse.py) injects that
argument so users never pass it. Every key has a default and a docstring, and
``validate`` (config/checks.py) checks them all at start-up with a message
that names the key. The values the run derives from them (pipeline depth,
server devices, ...) are resolved here.
"""



import os
from dataclasses import dataclass, field
from typing import Literal

from torchtitan_grpo import _titan  # noqa: F401  (before torchtitan)
from torchtitan_grpo.config.eval import Eval
from torchtitan_grpo.config.grpo import GRPO
from torchtitan_grpo.config.lora import LoRA
from torchtitan_grpo.config.moe import MoE

CONFIG_MODULE = "torchtitan_grpo.config.job_config"


@dataclass
class Rollout:
    source: Literal["builtin", "atropos"] = "builtin"
    """Where a step's groups come from. "builtin": the trainer's own producer
    (task, dataset, reward keys below). "atropos": Atropos environments post
    scored groups to atropos_url and rank 0 pulls prompts_per_step * group_size
    sequences per step; task, dataset and reward are the environments' then,
    and rollout.temperature must match theirs."""

    atropos_url: str = "http://localhost:8000"
    """Atropos trajectory API (atroposlib's run-api), rollout.source = "atropos"."""

    atropos_startup_timeout_s: float = 60.0
    """At start the Atropos API must answer within this, or the run stops naming atropos_url.
    Also the period of the hint printed while the API answers but no batch
    comes (no environment registered, none posted yet, or too few groups)."""

    atropos_unreachable_timeout_s: float = 600.0
    """Mid-run, stop at a step boundary after the Atropos API has not answered
    for this long; 0 retries for ever."""

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

    seeded_requests: bool = True
    """Each generation request carries a seed derived from grpo.seed, the step
    and the prompt, so a run's samples repeat. Off: the engine's own random
    stream (vLLM then draws every row's noise in one call instead of one
    seeded generator per request, its slower path)."""

    pipeline_depth: int = -1
    """How many steps ahead of the trainer the inference fleet may generate.
    0: the serial loop (a step's groups start once the previous step's
    weights are published; with weight_sync.mode "sync" exactly on-policy).
    1: the next step's groups generate while this one trains (one version
    off-policy), and so on; a step takes the first groups that finish, so a
    slow replica never holds it. Capped by grpo.max_staleness. -1 (auto): 1
    with weight_sync.mode "async" or "off", 0 with "sync", and 0 when the
    started servers share a trainer's GPU and it trains in float32
    (training.mixed_precision_param): the two processes' kernels take turns
    on one GPU, and a float32 serial step already keeps an H100 busy 86-89 %
    of the time (pipelined: 0.98 x serial). Training in bfloat16 (the
    default) that falls to 62-66 %, and pipelined gave 1.41-1.43 x the serial
    loop's samples/s on one H100 (a 28-layer model); with the servers on
    their own GPU 1.89-2.02 x (2 x H100; docs/PERFORMANCE.md). In pipelined mode a
    push installs its version between decode steps (weight_sync.pause_mode
    "none" becomes "in_place"), so generation does not drain for it. Off
    policy wants a gentler learning rate than on policy: pipelined, the CPU
    demo's 3e-3 collapses its entropy after ~300 steps, 1e-3 does not
    (docs/bench-runs/2026-11-26-pipeline_loop-cpu-long-runs.md)."""

    client_process: Literal["auto", "on", "off"] = "auto"
    """Where the rollout client runs (prompt encoding, the requests to the
    servers, decoding, rewards): "on", in a process of its own beside rank 0,
    which then only takes finished groups; "off", in rank 0's process, where
    its Python shares the GIL with the training step's; "auto": on when
    pipelined (pipeline_depth resolves to >= 1; serial, nothing runs beside
    the client). Pipelined on 2 x H100 (28-layer model) the trainer's step
    went from 1.006 to 0.95 s with it on (0.98-1.01 of the ideal overlap
    instead of 0.94; docs/PERFORMANCE.md). The process starts with the
    servers, so its imports overlap their start-up.
    rollout.source = "builtin" only (Atropos environments are their own
    processes already)."""

    client_max_restarts: int = 2
    """How many times a rollout client process that is lost (it exits or
    stops answering) is started again before the run stops. A restarted
    client resumes from the prompt ledger's state, as a resumed run would:
    no prompt handed to the trainer is drawn again, and the groups it had
    in flight or had finished but not handed over are generated again.
    0: the run stops at the step boundary (with its checkpoint)."""

    use_chat_template: bool = True
    """Wrap dataset prompts (task = "jsonl") as one user message with the
    tokenizer's chat template and the generation prompt, when it has one."""


@dataclass
class Inference:
    backend: Literal["builtin", "sglang", "vllm"] = "builtin"
    """Engine protocol spoken to the replicas. Without urls the trainer starts
    num_servers servers of this engine itself (vLLM's OpenAI server, SGLang's
    launch_server or ours, each importable here) and supervises them."""

    urls: list[str] = field(default_factory=list)
    """Replica base URLs for externally started servers (sglang/vllm, or builtin started elsewhere)."""

    replica_file: str = ""
    """File with one replica URL per line, written by a launcher and re-read
    periodically (replicas may join); used in addition to urls."""

    model: str = ""
    """Model name sent in vLLM /v1/completions requests (vLLM's served model name)."""

    num_servers: int = 1
    """Servers started by the trainer when urls is empty."""

    gpu_memory_utilization: float = 0.0
    """A started vLLM's --gpu-memory-utilization (SGLang: --mem-fraction-static):
    the share of its GPU it takes. 0 = the engine's default (vLLM: 0.9), which
    leaves no room for a trainer on the same GPU: set it then (e.g. 0.3)."""

    vllm_fp64_sampler: bool = True
    """A started vLLM draws its samples with fp64 noise (its --use-fp64-gumbel).
    With vLLM 0.26's default fp32 draws, the SmolLM2 recipe's completions grew
    longer right after the first weight push and it learned far slower
    (held-out pass@1 0.150 and 0.265 at step 25, against 0.740 with fp64 draws,
    serial and pipelined, and 0.735 on the built-in server; docs/GPU_RUNS.md,
    runs 128 and 130-132). Its cost there: none seen (step 1.78 s either way on
    an H200); GPUs with slow fp64 pay more per decode step. Servers reached by
    urls: start them with the flag."""

    engine_args: list[str] = field(default_factory=list)
    """Appended to a started vLLM's or SGLang's command line as they are
    (e.g. ["--enforce-eager"]; on the command line: --inference.engine_args
    --enforce-eager,--max-num-seqs,256)."""

    server_devices: list[str] = field(default_factory=list)
    """Devices of the started built-in servers, spread over them in turn
    (server k on entry k mod the list's length), e.g. ["cuda:2", "cuda:3"]
    (on the command line: --inference.server_devices cuda:2,cuda:3);
    ["auto"]: this node's GPUs that no trainer rank uses (rank k uses
    cuda:k). Empty: every server on server_device."""

    server_device: str = "cpu"
    """Device of started built-in servers: "cpu", "cuda" or "cuda:N". With
    weight_sync.transport "nccl" it must be a GPU no trainer rank of this node
    uses (rank k uses cuda:k); a server sharing the trainer's GPU (one GPU for
    both) takes its weights over "ipc" (or "gloo", "disk")."""

    server_dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of started built-in servers."""

    server_threads: int = 1
    """torch threads per started built-in server (CPU)."""

    kv_cache: Literal["auto", "static", "dynamic", "paged"] = "auto"
    """KV cache of started built-in servers (their ``--kv-cache``): "static"
    preallocates ``max_model_len`` positions for each of 64 sequences and
    replays decode steps as CUDA graphs (Llama / Qwen2 / Qwen3 / Mistral);
    "paged": the same models and graphs over a pool of 16-position blocks
    sized by kv_cache_memory_gb (or 0.8 of the GPU memory free after the
    weights), sequences admitted by free blocks and retracted when it runs
    out (long samples: max_model_len up to the model's context); "dynamic"
    runs the HF forward on a growing cache (any model, the CPU default);
    "auto" picks static on a GPU when the model allows it and its slots fit
    the KV budget, paged when they do not (or kv_cache_memory_gb is set)."""

    kv_cache_memory_gb: float = 0.0
    """kv_cache "paged": GiB of KV blocks per started server (0: the server's
    default, a fraction of the GPU memory free after its weights: set this
    when a trainer shares the GPU)."""

    max_model_len: int = 0
    """Started built-in servers' context: positions per sequence, prompt and
    completion together (their ``--max-model-len``); 0 = training.seq_len (no
    longer sample can be trained). The static cache takes its memory at
    start-up. Set, it also caps the rollouts' sequences (prompt_budget.py)."""

    max_batch_size: int = 64
    """Sequences each started built-in server decodes together (its
    ``--max-batch-size``); the static cache takes max_batch_size x
    max_model_len positions at start-up."""

    chat_template: str = ""
    """Started built-in servers' ``--chat-template``: a Jinja template (a
    file, or the text itself) that renders ``/v1/chat/completions`` messages
    in place of the tokenizer's own (environments such as Atropos's call
    that route; needed when the tokenizer has no template). "" = the
    tokenizer's."""

    host: str = "127.0.0.1"
    """Interface the started servers bind to."""

    startup_timeout_s: float = 180.0
    """Time a started server may take to answer /health before the run fails."""

    server_max_restarts: int = 3
    """A started server that exits is restarted on its port (then caught up to
    the newest weights and readmitted) at most this many times in a run; 0
    never restarts. A server given up leaves the fleet; when none is left the
    run saves its last completed step and stops."""

    request_timeout_s: float = 120.0
    """Per-request timeout of a generation call."""

    max_retries: int = 3
    """Attempts for one generation request (each on another replica when possible)."""

    api_key: str = ""
    """Key of servers started with --api-key, sent as "Authorization: Bearer
    KEY" by every client (generation, health, weight push); built-in servers
    the trainer starts get it too. "env:NAME" reads it from environment
    variable NAME (keeps it out of config files and logs)."""


@dataclass
class WeightSync:
    mode: Literal["async", "sync", "off"] = "sync"
    """"async": the trainer snapshots the weights after each step and goes on
    while a sidecar pushes them (replicas may serve a version or two behind);
    "sync": push and wait for every admitted replica (on-policy baseline);
    "off": never push (replicas keep the initial weights; for measuring)."""

    transport: Literal["gloo", "nccl", "disk", "ipc"] = "gloo"
    """How weights travel: a gloo or nccl broadcast per replica (nccl needs GPUs
    on both sides, and a GPU of each), "disk": safetensors in disk_folder plus
    /update_weights_from_disk (no shared network fabric needed; SGLang
    protocol), or "ipc": replicas on the trainer's host map its staging
    buffers (CUDA IPC on a GPU, shared memory on CPU) and copy the weights
    out, SGLang's /update_weights_from_tensor; the way for a server that
    shares the trainer's GPU (docs/PERFORMANCE.md, one GPU)."""

    disk_folder: str = ""
    """transport "disk": a folder every replica can read (default <dump_folder>/pushed_weights)."""

    fanout: Literal["per_replica", "broadcast"] = "per_replica"
    """Transports gloo and nccl, SGLang protocol: how one version reaches N
    replicas. "per_replica": a weight group per replica, so the trainer sends
    every byte N times; "broadcast": one group over the trainer and every
    admitted replica, each bucket sent once; a replica that is slow or down
    leaves it and catches up on its own group (weight_sync/fanout.py)."""

    bucket_size_mb: int = 1024
    """SGLang protocol: tensors are flattened into buckets of about this size,
    one update request and one broadcast each (vLLM's packed chunks keep
    vLLM's 1 GiB). Each replica holds one bucket of extra memory while it
    receives. Fewer buckets, fewer HTTP round trips: on 2 H200s an 8B push
    to the built-in server reached 0.74 of raw NCCL at 256 MiB and 0.92-0.94
    at 1024 and 4096 (run 57), and the async step of a 0.6B fp32 trainer
    cost 1.035-1.038x of no push at 256 against 1.010-1.034x at 1024
    (docs/PERFORMANCE.md)."""

    dtype: Literal["model", "bfloat16", "float16", "float32"] = "model"
    """Dtype the weights are sent in: "model" keeps the trainer's (fp32 master
    weights); "bfloat16" halves the bytes for bf16 servers (cast in the snapshot copy)."""

    num_staging_buffers: int = 2
    """Snapshots that may exist at once; when all are being sent, the trainer
    skips that step's snapshot instead of waiting (each costs one copy of the weights)."""

    staging: Literal["device", "host"] = "device"
    """Where snapshots wait to be sent: "device" keeps num_staging_buffers
    copies of the pushed weights on the trainer's GPU (the fastest push;
    transports gloo and disk stage in host memory anyway, from a GPU as
    "host" does, whichever is set); "host" keeps them
    in pinned host memory, for models that do not fit on the GPU twice: the
    copy to the host runs beside the next forward/backward and the next
    optimizer step waits for it on the GPU, each replica's sender holds two
    buckets of GPU memory to upload through, and the push runs at PCIe speed
    (docs/PERFORMANCE.md). A sharded trainer stages rank 0's gathered copy there."""

    replica_deadline_s: float = 60.0
    """A replica that has not received and loaded a version within this time is
    ejected from routing and readmitted only once it holds the newest version."""

    pause_mode: Literal["none", "abort", "retract", "in_place"] = "none"
    """How a replica treats running generations during an update (SGLang's
    /pause_generation mode); "none" lets the update wait for them to finish."""

    pipeline_requests: bool = True
    """Built-in servers: a push writes its HTTP requests (pause, session,
    updates, end, resume) on one connection without waiting for each reply,
    and the server takes them in order, so the version is served one or two
    round trips sooner per request (docs/PERFORMANCE.md). The broadcasts
    wait for the same replies either way. SGLang and vLLM always get one
    request after another's reply, as their documentation orders them."""

    ack_posted: bool = True
    """Built-in servers, with ``pipeline_requests``: each update is answered
    once its receive is posted (``?ack=posted``). In SGLang's protocol each
    bucket goes out then, queued behind the one in flight: the link never
    idles between buckets and no broadcast waits on the trainer's GPU for a
    receive (2 H200s, 8B in 1 GiB buckets: 0.73 -> 0.89 of raw NCCL;
    docs/perf-history/weight-push.md runs 47-48). In vLLM's (one update per version) the
    finish is then handled while the bytes arrive instead of after them."""

    lora_push: Literal["merged", "adapter"] = "merged"
    """With [lora]: "merged" pushes base + (alpha / rank) B A as full weights
    under the usual HF names (any server). "adapter" pushes only the adapter
    (a peft folder per version in weight_sync.disk_folder, loaded through
    SGLang's or vLLM's LoRA routes, which the servers must enable; the built-in
    server merges it into its own copy of the base): requests then name the
    adapter. One trainer process, as [lora] itself."""

    delta: bool = False
    """Built-in servers only: send each replica only the bf16 (or fp32)
    elements that changed since the version it holds (indices + new values,
    a tensor whose change is dense goes whole), checked bit-equal on receive
    by a per-tensor checksum; a replica whose version the trainer holds no
    copy of (new, restarted, more than one version behind) gets the full
    weights (weight_sync/delta_push.py, docs/PERFORMANCE.md "Delta push").
    Not for SGLang or vLLM (docs/PROTOCOL_NOTES.md "Delta push")."""

    master_address: str = "127.0.0.1"
    """Address the trainer's weight-group stores listen on (reachable by every replica)."""

    init_timeout_s: float = 120.0
    """Time for a replica to join its weight group."""


@dataclass
class Checkpoint:
    """Keys added to TorchTitan's own [checkpoint] section (enable, folder,
    interval, keep_latest_k, load_step, export_dtype, ... keep their meaning)."""

    hf_export: bool = False
    """After the last step, write the policy as an HF checkpoint (safetensors
    in checkpoint.export_dtype, config.json and tokenizer files copied from
    model.hf_assets_path) that transformers' from_pretrained and the
    inference engines load."""

    hf_export_folder: str = "hf"
    """Folder of the HF export, under job.dump_folder (outside checkpoint.folder,
    so it is never mistaken for a resumable checkpoint)."""


@dataclass
class JobConfig:
    """Merged into TorchTitan's JobConfig by its ConfigManager."""

    grpo: GRPO = field(default_factory=GRPO)
    rollout: Rollout = field(default_factory=Rollout)
    inference: Inference = field(default_factory=Inference)
    weight_sync: WeightSync = field(default_factory=WeightSync)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    eval: Eval = field(default_factory=Eval)
    lora: LoRA = field(default_factory=LoRA)
    moe: MoE = field(default_factory=MoE)


def _trainer_gpus() -> int:
    """This node's trainer ranks (rank k uses cuda:k)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def server_devices(cfg) -> tuple[str, list[str]]:
    """(the key that chose them, the device of each started built-in server)."""
    i = cfg.inference
    if not i.server_devices:
        return "inference.server_device", [i.server_device] * i.num_servers
    devices = list(i.server_devices)
    if devices == ["auto"]:
        devices = [f"cuda:{k}" for k in range(_trainer_gpus(), _gpu_count())]
    return "inference.server_devices", [devices[k % len(devices)] for k in range(i.num_servers)] if devices else []


def servers_share_trainer_gpu(cfg) -> bool:
    """Whether a started built-in server runs on a GPU a trainer rank of this
    node uses (rank k uses cuda:k)."""
    i = cfg.inference
    if i.urls or i.replica_file:
        return False
    return any(d.startswith("cuda") and int(d.partition(":")[2] or 0) < _trainer_gpus()
               for d in server_devices(cfg)[1])


def pipeline_depth(cfg) -> int:
    """rollout.pipeline_depth resolved (auto -> 0 or 1) and capped by grpo.max_staleness."""
    depth = cfg.rollout.pipeline_depth
    if depth == -1:
        shared_fp32 = servers_share_trainer_gpu(cfg) and cfg.training.mixed_precision_param == "float32"
        depth = 0 if cfg.weight_sync.mode == "sync" or shared_fp32 else 1
    if cfg.grpo.max_staleness >= 0:
        depth = min(depth, cfg.grpo.max_staleness)
    return depth


def client_process(cfg) -> bool:
    """rollout.client_process resolved: the built-in source's client in a process of its own."""
    mode = cfg.rollout.client_process
    return cfg.rollout.source == "builtin" and (mode == "on" or (mode == "auto" and pipeline_depth(cfg) > 0))


def api_key(cfg) -> str:
    """inference.api_key with "env:NAME" resolved."""
    key = cfg.inference.api_key
    return os.environ.get(key[4:], "") if key.startswith("env:") else key
