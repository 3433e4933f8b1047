"""metrics.py: the TensorBoard event file holds every scalar of every step."""

from __future__ import annotations

import logging


def test_tensorboard_gets_each_steps_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torchtitan_grpo.metrics import MetricLogger

    logging.getLogger("torchtitan_grpo").setLevel(logging.WARNING)
    log = MetricLogger(str(tmp_path), "tb", enable_tensorboard=True)
    for step in (1, 2, 3):
        log.log(step, {"loss": 0.5 * step, "reward/mean": 1.0 / step, "note": "not a number"})
    log.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "reward/mean"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 1.0), (3, 1.5)]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3
