"""Generic families streamed layer by layer from their shards (zoo.editing.stream) write the tensors the in-memory path
writes, vision-language ones included: a stored name is read as the model's through transformers' conversion
mapping, so a language model's layers are found below any prefix and a vision tower's own ``layers``/``blocks``
stay outside them, and the output carries the names an in-memory save writes."""

import pytest
import torch

import zoo
from tests.families.test_generic_families import CONVERTED, native_model
from zoo.editing import stream
from tiny import folder_tensors


tensors = folder_tensors


@pytest.mark.parametrize("model_type", CONVERTED)
def test_streamed_convert_writes_what_the_in_memory_convert_writes(model_type, tmp_path, one_thread):
    """(Inkling 2 stores some of a layer's tensors outside its prefix, model.llm.attn_res.mlp_queries.N: the
    conversion mapping names them as the layer's own.)"""
    native_model(model_type).save_pretrained(tmp_path / "native")
    zoo.convert(native_model(model_type)).save_pretrained(tmp_path / "memory")
    stream.convert(tmp_path / "native", tmp_path / "stream")
    a, b = tensors(tmp_path / "memory"), tensors(tmp_path / "stream")
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("model_type", ["glm4_moe", "jamba", "qwen3_next", "granitemoe", "qwen3_vl_moe"])
def test_streamed_apply_writes_what_apply_writes(model_type, tmp_path, one_thread):
    cal = [torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))]
    native_model(model_type).save_pretrained(tmp_path / "native")
    model = zoo.apply(zoo.convert(native_model(model_type)), "prune-frequency", calibration=cal, num_experts=3)
    model.save_pretrained(tmp_path / "memory")
    stream.apply(tmp_path / "native", [("prune-frequency", {"num_experts": 3})], tmp_path / "stream", calibration=cal)
    a, b = tensors(tmp_path / "memory"), tensors(tmp_path / "stream")
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_calibrated_step_on_layers_that_need_recording_is_refused_before_writing(tmp_path):
    """Gemma 4's layers take per-layer inputs beside the hidden states: calibrating it layer by layer needs the whole
    model in memory (the recording engine); streamed, the step is refused with the reason and nothing is written."""
    native_model("gemma4").save_pretrained(tmp_path / "native")
    cal = [torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))]
    with pytest.raises(ValueError, match="need such a model in memory, not streamed"):
        stream.apply(tmp_path / "native", [("prune-frequency", {"num_experts": 3})], tmp_path / "out",
                     calibration=cal)
    assert not (tmp_path / "out").exists()


def test_gemma4_streams_both_ways_and_its_quantizer_streams_too(tmp_path, one_thread):
    """Gemma 4 keeps its router, experts and their norms in the decoder layer itself: a layer is read by its native
    names and regrouped (``Family.native_layer_class`` / ``regroup_layer``), exported back under the layer
    (``native_in_layer``), and a component that needs no calibration streams as in memory. (Its outer embeddings
    carry a buffer the family computes: they are read from the checkpoint, never re-initialised.)"""
    native_model("gemma4_text").save_pretrained(tmp_path / "native")
    zoo.convert(native_model("gemma4_text")).save_pretrained(tmp_path / "memory")
    stream.export(tmp_path / "memory", tmp_path / "exported")
    a, b = tensors(tmp_path / "native"), tensors(tmp_path / "exported")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    stream.apply(tmp_path / "native", [("quantize", {"bits": 8, "group_size": 32})], tmp_path / "streamed")
    zoo.apply(zoo.convert(native_model("gemma4_text")), "quantize", bits=8, group_size=32).save_pretrained(
        tmp_path / "quantized")
    a, b = tensors(tmp_path / "quantized"), tensors(tmp_path / "streamed")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
