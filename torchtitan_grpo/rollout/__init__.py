"""Rollouts: prompts in, scored groups of samples out, for the trainer.

``producer`` keeps generation running ahead of the trainer over the fleet's
pool (``ledger``: which weights each sample came from; ``dynamic_sampling``,
``prompt_budget``, ``overlong``: what a group keeps); ``groups`` and
``advantages`` turn completions into scored samples; ``tasks``,
``arith_task``, ``rewards`` and ``math_reward`` are the built-in tasks and
rewards; ``evaluation`` scores held-out prompts during training;
``client_process`` / ``client_main`` run the rollout side in its own process;
``atropos*`` take groups from Atropos environments instead.

May import: protocol, fleet, train.
"""
