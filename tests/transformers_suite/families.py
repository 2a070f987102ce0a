"""Model testers and the test-class base for the six MoE families (moe-zoo's own code).

transformers' per-family test files (``tests/models/<family>/test_modeling_<family>.py``) and their shared
``tests/causal_lm_tester.py`` live only in transformers' git repository; this project does not vendor them (see
README.md). This module plays their part for transformers' own ``ModelTesterMixin`` (vendored unmodified from the
5.24.0 sdist under ``upstream/``): a tiny config per family and the tester interface that mixin drives
(``prepare_config_and_inputs_for_common``, ``get_config``, ``batch_size``, ``seq_length``, ...), plus the few tests a
causal-LM test class adds on top of the mixins (config, base model, classification heads, router logits).
"""
from __future__ import annotations

import unittest

import torch
import transformers
from transformers.testing_utils import require_torch, torch_device

from .upstream.generation.test_utils import GenerationTesterMixin
from .upstream.test_configuration_common import ConfigTester
from .upstream.test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask
from .upstream.test_training_mixin import TrainingTesterMixin

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]

# Family -> (class-name prefix in transformers, extra config kwargs). Small on purpose: 2 layers, 4-8 experts.
# qwen2_moe, qwen3_moe and deepseek_v3 get a dense first layer (as their real checkpoints may have): a mixed model,
# and the layout `test_tp_plan_matches_params` sets on the config after building it (`mlp_only_layers=[0]`,
# `first_k_dense_replace=1`) -- a zoo config's `zoo_layout`, recorded when the config is built, decides which layers
# are MoE, so that test's later edit would not reach a zoo model.
FAMILY_CONFIGS = {
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8)),
    "qwen2_moe": ("Qwen2Moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                   shared_expert_intermediate_size=32, norm_topk_prob=False,
                                   mlp_only_layers=[0])),
    "qwen3_moe": ("Qwen3Moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                   norm_topk_prob=True, mlp_only_layers=[0])),
    "olmoe": ("Olmoe", dict(num_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3", dict(num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                                       topk_group=1, first_k_dense_replace=1, moe_intermediate_size=16,
                                       kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                       v_head_dim=16, routed_scaling_factor=2.5, rope_interleave=True)),
    "gpt_oss": ("GptOss", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=4,
                               layer_types=["sliding_attention", "full_attention"])),
}


def native_classes(family: str) -> dict:
    """The family's transformers classes by role (None where the family has no such head)."""
    prefix, _ = FAMILY_CONFIGS[family]
    get = lambda suffix: getattr(transformers, prefix + suffix, None)  # noqa: E731
    return {
        "config_class": get("Config"),
        "base_model_class": get("Model"),
        "causal_lm_class": get("ForCausalLM"),
        "sequence_classification_class": get("ForSequenceClassification"),
        "token_classification_class": get("ForTokenClassification"),
        "question_answering_class": get("ForQuestionAnswering"),
    }


class CausalLMTester:
    """The tester ``ModelTesterMixin`` drives: tiny config + random inputs."""

    family: str = ""
    config_class = base_model_class = causal_lm_class = None
    sequence_classification_class = token_classification_class = question_answering_class = None

    def __init__(self, parent, batch_size=13, seq_length=7, is_training=True, use_input_mask=True, use_labels=True,
                 vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=32, hidden_act="silu", max_position_embeddings=512, initializer_range=0.02,
                 type_sequence_label_size=2, num_labels=3, num_choices=4, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2):
        self.parent = parent
        self.batch_size, self.seq_length = batch_size, seq_length
        self.is_training, self.use_input_mask, self.use_labels = is_training, use_input_mask, use_labels
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.intermediate_size, self.hidden_act = intermediate_size, hidden_act
        self.max_position_embeddings, self.initializer_range = max_position_embeddings, initializer_range
        self.type_sequence_label_size, self.num_labels, self.num_choices = type_sequence_label_size, num_labels, num_choices
        self.pad_token_id, self.bos_token_id, self.eos_token_id = pad_token_id, bos_token_id, eos_token_id

    @property
    def all_model_classes(self):
        return tuple(c for c in (self.base_model_class, self.causal_lm_class, self.sequence_classification_class,
                                 self.token_classification_class, self.question_answering_class) if c is not None)

    def config_kwargs(self) -> dict:
        names = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "hidden_act", "max_position_embeddings", "initializer_range",
                 "pad_token_id", "bos_token_id", "eos_token_id")
        return {**{n: getattr(self, n) for n in names}, **FAMILY_CONFIGS[self.family][1]}

    def get_config(self):
        return self.config_class(**self.config_kwargs())

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        input_mask = random_attention_mask([self.batch_size, self.seq_length]) if self.use_input_mask else None
        sequence_labels = token_labels = None
        if self.use_labels:
            sequence_labels = ids_tensor([self.batch_size], self.type_sequence_label_size)
            token_labels = ids_tensor([self.batch_size, self.seq_length], self.num_labels)
        return self.get_config(), input_ids, input_mask, sequence_labels, token_labels

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, input_mask, _, _ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": input_mask}

    def create_and_check_model(self, config, input_ids, input_mask, sequence_labels, token_labels):
        model = self.base_model_class(config).to(torch_device).eval()
        with torch.no_grad():
            model(input_ids, attention_mask=input_mask)
            result = model(input_ids)
        self.parent.assertEqual(tuple(result.last_hidden_state.shape),
                                (self.batch_size, self.seq_length, self.hidden_size))


