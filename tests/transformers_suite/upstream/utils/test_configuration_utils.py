"""moe-zoo stand-in, NOT transformers' file.

transformers' ``tests/utils/test_configuration_utils.py`` is not part of the 5.24.0 source distribution.
``test_configuration_common.ConfigTester.check_config_arguments_init`` needs one name from it,
``config_common_kwargs``: keyword arguments every ``PreTrainedConfig`` accepts, each with a non-default value, which
the check passes to a config class and then reads back. This dict is written here from the signature of
``transformers.PreTrainedConfig.__init__`` in 5.24.0 (``output_hidden_states``, ``return_dict``, ``dtype``,
``chunk_size_feed_forward``, ``is_encoder_decoder``, ``id2label``, ``label2id``, ``problem_type``, ``architectures``).
"""

config_common_kwargs = {
    "output_hidden_states": True,
    "return_dict": False,
    "dtype": "float16",  # the check compares config.dtype with torch.float16
    "chunk_size_feed_forward": 5,
    "is_encoder_decoder": True,
    "id2label": {0: "neg", 1: "pos"},
    "label2id": {"neg": 0, "pos": 1},
    "problem_type": "single_label_classification",
    "architectures": ["SomeModelForCausalLM"],
}
