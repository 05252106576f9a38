"""The Trainer's GPU side: D_{v+1} extracted where the weights live, FSDP2 sharding.

Theory of operation
-------------------
On a GPU the fp32 master weights, their bf16 rounding and the last published bf16 weights all
live in device memory. Rather than copying the whole model to the host every step to find the
1-3% that changed, :class:`DeviceDeltaEncoder` does the exact 16-bit comparison on the device,
tensor by tensor, and only the sparse changes cross to the host, where the CPU path's encoder
picks the encoding and segments leave while later tensors are still on the device. The bytes are
identical to the CPU path's for the same weights. In a ``torch.distributed`` group of more than
one process, :func:`shard` wraps the model with FSDP2; each rank keeps its rows of the master,
its AdamW state and the published bf16 weights, extracts there and all-gathers only the sparse
changes, so every rank encodes the same records and produces the same delta bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from aurora.delta import codecs
from aurora.delta.extract import FusedTensor, fused_layout
from aurora.delta.records import DEFAULT_SEGMENT_SIZE, TensorDelta
from aurora.delta.writer import RecordFramer, encode_tensor

LAYER_CLASSES = ("DecoderLayer",)
"""Modules wrapped by ``fully_shard`` on their own: class names ending in one of these (the
decoder blocks of transformers' causal LMs), then the whole model."""


def is_distributed() -> bool:
    """True in a ``torch.distributed`` group of more than one process."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@dataclass(frozen=True)
class Rows:
    """This process's share of one tensor: flat elements ``[start, start + numel)``."""

    start: int
    numel: int
    total: int
    """Elements of the whole tensor."""


def shard_rows(shape: tuple[int, ...], rank: int, world: int) -> Rows:
    """Rank ``rank``'s share of a tensor of ``shape`` sharded on dim 0 over ``world`` ranks as
    FSDP2 shards it (``torch.chunk``: ``ceil(rows / world)`` rows each, the last ones fewer or
    none)."""
    total = math.prod(shape)
    if not shape:
        return Rows(0, total, total) if rank == 0 else Rows(total, 0, total)
    rows = shape[0]
    per_row = total // rows if rows else 0
    chunk = -(-rows // world)
    lo, hi = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
    return Rows(lo * per_row, (hi - lo) * per_row, total)


def local_part(t: torch.Tensor) -> tuple[torch.Tensor, Rows]:
    """This process's part of ``t`` (an FSDP2 ``DTensor`` shard, or the whole of a plain
    tensor) and where it sits in the whole flat tensor."""
    to_local = getattr(t, "to_local", None)
    shape = tuple(t.shape)
    if not callable(to_local):
        n = math.prod(shape)
        return t.detach(), Rows(0, n, n)
    from torch.distributed.tensor import Shard

    mesh = t.device_mesh  # type: ignore[attr-defined]
    placements = tuple(t.placements)  # type: ignore[attr-defined]
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(f"only 1-D Shard(0) FSDP2 sharding is supported, got {placements}")
    local = to_local().detach()
    rows = shard_rows(shape, mesh.get_local_rank(), mesh.size())
    if local.numel() != rows.numel:
        raise ValueError(f"local shard of {rows.numel} elements expected, got {local.numel()}")
    return local, rows


def bf16_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bf16 (round to nearest even) as a flat contiguous ``int16`` tensor on
    its device (a new tensor: never a view of ``t``)."""
    b = t.detach().to(torch.bfloat16)
    if b.data_ptr() == t.data_ptr():
        b = b.clone()
    return b.contiguous().view(torch.int16).reshape(-1)


def local_bf16(t: torch.Tensor) -> torch.Tensor:
    """:func:`bf16_bits` of this process's part of ``t`` (:func:`local_part`)."""
    return bf16_bits(local_part(t)[0])


def full_bf16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bf16 and gathered whole if it is an FSDP shard (a collective), as a
    flat ``int16`` tensor on its device."""
    b = t.detach().to(torch.bfloat16)
    full = getattr(b, "full_tensor", None)
    if callable(full):
        return full().contiguous().view(torch.int16).reshape(-1)
    return bf16_bits(t)


def to_host(t: torch.Tensor) -> np.ndarray:
    """A flat ``int16`` device tensor as a host ``uint16`` array."""
    return t.to("cpu").numpy().view(np.uint16)


def gather_whole(local: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole flat ``int16`` tensor of ``shape`` from every rank's rows ``local`` (a
    collective over the default group; the identity outside one)."""
    if not is_distributed():
        return local
    import torch.distributed as dist

    world = dist.get_world_size()
    most = max(shard_rows(shape, r, world).numel for r in range(world))
    most += most % 2  # gathered as int32 pairs: neither gloo nor NCCL reduces int16
    padded = torch.zeros(most, dtype=torch.int16, device=local.device)
    padded[: local.numel()] = local
    out = [torch.empty(most // 2, dtype=torch.int32, device=local.device) for _ in range(world)]
    dist.all_gather(out, padded.view(torch.int32))
    pieces = [o.view(torch.int16)[: shard_rows(shape, r, world).numel] for r, o in enumerate(out)]
    return torch.cat(pieces)


def _all_gather_rows(packed: torch.Tensor) -> torch.Tensor:
    """Every rank's ``[n_r, 2]`` int64 rows concatenated in rank order (a collective)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    n = torch.tensor([packed.shape[0]], dtype=torch.int64, device=packed.device)
    counts = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(counts, n)
    sizes = [int(c.item()) for c in counts]
    most = max(sizes)
    if most == 0:
        return packed
    padded = torch.zeros((most, 2), dtype=torch.int64, device=packed.device)
    padded[: packed.shape[0]] = packed
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[:s] for o, s in zip(out, sizes, strict=True)])


def changed_on_device(
    tensor: FusedTensor,
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    rows: Mapping[str, Rows] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted int64 indices in the fused index space, new bits, old bits) where the 16-bit
    patterns of ``old`` and ``new`` (flat ``int16``, this process's rows ``rows[name]``; whole
    tensors when ``rows`` is None) differ. Computed on their device; when sharded, each part's
    sparse changes are all-gathered in rank order. Only the sparse arrays come to the host."""
    sharded = rows is not None and is_distributed()
    idxs, news, olds = [], [], []
    for p in tensor.parts:
        o, n = old[p.name], new[p.name]
        if o.shape != n.shape:
            raise ValueError(f"{p.name}: shape changed from {tuple(o.shape)} to {tuple(n.shape)}")
        i = torch.nonzero(o != n).reshape(-1)
        nv, ov = n.index_select(0, i), o.index_select(0, i)
        start = p.offset + (rows[p.name].start if rows is not None else 0)
        if sharded:
            # one collective per part: [global index, new << 16 | old] in rank order
            vals = ((nv.to(torch.int64) & 0xFFFF) << 16) | (ov.to(torch.int64) & 0xFFFF)
            got = _all_gather_rows(torch.stack([i + start, vals], dim=1))
            i, v = got[:, 0], got[:, 1]
            nv, ov, start = (v >> 16).to(torch.int16), (v & 0xFFFF).to(torch.int16), 0
        idxs.append(i + start if start else i)
        news.append(nv)
        olds.append(ov)
    idx = idxs[0] if len(idxs) == 1 else torch.cat(idxs)
    # int32 halves the bytes over PCIe; widened on the host, where the codecs want int64
    small = tensor.numel < 2**31
    host_idx = (idx.to(torch.int32) if small else idx).to("cpu").numpy().astype(np.int64)
    nv = news[0] if len(news) == 1 else torch.cat(news)
    ov = olds[0] if len(olds) == 1 else torch.cat(olds)
    return host_idx, to_host(nv), to_host(ov)


class DeviceDeltaEncoder(RecordFramer):
    """``D_v`` from bf16 weights on a device, extracted there.

    On a GPU the fp32 master weights, their bf16 rounding and the last published bf16 weights all
    live in device memory. Copying the whole model to the host every step to compare it there
    (what the CPU path does, :class:`aurora.delta.DeltaEncoder` on numpy arrays) moves 2 bytes per
    parameter over PCIe, ~16 GB for an 8B model, to find the 1-3% that changed. The
    :class:`DeviceDeltaEncoder` instead does the exact extraction on the device, tensor by tensor:
    round the master to bf16, view both bf16 tensors as ``int16`` and compare the 16-bit patterns
    (``!=``, so +0/-0 and NaN payloads count as the bits they are), ``nonzero`` for the sorted flat
    indices, and ``index_select`` the new and the old bits there. Only those sparse arrays cross to
    the host, where the same :func:`aurora.delta.writer.encode_tensor` as the CPU path picks the
    encoding, and the record is framed and cut into segments before the next tensor is extracted
    (cut-through: the first segment leaves while later tensors are still on the device). The bytes
    are identical to the CPU path's for the same weights (``tests/test_rl_device.py`` checks it on
    CPU tensors). A tensor whose changes are dense enough for a whole-tensor encoding to possibly
    win (:data:`aurora.delta.writer.DENSE_TRY_DENSITY`, or a tensor under 64 Ki elements) also
    needs its whole base on the host; it is copied then, and only then.

    ``old`` maps split names to the published bf16 bits (flat ``int16`` device tensors: this
    process's rows ``rows[name]``, or whole tensors when ``rows`` is None);
    ``new_bits(name)`` returns the new ones the same way, called once per tensor as extraction
    reaches it; ``host_old(name)`` returns a tensor's whole base as host ``uint16`` (asked only
    where a whole-tensor encoding may win; a collective when sharded). After iterating
    :meth:`segments`, :attr:`new` holds every tensor's new bits (what the Trainer commits as its
    published weights).
    """

    def __init__(
        self,
        old: Mapping[str, torch.Tensor],
        new_bits: Callable[[str], torch.Tensor],
        shapes: Mapping[str, tuple[int, ...]],
        *,
        host_old: Callable[[str], np.ndarray],
        model: str,
        version: int,
        base_hash: str,
        rows: Mapping[str, Rows] | None = None,
        codec: str = codecs.DEFAULT_CODEC,
        fuse: bool = True,
        segment_size: int = DEFAULT_SEGMENT_SIZE,
    ) -> None:
        codecs.get(codec)  # unknown codec: fail before any work
        if set(old) != set(shapes):
            raise ValueError(f"old weights and shapes differ: {sorted(set(old) ^ set(shapes))}")
        super().__init__(
            model=model, version=version, base_hash=base_hash, segment_size=segment_size
        )
        self.old, self._new_bits, self._host_old, self.codec = old, new_bits, host_old, codec
        self.rows = rows
        self.layout = fused_layout(dict(shapes), fuse=fuse)
        self.new: dict[str, torch.Tensor] = {}
        self.extract_s = 0.0
        """Seconds spent extracting on the device and copying the sparse result to the host
        (the rest of the publish is encoding and framing on the host)."""

    def _records(self) -> Iterator[TensorDelta]:
        import time

        for t in self.layout:
            t0 = time.perf_counter()
            for p in t.parts:
                self.new[p.name] = self._new_bits(p.name)
            idx, new, old = changed_on_device(t, self.old, self.new, self.rows)
            self.extract_s += time.perf_counter() - t0
            if idx.size == 0:
                continue
            td = encode_tensor(t, idx, new, old, self.codec, self._full(t))
            self.tensors.append(td)
            yield td

    def _full(self, t: FusedTensor) -> Callable[[], np.ndarray]:
        def full() -> np.ndarray:
            flat = [np.asarray(self._host_old(p.name)).reshape(-1) for p in t.parts]
            return flat[0] if len(flat) == 1 else np.concatenate(flat)

        return full


def shard(model: Any) -> Any:
    """Wrap ``model`` with FSDP2 over the default process group (decoder layers first, then
    the root); returns the device mesh. FSDP2 averages gradients over the ranks: the Trainer
    scales each rank's loss by the world size so the average is the sum (a divide factor of 1
    would do the same on NCCL, but gloo has no pre-multiplied sum).

    FSDP2 (:func:`shard`): when the Trainer runs in a ``torch.distributed`` group of more than one
    process (one per GPU, e.g. ``torchrun --nproc-per-node=N``), every decoder layer and then the
    whole model is wrapped with ``torch.distributed.fsdp.fully_shard`` over a 1-D device mesh of the
    group: each rank holds the rows ``[r*c, (r+1)*c)`` (``c = ceil(rows/N)``, ``torch.chunk``'s
    split, :func:`shard_rows`) of every fp32 master tensor and of its AdamW state. The Trainer
    splits one batch's rows over the ranks and weights each row by its share of the whole batch's
    tokens, so the sum of the ranks' gradients is the full batch's; FSDP2 averages, so each rank
    scales its loss by N. Each rank also keeps only its rows of the published bf16 weights, so
    extraction is rank-local: each rank compares its rows, and only the sparse changes (index, new
    and old bits: 16 bytes per change) are all-gathered, part by part in rank order, which is the
    sorted order of the flat index; no rank ever gathers a whole bf16 tensor except a small or
    densely changed one that a dense encoding may need. Every rank then encodes the same records
    and produces the same delta bytes (the encoding is deterministic, so the collectives line up
    on every rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for module in model.modules():
        if type(module).__name__.endswith(LAYER_CLASSES):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh
