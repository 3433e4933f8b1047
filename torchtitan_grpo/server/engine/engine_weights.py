"""The engine's weights API: versions, names, checks, installs and reads.

A mixin of :class:`~torchtitan_grpo.server.engine.engine.Engine` (moved out of
``server/engine/engine.py`` to keep that module to its scheduling): every method here runs
on a caller's thread and reaches generation only through the engine's own
``exclusive()`` (an install waits until no forward pass can run),
``_param_lock`` (copy-in vs read-out) and ``_cv`` (the version's books).
"""

from __future__ import annotations

from typing import Sequence

import torch

from torchtitan_grpo.server.engine.requests import RequestError
from torchtitan_grpo.server.engine.weights import adoptable, check_specs, install_weights
from torchtitan_grpo.weight_sync.buckets import TensorSpec


class EngineWeights:
    """The public weights methods of the engine (see the module docstring)."""

    @property
    def weight_version(self) -> str:
        return self._weight_version

    def set_weight_version(self, version: str) -> None:
        """Serve ``version`` from now on; live samples remember where it changed."""
        with self._cv:
            self._set_version_locked(version)

    def param_spec(self, name: str) -> TensorSpec | None:
        t = self._tensors.get(name)
        return None if t is None else TensorSpec(name, t.dtype, tuple(t.shape))

    def param_names(self) -> list[str]:
        return list(self._tensors)

    def check_weights(self, specs: Sequence[TensorSpec]) -> None:
        """Raise :class:`WeightUpdateError` naming the first tensor that does not
        fit the model (unknown name, shape mismatch, duplicate)."""
        check_specs(self._tensors, specs)

    def check_received(self, specs: Sequence[TensorSpec], device: torch.device) -> list[bool]:
        """:meth:`check_weights`, and for tensors received as ``specs`` on
        ``device`` which will become their parameter's storage (``adoptable``)."""
        self.check_weights(specs)
        if self.static_cache:
            # Captured graphs read the parameters' storage: copy into it, never swap it.
            return [False] * len(specs)
        return adoptable(self._tensors, specs, device)

    def load_weights(
        self, named: Sequence[tuple[str, torch.Tensor]], weight_version: str | None = None,
        checked: bool = False, adopt: Sequence[bool] | None = None,
    ) -> None:
        """Copy ``named`` tensors into the model, all or nothing.

        Everything is validated before the first copy (``checked``: the caller
        already ran :meth:`check_weights` on them, as a weight-update session
        does per request; ``adopt``: and :meth:`check_received` decided which
        to adopt). The copy waits for :meth:`exclusive` (no forward pass in
        flight: batch drained, or paused).
        """
        if not checked:
            self.check_weights([TensorSpec.of(n, t) for n, t in named])
        with self.exclusive(), self._param_lock:
            if self.static_cache:
                adopt = [False] * len(named)  # copy into the storage the captured graphs read
            install_weights(self._tensors, named, adopt)
            self._batch.weights_changed()
            if weight_version is not None:
                with self._cv:
                    self._set_version_locked(weight_version)

    def prompt_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """[len(ids), vocab] logits of one forward over ``ids`` with the live
        weights (prompt logprobs); any thread, beside the worker's steps."""
        with torch.inference_mode(), self._param_lock:
            return self.model(input_ids=torch.tensor([list(ids)], device=self.device), use_cache=False).logits[0]

    def get_weights(self, name: str, truncate_size: int = 100) -> list:
        """A parameter as nested float lists, its first ``truncate_size`` rows."""
        t = self._tensors.get(name)
        if t is None:
            raise RequestError(f"unknown parameter {name!r}")
        with self._param_lock:
            value = t.detach().to("cpu", torch.float32)
        return value.reshape(1).tolist() if value.dim() == 0 else value[: max(truncate_size, 0)].tolist()
