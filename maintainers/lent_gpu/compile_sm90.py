"""Compile Triton code for the H100 (sm_90) on a machine without a GPU: a failure the device
reports as "PassManager::run failed" shows here with its MLIR diagnostic, in seconds, without
spending device time.

    # the device's Triton (3.6.0), beside this machine's:
    pip download --no-deps triton==3.6.0 -d /tmp/t36 && pip install --no-deps --target /tmp/t36/site /tmp/t36/*.whl
    # a kernel the device failed on: run it there with TRITON_KERNEL_DUMP=1 TRITON_DUMP_DIR=$OUT/dump,
    # then compile its dumped TTIR here
    PYTHONPATH=/tmp/t36/site python maintainers/lent_gpu/compile_sm90.py --ttir KERNEL.ttir [--num-warps 4]

In Python, `with compile_only(): wrapper(...)` turns every Triton launch inside into a compile
for sm_90 (arguments specialised as a launch would: CPU tensors of the server's shapes and dtypes
stand in for device ones), and names the kernels compiled; the outputs are not computed. Use it
in a process of its own, without TRITON_INTERPRET: the kernels keep their sm_90 caches.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

SM90 = GPUTarget("cuda", 90, 32)


class _CompileOnlyDriver:
    """What a launch asks of the active driver before it compiles (device, stream, target)."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return SM90

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def compile_only():
    """Inside, a Triton launch compiles its kernel for sm_90 and returns without running it;
    yields the list of kernel names compiled."""
    compiled: list[str] = []
    run = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(self.fn.__name__)
        return kernel

    previous = driver._active  # (reset_active would build the default driver: none on a CPU machine)
    driver.set_active(_CompileOnlyDriver())
    JITFunction.run = compile_instead
    try:
        yield compiled
    finally:
        JITFunction.run = run
        driver.set_active(previous)


def compile_ttir(path: str, num_warps: int = 4):
    """Every stage after TTIR (TTGIR, LLVM IR, PTX, cubin) of a dumped kernel, for sm_90."""
    return triton.compile(path, target=SM90, options={"num_warps": num_warps})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ttir", required=True, help="a kernel's .ttir file (Triton's TRITON_KERNEL_DUMP output)")
    parser.add_argument("--num-warps", type=int, default=4, help="as the launch had it (the dump's .json says)")
    args = parser.parse_args()
    kernel = compile_ttir(args.ttir, args.num_warps)
    print(f"compiled for sm_90 with triton {triton.__version__}: {', '.join(kernel.asm)}")


if __name__ == "__main__":
    main()
