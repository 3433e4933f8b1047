"""The built-in server's engine: batches, KV cache, kernels, sampling, weights.

``engine`` (settings in ``config``) runs generation on a KV batch (``batch``: the dynamic one,
``static_batch`` and ``paged_batch`` with CUDA-graph decode, ``kv_pool``
their block pool, ``paged_attention`` the decode kernel, ``shared_prompts``
which slot a sample reads its prompt's KV from, ``static_moe`` a
graph-safe MoE MLP), picks tokens (``sampling``), loads the model
(``loading``) and installs new weights (``weights``, ``engine_weights``,
``expert_views``); ``requests`` are its request and result types,
``admission`` when an idle engine admits a burst of them, and
``moe_routes`` the routed experts it records.

May import: protocol, weight_sync.
"""
