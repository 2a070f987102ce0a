import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TQDM_DISABLE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs a worker per core: one thread each, children too
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
sys.path.insert(0, os.path.dirname(__file__))


def pytest_sessionstart(session):
    """Eager inference on a few tokens takes the zoo's expert kernel once it is loaded (zoo.moe.experts.use_kernel):
    load it in every process up front, so the path a test sees does not depend on which test ran before it."""
    from zoo.moe import kernels

    kernels.load()


@pytest.fixture(scope="module")
def one_thread():
    """For files of tiny tensors: one intra-op thread is faster, and does not spin against other work on a
    small shared machine (two threads made such files ~10x slower on a busy 2-core box)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# pytest-xdist hands whole files to its workers in collection order (with --no-loadscope-reorder, which the
# Makefile passes: by default it orders files by their number of tests, which put the two-minute claim scripts'
# file of ~20 tests last, run alone by one worker while the other idled): the files that take a minute or more go
# first, so the two workers end together.
SLOW_FILES_FIRST = ("test_claim_scripts_quick.py", "test_check_component.py", "test_benchmark_smoke.py",
                    "test_scaffold.py", "test_plugins.py",
                    "test_install_cli.py", "test_space_components.py", "test_channel_topk.py", "test_meta.py",
                    "test_browser.py", "test_startup.py", "test_readme.py", "test_readme_path.py", "test_gguf.py",
                    "test_lm_eval.py", "test_remote_code.py", "test_compressed_tensors.py", "test_gguf_families.py",
                    "test_quantize_claims_quick.py", "test_peft_names.py", "test_decode.py", "test_parallel.py",
                    "test_kernels.py", "test_hub.py", "test_multimodal_claim_quick.py",
                    "test_quantize_mlp_experts.py", "test_distributed_calibration.py", "test_adapters_structure.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: every file stays in one piece
