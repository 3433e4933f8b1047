"""The reply builders' garbage-collector pause (``httputil.gc_paused``) and
the chat route's logprobs with the collector held off: same content."""

from __future__ import annotations

import gc

import torchtitan_grpo  # noqa: F401  (before torchtitan)
from torchtitan_grpo.server.httputil import gc_paused


def test_gc_paused_restores_an_enabled_collector() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_gc_paused_restores_on_error() -> None:
    try:
        with gc_paused():
            raise ValueError("boom")
    except ValueError:
        pass
    assert gc.isenabled()


def test_gc_paused_leaves_a_disabled_collector_disabled() -> None:
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # someone else turned it off: not ours to turn on
    finally:
        gc.enable()


def test_nested_pauses_reenable_once_at_the_outer_end() -> None:
    with gc_paused():
        with gc_paused():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
