"""zoo.runtime.huge_pages: weights moved onto 2 MB pages in place, and only anonymous memory."""
import mmap
import platform
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from zoo.runtime.huge_pages import HUGE_PAGE, anonymous_ranges, collapse_to_huge_pages, huge_page_bytes


def _thp_usable() -> str | None:
    """Why this system cannot collapse pages (None where it can)."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.exists() or "[never]" in setting.read_text():
        return "transparent huge pages are off"
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return "MADV_COLLAPSE needs Linux 6.1" if (major, minor) < (6, 1) else None


needs_thp = pytest.mark.skipif(_thp_usable() is not None, reason=str(_thp_usable()))


@needs_thp
def test_weights_move_onto_huge_pages_with_the_same_addresses_and_values():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 16))  # 8 MB weight; the second one small
    before = {k: (v.clone(), v.data_ptr()) for k, v in model.state_dict().items()}
    x = torch.randn(3, 1024)
    expected = model(x)
    moved = collapse_to_huge_pages(model)
    weight = model[0].weight
    first = -(-weight.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    last = (weight.data_ptr() + weight.nbytes) // HUGE_PAGE * HUGE_PAGE
    assert moved == last - first >= 3 * HUGE_PAGE  # the 2 MB-aligned inside of the big weight, nothing else
    assert huge_page_bytes(weight) >= moved
    for k, v in model.state_dict().items():
        assert v.data_ptr() == before[k][1] and torch.equal(v, before[k][0]), k
    assert torch.equal(model(x), expected)
    assert collapse_to_huge_pages(model) == moved  # again: the same pages, nothing else


@needs_thp
def test_storages_counted_once_and_small_ones_left():
    shared = torch.zeros(4 * HUGE_PAGE // 4)
    model = nn.Module()
    model.a = nn.Parameter(shared[: shared.numel() // 2])
    model.b = nn.Parameter(shared[shared.numel() // 2:])  # views of one storage
    model.small = nn.Parameter(torch.zeros(1000))
    moved = collapse_to_huge_pages(model)
    assert 2 * HUGE_PAGE <= moved <= 4 * HUGE_PAGE
    assert collapse_to_huge_pages(model, min_bytes=1 << 40) == 0


def test_weights_mapped_from_a_file_stay_where_they_are(tmp_path):
    path = tmp_path / "weights.bin"
    data = torch.arange(3 * HUGE_PAGE // 4, dtype=torch.float32)
    path.write_bytes(data.numpy().tobytes())
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE)
    tensor = torch.frombuffer(mapped, dtype=torch.float32)
    start = tensor.data_ptr()
    assert not any(s <= start < e for s, e in anonymous_ranges())
    model = nn.Module()
    model.w = nn.Parameter(tensor, requires_grad=False)
    assert collapse_to_huge_pages(model) == 0
    assert huge_page_bytes(model.w) == 0 and torch.equal(model.w, data)
    del model, tensor


def test_meta_and_empty_models_are_a_no_op():
    with torch.device("meta"):
        model = nn.Linear(4096, 4096)
    assert collapse_to_huge_pages(model) == 0
    assert collapse_to_huge_pages(nn.Module()) == 0
