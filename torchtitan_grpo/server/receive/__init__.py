"""The built-in server's ends of the weight pushes.

``delta`` applies a delta push, ``lora`` loads pushed adapters, ``packed``
and ``vllm_ipc`` receive vLLM's packed NCCL and CUDA IPC transfers; each
hands the engine tensors to install.

May import: server, server.engine, protocol, fleet, weight_sync.
"""
