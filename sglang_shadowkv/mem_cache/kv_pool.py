"""Dense paged KV pool and the request-to-token table.

Pages hold `page_size` consecutive tokens of one request; token i of a request lives in slot
pages[i // page_size] * page_size + i % page_size. Every request's KV layout is therefore a page
list, which is what FlashInfer's paged kernels and the page-aligned radix cache both want.
Page 0 is never handed out: its slots are the padding target for unused table entries.

Free pages may be lent to a cache that can give them back at once (ShadowKV's GPU copies of
compressed values): lent pages count as free, and an allocation that needs them first asks the
`reclaim` hook to give enough back, so callers never see the loan.
"""

from __future__ import annotations

from typing import Callable

import torch


class PoolExhaustedError(RuntimeError):
    """Raised when a page allocation cannot be satisfied even after eviction."""


class PagedKVPool:
    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self.lent = 0  # pages lent out (lend), counted as free
        self.reclaim: Callable[[int], None] | None = None  # gives back at least n lent pages (give_back)
        # run before a step writes (then reads) a layer's KV: each waits for the pages its loads are
        # still copying into that layer (the host tier's, host_kv_pool.py; exact copies', copy_loads.py)
        self.before_layer: list[Callable[[int], None]] = []

    @property
    def capacity(self) -> int:
        """Pages that can ever be allocated (all but the reserved page 0)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: the unused and the lent."""
        return len(self._free) + self.lent

    @property
    def num_unused(self) -> int:
        """Free pages that are not lent."""
        return len(self._free)

    @property
    def bytes_per_token(self) -> int:
        k = self.k_buffers[0]
        return 2 * len(self.k_buffers) * k.shape[1] * k.shape[2] * k.element_size()

    def free_ids(self) -> list[int]:
        """The free page ids (a copy; for accounting checks)."""
        return list(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n free page ids, or None (nothing taken) when fewer are free; lent pages are reclaimed
        when the unused ones are too few."""
        if n > self.num_free:
            return None
        if n > len(self._free):
            self.reclaim(n - len(self._free))
        return self._take(n)

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def lend(self, n: int) -> list[int] | None:
        """n unused pages for a cache that gives them back on demand (None when fewer are unused)."""
        if n > len(self._free) or self.reclaim is None:
            return None
        self.lent += n
        return self._take(n)

    def give_back(self, pages: list[int]) -> None:
        """Lent pages returned."""
        self.lent -= len(pages)
        self._free.extend(pages)

    def _take(self, n: int) -> list[int]:
        taken = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        return taken[::-1]

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for wait in self.before_layer:
            wait(layer)
        self.k_buffers[layer][slots] = k
        self.v_buffers[layer][slots] = v

    def slots_of_pages(self, pages: list[int], num_tokens: int) -> torch.Tensor:
        """Token slots of the first num_tokens tokens laid out on `pages`."""
        p = torch.tensor(pages, dtype=torch.int64)
        slots = (p[:, None] * self.page_size + torch.arange(self.page_size)).flatten()
        return slots[:num_tokens]


class LayerLoads:
    """The ready event per layer of the last load a side stream queued into a pool's pages, for
    the pool's before_layer hook: a step's layer waits for its own layer's pages only, so the first
    layers compute while the last still cross PCIe (loads on one stream run in order: the last
    load's event of a layer comes after every earlier load)."""

    def __init__(self, pool: PagedKVPool):
        self.device, self._ready = pool.device, None
        pool.before_layer.append(self.wait)

    def loaded(self, events: list) -> None:
        """A load queued these per-layer events (none: it ran synchronously, off a GPU)."""
        if events:
            self._ready = events

    def wait(self, layer: int) -> None:
        """The current stream waits for the last load's pages of this layer (a no-op once they are
        known to be there)."""
        ready = self._ready
        if ready is None or torch.cuda.is_current_stream_capturing():  # (a graph never reads a loading page)
            return
        torch.cuda.current_stream(self.device).wait_event(ready[layer])
        if layer == len(ready) - 1 and ready[-1].query():
            self._ready = None


class ReqToTokenPool:
    """Rows of token slots, one row per running request (the page table at token granularity).

    One extra row, `padding_row`, is never handed out: its slots are all 0 (page 0's first slot),
    so a padded batch entry (a CUDA-graph batch filled up to its captured size) reads and writes
    only the reserved page.
    """

    def __init__(self, max_requests: int, max_context: int, device: torch.device | str):
        self.table = torch.zeros((max_requests + 1, max_context), dtype=torch.int32, device=device)
        self.padding_row = max_requests
        self._free = list(range(max_requests - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[int]:
        """The free rows (a copy; for accounting checks)."""
        return list(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        self._free.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.table[row, start:start + slots.numel()] = to_device(slots.to(torch.int32), self.table.device)

    def span_slots(self, rows: list[int], starts: list[int], ends: list[int]) -> torch.Tensor:
        """Slots [sum(ends - starts)] int32 of tokens starts[i]..ends[i]-1 of each row, concatenated.

        One gather on the device for the whole batch (the per-request slices it replaces cost a
        kernel launch each), and no host sync: the output size is known here.
        """
        lens = [end - start for start, end in zip(starts, ends)]
        total = sum(lens)
        meta = to_device(torch.tensor([rows, starts, lens], dtype=torch.int64), self.table.device)
        rows_t, starts_t, lens_t = meta
        first = torch.cumsum(lens_t, 0) - lens_t  # where each span begins in the output
        row_of = torch.repeat_interleave(rows_t, lens_t, output_size=total)
        shift = torch.repeat_interleave(first - starts_t, lens_t, output_size=total)
        column = torch.arange(total, device=self.table.device) - shift
        return self.table[row_of, column]


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor to the device without waiting for the device: through page-locked
    memory on a GPU (torch's host allocator keeps the buffer until the copy has run)."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)
