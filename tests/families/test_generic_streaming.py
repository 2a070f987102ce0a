"""Generic families streamed layer by layer from their shards (zoo.editing.stream) write the tensors the in-memory path
writes; vision-language ones are refused with the reason (their layers sit below the language model)."""

import pytest
import torch

import zoo
from tests.families.test_generic_families import CONVERTED, native_model
from zoo.editing import stream
from zoo.architectures.families import GENERIC
from zoo.io.checkpoint import CheckpointError
from tiny import folder_tensors

TEXT = [t for t in CONVERTED if GENERIC[t] == "causal-lm"]
# Inkling2 saves some tensors of a layer outside it (model.llm.attn_res.mlp_queries.N for layer N's
# mlp_input.query): a layer cannot be read by its own key prefix, and the streaming path says it lacks them
SAVED_OUTSIDE_THEIR_LAYER = {"inkling2_text", "inkling2_loop_text"}
VISION = [t for t in CONVERTED if GENERIC[t] == "image-text-to-text"]


tensors = folder_tensors


@pytest.mark.parametrize("model_type", TEXT)
def test_streamed_convert_writes_what_the_in_memory_convert_writes(model_type, tmp_path, one_thread):
    native_model(model_type).save_pretrained(tmp_path / "native")
    if model_type in SAVED_OUTSIDE_THEIR_LAYER:
        with pytest.raises(CheckpointError, match="lacks tensors of layer 0"):
            stream.convert(tmp_path / "native", tmp_path / "stream")
        return
    zoo.convert(native_model(model_type)).save_pretrained(tmp_path / "memory")
    stream.convert(tmp_path / "native", tmp_path / "stream")
    a, b = tensors(tmp_path / "memory"), tensors(tmp_path / "stream")
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("model_type", ["glm4_moe", "jamba", "qwen3_next", "granitemoe"])
def test_streamed_apply_writes_what_apply_writes(model_type, tmp_path, one_thread):
    cal = [torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))]
    native_model(model_type).save_pretrained(tmp_path / "native")
    model = zoo.apply(zoo.convert(native_model(model_type)), "prune-frequency", calibration=cal, num_experts=3)
    model.save_pretrained(tmp_path / "memory")
    stream.apply(tmp_path / "native", [("prune-frequency", {"num_experts": 3})], tmp_path / "stream", calibration=cal)
    a, b = tensors(tmp_path / "memory"), tensors(tmp_path / "stream")
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_vision_language_checkpoint_is_refused_with_the_reason(tmp_path):
    native_model(VISION[0]).save_pretrained(tmp_path / "native")
    with pytest.raises(CheckpointError, match="in memory"):
        stream.convert(tmp_path / "native", tmp_path / "stream")
    assert not (tmp_path / "stream").exists()


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
