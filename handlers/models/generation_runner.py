"""The generation engine's model runner: prefill and batched greedy decode of a causal LM with a KV cache.

Chosen: each sequence owns a KV cache (a view of its row in the batch of its last step); a step
runs on one transformers Cache, the last step's batch as it is or one left-padded from the
views. Not transformers' continuous batching (generate_batch, correct here): it runs its own
scheduler loop and fails every request of a batch on one error; ours plans and isolates per step.
The batch's layers are `_RoomyLayer`s, transformers' DynamicLayer with room to grow: DynamicLayer
concatenates (a copy of the whole cache every step, and one more to build it from the views),
which on the bench's model was a third of a decode step; a step now writes its token in place.
The room is memory kv_bound does not count: up to ROOM tokens per row of each batch still held.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers.cache_utils import DynamicLayer

from tsbatch.handlers.core.errors import ConfigError, OutOfMemory

logger = logging.getLogger(__name__)

ROOM = 64  # tokens of room a batch's cache is given when it fills: one copy per ROOM decode steps, not per step


class _RoomyLayer(DynamicLayer):
    """One layer's KV cache in buffers with room ([rows, heads, capacity, head_dim]): `keys` and
    `values` are views of the filled part, and an update writes after it in place (copying into
    larger buffers only when full). A view handed out before stays valid: nothing before
    `length` is ever written again."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None, length: int = 0):
        super().__init__()
        self.buffers = None if keys is None else (keys, values)
        self.length = length
        if keys is not None:
            self._initialize(keys)
            self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def _initialize(self, like: torch.Tensor) -> None:
        """What DynamicLayer.lazy_initialization sets (its signature differs between 4.x and 5.x)."""
        self.dtype, self.device, self.is_initialized = like.dtype, like.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self._initialize(key_states)
        end = self.length + key_states.shape[-2]
        if self.buffers is None or end > self.buffers[0].shape[-2]:
            self.buffers = tuple(_with_room(old, state, self.length, end) for old, state in
                                 zip(self.buffers or (None, None), (key_states, value_states)))
        keys, values = self.buffers
        keys[:, :, self.length:end] = key_states
        values[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        return self.keys, self.values


def _with_room(old: torch.Tensor | None, state: torch.Tensor, length: int, end: int) -> torch.Tensor:
    """A buffer for `end` tokens and ROOM more, holding `old`'s first `length`."""
    shape = (*state.shape[:2], end + ROOM, state.shape[3])
    buffer = state.new_zeros(shape)
    if old is not None and length:
        buffer[:, :, :length] = old[:, :, :length]
    return buffer


@dataclass(frozen=True, eq=False)
class _Batch:
    """The padded KV cache of the step that last grew a set of sequences: one _RoomyLayer per model
    layer, `length` tokens long (with padding) when that step ended."""

    layers: tuple[_RoomyLayer, ...]
    rows: int
    length: int

    @property
    def intact(self) -> bool:
        """Nothing wrote past the step that made it (a step on it that raised may have, in some layers)."""
        return all(layer.length == self.length for layer in self.layers)


@dataclass(frozen=True)
class SequenceCache:
    """One sequence's KV cache: (keys, values) per layer, each [1, heads, length, head_dim] — a view
    of row `row` of the step's `batch` without its padding. The next step of the same sequences in
    the same order runs on that batch as it is; any other set is combined from the views (a
    step's batch lives until every sequence of it has stepped again or left)."""

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    batch: _Batch | None = None
    row: int = 0

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[-2]


@dataclass(frozen=True)
class RowResult:
    """What one sequence got from a step: its greedy next token (None when its logits held NaN)
    and its cache grown by the tokens it fed."""

    token: int | None
    cache: SequenceCache


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


class GenerationRunner:
    """A local causal-LM directory (safetensors weights, a tokenizer) and the two kinds of step."""

    def __init__(self, model_dir: str, device: str = "cpu"):
        from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.lm = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, use_safetensors=True)
        self.lm = self.lm.to(self.device).eval()
        layers = DynamicCache(config=self.lm.config).layers
        kinds = {type(layer).__name__ for layer in layers}
        if kinds != {DynamicLayer.__name__}:
            raise ConfigError(f"generation serves models whose KV cache is plain full attention; {model_dir} has "
                              f"{sorted(kinds)} layers (sliding windows or recurrent state are not supported yet)")
        self.layer_count = len(layers)
        self._cache_class = DynamicCache
        # transformers 5 names the KV cache `cache` (argument and output); 4.x `past_key_values`
        forward = inspect.signature(self.lm.forward).parameters
        self._cache_name = "cache" if "cache" in forward else "past_key_values"
        eos = self.lm.generation_config.eos_token_id
        self.eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        config = self.lm.config.get_text_config(decoder=True)
        self.max_positions = int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions"))
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)  # masked anyway
        try:  # one prefill and one decode step at load: a model these steps cannot drive fails here, not later
            [probe] = self.prefill([[self.pad_id]])
            self.decode([(self.pad_id, probe.cache)])
        except Exception as error:
            raise ConfigError(f"{model_dir} cannot run a generation step (prefill then decode with a KV cache): "
                              f"{type(error).__name__}: {error}") from error
        self.kv_bytes_per_token = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                                      for k, v in probe.cache.layers)  # one token's cache

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode_text(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def example(self, length: int) -> list[int]:
        """`length` real token ids (an ordinary sentence's, repeated): what warmup feeds."""
        sentence = self.encode("The quick brown fox jumps over the lazy dog while the band plays on. ") or [self.pad_id]
        return [sentence[i % len(sentence)] for i in range(length)]

    @torch.inference_mode()
    def prefill(self, contexts: Sequence[Sequence[int]], pad_to: int = 0) -> list[RowResult]:
        """Feed each context (prompt plus tokens so far) whole, left-padded to the longest or to
        `pad_to` if longer (the engine pads to the contexts' length edge, so every prefill is a
        shape warmup ran); raises OutOfMemory when the step does not fit."""
        if not contexts:
            return []
        longest = max(pad_to, max(len(c) for c in contexts))
        ids = torch.full((len(contexts), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(contexts), longest), dtype=torch.long)
        for row, context in enumerate(contexts):
            ids[row, longest - len(context):] = torch.tensor(list(context), dtype=torch.long)
            mask[row, longest - len(context):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        layers = [_RoomyLayer() for _ in range(self.layer_count)]
        out = self._forward(ids, mask, positions, self._cache(layers))
        return self._split(layers, out, [longest - len(c) for c in contexts])

    @torch.inference_mode()
    def decode(self, rows: Sequence[tuple[int, SequenceCache]]) -> list[RowResult]:
        """Feed each sequence its last token over its own cache, in one batch; raises OutOfMemory
        when the step does not fit."""
        if not rows:
            return []
        lengths = [cache.length for _, cache in rows]
        longest = max(lengths)
        same = rows[0][1].batch
        if (same is not None and same.rows == len(rows) and same.intact
                and all(c.batch is same and c.row == i for i, (_, c) in enumerate(rows))):
            layers = list(same.layers)  # the sequences of the last step, in its order: no copy
            longest = same.length  # its padding as that step left it (a prefill's edge)
        else:
            layers = [_RoomyLayer(*self._combine([cache.layers[layer] for _, cache in rows], lengths, longest), longest)
                      for layer in range(len(rows[0][1].layers))]
        mask = torch.zeros((len(rows), longest + 1), dtype=torch.long)
        for row, length in enumerate(lengths):
            mask[row, longest - length:] = 1
        ids = torch.tensor([[token] for token, _ in rows], dtype=torch.long)
        positions = torch.tensor([[length] for length in lengths], dtype=torch.long)
        out = self._forward(ids, mask, positions, self._cache(layers))
        return self._split(layers, out, [longest - length for length in lengths])

    def _cache(self, layers: list[_RoomyLayer]):
        """A transformers Cache on these layers (set after construction: both 4.x and 5.x read `layers`)."""
        cache = self._cache_class()
        cache.layers = layers
        return cache

    @staticmethod
    def _combine(per_row: list[tuple[torch.Tensor, torch.Tensor]], lengths: list[int], longest: int):
        """One layer's (keys, values) of several sequences, left-padded with zeros to `longest`, in
        buffers with ROOM tokens to spare."""
        keys, values = per_row[0]
        shape = (len(per_row), keys.shape[1], longest + ROOM, keys.shape[3])
        batch_keys, batch_values = keys.new_zeros(shape), values.new_zeros(shape)
        for row, (k, v) in enumerate(per_row):
            batch_keys[row, :, longest - lengths[row]:longest] = k[0]
            batch_values[row, :, longest - lengths[row]:longest] = v[0]
        return batch_keys, batch_values

    def _forward(self, ids, mask, positions, cache):
        try:
            return self.lm(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                           position_ids=positions.to(self.device), use_cache=True, logits_to_keep=1,
                           **{self._cache_name: cache})
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise OutOfMemory(f"a generation step of {ids.shape[0]} sequences ran out of memory: {error}") from error

    def _split(self, layers: list[_RoomyLayer], out, padding: list[int]) -> list[RowResult]:
        logits = out.logits[:, -1].float()
        bad = torch.isnan(logits).any(dim=-1).tolist()
        tokens = logits.argmax(dim=-1).tolist()
        batch = _Batch(tuple(layers), len(padding), layers[0].length)
        return [RowResult(None if bad[row] else tokens[row],
                          SequenceCache(tuple((layer.keys[row:row + 1, :, pad:], layer.values[row:row + 1, :, pad:])
                                              for layer in layers), batch, row))
                for row, pad in enumerate(padding)]
