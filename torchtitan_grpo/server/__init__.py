"""The built-in inference server: an HF model behind SGLang's and vLLM's HTTP protocols.

``python -m torchtitan_grpo.server --model DIR --port N`` runs it (``app``:
the command line, ``settings``, the aiohttp application). ``engine/`` is the
generation engine (KV batches, the paged-attention kernel, sampling, weight
installs); ``routes/`` are the HTTP routes of both protocols (generation,
streaming, OpenAI completions and chat, weight updates); ``receive/`` the
receiving ends of the weight pushes (delta, adapters, vLLM's packed and IPC
transfers). ``httputil``, ``vllm_http`` and ``streaming`` are request
plumbing the routes and receivers share.

May import: models, protocol, fleet, weight_sync.
"""
