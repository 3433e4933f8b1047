"""Configuration: our sections of TorchTitan's JobConfig and what follows from them.

``job_config`` holds the ``[rollout]``, ``[inference]``, ``[weight_sync]``
and ``[checkpoint]`` sections and the ``JobConfig`` TorchTitan merges into
its own (``job.custom_config_module``), plus the values a run derives from
them (server devices, pipeline depth); ``grpo``, ``eval``, ``lora``, ``moe``
and ``pipeline`` hold one section or key set each. ``parse`` turns the
command line and the TOML file into a validated config; ``checks`` are the
start-up checks, each failure one line naming the key; ``keys`` and
``cli_bools`` check key names and types and spell booleans on the command
line.

The bottom layer: it imports no other package of ours at import time. A few
start-up checks ask the package that owns a value whether it is valid (a
reward name, a chat template, a loss variant, the delta transport, the demo
model's folder), and import it inside the check.

May import: none.
May import on use: models, train, rollout, weight_sync.
"""
