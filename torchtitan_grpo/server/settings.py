"""Settings of the built-in server (its command line, ``server.parse_args``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerConfig:
    """Command-line settings of the built-in server."""

    model: str
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "cpu"
    dtype: str = "auto"
    seed: int = 0
    max_batch_size: int = 64
    kv_cache: str = "auto"
    """``--kv-cache``: static, paged, dynamic or auto (``EngineConfig.kv_cache``)."""
    max_model_len: int = 0
    """``--max-model-len``: positions per sequence of a static or paged cache
    (0: the model's context, at most 2048 static, what the pool holds paged)."""
    kv_cache_memory_gb: float = 0.0
    """``--kv-cache-memory-gb``: the paged cache's pool in GiB."""
    kv_cache_memory_fraction: float = 0.0
    """``--kv-cache-memory-fraction``: the paged pool's share of the GPU memory
    free after the weights (0: ``kv_pool.DEFAULT_MEMORY_FRACTION``)."""
    cuda_graphs: bool = True
    """Off with ``--no-cuda-graphs``."""
    overlap_schedule: bool = True
    """Off with ``--disable-overlap-schedule`` (on: the engine's default, which
    overlaps on a GPU only)."""
    api_key: str | None = None
    """If set, every route except /health and /health_generate needs
    ``Authorization: Bearer KEY``."""
    weight_group_timeout_s: float = 300.0
    """Rendezvous and per-broadcast timeout of weight-update groups."""
    num_threads: int | None = None
    debug_update_delay_s: float = 0.0
    """Test knob: every weight-update handler (both protocols) sleeps this long
    after receiving, to simulate a slow replica. 0 in production."""
    debug_decode_delay_s: float = 0.0
    """Debug knob for benchmarks: every decode step of the engine's batch takes
    this much longer (a replica N times slower at generating). 0 in
    production."""
    chat_template: str | None = None
    """``--chat-template`` (the template's text, read at start-up): renders
    ``/v1/chat/completions`` messages when the tokenizer has no template of
    its own, or in place of it. None: the tokenizer's."""
    trust_request_chat_template: bool = False
    """``--trust-request-chat-template``: accept a ``chat_template`` in a
    request (vLLM refuses it without this flag)."""
    enable_return_routed_experts: bool = False
    """``--enable-return-routed-experts``: MoE models capture the routed experts
    of every position; a request gets them with ``return_routed_experts``
    (a request asking without this flag, or of a dense model, is a 400)."""
    admission_window_ms: float = 40.0
    """``--admission-window-ms``: an idle engine admits a burst of requests as
    one prefill (``EngineConfig.admission_window_ms``)."""
