"""Distribution: how the policy is laid out over the trainer's ranks.

``parallel`` applies TorchTitan's FSDP2 / HSDP / TP set-up with gradients
normalised the same way in every layout; ``pipeline`` splits the model into
PP stages and runs their schedules; ``context_parallel`` shards sequences
over the CP ranks (ring attention, also on CPU) and ``expert_parallel`` the
MoE experts over the EP ranks; ``cpu_sdpa_sharding`` registers the DTensor
rules CPU attention needs; ``stage_transfer`` plans and runs the moves of
each PP stage's tensors to rank 0.

May import: config, models.
"""
