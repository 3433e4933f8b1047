"""Fleet: the trainer's side of inference, whatever engine serves.

``pool`` sends generation requests over the replicas (``replicas``: health,
load, retries); ``sglang`` and ``vllm`` build each engine's request bodies
and parse its replies strictly into ``types``' engine-neutral results;
``route_backend`` asks for routed experts (MoE router replay);
``launcher`` starts, watches and restarts the servers the trainer runs
itself, with the command line of each engine from ``engine_commands``
(``python -m torchtitan_grpo.server`` for the built-in one).

May import: protocol.
"""
