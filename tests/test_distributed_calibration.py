"""Calibration split over processes (zoo.editing.distributed): streamed apply under ``torchrun --nproc-per-node 2``
(CPU, gloo) writes the same tensors as one process, for statistics summed over ranks and for raw tokens gathered;
the pieces against references without a process group."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tiny import folder_tensors, tiny_native
from zoo.editing import distributed

WORKER = os.path.join(os.path.dirname(__file__), "calibration_worker.py")


def test_without_a_process_group_everything_is_the_identity():
    x = torch.randn(5, 3)
    assert distributed.world() == (0, 1) and distributed.is_writer()
    assert distributed.share([1, 2, 3]) == [1, 2, 3]
    assert distributed.gather_tokens(x) is x and distributed.my_rows(x) is x
    t = x.clone()
    distributed.all_reduce_sum(t, None)
    assert torch.equal(t, x)


def test_shares_are_contiguous_and_cover_every_batch_once(monkeypatch):
    items = list(range(7))
    shares = []
    for rank in range(3):
        monkeypatch.setattr(distributed, "world", lambda rank=rank: (rank, 3))
        shares.append(distributed.share(items))
    assert shares == [[0, 1, 2], [3, 4], [5, 6]]  # concatenated in rank order: the one-process order
    with pytest.raises(ValueError, match="2 calibration windows cannot be shared by 3 processes"):
        distributed.share([0, 1])
    batches = [torch.arange(12).reshape(3, 4), torch.arange(12, 20).reshape(2, 4), torch.arange(20, 23)[None]]
    got = []
    for rank in range(2):
        monkeypatch.setattr(distributed, "world", lambda rank=rank: (rank, 2))
        got.append(distributed.share_windows(batches))
    # 6 windows, 3 each; regrouped up to 3 rows of one length per batch
    assert [[b.tolist() for b in g] for g in got] == [[[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]],
                                                      [[[12, 13, 14, 15], [16, 17, 18, 19]], [[20, 21, 22]]]]


def test_two_processes_write_the_same_tensors_as_one(tmp_path):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo (CPU collectives) is not in this torch build")
    src = tmp_path / "src"
    tiny_native("olmoe").save_pretrained(src)  # 8 experts, top-2
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    one = subprocess.run([sys.executable, WORKER, str(src), str(tmp_path / "one")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          WORKER, str(src), str(tmp_path / "two")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert (tmp_path / "one" / "world").read_text() == "1" and (tmp_path / "two" / "world").read_text() == "2"
    for n in range(2):
        a, b = folder_tensors(tmp_path / "one" / str(n)), folder_tensors(tmp_path / "two" / str(n))
        assert sorted(a) == sorted(b)
        different = [k for k in a if not torch.equal(a[k], b[k])]
        assert not different, (n, different)
        one_files = sorted(p.name for p in (tmp_path / "one" / str(n)).iterdir())
        assert one_files == sorted(p.name for p in (tmp_path / "two" / str(n)).iterdir())
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["0", "1", "world"]  # rank 1 wrote none
