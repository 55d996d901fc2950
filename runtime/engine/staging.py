"""Host-to-device copies of a step's metadata (input ids, positions, slot mapping, tables).

On CUDA the arrays go through one pinned host arena reused across steps, so every copy is a
truly asynchronous DMA (a `non_blocking` copy from pageable memory is synchronous) and no step
pins fresh memory. The arena is rewound at the start of each step after waiting for the last
step's copies (a CUDA event), and grows by doubling when a step needs more; a grown-out arena
stays alive until its copies are done. On the CPU the arrays are wrapped without a copy.
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 64  # bytes; keeps every view aligned for any dtype


class HostStaging:
    def __init__(
        self,
        device: torch.device,
        *,
        use_arena: bool | None = None,
        initial_bytes: int = 1 << 20,
    ) -> None:
        self.device = device
        self.use_arena = device.type == "cuda" if use_arena is None else use_arena
        self._pin = self.use_arena and device.type == "cuda"
        self._arena = self._alloc(initial_bytes) if self.use_arena else None
        self._retired: list[torch.Tensor] = []
        self._offset = 0
        self._event = torch.cuda.Event() if self._pin else None
        self._recorded = False

    @property
    def capacity(self) -> int:
        return 0 if self._arena is None else self._arena.numel()

    def _alloc(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self._pin)

    def begin_step(self) -> None:
        """Rewind the arena; the last step's copies must have left it first."""
        if self._event is not None and self._recorded:
            self._event.synchronize()
        self._retired.clear()
        self._offset = 0

    def put(self, array: np.ndarray) -> torch.Tensor:
        """`array` on the device (through the arena on CUDA)."""
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self._arena is None:
            return host.to(self.device, non_blocking=True)
        num_bytes = host.numel() * host.element_size()
        if self._offset + num_bytes > self._arena.numel():
            self._retired.append(self._arena)
            self._arena = self._alloc(max(2 * self._arena.numel(), self._offset + num_bytes))
            self._offset = 0
        staged = self._arena[self._offset : self._offset + num_bytes].view(host.dtype)
        staged = staged.view(host.shape)
        staged.copy_(host)
        self._offset += -(-num_bytes // ALIGN) * ALIGN
        out = staged.to(self.device, non_blocking=True)
        if self._event is not None:
            self._event.record()
            self._recorded = True
        return out
