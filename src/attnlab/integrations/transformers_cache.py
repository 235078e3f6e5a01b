"""A transformers cache that appends in place: :class:`AttnlabCache`.

transformers' ``DynamicCache`` appends each step's keys and values with ``torch.cat``: every new
token copies the whole cache of every layer (57% of a decode step at an 8k-token prompt, against
11% in attnlab's decode kernel: issue 49's profile). :class:`AttnlabCache` keeps each full-attention
layer's keys and values in a buffer with room to spare (doubled when full), writes the new rows
into it, and hands the attention the filled rows as a view ``buffer[:, :, :n]`` (no copy; attnlab's
decode kernel reads such strided views as they are)::

    from attnlab.integrations.transformers_cache import AttnlabCache
    out = model.generate(ids, past_key_values=AttnlabCache(model.config), max_new_tokens=64)

Sliding-window and other special layers stay transformers' own.

    key_states (B, Hkv, n, E), value_states (B, Hkv, n, Ev)  ->  keys (B, Hkv, S, E), values (B, Hkv, S, Ev)
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from attnlab.integrations.transformers import check_version
from attnlab.kernels.memory import cache_empty

check_version()  # names the supported range before transformers' own imports fail less helpfully
from transformers.cache_utils import DynamicCache, DynamicLayer  # noqa: E402

__all__ = ["AttnlabCache", "InPlaceLayer"]

MIN_CAPACITY = 256  # rows a layer's buffer starts with, at least: 256 keys of 64 fp32 values = 64 KiB a head


class InPlaceLayer(DynamicLayer):
    """A full-attention cache layer whose ``keys`` and ``values`` are views of buffers appended in
    place: a step copies its own rows only (the buffers double when full, so growing costs O(1) a
    row). Anything that replaces ``keys`` (``crop``, beam search's reordering, ``reset``) is taken
    over at the next update."""

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.capacity = capacity
        self._buffers: Optional[tuple[Tensor, Tensor]] = None
        self._views: Optional[tuple[Tensor, Tensor]] = None

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Append ``key_states (B, Hkv, n, E)`` and ``value_states (B, Hkv, n, Ev)``; return every
        cached row, ``(B, Hkv, S, E)`` and ``(B, Hkv, S, Ev)``, as views of the buffers."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._views is None or self.keys is not self._views[0] or self.values is not self._views[1]:
            self._take_over()  # first call, or keys replaced from outside: the buffers follow them
        n_old, n = self.keys.shape[-2] if self.keys.dim() == 4 else 0, key_states.shape[-2]
        self._reserve(key_states, value_states, n_old + n)
        k, v = self._buffers
        k[:, :, n_old:n_old + n] = key_states
        v[:, :, n_old:n_old + n] = value_states
        self._views = (k[:, :, :n_old + n], v[:, :, :n_old + n])  # (B, Hkv, S, E), (B, Hkv, S, Ev)
        self.keys, self.values = self._views
        return self.keys, self.values

    def _take_over(self) -> None:
        keys, values = self.keys, self.values
        self._buffers = self._views = None
        if keys is not None and keys.dim() == 4 and keys.shape[-2] > 0:
            self._reserve(keys, values, keys.shape[-2])
            self._buffers[0][:, :, :keys.shape[-2]] = keys
            self._buffers[1][:, :, :keys.shape[-2]] = values
            self._views = (self._buffers[0][:, :, :keys.shape[-2]], self._buffers[1][:, :, :keys.shape[-2]])
            self.keys, self.values = self._views

    def _reserve(self, key_states: Tensor, value_states: Tensor, rows: int) -> None:
        """Buffers for at least ``rows`` rows, shaped like the states but for their length."""
        B, H, _, E = key_states.shape
        Ev = value_states.shape[-1]
        have = self._buffers
        if have is not None and have[0].shape[2] >= rows and have[0].shape[:2] == (B, H) \
                and have[0].dtype == key_states.dtype:
            return
        cap = max(rows, self.capacity, MIN_CAPACITY, 2 * (have[0].shape[2] if have is not None else 0))
        # on huge pages where Linux offers them (attnlab.kernels.memory: a decode step's page walks)
        k = cache_empty((B, H, cap, E), key_states.dtype, key_states.device)
        v = cache_empty((B, H, cap, Ev), value_states.dtype, value_states.device)
        if self._views is not None:  # what is cached moves once; a doubling keeps that O(1) a row
            filled = self._views[0].shape[-2]
            k[:, :, :filled] = self._views[0]
            v[:, :, :filled] = self._views[1]
        self._buffers = (k, v)


class AttnlabCache(DynamicCache):
    """transformers' ``DynamicCache`` with every full-attention layer an :class:`InPlaceLayer`:
    pass it to ``generate`` as ``past_key_values`` (or to a forward). ``capacity``: rows to
    reserve at the first update (``prompt + max_new_tokens`` avoids every regrowth)."""

    def __init__(self, config: Any = None, capacity: int = 0, **kwargs: Any):
        super().__init__(config=config, **kwargs)
        self.layers = [InPlaceLayer(capacity) if type(layer) is DynamicLayer else layer for layer in self.layers]
        if getattr(self, "layer_class_to_replicate", None) is DynamicLayer:
            self.layer_class_to_replicate = lambda: InPlaceLayer(capacity)
