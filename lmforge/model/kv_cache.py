"""The KV cache of incremental decoding, and the protocol the engine and the model use it through.

A cache holds, for every layer, two cached quantities per position and head, ``k`` and ``v``:
a layer's keys and values (``Attention``), or what a family caches in their place (a latent
cache's compressed latent and RoPE key, under one "head", with widths of their own). It is a
set of named tensors, each (layers, batch, heads, capacity, ...), and a cache class says only
which tensors it keeps (``layout``) and how a step's ``k``/``v`` (B, heads, T, width) become
entries of them (``encode``) and back (``decode``); the rest (where a position goes, the ring,
copying rows, joining two batches, counting bytes) is the base class's, written once over the
named tensors:

- ``store(layer, k, v)``: write a step, return what attention reads (``key_times``' order);
- ``key_times(T, device)``, ``wraps(T)``, ``length``, ``capacity``, ``window``, ``batch``, ``dtype``;
- ``select(rows)``, ``merged(other, width, capacity)``, ``recent_columns(n)``: continuous batching;
- ``nbytes()``, ``bytes_per_token()``.

A model makes its own cache (``Transformer.new_kv_cache``, which a family may override), and
every cache is made by ``new_cache``: the storage kind (``KV_CACHE_DTYPES``) picks the class,
so a family's own cached quantities (heads and widths of its choosing) can be stored quantised too.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

KVCacheDtype = Literal["auto", "bf16", "fp16", "fp32", "int8", "int4"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)
KV_CACHE_DTYPE_HELP = ("how the KV cache stores keys and values: auto = the model's dtype; bf16/fp16/fp32; "
                       "int8 = per token and head, symmetric, float32 scale (0.53 of bf16's bytes at head_dim 64); "
                       "int4 = groups of 64 along head_dim, asymmetric, float32 step and minimum (0.31 of bf16's at "
                       "head_dim 64); attention reads them dequantised")
FLOAT_STORAGE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INT4_GROUP = 64  # values per int4 group along a head's width (transformers' QuantizedCacheConfig q_group_size)


def ring_capacity(max_len: int, window: int | None) -> int:
    """Slots a cache for ``max_len`` positions needs: a ring keeps the last ``window`` (the new
    position's window: itself and the ``window - 1`` before it)."""
    return max_len if window is None else min(max_len, window)


def slot_times(length: int, capacity: int, device: torch.device | str) -> torch.Tensor:
    """(capacity,) the time each slot of a ring holds after ``length`` writes (a slot not yet
    written: the time it will hold)."""
    slots = torch.arange(capacity, device=device)
    if length <= capacity:
        return slots
    return (length - 1) - (length - 1 - slots) % capacity


class KVCache:
    """Two cached quantities of every layer, stored as they are (in ``storage``, by default the model's dtype).

    ``tensors`` maps each stored name to its (layers, batch, heads, capacity, ...) tensor;
    ``dtype`` is what attention reads (``decode`` casts to it). ``length`` counts the positions
    written (the time of the next one). When every layer is a sliding one (``window`` set), the
    capacity is at most the window and the cache is a ring: time t lives in slot t mod capacity,
    a slot is overwritten once no query can see it again, and memory stays flat however long
    decoding runs. Attention is order-free over keys, so a one-token step reads the ring in slot
    order; ``key_times`` says which time each key holds.

    A subclass (a quantised cache) overrides ``layout``, ``encode`` and ``decode`` only; its
    constructor is this one, so everything it keeps is in ``tensors``.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, length: int = 0, window: int | None = None,
                 first_layer: int = 0):
        self.tensors, self.dtype, self.length, self.window = tensors, dtype, length, window
        self.first_layer = first_layer  # the layer index of the tensors' first row (an MTP modules' cache: n_layers)

    # ---------------------------------------------------------------- what a cache class defines

    @classmethod
    def layout(cls, widths: tuple[int, int], storage: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        """Each stored tensor's name -> (its last dimension, its element type), for ``k``/``v`` of ``widths``."""
        return {"k": (widths[0], storage), "v": (widths[1], storage)}

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """A step's ``k``, ``v`` (B, heads, T, width) as entries (B, heads, T, ...) of each stored tensor."""
        return {"k": k.to(self.tensors["k"].dtype), "v": v.to(self.tensors["v"].dtype)}

    def decode(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored entries (B, heads, S, ...) back to ``k``, ``v`` (B, heads, S, width) in ``dtype``
        (views of the cache when nothing is converted)."""
        return parts["k"].to(self.dtype), parts["v"].to(self.dtype)

    # ---------------------------------------------------------------- the protocol, written once

    @classmethod
    def empty(cls, *, layers: int, batch: int, heads: int, widths: tuple[int, int], max_len: int, window: int | None,
              dtype: torch.dtype, device: torch.device | str, storage: torch.dtype | None = None,
              first_layer: int = 0) -> KVCache:
        """An unwritten cache of layers ``first_layer`` .. ``first_layer + layers - 1`` for ``max_len`` positions (a ring
        of at most ``window`` slots when ``window`` is set). Uninitialised: attention reads only the positions written so far."""
        capacity = ring_capacity(max_len, window)
        tensors = {name: torch.empty((layers, batch, heads, capacity, last), dtype=kind, device=device)
                   for name, (last, kind) in cls.layout(widths, storage or dtype).items()}
        return cls(tensors, dtype, window=window, first_layer=first_layer)

    def like(self, tensors: dict[str, torch.Tensor], length: int) -> KVCache:
        """A cache of the same class, read dtype, window and layers over other tensors."""
        return type(self)(tensors, self.dtype, length, self.window, self.first_layer)

    @property
    def capacity(self) -> int:
        return next(iter(self.tensors.values())).shape[3]

    @property
    def batch(self) -> int:
        return next(iter(self.tensors.values())).shape[1]

    def nbytes(self) -> int:
        """Bytes the cache holds, every tensor counted."""
        return sum(t.nbytes for t in self.tensors.values())

    def bytes_per_token(self) -> int:
        """Bytes one position of one row costs, over every layer (exact: from the tensors' shapes and element sizes)."""
        return self.nbytes() // (self.batch * self.capacity)

    def wraps(self, T: int) -> bool:
        """Whether a step of ``T`` new positions goes past the capacity (only a ring may)."""
        return self.length + T > self.capacity

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's ``k``/``v`` after the cached ones; return what the step
        attends to, decoded, in ``key_times``' order: every position so far, or on a ring that wraps,
        the slots in slot order (one new position) or the kept ones then the new ones (several)."""
        start, T, C = self.length, k.shape[2], self.capacity
        layer -= self.first_layer
        new = self.encode(k, v)
        if start + T <= C:  # not wrapping
            parts = {name: t[layer, :, :, : start + T] for name, t in self.tensors.items()}
            for name, part in parts.items():
                part[:, :, start:] = new[name]
            return self.decode(parts)
        if self.window is None:
            raise ValueError(f"KV cache holds {C} positions; {start + T} requested")
        if T == 1:
            for name, t in self.tensors.items():
                t[layer, :, :, start % C] = new[name][:, :, 0]
            return self.decode({name: t[layer] for name, t in self.tensors.items()})
        kept = torch.arange(start - min(start, C), start, device=k.device) % C
        parts = {name: torch.cat((t[layer][:, :, kept], new[name]), dim=2) for name, t in self.tensors.items()}
        m = min(T, C)
        slots = torch.arange(start + T - m, start + T, device=k.device) % C
        for name, t in self.tensors.items():
            t[layer][:, :, slots] = new[name][:, :, -m:]
        return self.decode(parts)

    def key_times(self, T: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """The time of each key a step of ``T`` new positions attends to (``store``'s order), and the earliest."""
        start, C = self.length, self.capacity
        if not self.wraps(T):
            return torch.arange(start + T, device=device), 0
        if T == 1:
            return slot_times(start + 1, C, device), start + 1 - C
        first = start - min(start, C)
        return torch.arange(first, start + T, device=device), first

    def recent_columns(self, n: int) -> torch.Tensor:
        """(n,) the columns holding the last ``n`` positions, oldest first."""
        device = next(iter(self.tensors.values())).device
        return torch.arange(self.length - n, self.length, device=device) % self.capacity

    def select(self, rows: torch.Tensor) -> KVCache:
        """A new cache of the rows ``rows`` (a row may repeat), in that order; the columns not yet
        written are not copied (a prompt's prefill copied for its ``n`` samples has most still to come)."""
        written = min(self.length, self.capacity)
        return self.like({name: written_rows(t, rows, written) for name, t in self.tensors.items()}, self.length)

    def merged(self, other: KVCache, width: int, capacity: int) -> KVCache:
        """A new cache of ``capacity`` columns holding this cache's rows then ``other``'s, each one's
        last min(length, capacity, width) positions oldest first, right-aligned to end at column
        ``width`` (its length); zeros elsewhere: padding is masked, and a masked NaN would still poison softmax."""
        tensors = {name: t.new_zeros((t.shape[0], self.batch + other.batch, t.shape[2], capacity, *t.shape[4:]))
                   for name, t in self.tensors.items()}
        start = 0
        for part in (self, other):
            n = min(part.length, part.capacity, width)
            columns = part.recent_columns(n)
            for name, t in tensors.items():
                t[:, start : start + part.batch, :, width - n : width] = part.tensors[name][:, :, :, columns]
            start += part.batch
        return self.like(tensors, width)


def written_rows(cache: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
    """A new (layers, len(rows), heads, capacity, ...) tensor holding the first ``length`` columns of ``rows``."""
    shape = list(cache.shape)
    shape[1] = len(rows)
    out = cache.new_empty(shape)
    with torch.no_grad():  # a cache is never differentiated; out= refuses tensors that require grad
        torch.index_select(cache[:, :, :, :length], 1, rows, out=out[:, :, :, :length])
    return out


def quantise_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dimension: s = max|x| / 127, q = round(x / s) in [-127, 127]
    (int8), s (float32, the last dimension kept as 1); |x - q·s| <= s/2. All-zero x: s = 0, q = 0."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.round(x / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(-127, 127)
    return q.to(torch.int8), scale


def dequantise_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def quantise_int4(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of ``group`` consecutive values of the last dimension: per group
    m = min, s = (max - min) / 15, q = round((x - m) / s) in [0, 15], two per byte (even index in
    the low nibble); returns (packed uint8 (..., width/2), s, m (float32, (..., width/group)));
    |x - (m + q·s)| <= s/2."""
    g = x.float().unflatten(-1, (-1, group))
    low = g.amin(dim=-1, keepdim=True)
    scale = (g.amax(dim=-1, keepdim=True) - low) / 15
    q = torch.round((g - low) / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(0, 15).to(torch.uint8)
    q = q.flatten(-2)
    return q[..., 0::2] | (q[..., 1::2] << 4), scale.squeeze(-1), low.squeeze(-1)


def dequantise_int4(packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)
    g = q.float().unflatten(-1, (scale.shape[-1], -1))
    return (g * scale[..., None] + low[..., None]).flatten(-2).to(dtype)


def int4_group(width: int) -> int:
    """Values per int4 group of a width: ``INT4_GROUP``, or the greatest divisor of both (a narrow head: itself)."""
    if width % 2:
        raise ValueError(f"an int4 KV cache packs two values per byte: a width of {width} is odd")
    return math.gcd(width, INT4_GROUP)


class Int8KVCache(KVCache):
    """Keys and values in int8, symmetric, one float32 scale per position and head (``quantise_int8``):
    width + 4 bytes per head and position for each of k and v, against 2·width in bf16. Quantised
    as each position is written, dequantised to ``dtype`` as attention reads it (every position,
    the step's own included), so prefill and decoding see the same rounded keys and values. Each
    element is within half a step (s/2, s = max|x| / 127 of its head) of the model's."""

    @classmethod
    def layout(cls, widths: tuple[int, int], storage: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        return {"k": (widths[0], torch.int8), "k_scale": (1, torch.float32),
                "v": (widths[1], torch.int8), "v_scale": (1, torch.float32)}

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        (kq, ks), (vq, vs) = quantise_int8(k), quantise_int8(v)
        return {"k": kq, "k_scale": ks, "v": vq, "v_scale": vs}

    def decode(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return (dequantise_int8(parts["k"], parts["k_scale"], self.dtype),
                dequantise_int8(parts["v"], parts["v_scale"], self.dtype))


class Int4KVCache(KVCache):
    """Keys and values in int4, asymmetric, grouped along the head's width (``quantise_int4``: groups
    of ``INT4_GROUP`` = 64 values, or the whole head when narrower), each group's step and minimum
    in float32: width/2 + 8·width/group bytes per head and position for each of k and v. This is
    transformers' quanto ``QuantizedCache`` grouping (axis 0: min/max of each run of
    ``q_group_size`` values along head_dim) without its full-precision window of recent tokens:
    every position is quantised as it is written, and read back dequantised to ``dtype`` (KIVI
    groups keys per channel across tokens instead, which needs such a window). Each element is
    within half its group's step, s/2 with s = (max - min) / 15."""

    @classmethod
    def layout(cls, widths: tuple[int, int], storage: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        out = {}
        for name, width in zip(("k", "v"), widths):
            groups = width // int4_group(width)
            out |= {name: (width // 2, torch.uint8), f"{name}_scale": (groups, torch.float32),
                    f"{name}_min": (groups, torch.float32)}
        return out

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, x in (("k", k), ("v", v)):
            packed, scale, low = quantise_int4(x, int4_group(x.shape[-1]))
            out |= {name: packed, f"{name}_scale": scale, f"{name}_min": low}
        return out

    def decode(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(dequantise_int4(parts[n], parts[f"{n}_scale"], parts[f"{n}_min"], self.dtype) for n in ("k", "v"))


CACHE_CLASSES: dict[str, type[KVCache]] = {"int8": Int8KVCache, "int4": Int4KVCache}


def new_cache(kind: str, *, layers: int | range, batch: int, heads: int, widths: tuple[int, int], max_len: int,
              window: int | None, dtype: torch.dtype, device: torch.device | str) -> KVCache:
    """The cache of storage ``kind`` (``KV_CACHE_DTYPES``: ``auto`` stores in ``dtype``, the model's)
    for ``layers`` layers (a count from layer 0, or a range of layer indices) of ``heads`` heads caching
    ``widths`` values each per position; attention reads ``dtype``."""
    layers = range(layers) if isinstance(layers, int) else layers
    if kind not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {kind!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    cls = CACHE_CLASSES.get(kind, KVCache)
    storage = FLOAT_STORAGE.get(kind, dtype)
    return cls.empty(layers=len(layers), batch=batch, heads=heads, widths=widths, max_len=max_len, window=window,
                     dtype=dtype, device=device, storage=storage, first_layer=layers.start)
