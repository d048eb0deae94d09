"""Host values to the device (uploads.py): the same tensor whatever form the values come in."""

import numpy as np
import torch

from tts_gateway.engine.cosyvoice2.serving.uploads import to_device


def test_values_arrive_as_given_in_the_asked_dtype() -> None:
    cpu = torch.device("cpu")
    for values in ([3, 1, 2], np.array([3, 1, 2]), torch.tensor([3, 1, 2])):
        out = to_device(values, torch.int32, cpu)
        assert out.dtype == torch.int32 and out.tolist() == [3, 1, 2]
    table = np.arange(6, dtype=np.int64).reshape(2, 3)
    assert torch.equal(to_device(table, None, cpu), torch.from_numpy(table))  # None: the dtype as given
    assert to_device([True, False], torch.bool, cpu).tolist() == [True, False]
