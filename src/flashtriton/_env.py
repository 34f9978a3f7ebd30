"""Where the kernels run: on a CUDA GPU, or through Triton's interpreter on the CPU.

`@triton.jit` reads ``TRITON_INTERPRET`` when a kernel module is imported, so the choice is fixed for the
life of the process. Set ``TRITON_INTERPRET=1`` before importing flashtriton to run on CPU tensors.
"""

import os

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def enable_interpreter_if_no_cuda() -> bool:
    """Turn the interpreter on when there is no CUDA GPU. Must run before flashtriton is imported.

    Used by the CLI and the test suite; the library itself never changes the environment on import.
    Returns whether the interpreter is on.
    """
    import torch

    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
