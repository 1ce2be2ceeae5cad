"""Head dims of any even size in the Triton kernels: tl.arange needs a power of two, so a kernel
spans a head as the next power of two (`dim_pad`) and masks the dims past the real ones out of
every load and store (loaded as zeros, which add nothing to a dot product). Phi-3's 96 dims take
128; a power of two pads nothing."""

from __future__ import annotations

import triton
import triton.language as tl


def dim_pad(dims: int) -> int:
    """The power of two a kernel spans `dims` with."""
    return triton.next_power_of_2(dims)


@triton.jit
def head_dims(DIMS: tl.constexpr, DIM_PAD: tl.constexpr):
    """Offsets [DIM_PAD] of a head's dims and which of them are real."""
    offs = tl.arange(0, DIM_PAD)
    return offs, offs < DIMS
