"""LoRA: low-rank adapters on a frozen base, in every trainer layout.

``adapters`` puts adapters on TorchTitan's projections and merges them into
the weights the push and the export send; ``sharded`` (FSDP2 / HSDP / DDP),
``tp`` (tensor parallel) and ``pp`` (pipeline stages) are the same adapters
on sharded ranks; ``peft`` writes them in the format peft loads on the HF
model.

May import: config, models, distributed.
"""
