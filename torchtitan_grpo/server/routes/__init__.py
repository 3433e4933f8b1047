"""The built-in server's HTTP routes, one protocol's family per module.

SGLang's ``/generate`` (``sglang``, streamed in ``sglang_stream``) and
weight-update routes (``sglang_weights``); vLLM's OpenAI completions and
chat (``vllm_openai``, ``vllm_chat``, streamed in ``vllm_stream``), native
``/generate`` (``vllm_generate``) and weight-transfer routes
(``vllm_weights``); ``prompt_logprobs`` shapes prompt log-probs for both,
``logprob_json`` writes the OpenAI replies' per-token log-prob arrays as JSON text.

May import: server, server.engine, server.receive, models, protocol, fleet, weight_sync.
"""
