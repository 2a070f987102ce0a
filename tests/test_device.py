"""--device for the layer-at-a-time engine (zoo.editing.device): naming the CPU gives today's tensors bit for bit,
and a device this process has not got, or a name that is none, is refused in one line before anything is written.
(No accelerator here: the moves to and from one are exercised only as no-op moves to the CPU.)"""
import pytest
import torch
from click.testing import CliRunner

import zoo
from zoo.editing import device as devices
from zoo.editing import stream
from tiny import folder_tensors, tiny_native

CAL = [torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(i)) for i in range(3)]
RECIPE = [("prune-reap", {"num_experts": 2}), ("quantize", {"bits": 4, "group_size": 32})]
CUDA = torch.cuda.is_available()


def assert_same_tensors(a, b):
    ta, tb = folder_tensors(a), folder_tensors(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    path = tmp_path_factory.mktemp("native") / "mixtral"
    tiny_native("mixtral").save_pretrained(path)
    return str(path)


def test_naming_the_cpu_streams_the_same_tensors_as_the_default(native, tmp_path, one_thread):
    stream.apply(native, RECIPE, tmp_path / "default", calibration=CAL)
    stream.apply(native, RECIPE, tmp_path / "cpu", calibration=CAL, device="cpu")
    stream.apply(native, RECIPE, tmp_path / "torch", calibration=CAL, device=torch.device("cpu"))
    assert_same_tensors(tmp_path / "default", tmp_path / "cpu")
    assert_same_tensors(tmp_path / "default", tmp_path / "torch")


def test_in_memory_layerwise_on_a_named_device_matches_and_the_model_stays_on_the_cpu(native, one_thread):
    plain = zoo.apply(zoo.load(native), "prune-reap", calibration=CAL, num_experts=2)
    with devices.using("cpu"):
        moved = zoo.apply(zoo.load(native), "prune-reap", calibration=CAL, num_experts=2)
    a, b = plain.state_dict(), moved.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert {p.device.type for p in moved.parameters()} == {"cpu"}
    assert devices.current() is None  # the context ends with the block


@pytest.mark.skipif(CUDA, reason="this machine has CUDA: the refusal of an absent backend cannot be shown")
def test_an_absent_backend_is_refused_before_anything_is_read_or_written(native, tmp_path):
    with pytest.raises(ValueError, match="not available in this process.*available here: cpu") as exc:
        stream.apply(native, RECIPE, tmp_path / "out", calibration=CAL, device="cuda")
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="not available"):
        stream.evaluate(native, device="cuda:0")
    with pytest.raises(ValueError, match="not available"):
        stream.convert(native, tmp_path / "conv", device="cuda")
    model = zoo.load(native)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="not available"):
        with devices.using("cuda"):
            zoo.apply(model, "prune-reap", calibration=CAL, num_experts=2)
    with pytest.raises(ValueError, match="not available"):
        from zoo.editing.layerwise import compress_in_memory
        from zoo.editing.stream import bind_steps

        compress_in_memory(zoo.convert(model), bind_steps(RECIPE[:1]), CAL, device="cuda")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "out").exists() and not (tmp_path / "conv").exists()


@pytest.mark.parametrize("name,match", [("cuda!", "not a device name"), ("gpu", "not a device name"),
                                        ("", "not a device name"), ("cpu:3", "does not exist"),
                                        ("meta", "not available")])
def test_a_bad_device_name_is_one_clear_line(name, match):
    with pytest.raises(ValueError, match=match) as exc:
        devices.resolve(name)
    assert "\n" not in str(exc.value) and "cpu" in str(exc.value)


def test_resolve_keeps_what_exists():
    assert devices.resolve(None) is None
    assert devices.resolve("cpu") == torch.device("cpu") == devices.resolve(torch.device("cpu"))
    assert devices.available()[0] == "cpu"


def test_the_command_line_refuses_a_device_in_one_line_and_writes_nothing(native, tmp_path):
    from zoo.cli import cli

    runner = CliRunner()
    out = tmp_path / "out"
    for device, match in ([("nonsense", "not a device name")] + ([] if CUDA else [("cuda", "not available")])):
        for args in (["apply", native, "prune-reap:num_experts=2", "--out", str(out), "--stream"],
                     ["apply", native, "prune-reap:num_experts=2", "--out", str(out), "--no-stream"],
                     ["convert", native, str(out)], ["eval", native, "--stream"]):
            result = runner.invoke(cli, [*args, "--device", device])
            assert result.exit_code == 1, (args, result.output)
            lines = result.output.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("Error: --device:") and match in lines[0], result.output
            assert not out.exists()


def test_the_command_line_with_the_cpu_named_writes_the_default_tensors(tmp_path, one_thread):
    from zoo.cli import cli

    runner = CliRunner()
    steps = ["prune-reap:num_experts=6", "quantize:bits=4,group_size=32"]
    for name, extra in (("default", []), ("cpu", ["--device", "cpu"])):
        result = runner.invoke(cli, ["apply", "zoo-tiny-moe", *steps, "--out", str(tmp_path / name), "--stream",
                                     "--calibration", "code:256", *extra])
        assert result.exit_code == 0, result.output
    assert_same_tensors(tmp_path / "default", tmp_path / "cpu")
