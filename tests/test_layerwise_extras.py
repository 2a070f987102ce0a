"""The layer-at-a-time engine on families whose decoder layers take positional inputs or hand each other more than
hidden states: each MoE layer is compressed on exactly the block inputs a forward of the whole model gives it once
the layers before it hold their compressed blocks, and prune-frequency keeps what it keeps on those inputs."""
import copy

import pytest
import torch

import zoo
from tests.families.test_generic_families import input_ids
from tests.families.tiny_configs import model_class, tiny_config
from zoo.editing import layer_calls
from zoo.editing.apply import find
from zoo.editing.layerwise import LayerInputs, capture_inputs
from zoo.moe.layout import decoder_layers, get_block, moe_layers, put_block

# case: (family, config changes, how the engine carries the calibration batches)
CASES = {
    # layer 2 reuses the top-k indices layer 1 computes from what the compressed layer 0 handed it (with 3 of them
    # kept, they differ from the uncompressed model's: taken from the recording, layer 2's inputs would be wrong)
    "hy_v4": ("hy_v4", dict(num_hidden_layers=3, mlp_layer_types=["sparse"] * 3,
                            indexer_types=["full", "full", "shared"], index_topk=3), layer_calls.LinkedCalls),
    # per-layer inputs passed positionally
    "gemma4_text": ("gemma4_text", {}, layer_calls.LinkedCalls),
    # the last layer of each attention kind writes its keys and values into a store every layer is handed: rerun
    "gemma4_text_stores_kv": ("gemma4_text", dict(num_hidden_layers=3,
                                                  layer_types=["sliding_attention", "sliding_attention",
                                                               "full_attention"]), layer_calls.RerunCalls),
    # the last two layers read the keys and values the first two write into a store every layer is handed: rerun
    "gemma4_text_shared_kv": ("gemma4_text", dict(num_hidden_layers=4, num_kv_shared_layers=2,
                                                  layer_types=["sliding_attention", "full_attention"] * 2),
                              layer_calls.RerunCalls),
    # block states the model's loop builds from the hidden states entering earlier layers: rerun
    "inkling2_text": ("inkling2_text", dict(num_hidden_layers=3, n_layers_per_attn_res_block=1,
                                            layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"]),
                      layer_calls.RerunCalls),
    # layer 1 runs twice per forward (two loop passes): rerun
    "inkling2_loop_text": ("inkling2_loop_text", {}, layer_calls.RerunCalls),
}
PLAIN = "qwen3_5_moe_text"  # layers that take keywords and return hidden states


def tiny(model_type, **changes):
    config = tiny_config(model_type)
    for key, value in changes.items():
        setattr(config, key, value)
    for key in ("moe_intermediate_size", "intermediate_size"):
        if getattr(config, key, None) == 16:  # as the family tests build them
            setattr(config, key, 32)
    torch.manual_seed(0)
    return zoo.convert(model_class(model_type)(config).eval())


def batches(model):
    ids = input_ids(model, rows=4, length=16)
    return [ids[:3], ids[3:]]


@torch.no_grad()
def reference_inputs(model, i, blocks, batches):
    """Every input of layer i's block over full forwards of ``batches``, the layers in ``blocks`` swapped first."""
    layers = decoder_layers(model)
    seen = []
    old = {j: get_block(layers[j]) for j in blocks}
    for j, block in blocks.items():
        put_block(layers[j], block)
    handle = get_block(layers[i]).register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    try:
        for batch in batches:
            model(input_ids=batch, use_cache=False)
    finally:
        handle.remove()
        for j, block in old.items():
            put_block(layers[j], block)
    return torch.cat(seen)


def same_block(a, b):
    one, two = a.state_dict(), b.state_dict()
    return one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


def compress_recorded(model, data, monkeypatch, num_experts):
    """prune-frequency applied by ``zoo.apply``; {layer: (block inputs it was given, block it returned)}."""
    cls = find("prune-frequency").obj
    original, seen = cls.compress_layer, {}

    def recording(self, i, block, x):
        out = original(self, i, block, x)
        seen[i] = (x.clone(), out)
        return out

    monkeypatch.setattr(cls, "compress_layer", recording)
    zoo.apply(model, "prune-frequency", calibration=data, num_experts=num_experts)
    monkeypatch.setattr(cls, "compress_layer", original)
    return seen


@pytest.mark.parametrize("case", CASES)
def test_each_layer_is_compressed_on_the_inputs_of_the_model_compressed_before_it(case, monkeypatch, one_thread):
    model_type, changes, carrier = CASES[case]
    model = tiny(model_type, **changes)
    reference = copy.deepcopy(model)
    data = batches(model)
    assert type(capture_inputs(model, data)) is carrier
    n = moe_layers(model)[0][1].num_experts
    seen = compress_recorded(model, data, monkeypatch, n - 1)

    cls = find("prune-frequency").obj
    blocks = {}
    for i, block in moe_layers(reference):
        x = reference_inputs(reference, i, blocks, data)
        assert torch.equal(seen[i][0], x), f"layer {i}"
        blocks[i] = cls(num_experts=n - 1).compress_layer(i, block, x)  # by hand, on the reference inputs
        assert same_block(seen[i][1], blocks[i]), f"layer {i}"
        assert blocks[i].num_experts == n - 1
    last = max(blocks)
    # the carried inputs matter: the last layer's inputs are not those of the uncompressed model
    assert not torch.equal(seen[last][0], reference_inputs(reference, last, {}, data))


def test_families_without_extras_keep_the_stand_in_capture(monkeypatch, one_thread):
    model = tiny(PLAIN)
    data = batches(model)
    plain = LayerInputs.capture(model, data)
    assert type(plain) is LayerInputs
    recorded = layer_calls.capture(model, data)  # the full-forward recording agrees with it bit for bit
    assert type(recorded) is layer_calls.LinkedCalls
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        assert torch.equal(plain.block_inputs(i, layer), recorded.block_inputs(i, layer))
        plain, recorded = plain.advance(i, layer), recorded.advance(i, layer)

    reference = copy.deepcopy(model)
    n = moe_layers(model)[0][1].num_experts
    seen = compress_recorded(model, data, monkeypatch, n - 1)
    blocks = {}
    for i, block in moe_layers(reference):
        x = reference_inputs(reference, i, blocks, data)
        assert torch.equal(seen[i][0], x), f"layer {i}"
        blocks[i] = seen[i][1]


def test_layers_that_hand_on_more_are_refused_when_not_in_memory():
    model = tiny("hy_v4")
    for layer in decoder_layers(model):
        layer.to("meta")  # as a checkpoint streamed layer by layer holds them
    with pytest.raises(ValueError, match="hand each other more than hidden states.*in memory"):
        capture_inputs(model, batches(model))
