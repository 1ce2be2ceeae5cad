"""Parallel sampling (n > 1) as SGLang's tokenizer manager does it: each prompt is first prefilled
once by a request with max_new_tokens 0, which leaves it in the radix cache, then its n samples
run as n ordinary requests that find it there. Results come prompt by prompt, n each."""

from __future__ import annotations

import dataclasses

from sglang_shadowkv.managers.io_struct import GenerateReq


def expand_parallel(reqs: list[GenerateReq]) -> tuple[list[list[int]], list[GenerateReq]]:
    """(the prompts to prefill and cache first, the requests to run). Sample j of a request gets
    rid "<rid>-<j>" when the request had one, and sampling_seed + j when it had a seed, so the
    samples differ but are reproducible."""
    prefixes, runs = [], []
    for req in reqs:
        n = req.sampling.n
        if n == 1:
            runs.append(req)
            continue
        if req.input_ids not in prefixes:
            prefixes.append(req.input_ids)
        seed = req.sampling.sampling_seed
        for j in range(n):
            sampling = dataclasses.replace(req.sampling, n=1,
                                           sampling_seed=None if seed is None else seed + j)
            runs.append(dataclasses.replace(req, sampling=sampling,
                                            rid=None if req.rid is None else f"{req.rid}-{j}"))
    return prefixes, runs