def native_tester(family: str) -> type:
    classes = {k: v for k, v in native_classes(family).items()}
    return type(f"{FAMILY_CONFIGS[family][0]}Tester", (CausalLMTester,), {"family": family, **classes})


@require_torch
class CausalLMTestBase(ModelTesterMixin, GenerationTesterMixin, TrainingTesterMixin):
    """What a transformers family test class is made of: the vendored mixins + a handful of causal-LM tests.

    Subclasses (made by ``zoo_variants.make_test_classes``) set ``model_tester_class``, ``variant`` and ``family``.
    """

    model_tester_class: type = None
    variant = family = ""
    test_all_params_have_gradient = False  # MoE: a tiny batch need not route a token to every expert

    def setUp(self):
        self.model_tester = self.model_tester_class(self)
        self.config_tester = ConfigTester(self, config_class=self.model_tester.config_class, hidden_size=37)
        self.all_model_classes = self.model_tester.all_model_classes

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())

    def _head_check(self, head, problem_type=None, labels_shape=None, float_labels=False):
        cls = getattr(self.model_tester, head)
        if cls is None:
            self.skipTest(f"{self.family} has no {head.replace('_class', '').replace('_', ' ')} head")
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.num_labels = 3
        if problem_type:
            config.problem_type = problem_type
        ids = inputs["input_ids"]
        tester = self.model_tester
        kwargs = {}
        if labels_shape is not None:
            labels = ids_tensor(labels_shape, 2 if float_labels else config.num_labels)
            kwargs["labels"] = labels.to(torch.float) if float_labels else labels
        model = cls(config).to(torch_device).eval()
        with torch.no_grad():
            return model(ids, attention_mask=ids.ne(1).to(torch_device), **kwargs), tester

    def test_sequence_classification_model(self):
        out, t = self._head_check("sequence_classification_class", labels_shape=[self.model_tester.batch_size])
        self.assertEqual(tuple(out.logits.shape), (t.batch_size, 3))
        self.assertIsNotNone(out.loss)

    def test_sequence_classification_model_for_multi_label(self):
        out, t = self._head_check("sequence_classification_class", "multi_label_classification",
                                  labels_shape=[self.model_tester.batch_size, 3], float_labels=True)
        self.assertEqual(tuple(out.logits.shape), (t.batch_size, 3))
        self.assertIsNotNone(out.loss)

    def test_token_classification_model(self):
        t = self.model_tester
        out, _ = self._head_check("token_classification_class", labels_shape=[t.batch_size, t.seq_length])
        self.assertEqual(tuple(out.logits.shape), (t.batch_size, t.seq_length, 3))
        self.assertIsNotNone(out.loss)

    def test_question_answering_model(self):
        out, t = self._head_check("question_answering_class")
        self.assertEqual(tuple(out.start_logits.shape), (t.batch_size, t.seq_length))
        self.assertEqual(tuple(out.end_logits.shape), (t.batch_size, t.seq_length))

    def test_router_logits_and_load_balancing_loss(self):
        """``output_router_logits=True``: one router-logit tensor per MoE layer; where the config has an
        auxiliary-loss coefficient, the loss includes ``coef * aux_loss`` (upstream's MoE family tests check the
        same through ``test_load_balancing_loss``)."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.output_router_logits = True
        model = self.model_tester.causal_lm_class(config).to(torch_device).eval()
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, labels=ids)
            plain = model(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=False)
        self.assertTrue(out.router_logits, "no router logits returned")
        self.assertEqual(out.router_logits[0].shape[0], ids.numel())
        if getattr(config, "router_aux_loss_coef", None) is not None:
            self.assertIsNotNone(out.aux_loss)
            self.assertGreater(out.aux_loss.item(), 0)
            torch.testing.assert_close(out.loss, plain.loss + config.router_aux_loss_coef * out.aux_loss)


def make_test_class(family: str, variant: str, tester: type, module: str, mixins: tuple = ()) -> type:
    """``Test<Family><Variant>``: a ``unittest.TestCase`` running every vendored test on ``tester``'s classes."""
    name = f"Test{FAMILY_CONFIGS[family][0]}{variant.capitalize()}"
    return type(name, (*mixins, CausalLMTestBase, unittest.TestCase),
                {"model_tester_class": tester, "variant": variant, "family": family, "__module__": module})
