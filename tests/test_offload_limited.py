"""benchmarks/offload_limited.py's own parts: where its rows' memory cgroups go, and the experts' bytes its limits
subtract. (The rows themselves need root and a writable memory cgroup, and drop the system's page cache: run by
hand, not in the suite.)"""
import sys
from pathlib import Path

import pytest

import zoo
from tests.tiny import tiny_native

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from offload_limited import expert_bytes, own_memory_cgroup  # noqa: E402

V1 = "5:devices:/\n4:memory:/process_api/abc\n3:cpuset:/\n0::/\n"
V2 = "0::/user.slice/session-1.scope\n"


def test_the_memory_cgroup_is_read_from_the_v1_memory_line_or_the_v2_unified_one():
    assert own_memory_cgroup(V1) == (Path("/sys/fs/cgroup/memory/process_api/abc"), False)
    assert own_memory_cgroup(V2) == (Path("/sys/fs/cgroup/user.slice/session-1.scope"), True)
    assert own_memory_cgroup("4:cpu,memory:/a\n0::/b\n") == (Path("/sys/fs/cgroup/memory/a"), False)
    with pytest.raises(RuntimeError, match="no memory cgroup"):
        own_memory_cgroup("5:devices:/\n")


@pytest.mark.parametrize("bits", [None, 4])
def test_expert_bytes_are_the_experts_tensors_and_nothing_else(tmp_path, bits):
    model = zoo.convert(tiny_native("mixtral")).eval()
    if bits:
        model = zoo.apply(model, "quantize", bits=bits)
    model.save_pretrained(tmp_path)
    state = model.state_dict()
    experts = sum(t.nbytes for k, t in state.items() if ".experts." in k)
    assert 0 < experts < sum(t.nbytes for t in state.values())
    assert expert_bytes(tmp_path) == experts
