"""Training at a tiny size: the loss goes down, checkpoints resume exactly, the result is a native checkpoint."""
import json
import subprocess
import sys

import pytest
import torch

from zoo.data.tokens import eval_windows, train_batch
from zoo.training.train import TrainConfig, lr_at, train

TINY = dict(hidden_size=48, num_layers=2, num_heads=2, num_kv_heads=1, num_experts=4, expert_intermediate=48,
            seq_len=32, batch_size=4, warmup=3, lr=3e-3, eval_every=4, eval_windows=2, threads=1)


def test_batches_are_a_function_of_seed_and_step():
    streams = {"english": torch.arange(1000), "code": torch.arange(1000, 3000)}
    a, b = train_batch(streams, 7, 4, 16, seed=1), train_batch(streams, 7, 4, 16, seed=1)
    assert torch.equal(a, b) and not torch.equal(a, train_batch(streams, 8, 4, 16, seed=1))
    assert (a[0::2] < 1000).all() and (a[1::2] >= 1000).all()  # half the rows from each domain
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(4, 15, dtype=a.dtype))  # contiguous windows
    w = eval_windows(torch.arange(100), 16, max_windows=3)
    assert w.shape == (3, 16) and torch.equal(w.flatten(), torch.arange(48))


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    lrs = [lr_at(cfg, s) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(x >= y for x, y in zip(lrs[10:], lrs[11:])) and lrs[-1] == pytest.approx(0.1, abs=1e-3)


@pytest.mark.parametrize("arch", ["mixtral", "dense"])
def test_loss_goes_down(arch, tmp_path):
    history = train(TrainConfig(arch=arch, steps=12, out=str(tmp_path), **TINY), progress=False)
    first, last = history["val"][0], history["val"][-1]
    assert last["english"] < first["english"] and last["code"] < first["code"]
    train_loss = [l for _, l in history["train"]]
    assert sum(train_loss[-3:]) < sum(train_loss[:3])
    assert json.loads((tmp_path / "final" / "training.json").read_text())["tokens"] == 12 * 4 * 32


def test_resume_continues_exactly(tmp_path):
    straight = train(TrainConfig(steps=8, out=str(tmp_path / "a"), **TINY), progress=False)
    # stop after 4 steps, then ask for 8: the run resumes from its step-4 checkpoint
    cfg = TrainConfig(steps=4, out=str(tmp_path / "c"), **TINY)
    train(cfg, progress=False)
    cfg.steps = 8
    resumed = train(cfg, progress=False)
    assert [s for s, _ in resumed["train"]] == list(range(1, 9))
    assert resumed["val"][-1] == pytest.approx(straight["val"][-1], abs=2e-3)
    assert resumed["train"][-1][1] == pytest.approx(straight["train"][-1][1], abs=2e-3)


def test_moe_result_is_a_native_mixtral_checkpoint(tmp_path):
    train(TrainConfig(steps=2, eval_every=2, out=str(tmp_path), **{k: v for k, v in TINY.items()
                                                                 if k != "eval_every"}), progress=False)
    code = ("import sys; from transformers import AutoModelForCausalLM;"
            f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'final')!r});"
            "assert 'zoo' not in sys.modules; print(type(m).__name__)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "MixtralForCausalLM"


def test_training_can_start_from_an_upcycled_model(tmp_path):
    """init + init_recipe: a trained dense model, upcycled, computes what it did (identical experts), then trains
    on as a native Mixtral of the dense model's FFN size."""
    from transformers import AutoModelForCausalLM

    from zoo.data.tokenizer import load_tokenizer
    from zoo.training.train import initial_model

    tiny = {k: v for k, v in TINY.items() if k != "eval_every"}
    train(TrainConfig(arch="dense", steps=2, eval_every=2, out=str(tmp_path / "dense"), **tiny), progress=False)
    dense_dir = str(tmp_path / "dense" / "final")
    cfg = TrainConfig(arch="mixtral", init=dense_dir, init_recipe="upcycle:num_experts=4,top_k=2", steps=2,
                      eval_every=2, out=str(tmp_path / "up"), **tiny)
    dense = AutoModelForCausalLM.from_pretrained(dense_dir).eval()
    upcycled = initial_model(cfg, load_tokenizer()).eval()
    ids = torch.randint(0, dense.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(upcycled(ids).logits, dense(ids).logits, atol=1e-4, rtol=1e-4)
    history = train(cfg, progress=False)
    assert history["config"]["init"] == dense_dir and len(history["train"]) == 2
    out = AutoModelForCausalLM.from_pretrained(str(tmp_path / "up" / "final"))
    assert type(out).__name__ == "MixtralForCausalLM" and out.config.num_local_experts == 4
    assert out.config.intermediate_size == dense.config.intermediate_size


def test_init_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="init_recipe needs init"):
        TrainConfig(init_recipe="upcycle")
    with pytest.raises(ValueError, match="bf16 must be"):
        TrainConfig(bf16="false")
    from zoo.data.tokenizer import load_tokenizer
    from zoo.training.train import initial_model

    with pytest.raises(ValueError, match="is a mistral model; arch 'mixtral' expects zoo_mixtral"):
        initial_model(TrainConfig(arch="mixtral", init="zoo-tiny-dense", out=str(tmp_path)), load_tokenizer())


@pytest.mark.parametrize("native", [True, False])
def test_steps_autocast_to_bf16_only_where_bf16_is_native(monkeypatch, native):
    """bf16 autocast by default where the processor multiplies bf16 natively; fp32 where it does not (an AVX2-only
    CPU, where torch's bf16 products are ~100x slower); an explicit choice is kept."""
    from zoo.moe import cpu_precision
    from zoo.training.precision import precision_label, training_autocast

    monkeypatch.setattr(cpu_precision, "bf16_matmul_is_native", lambda: native)
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    for bf16, expect in ((None, native), (True, True), (False, False)):
        with training_autocast(bf16):
            assert (a @ b).dtype == (torch.bfloat16 if expect else torch.float32)
        assert precision_label(bf16).startswith("bf16" if expect else "fp32")
