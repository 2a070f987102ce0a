"""sigmoid-bias's auxiliary-loss-free balancing (DeepSeek-V3): in training the router counts each expert's picks and
``after_step`` moves the selection bias by gamma toward balanced load; inference and gamma 0 never touch it."""
import pytest
import torch

import zoo
from zoo.moe.layout import moe_layers
from zoo_routers.sigmoid_bias import SigmoidBias


def naive_update(bias, indices, num_experts, gamma):
    """The rule spelt out per expert: overloaded down by gamma, underloaded up, exactly average unchanged."""
    load = [0] * num_experts
    for i in indices.reshape(-1).tolist():
        load[i] += 1
    mean = sum(load) / num_experts
    return torch.tensor([b + gamma * ((mean > l) - (mean < l)) for b, l in zip(bias.tolist(), load)])


def test_after_step_applies_deepseek_v3s_rule_to_the_loads_counted_in_training():
    torch.manual_seed(0)
    router = SigmoidBias(16, 6, 2, bias_update_speed=0.01).train()
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
    picked = []
    for _ in range(3):  # several forwards in one step (gradient accumulation) add up
        picked.append(router(torch.randn(10, 16)).indices)
    want = naive_update(router.e_score_correction_bias, torch.cat(picked), 6, 0.01)
    router.after_step()
    torch.testing.assert_close(router.e_score_correction_bias, want.float())
    assert router.picks is None and "picks" not in dict(router.named_buffers())  # reset; training state only
    before = router.e_score_correction_bias.clone()
    router.after_step()  # nothing counted: nothing moves
    assert torch.equal(router.e_score_correction_bias, before)


def test_the_update_steers_selection_toward_balance():
    torch.manual_seed(0)
    router = SigmoidBias(8, 4, 1, bias_update_speed=0.05).train()
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.weight[0] += 2.0  # expert 0 wins every token at first
    hidden = torch.randn(64, 8).abs()
    first = torch.bincount(router(hidden).indices.reshape(-1), minlength=4)
    for _ in range(40):
        router(hidden)
        router.after_step()
    last = torch.bincount(router(hidden).indices.reshape(-1), minlength=4)
    assert first.max() == 64 and last.max() <= 32 and (last > 0).sum() >= 3


def test_inference_and_gamma_zero_leave_the_bias_alone():
    router = SigmoidBias(8, 4, 2, bias_update_speed=0.1).eval()
    router(torch.randn(5, 8))
    router.after_step()
    assert not router.e_score_correction_bias.any()  # eval: nothing counted
    frozen = SigmoidBias(8, 4, 2).train()
    frozen(torch.randn(5, 8))
    frozen.after_step()
    assert not frozen.e_score_correction_bias.any() and "bias_update_speed" not in frozen.options


@pytest.mark.parametrize("bad", [-0.1, "fast", True, float("inf")])
def test_a_bad_speed_is_refused(bad):
    with pytest.raises(ValueError, match="bias_update_speed"):
        SigmoidBias(8, 4, 2, bias_update_speed=bad)


def test_finetune_calls_after_step_and_the_speed_survives_a_reload(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    from zoo.training.finetune import finetune
    from zoo.io.loading import ZOO_VOCAB
    from tiny import COMMON

    torch.manual_seed(0)
    config = MixtralConfig(**{**COMMON, "vocab_size": ZOO_VOCAB, "max_position_embeddings": 256},
                           intermediate_size=96, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
    MixtralForCausalLM(config).save_pretrained(tmp_path / "base")
    model = zoo.apply(zoo.load(tmp_path / "base", dtype=torch.float32), "sigmoid-bias", bias_update_speed=0.01)
    model.save_pretrained(tmp_path / "sigmoid")
    result = finetune(str(tmp_path / "sigmoid"), "lora-experts", {"r": 2}, domain="code", steps=2, batch_size=1,
                      seq_len=32, windows=1, progress=False)
    biases = [moe.router.e_score_correction_bias for _, moe in moe_layers(result.model)]
    assert all(b.abs().max() > 0 for b in biases)  # two steps moved every layer's bias
    assert all(b.abs().max() <= 0.02 + 1e-6 for b in biases)  # by at most gamma per step
    reloaded = zoo.load(tmp_path / "sigmoid")
    assert all(moe.router.bias_update_speed == 0.01 for _, moe in moe_layers(reloaded))
