"""Test setup: on a machine without CUDA the kernels run through Triton's interpreter.

TRITON_INTERPRET must be set before flashtriton (which defines the @triton.jit kernels) is imported.
Tests marked `gpu` (large shapes) run only on a CUDA GPU.
"""

import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import flashtriton  # noqa: E402  (after the environment is set)
from flashtriton._env import INTERPRET  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"


def pytest_collection_modifyitems(config, items):
    if not INTERPRET:
        return
    skip_gpu = pytest.mark.skip(reason="large shape: runs on a CUDA GPU only (interpreter is on)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    return DEVICE


assert flashtriton.__version__
