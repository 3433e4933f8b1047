"""The built-in engine's settings (``EngineConfig``): the server's command
line maps onto them one to one (``server/app.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    """Built-in engine settings (the server CLI maps 1:1 onto these)."""

    model_path: str
    device: str = "cpu"
    dtype: str = "auto"
    """"auto" keeps the checkpoint's dtype; or float32 / bfloat16 / float16."""
    seed: int = 0
    max_batch_size: int = 64
    """Most sequences decoded together."""
    kv_cache: str = "auto"
    """"static": a preallocated cache of ``max_batch_size`` slots x
    ``max_model_len`` positions, decode steps replayed as CUDA graphs on a
    GPU (``server/engine/static_batch.py``); "paged": the same decode on a pool of blocks
    sized by a memory budget, sequences admitted by free blocks and retracted
    when it runs out (``server/engine/paged_batch.py``); "dynamic": the HF forward on a
    growing cache (any HF causal LM); "auto": on a GPU for Llama / Qwen2 /
    Qwen3 / Mistral static while its slots fit the KV budget, else paged
    (``batch.auto_kind``); dynamic otherwise (and on CPU)."""
    max_model_len: int = 0
    """Static / paged cache: positions per sequence, prompt and output together
    (a longer prompt is refused, generation stops there with "length"); 0 =
    the model's context, at most 2048 (static) or what the pool holds (paged)."""
    kv_cache_memory_gb: float = 0.0
    """Paged cache: the pool's size in GiB (0: by ``kv_cache_memory_fraction``)."""
    kv_cache_memory_fraction: float = 0.0
    """Paged cache: the pool's share of the GPU memory free after the weights
    (0: ``kv_pool.DEFAULT_MEMORY_FRACTION``; on a CPU the pool holds
    ``max_batch_size`` x ``max_model_len`` positions instead)."""
    cuda_graphs: bool = True
    """Static cache on a GPU: replay decode steps as CUDA graphs (off: the
    same kernels launched one by one, for debugging)."""
    overlap_schedule: bool | None = None
    """Launch decode step k+1 before step k's tokens reach the host, so the
    host's bookkeeping runs while the device computes (SGLang's overlap
    scheduler). A row that ends at step k is computed once more, unread.
    None: on a GPU (on a CPU nothing runs concurrently)."""
    debug_decode_delay_s: float = 0.0
    """Debug knob for benchmarks: every decode step of the batch takes this
    much longer (the worker sleeps in it), so one replica generates N times
    slower than its peers (the pipelined loop's slow-replica case). 0 in
    production."""
    return_routed_experts: bool = False
    """Capture every MoE layer's routed experts per position (``server/engine/moe_routes.py``)."""
    admission_window_ms: float = 40.0
    """While the engine has no rows, the first request of a burst waits until
    none has come for ``admission.QUIET_MS`` (or this long after it came), so
    the burst is one prefill (``server/engine/admission.py``); 0: admit at once."""
