"""transformers' own model tests for every family, native and zoo (see README.md)."""
import os
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

from transformers_suite.skips import reason_for

# the vendored files hold mixins, not tests; the stand-ins neither
collect_ignore_glob = ["upstream/*"]

# marks transformers' own conftest.py registers, used by the vendored files and transformers.testing_utils
_UPSTREAM_MARKERS = ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "is_agent_test",
                     "is_expert_parallel_test", "is_fsdp_test", "is_pipeline_test", "is_staging_test",
                     "is_tensor_parallel_test", "is_training_test", "order", "slow", "torch_compile_test")

FULL_ENV = "MOE_ZOO_FULL_TRANSFORMERS"

# Run only by the full suite (`make test-transformers`, or MOE_ZOO_FULL_TRANSFORMERS=1), not by a plain `pytest`.
# Everything else (1,777 of 2,089 test cases) is the default subset. Measured on a busy 2-core
# box (RESULTS.md): the whole suite ~125-215 s wall, the default subset ~45-60 s.
FULL_ONLY = {
    "test_eager_matches_sdpa_inference_*": "24 dtype x padding x mask x kernel combinations (~33 s in all); the "
                                           "default keeps the fp32 left- and right-padded ones and output_attentions",
    "test_eager_matches_batched_and_grouped_inference_*": "three dtypes; the default keeps fp32",
    "test_training_overfit": "300 optimiser steps per family and variant (~27 s in all)",
    "test_bc_torch_dtype": "saves and reloads the model in every dtype (~26 s in all)",
}
DEFAULT_KEEPS = ("test_eager_matches_sdpa_inference_09_fp32_pad_left", "test_eager_matches_sdpa_inference_13_fp32_pad_right",
                 "test_eager_matches_sdpa_inference_24_fp32_pad_left_output_attentions",
                 "test_eager_matches_batched_and_grouped_inference_1_fp32")


def full_only(name: str) -> bool:
    return name not in DEFAULT_KEEPS and any(fnmatchcase(name, p) for p in FULL_ONLY)


def pytest_configure(config):
    for name in _UPSTREAM_MARKERS:
        config.addinivalue_line("markers", f"{name}: transformers' own test marker (vendored tests)")
    config.addinivalue_line("markers", f"transformers_full: in the full transformers suite only ({FULL_ENV}=1)")


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread(one_thread):
    """Tiny models: one torch thread is much faster here (2 threads made the suite several times slower on a busy
    2-core box) and leaves the other core to the rest of the machine."""
    yield


def pytest_collection_modifyitems(config, items):
    full = os.environ.get(FULL_ENV, "") not in ("", "0")
    kept, deselected = [], []
    for item in items:
        cls = getattr(item, "cls", None)
        variant = getattr(cls, "variant", None)
        if not variant or _HERE not in item.path.parents:
            kept.append(item)
            continue
        reason = reason_for(variant, cls.family, item.name)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"skips.py: {reason}"))
        if full_only(item.name):
            item.add_marker(pytest.mark.transformers_full)
            if not full:
                deselected.append(item)
                continue
        kept.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


_HERE = Path(__file__).resolve().parent
