"""Page-locked host tensors of exactly the asked size, for ShadowKV's host value pool and exact
copies; and the runs of consecutive host slots that a copy into them moves at once.

torch's pinned allocator (`pin_memory=True`) rounds every block up to a power of two, so a 1.1 GiB
layer of host values locks 2 GiB. The host pool is most of a machine's RAM, and on the lent H100
that rounding alone got the process killed for memory. Here an ordinary allocation is registered
with cudaHostRegister instead (as torch.distributed's checkpoint stager does): the bytes locked
are the bytes asked for, copies into it are asynchronous, and kernels read it over PCIe through
its mapped device address (UVA).
"""

from __future__ import annotations

import torch

_PORTABLE_AND_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


class PinnedHostTensor:
    """Owns one registration: `tensor` stays page-locked while this object lives."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        self.tensor = torch.zeros(shape, dtype=dtype)
        self._ptr = None
        nbytes = self.tensor.numel() * self.tensor.element_size()
        if nbytes:
            err = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, _PORTABLE_AND_MAPPED))
            if err:
                raise MemoryError(f"could not page-lock {nbytes / 2**30:.2f} GiB of host memory (cudaError "
                                  f"{err}); lower shadowkv_host_tokens")
            self._ptr = self.tensor.data_ptr()

    def __del__(self):
        if self._ptr is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(self._ptr)
            except Exception:  # interpreter shutdown: the driver releases it with the process
                pass
            self._ptr = None


def contiguous_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first slot, count, offset in the list) of each run of consecutive slots."""
    runs: list[tuple[int, int, int]] = []
    for offset, slot in enumerate(slots):
        if runs and runs[-1][0] + runs[-1][1] == slot:
            first, count, start = runs[-1]
            runs[-1] = (first, count + 1, start)
        else:
            runs.append((slot, 1, offset))
    return runs
