"""Reusable host buffers for asynchronous saves (C-ASYNC).

The training loop blocks only while live tensors are copied into these buffers. They are
allocated once (pinned when CUDA is in use, so device-to-host copies run at full speed)
and re-allocated only when a tensor's shape or dtype changes; at most one save is in flight,
so one set of buffers bounds the extra memory to one copy of the state.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

__all__ = ["Snapshotter"]


class Snapshotter:
    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.allocated_bytes = 0

    def _buffer_for(self, key: str, src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            pin = src.device.type == "cuda"
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
            self._buffers[key] = buf
            self.allocated_bytes = sum(b.numel() * b.element_size() for b in self._buffers.values())
        return buf

    def prepare(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Allocate and fault in the buffers for ``tensors`` ahead of the first save.

        Run on the checkpoint thread while the loop trains: the first touch of fresh host
        memory (page faults; pinning on CUDA) can cost more than the copy itself, and it
        would otherwise stall the loop at the first save.
        """
        with torch.no_grad():
            for k, t in tensors.items():
                local = t.to_local() if isinstance(t, DTensor) else t
                if k not in self._buffers:
                    # zero_() faults in pageable memory; on pinned memory it is also the gap
                    # between two cudaHostAllocs in which the loop's CUDA calls get through
                    # (back to back, the allocations starved a GPU loop: 6.8x slower steps
                    # against 1.27x with the gaps; benchmarks/gpu_prepare_overlap.py)
                    self._buffer_for(k, local).zero_()

    def take(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into the buffers; returns ``{key: buffer}`` (DTensors keep their
        placement, with the local shard copied)."""
        out: dict[str, torch.Tensor] = {}
        cuda = False
        with torch.no_grad():
            for k, t in tensors.items():
                local = t.to_local() if isinstance(t, DTensor) else t
                buf = self._buffer_for(k, local)
                buf.copy_(local.detach(), non_blocking=local.device.type == "cuda")
                cuda = cuda or local.device.type == "cuda"
                if isinstance(t, DTensor):
                    out[k] = DTensor.from_local(
                        buf,
                        t.device_mesh,
                        t.placements,
                        run_check=False,
                        shape=t.shape,
                        stride=t.stride(),
                    )
                else:
                    out[k] = buf
        if cuda:
            torch.cuda.synchronize()  # the buffers must hold the values of *this* step
        for k in set(self._buffers) - set(tensors):
            del self._buffers[k]
        return out
