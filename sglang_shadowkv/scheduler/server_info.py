"""What /get_server_info reports of a scheduler: the model and device, memory and capacity, the
counters, ShadowKV's compressed state, how steps ran (graphs, overlap), and under tensor
parallelism each rank's device, memory and start-up time (every rank runs this together)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import torch

from sglang_shadowkv.mem_cache.memory_plan import documents_that_fit

if TYPE_CHECKING:
    from .scheduler import Scheduler


def server_info(scheduler: "Scheduler") -> dict:
    runner, running = scheduler.runner, scheduler.running
    scheduler.device_timer.collect()  # the device times of the steps finished since the last step
    return {
        "model_path": runner.loaded.model_path,
        "attention": scheduler.args.attention,
        "attention_backend": runner.backend_name,
        "device": str(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "context_length": runner.context_length,
        "tp_size": runner.tp.size,
        "ranks": runner.tp.gather_objects(rank_info(scheduler)),
        "memory": scheduler.cache.memory_stats(running),
        "allocator": allocator_stats(runner.device),
        "capacity": capacity(scheduler),
        "shadowkv": scheduler.cache.shadowkv_stats(running),
        "stats": scheduler.stats,
        "steps": {"overlap": scheduler.overlap, "schedule_policy": scheduler.args.schedule_policy,
                  "chunked_prefill_size": scheduler.chunked_prefill_size, "eager_steps": runner.eager_steps,
                  "clock": scheduler.step_clock.as_dict(),
                  "cuda_graph": None if runner.graphs is None else runner.graphs.stats()},
        "running_requests": len(running),
        "waiting_requests": len(scheduler.prefill.waiting),
        "time": time.time(),
    }


def rank_info(scheduler: "Scheduler") -> dict:
    """This rank's device, what it holds (weights: its share; the KV pool; on a GPU what torch's
    allocator holds in all) and how long it took to start."""
    runner = scheduler.runner
    info = {"rank": runner.tp.rank, "pid": os.getpid(), "device": str(runner.device),
            "weight_bytes": runner.weight_bytes,
            "kv_pool_bytes": runner.pool.capacity * runner.pool.page_size * runner.pool.bytes_per_token,
            "startup_seconds": round(scheduler.startup_seconds, 2)}
    if runner.device.type == "cuda":
        info["reserved_bytes"] = torch.cuda.memory_reserved(runner.device)
    return info


def allocator_stats(device) -> dict:
    """torch's CUDA caching allocator: a retry (memory ran short, cached blocks were freed with a
    device sync, then cudaMalloc again) or a cudaMalloc/cudaFree while serving stalls the step it
    falls in; these counts show whether that happens (empty off a GPU)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"alloc_retries": stats.get("num_alloc_retries", 0), "device_mallocs": stats.get("num_device_alloc", 0),
            "device_frees": stats.get("num_device_free", 0), "ooms": stats.get("num_ooms", 0),
            "reserved_bytes": stats.get("reserved_bytes.all.current", 0),
            "peak_reserved_bytes": stats.get("reserved_bytes.all.peak", 0)}


def capacity(scheduler: "Scheduler") -> dict:
    """How many documents of 16K, 32K and 128K tokens the pool holds at once, dense and (with
    ShadowKV) compressed, and how memory was planned."""
    runner = scheduler.runner
    store, cfg = runner.compressed_pool, runner.shadowkv_config
    pages_for = None if store is None else (
        lambda tokens: store.pages_for(tokens // cfg.chunk_size, cfg.num_outliers(tokens // cfg.chunk_size)))
    fit = documents_that_fit(runner.pool.capacity * scheduler.page_size, pages_for, scheduler.page_size,
                             0 if store is None else store.chunk_capacity)
    return {**fit, "memory_plan": runner.memory_plan.as_dict()}
