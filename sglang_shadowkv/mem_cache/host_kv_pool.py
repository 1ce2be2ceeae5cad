"""The host tier of dense KV (SGLang's HiCache): pages evicted from the GPU pool go to page-locked
host memory instead of being dropped, and a prefix match on them loads them back.

The pool holds whole pages, laid out like the GPU pool's ([pages, page_size x Hkv x D] per layer,
K and V), so a page moves in one block (kernels/copy_pages.py). A radix-tree entry of a page held
here is a HostPage. Copies run on two side streams, each after the work the compute stream
queued before it: stores and backups (GPU -> host) on one, loads (host -> GPU) on the other, so
that neither waits for the other's queue (PCIe carries both directions at once):
- a store reads pages whose K/V the compute stream wrote, and the compute stream waits for that
  copy (only) before it reuses the pages;
- a load runs layer by layer; each layer's pages are ready at its event, and the GPU pool's
  `before_layer` hook makes the forward pass wait for that layer only (kv_pool.LayerLoads: the
  first layers compute while the last ones still cross PCIe);
- a copy that touches a page (host or GPU) that a copy on the other stream still reads or writes
  waits for that copy first (`CopyFences`).
With one stream for both, a store queued after the step's loads made the compute stream wait for
all of them before the step began (in ShadowKV mode documents move to the host after the step's
admissions), and a step's loads queued behind the backups of the step before.
Write policies (SGLang's names): `write_back` copies a page when it is evicted from the GPU;
`write_through` copies each page when the radix tree takes it (a backup, kept while the page stays
in the tree), so an eviction moves no data, and a loaded page keeps its host copy as its backup.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from sglang_shadowkv.kernels.copy_pages import copy_pages, copy_pages_reference

from .host_memory import PinnedHostTensor
from .kv_pool import LayerLoads, PagedKVPool, to_device



class HostEntry:
    """A radix-tree entry held in host memory, not on the GPU: eviction of GPU memory passes it
    by, and the host tier's own eviction drops it."""
    __slots__ = ()


def on_host(entry) -> bool:
    return isinstance(entry, HostEntry)


class HostPage(HostEntry):
    """A radix-tree entry: one page of dense KV held in the host tier, page `id` of its pool."""
    __slots__ = ("id",)

    def __init__(self, page_id: int):
        self.id = page_id

    def __repr__(self) -> str:
        return f"HostPage({self.id})"


@dataclass
class HostTierCounters:
    """The host tier's (server_info "stats", Prometheus)."""
    host_hit_tokens: int = 0  # prompt tokens a request found in the host tier (loaded, not prefilled)
    host_loaded_bytes: int = 0
    host_load_ms: int = 0  # host time spent issuing loads (on a GPU the copies themselves overlap the forward)
    host_stored_bytes: int = 0
    host_evicted_tokens: int = 0  # tokens dropped from the host tier or flushed (a prefill to get them back)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def restore(self, snapshot: dict[str, int]) -> None:
        self.__dict__.update(snapshot)


class CopyFences:
    """The last queued copy that touched each page of one pool (the event it ends at): a copy on
    the other stream that touches one of those pages again, or the compute stream before it
    reuses them, waits for that event. Events in one stream complete in order, so the last one
    stands for every earlier copy of the page on its stream."""

    def __init__(self):
        self._last: dict[int, object] = {}

    def mark(self, pages: list[int], event) -> None:
        for p in pages:
            self._last[p] = event

    def pending(self, pages: list[int]) -> list:
        """The distinct events of copies of these pages not done yet."""
        events = {id(ev): ev for p in pages if (ev := self._last.get(p)) is not None}
        return [ev for ev in events.values() if not ev.query()]


