"""The switch of the flow decoder's fused Triton kernels: the fused norms (fused_norms.py) and a
paged call's conv context (serving/fused_context.py).

Which path an op runs is decided per call: its Triton kernel for CUDA tensors while
:data:`enabled` is true (the engine's ``flow_fused_kernels`` setting) and Triton imports, its
torch reference otherwise, so a CPU runs exactly the plain torch ops. Under Triton's
interpreter (``TRITON_INTERPRET=1`` set before Triton is imported) the kernels run on CPU
tensors too, which is how the tests check them.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
except ImportError:  # a CPU build of torch comes without Triton: the references serve
    triton = None

# Set by the engine from its flow_fused_kernels setting; off, the GPU runs the plain torch ops too.
enabled = False

# Set before Triton is imported, this makes its kernels Python functions over CPU tensors.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def available() -> bool:
    """Whether the fused kernels can run in this process (Triton imported)."""
    return triton is not None


def applies(t: Tensor) -> bool:
    """Whether an op on ``t`` runs as its Triton kernel."""
    return (
        enabled
        and triton is not None
        and (t.is_cuda or INTERPRETED)
        and not torch.compiler.is_compiling()  # inductor fuses the torch ops itself
    )
