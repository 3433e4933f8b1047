"""Training: the trainer's side of the loop, one GRPO step at a time.

``trainer`` sets up the ranks, builds the policy (``policy``, per layout,
with LoRA's adapters) and runs one step: micro-batches (``packing`` for
packed rows), per-token log-probs (``token_logprobs``, chunked),
``loss`` (GRPO / DAPO / Dr. GRPO / GSPO / CISPO aggregations), the
importance weights of off-policy samples (``importance``), the forward under
context parallelism (``cp_step``) and what a mixture-of-experts model adds
(``moe_step``). ``sample`` is the sample a rollout hands the trainer and
``checkpoint`` saves and resumes a run and exports the policy to HF.

May import: config, models, distributed, lora.
"""