class HostKVPool:
    def __init__(self, gpu_pool: PagedKVPool, num_pages: int, write_policy: str = "write_through"):
        if num_pages < 1:
            raise ValueError(f"the host tier needs at least one page, got {num_pages}")
        self.gpu_pool, self.write_policy, self.num_pages = gpu_pool, write_policy, num_pages
        k = gpu_pool.k_buffers[0]
        self.page_numel = gpu_pool.page_size * k.shape[1] * k.shape[2]
        self.bytes_per_page = 2 * len(gpu_pool.k_buffers) * self.page_numel * k.element_size()
        self.on_gpu = gpu_pool.device.type == "cuda"
        shape = (2, len(gpu_pool.k_buffers), num_pages, self.page_numel)
        self._memory = PinnedHostTensor(shape, k.dtype) if self.on_gpu else None
        self.buffers = self._memory.tensor if self.on_gpu else torch.zeros(shape, dtype=k.dtype)
        self._free = list(range(num_pages - 1, -1, -1))
        self.backups: dict[int, int] = {}  # write_through: GPU page -> its host copy
        self.counters = HostTierCounters()
        self._store_stream = torch.cuda.Stream(gpu_pool.device) if self.on_gpu else None
        self._load_stream = torch.cuda.Stream(gpu_pool.device) if self.on_gpu else None
        self._host_fences, self._gpu_fences = CopyFences(), CopyFences()
        self._layer_ready = LayerLoads(gpu_pool)

    # ---- pages --------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[int]:
        """The free host pages (a copy; for accounting checks)."""
        return list(self._free)

    def shortfall(self, gpu_pages: list[int]) -> int:
        """Host pages that storing these GPU pages lacks beyond the free ones and the backups (a
        page's own backup becomes its host copy; another page's can be dropped at no loss, since
        that page is still on the GPU): what making room for them must push out."""
        return len(gpu_pages) - len(self._free) - len(self.backups)

    def drop_backups_for(self, gpu_pages: list[int]) -> int:
        """Drop backups of other GPU pages, newest first, until the free host pages can take these
        pages; returns how many are still missing (what the tree must push out). A backup only
        spares its page a copy when it leaves the GPU, and the oldest are the ones whose pages
        leave first, while dropping a host-only document costs its prefill: in ShadowKV mode on
        the H100 (many_16k) backups of documents still on the GPU took the host tier's room and
        128K tokens of documents held only there were pushed out."""
        keep = set(gpu_pages)
        missing = sum(p not in self.backups for p in gpu_pages) - len(self._free)
        dropped = []
        for page in reversed(self.backups):
            if len(dropped) >= missing:
                break
            if page not in keep:
                dropped.append(page)
        self.free([self.backups.pop(p) for p in dropped])
        return max(0, missing - len(dropped))

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        return taken[::-1]

    def free(self, ids: list[int]) -> None:
        self._free.extend(ids)

    def release_entries(self, entries: list) -> list:
        """Free the host pages among tree entries, and the backups of the GPU pages among them
        (those leave the tree); returns the other entries, for their own owners."""
        host = [e.id for e in entries if type(e) is HostPage]
        self.counters.host_evicted_tokens += len(host) * self.gpu_pool.page_size
        self.free(host + [self.backups.pop(e) for e in entries if type(e) is int and e in self.backups])
        return [e for e in entries if type(e) is not HostPage]

    # ---- moving pages -------------------------------------------------------------------------
    def backup(self, gpu_pages: list[int]) -> None:
        """write_through: copy the pages the tree just took that have no host copy yet (as far as
        free host pages go: a page without one is copied when it is evicted)."""
        todo = [p for p in gpu_pages if p not in self.backups][:len(self._free)]
        if todo:
            host = self.alloc(len(todo))
            self._copy_to_host(todo, host)
            self.backups.update(zip(todo, host))

    def store(self, gpu_pages: list[int]) -> list[HostPage] | None:
        """The host entries of GPU pages leaving the GPU (None: too few free host pages). Pages
        with a backup move no data; the compute stream waits for the copies that still read any
        of these pages (theirs, and a backup's not run yet) before it reuses them."""
        todo = [p for p in gpu_pages if p not in self.backups]
        if len(todo) > len(self._free):
            return None
        host = dict(zip(todo, self.alloc(len(todo)) or []))
        if todo:
            self._copy_to_host(todo, [host[p] for p in todo])
        if self.on_gpu:
            compute = torch.cuda.current_stream(self.gpu_pool.device)
            for event in self._gpu_fences.pending(gpu_pages):
                compute.wait_event(event)
        for p in gpu_pages:
            if p in self.backups:
                host[p] = self.backups.pop(p)
        return [HostPage(host[p]) for p in gpu_pages]

    def load(self, entries: list[HostPage], gpu_pages: list[int], keep_copies: bool = True) -> None:
        """Copy host pages back into (just allocated) GPU pages, layer by layer. With write_through
        each keeps its host copy as the backup of its new GPU page (keep_copies: pages of the
        radix tree's dense KV); else the host page is freed."""
        started = time.perf_counter()
        host = [e.id for e in entries]
        self._copy(host, gpu_pages, to_host=False)
        if self.write_policy == "write_through" and keep_copies:
            self.backups.update(zip(gpu_pages, host))
        else:
            self.free(host)  # a store that reuses one waits for this load first (CopyFences)
        self.counters.host_loaded_bytes += len(host) * self.bytes_per_page
        self.counters.host_load_ms += round(1000 * (time.perf_counter() - started))

    def _copy_to_host(self, gpu_pages: list[int], host: list[int]) -> None:
        self._copy(gpu_pages, host, to_host=True)
        self.counters.host_stored_bytes += len(host) * self.bytes_per_page

    def _copy(self, src_pages: list[int], dst_pages: list[int], to_host: bool) -> None:
        """Every layer's K and V pages from one pool to the other; loads record a ready event per
        layer. A copy waits for the compute stream first (a store reads pages it wrote, a load
        writes pages it may have used before they were freed), and for the other stream's copies
        of the same pages (a load reads a host page a store may still write; a store may write a
        host page a load still reads, freed by it or as a dropped backup). The page lists are made
        on the compute stream and read on the copy's: they are kept from reuse until the copy has
        run (without that, the compute stream's next allocation took their memory while the copy
        still read it: an illegal address on the H100, 64K documents, gone under
        CUDA_LAUNCH_BLOCKING)."""
        gpu = self.gpu_pool
        pages = [to_device(torch.tensor(p, dtype=torch.int64), gpu.device) for p in (src_pages, dst_pages)]
        stream = self._store_stream if to_host else self._load_stream
        gpu_pages, host_pages = (src_pages, dst_pages) if to_host else (dst_pages, src_pages)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(gpu.device))
            for event in self._gpu_fences.pending(gpu_pages) + self._host_fences.pending(host_pages):
                stream.wait_event(event)
            for p in pages:
                p.record_stream(stream)
        events = []
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for layer, gpu_buffers in enumerate(zip(gpu.k_buffers, gpu.v_buffers)):
                for side, buffer in enumerate(gpu_buffers):
                    gpu_view, host_view = buffer.view(-1, self.page_numel), self.buffers[side, layer]
                    src, dst = (gpu_view, host_view) if to_host else (host_view, gpu_view)
                    (copy_pages if self.on_gpu else copy_pages_reference)(src, pages[0], dst, pages[1])
                if stream is not None and not to_host:
                    events.append(torch.cuda.Event())
                    events[-1].record(stream)
        if stream is not None:
            if events:  # a load: its last layer's event
                done = events[-1]
            else:
                done = torch.cuda.Event()
                done.record(stream)
            self._gpu_fences.mark(gpu_pages, done)
            self._host_fences.mark(host_pages, done)
        self._layer_ready.loaded(events)

    def wait_loads(self) -> None:
        """The compute stream waits for every load queued so far, all layers (what a CUDA graph
        reads cannot wait layer by layer: a parked compressed segment brought back)."""
        if self._load_stream is not None:
            torch.cuda.current_stream(self.gpu_pool.device).wait_stream(self._load_stream)

