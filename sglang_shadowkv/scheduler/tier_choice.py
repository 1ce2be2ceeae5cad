"""Where a long document's KV sits in ShadowKV mode, chosen per document by cost from measured
rates (DESIGN.md §3, the hierarchy). A document is a dense span of the radix cache of at least
--shadowkv-min-context tokens; it may sit
- dense on the GPU: exact, the fastest hit; a decode row reads all of it each step;
- dense in the host tier (--enable-hierarchical-cache): exact, takes no GPU memory, and its next
  hit pays a reload over PCIe;
- compressed: low-rank keys, landmarks and outliers on the GPU, values in host memory: no reload,
  and a decode row reads a fixed budget of chunks instead of the whole document; approximate.

The rule, in the units the scheduler measures (`Rates`):
- Under memory pressure the least recently used long dense document must leave the GPU
  (`leave_gpu`). It goes to the host tier when its next hit costs less reloaded than compressed:
  reload + the answer's decode steps reading it dense, against compression (a share of its
  prefill time) + the same steps as a sparse row. So a short document, or short answers, go to the
  host; a long one read by many decode steps is compressed. It is compressed also when there is no
  host tier or the host tier cannot take it. A host tier without free room for it takes it by
  pushing its least recently used documents out, which a later hit must prefill again: the move is
  charged their prefill. On the H100 (many_16k, 40 documents of 16K, where ShadowKV's pinned values
  leave the host tier smaller than full attention's) the rule without that charge sent 56
  documents to a full host tier, 267K tokens were pushed out and prefilled again, and the run was
  0.86x of full attention with the host tier.
- A sparse row's cost includes its share of the sparse path, which a step runs once for all its
  sparse rows (`sparse_row_cost`): a few sparse rows beside many dense ones pay it almost alone.
  On the H100 (many_16k: 16K documents, 32-token answers) a sparse row cost 0.39 ms against 1.16
  ms dense, but the path 6.8 ms a step: compressing documents a few rows read made the steps
  slower.
- Without pressure a dense document that running decode rows read is compressed when sparse
  decode pays (`decode_pays`): over the rows' remaining decode steps, what the dense step spends
  reading it, less what a sparse row costs, exceeds the one-off compression. The rows then decode
  sparse over it.
Each choice is counted by its reason (the names below), in server_info's ShadowKV section.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# the reasons (counters of server_info's "shadowkv" section and of Prometheus)
TO_HOST = "to_host_reload_cheaper"  # under pressure: reloaded from the host costs less than compressed
COMPRESSED_NO_ROOM = "compressed_no_room"  # under pressure, no host tier or the host tier cannot take it
COMPRESSED_SPARSE_CHEAPER = "compressed_sparse_cheaper"  # under pressure: compressed costs less than a reload
COMPRESSED_DECODE_PAYS = "compressed_decode_pays"  # no pressure: its decode rows save more than compressing costs
REASONS = (TO_HOST, COMPRESSED_NO_ROOM, COMPRESSED_SPARSE_CHEAPER, COMPRESSED_DECODE_PAYS)

# priors until measured: DESIGN.md §6 (the lent H100) and issue 53 (the 8B shape)
HBM_BYTES_PER_S = 3.0e12
PCIE_BYTES_PER_S = 53e9  # pinned host to GPU; also the ceiling of a measurement (below)
PREFILL_TOKENS_PER_S = 23_000.0  # 16K tokens of the 8B shape in about 0.7 s
SPARSE_ROW_TOKENS = 16384  # a sparse row costs about a dense row's read of 16K tokens (issue 53: 0.8 ms)
# a step with any sparse row runs the sparse path's kernels (scores, selection, rebuild, gather,
# attention) once: on the H100 a layer of them took 0.11-0.20 ms for one row of 32K or 128K
# (bench_kernels_decode_layer_h100.json), about a dense read of 100K tokens; in the server's steps
# the fit measured 6.8 ms (many_16k, H100). Without this term 2-3 rows of a 32K document with
# 64-token answers looked worth compressing (H200, shared_32k): the steps got no faster and the run
# was 0.945x of full attention
SPARSE_STEP_TOKENS = 98304
ANSWER_TOKENS = 128.0  # decode steps of a hit's answer
# compressing a document costs this share of its prefill: measured on the H100 (8B shape), 6-11% for
# one cold document alone (cold_and_hit.py, 16K and 32K) and about 19% in the steps of a busy
# server (chat_16k's step clock). At 0.05 a 16K document under pressure with short answers was
# compressed rather than reloaded (40 ms over PCIe against 36 ms), and many_16k ran 0.93x of full
# attention with the host tier
COMPRESSION_SHARE = 0.1
ALPHA = 0.05  # weight of the newest measurement in a moving average (the prior counts as one at first)
FIT_DECAY = 0.01  # the decode fit forgets a step's weight at this rate a step (a memory of ~100 steps)
PRIOR_STEPS = 0.5  # the decode fit's priors weigh as much as this many average steps
MIN_FACTOR = 1e-3  # a fitted decode cost stays above this share of its prior (never zero or negative)


@dataclass
class Average:
    """An exponential moving average that starts at a prior counted as one measurement."""
    value: float
    count: int = 0

    def add(self, x: float) -> None:
        self.count += 1
        self.value += max(ALPHA, 1.0 / (self.count + 1)) * (x - self.value)


class DecodeFit:
    """A decode-only step's seconds = base + dense tokens its rows read x seconds per token + sparse
    rows x seconds per sparse row + (any sparse row) x the sparse path's seconds a step: least
    squares over recent steps (older steps' weight decays by FIT_DECAY a step), pulled toward the
    priors as if PRIOR_STEPS steps had agreed with them. Solved for each term's factor over its
    prior, so the pull is scale-free; a term no step has had keeps its prior, but the sparse terms
    stay a dense read's worth as measured (on a CPU, or a model unlike the priors' 8B shape, the
    priors' scale means nothing). A step's rows are not timed apart, so only a fit separates a
    row's read from the step's fixed cost (the weights)."""

    def __init__(self, prior: tuple[float, float, float, float]):
        self.prior = torch.tensor(prior, dtype=torch.float64)
        self.gram = torch.zeros(4, 4, dtype=torch.float64)
        self.moment = torch.zeros(4, dtype=torch.float64)
        self.weight = 0.0
        self.coefficients = list(prior)

    def add(self, seconds: float, dense_tokens: int, sparse_rows: int) -> None:
        # each term's seconds by its prior
        z = self.prior * torch.tensor([1.0, dense_tokens, sparse_rows, sparse_rows > 0], dtype=torch.float64)
        self.gram.mul_(1 - FIT_DECAY).add_(torch.outer(z, z))
        self.moment.mul_(1 - FIT_DECAY).add_(z * seconds)
        self.weight = self.weight * (1 - FIT_DECAY) + 1
        seen = (self.gram.diagonal() > 0).nonzero().flatten()
        gram, moment = self.gram[seen][:, seen], self.moment[seen]
        ridge = PRIOR_STEPS * gram.diagonal() / self.weight
        factors = torch.ones(4, dtype=torch.float64)
        factors[seen] = torch.linalg.solve(gram + torch.diag(ridge), moment + ridge)
        if not self.gram[2, 2]:  # no sparse row yet: SPARSE_ROW_TOKENS and SPARSE_STEP_TOKENS dense
            factors[2:] = factors[1]  # tokens' worth, as measured
        self.coefficients = (self.prior * factors.clamp_min(MIN_FACTOR)).tolist()


@dataclass
class Rates:
    """What the scheduler measures, as the rule reads it (priors until measured): prefill tokens a
    second (pure prefill steps), host-to-GPU bytes a second (the host tier's loads), tokens an
    answer decodes (finished requests), and the decode fit (decode-only steps)."""
    kv_bytes_per_token: int
    decode: DecodeFit
    prefill: Average = field(default_factory=lambda: Average(PREFILL_TOKENS_PER_S))
    pcie_bytes_per_s: float = PCIE_BYTES_PER_S
    answer: Average = field(default_factory=lambda: Average(ANSWER_TOKENS))

    @classmethod
    def priors(cls, kv_bytes_per_token: int, weight_bytes: int) -> "Rates":
        """A model's priors: a decode step reads its weights, a dense row its context's KV, a
        sparse row SPARSE_ROW_TOKENS tokens' worth and the sparse path SPARSE_STEP_TOKENS, at HBM
        speed."""
        per_token = kv_bytes_per_token / HBM_BYTES_PER_S
        prior = (weight_bytes / HBM_BYTES_PER_S, per_token, SPARSE_ROW_TOKENS * per_token,
                 SPARSE_STEP_TOKENS * per_token)
        return cls(kv_bytes_per_token, DecodeFit(prior))

    def agreed(self, tp) -> "Rates":
        """Rank 0's rates, on every rank: under tensor parallelism each rank times its own steps,
        but every rank must take the same decisions (DESIGN.md §3)."""
        return self if tp.size == 1 else tp.gather_objects(self)[0]

    # ---- measurements --------------------------------------------------------------------------
    def observe_prefill(self, seconds: float, tokens: int) -> None:
        if seconds > 0 and tokens:
            self.prefill.add(tokens / seconds)

    def observe_decode(self, seconds: float, dense_tokens: int, sparse_rows: int) -> None:
        self.decode.add(seconds, dense_tokens, sparse_rows)

    def observe_host_loads(self, loaded_bytes: int, load_ms: int) -> None:
        """The host tier's totals so far. Capped at the prior: on a GPU the copies overlap the
        forward pass and load_ms is the time spent issuing them, so a faster reading is no link's.
        Nothing loaded yet reads as no measurement (a zero rate would divide by zero in reload_s)."""
        if load_ms > 0 and loaded_bytes > 0:
            self.pcie_bytes_per_s = min(PCIE_BYTES_PER_S, 1000 * loaded_bytes / load_ms)

    def observe_answer(self, tokens: int) -> None:
        self.answer.add(tokens)

    # ---- costs in seconds ----------------------------------------------------------------------
    def dense_row_s(self, tokens: int) -> float:
        """What one decode step of one row spends reading `tokens` tokens of dense KV."""
        return tokens * self.decode.coefficients[1]

    @property
    def sparse_row_s(self) -> float:
        """What one decode step of one row over a compressed document spends on it."""
        return self.decode.coefficients[2]

    @property
    def sparse_step_s(self) -> float:
        """What a decode step with any sparse row spends running the sparse path at all."""
        return self.decode.coefficients[3]

    def reload_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.pcie_bytes_per_s

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill.value

    def compression_s(self, tokens: int) -> float:
        return COMPRESSION_SHARE * self.prefill_s(tokens)

    def as_dict(self) -> dict[str, float]:
        """server_info's view: the rates and the decode fit's terms."""
        base, per_token, sparse_row, sparse_step = self.decode.coefficients
        return {"prefill_tokens_per_s": self.prefill.value, "pcie_bytes_per_s": self.pcie_bytes_per_s,
                "answer_tokens": self.answer.value, "decode_base_s": base,
                "dense_row_s_per_token": per_token, "sparse_row_s": sparse_row, "sparse_step_s": sparse_step}


# ---- the rule ------------------------------------------------------------------------------------
def sparse_row_cost(rates: Rates, sparse_rows: int) -> float:
    """A sparse row's seconds a step when `sparse_rows` rows decode sparse (itself included): its
    own, and its share of the sparse path the step runs once for all of them."""
    return rates.sparse_row_s + rates.sparse_step_s / max(1, sparse_rows)


def leave_gpu(tokens: int, rates: Rates, host_tier: bool, sparse_running: int, displaced: int = 0) -> str:
    """Where a dense document of `tokens` tokens that must leave the GPU goes: TO_HOST or a
    compressed reason. host_tier: a host tier is on (if it then cannot take the document, the
    caller compresses it for COMPRESSED_NO_ROOM). sparse_running: rows decoding sparse now, beside
    which its next hit's row would decode. displaced: tokens the host tier would push out to take
    it. A tie goes to the host: it is exact."""
    if not host_tier:
        return COMPRESSED_NO_ROOM
    steps = rates.answer.value
    reloaded = rates.reload_s(tokens) + steps * rates.dense_row_s(tokens) + rates.prefill_s(displaced)
    compressed = rates.compression_s(tokens) + steps * sparse_row_cost(rates, sparse_running + 1)
    return TO_HOST if reloaded <= compressed else COMPRESSED_SPARSE_CHEAPER


def decode_pays(tokens: int, remaining_steps: list[int], rates: Rates, sparse_running: int) -> bool:
    """Whether compressing a dense document of `tokens` tokens that decode rows read (each with
    its remaining decode steps) saves more than it costs. sparse_running: rows decoding sparse
    now, beside which these would."""
    per_row = rates.dense_row_s(tokens) - sparse_row_cost(rates, sparse_running + len(remaining_steps))
    return sum(remaining_steps) * per_row > rates.compression_s(tokens)


def remaining_steps(req, rates: Rates) -> int:
    """Decode steps a running request is expected still to take: an answer's measured length, at
    most what its max_new_tokens leaves."""
    return max(0, min(req.max_total_len - len(req.input_ids) - req.num_sampled, round(rates.answer.value)))


def decode_reads(items) -> tuple[int, int]:
    """(dense KV tokens the decode rows of a step read, rows over compressed chunks): the decode
    fit's features."""
    dense = sparse = 0
    for it in items:
        if it.over_compressed_prefix:
            layout = it.shadowkv.layout
            sparse += 1
            dense += sum(b - a for a, b in layout.dense_spans) + it.seq_len - layout.compressed_end
        else:
            dense += it.seq_len
    return dense, sparse
