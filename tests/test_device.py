"""Device names from configs and the command line: a torch.device, or an error that names them."""

import pytest
import torch

from marinlm.utils.device import resolve_device


def test_good_names():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("name", ["foo", "mps", "cuda:x"])
def test_a_malformed_or_unsupported_name_is_named(name):
    with pytest.raises(ValueError, match=f"device '{name}': expected auto, cpu, cuda or cuda:N"):
        resolve_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_is_a_clear_error(name):
    with pytest.raises(ValueError, match=f"device '{name}': no CUDA device on this machine"):
        resolve_device(name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_index_past_the_last_gpu_is_named():
    name = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=f"device '{name}': this machine has"):
        resolve_device(name)
