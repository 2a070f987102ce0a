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


@pytest.fixture
def at_unreadable_page():
    """A function copying a tensor so that its bytes end where the process's readable memory does (the next page
    PROT_NONE, as past the end of a mapped checkpoint): a kernel that reads past them ends the process. Returns the
    copy, of the tensor's dtype and shape. The pages are readable again after the test."""
    import ctypes
    import mmap

    import torch

    libc, page, areas = ctypes.CDLL(None, use_errno=True), mmap.PAGESIZE, []

    def place(t):
        raw = t.contiguous().flatten().view(torch.uint8)
        n = -(-raw.numel() // page) * page
        area = mmap.mmap(-1, n + page)
        base = ctypes.addressof(ctypes.c_char.from_buffer(area))
        assert libc.mprotect(ctypes.c_void_p(base + n), page, 0) == 0  # PROT_NONE
        areas.append((area, base + n))
        held = torch.frombuffer(area, dtype=torch.uint8, count=raw.numel(), offset=n - raw.numel())
        held.copy_(raw)
        return held.view(t.dtype).view(t.shape)

    yield place
    for _, guard in areas:  # (each map is unmapped once nothing views it)
        libc.mprotect(ctypes.c_void_p(guard), page, mmap.PROT_READ | mmap.PROT_WRITE)


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
