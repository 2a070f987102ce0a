"""moe-zoo stand-in, NOT transformers' file.

transformers' ``tests/generation/test_utils.py`` (``GenerationTesterMixin``: about a hundred ``generate`` tests) is
not part of the 5.24.0 source distribution, only of transformers' git repository, which this project does not vendor
(see ../../README.md). ``test_modeling_common.py`` imports ``GenerationTesterMixin`` by name, and its
``test_generation_tester_mixin_inheritance`` requires a generative model's test class to inherit it, so this module
defines one: a handful of ``generate`` checks written for moe-zoo, run on every class of
``all_generative_model_classes`` like upstream's, against the same tiny model testers.
"""
import torch
from transformers import set_seed
from transformers.testing_utils import torch_device


class GenerationTesterMixin:
    """moe-zoo's own ``generate`` checks (upstream's generation tests are not vendored)."""

    max_new_tokens = 4

    def _generation_setup(self, model_class, batch=2):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        ids = inputs["input_ids"][:batch]
        mask = inputs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask[:batch]
        set_seed(0)
        model = model_class(config).to(torch_device).eval()
        return config, model, ids, mask

    def _generate(self, model, ids, mask, **kwargs):
        kwargs = {"max_new_tokens": self.max_new_tokens, "min_new_tokens": self.max_new_tokens,
                  "do_sample": False, "pad_token_id": model.config.pad_token_id, **kwargs}
        return model.generate(ids, attention_mask=mask, **kwargs)

    def test_greedy_generate(self):
        for model_class in self.all_generative_model_classes:
            _, model, ids, mask = self._generation_setup(model_class)
            out = self._generate(model, ids, mask)
            self.assertEqual(tuple(out.shape), (ids.shape[0], ids.shape[1] + self.max_new_tokens))
            self.assertTrue(torch.equal(out[:, : ids.shape[1]], ids))

    def test_greedy_generate_cache_matches_no_cache(self):
        for model_class in self.all_generative_model_classes:
            _, model, ids, mask = self._generation_setup(model_class)
            cached = self._generate(model, ids, mask, use_cache=True, return_dict_in_generate=True,
                                    output_scores=True)
            uncached = self._generate(model, ids, mask, use_cache=False, return_dict_in_generate=True,
                                      output_scores=True)
            self.assertTrue(torch.equal(cached.sequences, uncached.sequences))
            for a, b in zip(cached.scores, uncached.scores):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    def test_greedy_generate_dict_outputs(self):
        for model_class in self.all_generative_model_classes:
            config, model, ids, mask = self._generation_setup(model_class)
            plain = self._generate(model, ids, mask)
            out = self._generate(model, ids, mask, return_dict_in_generate=True, output_scores=True,
                                 output_logits=True)
            self.assertTrue(torch.equal(out.sequences, plain))
            self.assertEqual(len(out.scores), self.max_new_tokens)
            self.assertEqual(len(out.logits), self.max_new_tokens)
            for scores in out.scores:
                self.assertEqual(tuple(scores.shape), (ids.shape[0], config.get_text_config().vocab_size))

    def test_sample_generate(self):
        for model_class in self.all_generative_model_classes:
            _, model, ids, mask = self._generation_setup(model_class)
            set_seed(0)
            first = self._generate(model, ids, mask, do_sample=True, top_k=5)
            set_seed(0)
            second = self._generate(model, ids, mask, do_sample=True, top_k=5)
            self.assertEqual(tuple(first.shape), (ids.shape[0], ids.shape[1] + self.max_new_tokens))
            self.assertTrue(torch.equal(first, second))

    def test_left_padding_compatibility(self):
        """The next-token logits of a sequence do not change when it is left-padded (with mask and positions)."""
        for model_class in self.all_generative_model_classes:
            config, model, ids, _ = self._generation_setup(model_class)
            mask = torch.ones_like(ids)
            pad = torch.full((ids.shape[0], 3), config.pad_token_id, dtype=ids.dtype, device=ids.device)
            padded_ids = torch.cat([pad, ids], dim=1)
            padded_mask = torch.cat([torch.zeros_like(pad), mask], dim=1)
            positions = (padded_mask.cumsum(-1) - 1).clamp(min=0)
            with torch.no_grad():
                ref = model(input_ids=ids, attention_mask=mask).logits[:, -1]
                out = model(input_ids=padded_ids, attention_mask=padded_mask, position_ids=positions).logits[:, -1]
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
