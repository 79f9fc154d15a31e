"""--dtype auto is bfloat16 on a CPU with AVX512-BF16 and the native kernels (devices/cpu_native.py:
auto_cpu_dtype). The tests hold tokens against transformers' float32 run or compare exact tokens
between paths, so in-process models resolve auto to float32 here, as rank and server processes
started by the harnesses get --dtype float32 (tests/server_harness.py: pinned_dtype); the bf16
path has its own tests (tests/test_bf16_spec.py, tests/test_default_dtype.py).

--speculative-adaptive auto is on on the CPU: it picks plain or speculative steps by the time they
take, so in-process engines resolve auto to off here, and tests that count speculative steps,
accepted drafts or verify steps count what they set up; tests/test_spec_gate.py runs the gate.
Servers and ranks the harnesses start keep the default (their tests hold outputs, which the gate
never changes)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def float32_for_auto():
    """Session-wide, so that module-scoped fixtures that build models see it too; the tests of
    the default itself (tests/test_default_dtype.py) put the real resolution back for themselves."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("engine.models.loader.auto_cpu_dtype", lambda *args, **kwargs: torch.float32)
        yield


@pytest.fixture(autouse=True, scope="session")
def no_adaptive_speculation_for_auto():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("engine.args.auto_adaptive", lambda device_name: False)
        yield
