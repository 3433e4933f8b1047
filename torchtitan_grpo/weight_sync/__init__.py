"""Weight sync: the trainer's new weights onto the inference servers.

``gather`` brings the policy's weights (whole, merged with LoRA, or the
adapters alone) to rank 0; ``staging`` and ``buckets`` stage them in pinned
buffers; ``pusher`` runs a push in the background, one transport per file
(``sglang_push``, ``vllm_push``, ``builtin_push``, ``disk_push``,
``ipc_push``, ``group_push``, ``delta_push``, ``adapter_push``), with
``fanout`` relaying to many servers and ``delta`` sending only what changed.
A real vLLM's NCCL group is joined through vLLM's own handshake
(``vllm_group``), calling libnccl through ctypes (``nccl_lib``).
The receiving servers share its wire formats through ``protocol``; the
built-in server also reuses its bucket and group layouts.

May import: protocol, distributed.
May import on use: models, lora.
"""
