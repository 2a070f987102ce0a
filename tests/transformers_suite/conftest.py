"""transformers' own model tests for every family, native and zoo (see README.md)."""
import os

import pytest

from transformers_suite.skips import reason_for

# the vendored files hold mixins, not tests; the stand-ins neither
collect_ignore_glob = ["upstream/*"]

# marks transformers' own conftest.py registers, used by the vendored files and transformers.testing_utils
_UPSTREAM_MARKERS = ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "is_agent_test",
                     "is_expert_parallel_test", "is_fsdp_test", "is_pipeline_test", "is_staging_test",
                     "is_tensor_parallel_test", "is_training_test", "order", "slow", "torch_compile_test")


def pytest_configure(config):
    for name in _UPSTREAM_MARKERS:
        config.addinivalue_line("markers", f"{name}: transformers' own test marker (vendored tests)")


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread(one_thread):
    """Tiny models: one torch thread is faster and leaves the other core to the rest of the machine."""
    yield


def pytest_collection_modifyitems(config, items):
    for item in items:
        cls = getattr(item, "cls", None)
        variant = getattr(cls, "variant", None)
        if not variant or not item.nodeid.startswith(_HERE):
            continue
        reason = reason_for(variant, cls.family, item.name)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"skips.py: {reason}"))


_HERE = os.path.relpath(os.path.dirname(__file__), os.getcwd()).replace(os.sep, "/")
