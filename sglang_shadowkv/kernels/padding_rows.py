"""The rows of a CUDA-graph decode step that are padding, and the gate that lets kernels skip them.

A graph is captured for a fixed batch size and a smaller batch replays it padded (rows that read
and write only the reserved page). The sparse decode kernels' grids are fixed by the capture, so
every padding row would still run their full work: on the H100, 48 padding rows beside 16 real
ones (16K documents) made the step 27.1 ms instead of 21.2. The step's plan therefore holds `live`,
a one-element device tensor: its requests are rows 0 .. live - 1, the padding follows; each kernel
reads it at run time (a replay needs no new capture) and does nothing for the rest. Without it
(`live=None`: an eager step, never padded) every row is live.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def live_row(LIVE, b, GATED: tl.constexpr):
    """Whether row b is one of the step's requests (always, unless GATED by LIVE)."""
    if GATED:
        return b < tl.load(LIVE)
    else:
        return b >= 0


def live_rows(live: torch.Tensor | None, rows: int) -> int:
    """The live count as an int, for the torch references (rows when there is no gate)."""
    return rows if live is None else min(rows, int(live))
