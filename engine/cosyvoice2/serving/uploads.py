"""Host values to the GPU without waiting for it.

torch copies host memory to a CUDA device synchronously unless the copy is non-blocking from
pinned memory: ``torch.tensor(values, device="cuda")`` waits for all the work queued on the
stream before it returns. A token2wav call that did so between its kernels left the GPU idle
while the host caught up (on an H100 at 64 sessions, a call's token encoder ran exactly as
long on the GPU as its thread took to launch it), and no thread can launch a call while the
last one still runs. ``to_device`` copies from pinned memory without waiting; torch keeps the
pinned block until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


def to_device(values: Sequence | np.ndarray | Tensor, dtype: torch.dtype | None, device: torch.device) -> Tensor:
    """``values`` (a list, an array or a CPU tensor) as a tensor on ``device``, in ``dtype``
    (None: as given), copied without waiting for the device."""
    pinned = torch.device(device).type == "cuda"
    if isinstance(values, (Tensor, np.ndarray)):
        host = torch.as_tensor(values, dtype=dtype)
        host = host.pin_memory() if pinned else host
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=pinned)
    return host.to(device, non_blocking=pinned)
