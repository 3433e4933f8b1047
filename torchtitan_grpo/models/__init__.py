"""Models: HF checkpoints <-> TorchTitan models, one family at a time.

``hf_bridge`` maps HF checkpoint folders to TorchTitan's qwen3 and llama3
models and back (state-dict names, configs, dtype); ``llama3_tied`` adds
llama3 with tied embeddings and ``qwen3_moe`` Qwen3-MoE on TorchTitan's MoE
model, whose routers ``router_replay`` can make follow a rollout's experts
(R3). ``gguf`` dequantises a GGUF file into an HF checkpoint once
(``python -m torchtitan_grpo.models.gguf``), ``demo_assets`` writes the tiny
demo model and tokenizer, and ``chat_template`` renders chat messages with
a model's template.

Below everything that builds or serves a model.

May import: none.
"""
