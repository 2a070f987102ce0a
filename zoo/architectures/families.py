"""Every MoE family transformers ships, and what the zoo does with it: converted by a first-party spec
(``FIRST_PARTY``), converted by the generic adapter (``GENERIC``: model type -> the Auto class users load it
with), or not converted (``EXCEPTIONS``: model type -> why). ``tests/families`` checks that this list covers
every MoE config class of the installed transformers and that each GENERIC family converts losslessly."""

FIRST_PARTY = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "dbrx", "switch_transformers")

GENERIC: dict[str, str] = {
    # text decoders (hybrids included: Jamba, Qwen3-Next, Kimi-Linear, Granite-MoE-hybrid, ... keep their
    # attention-free layers and convert their MoE blocks)
    **{t: "causal-lm" for t in (
        "afmoe", "aria_text", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_v2", "deepseek_v32",
        "deepseek_v4", "doge", "dots1", "dots3_note_text", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint",
        "gemma4_text",
        "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "granitemoe", "granitemoe_swa", "granitemoehybrid",
        "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4", "inkling2_loop_text", "inkling2_text", "inkling_text",
        "jamba", "jetmoe", "kimi_linear", "kolibri1", "laguna", "lara_mini", "lfm2_moe", "llama4_text", "longcat_flash",
        "mellum", "mimo_v2_flash", "minimax", "minimax_m2", "minimax_m3_vl_text", "nemotron_h", "phimoe",
        "qwen3_5_moe_text", "qwen3_next", "qwen4_exp_text", "sarvam_mla", "sarvam_moe", "solar_open",
        "zaya")},
    # vision-language models: the language model's MoE blocks convert, the vision tower stays (dots3_note's
    # vision tower has MoE blocks of its own: they stay native)
    **{t: "image-text-to-text" for t in (
        "aria", "deepseek_ocr2", "diffusion_gemma", "dots3_note", "ernie4_5_vl_moe",
        "gemma4", "glm4v_moe", "glm5_next", "hy_v4_vl", "inkling2",
        "inkling2_loop", "inkling_mm_model", "llama4", "minimax_m3_vl", "mistral4", "mistral_large4", "muse_spark",
        "qwen3_5_moe", "step3p7",
        "qwen3_omni_moe_thinker", "qwen3_vl_moe", "qwen4_exp", "unlimited_ocr")},
    # a model holding two MoE decoders (Qwen3-Omni's thinker and talker): AutoModelForMultimodalLM
    "qwen3_omni_moe": "multimodal-lm",
}

_TEXT_PART = ("the text sub-config of a vision-language family; converted as part of that family (no model class of "
              "its own)")

# Why each of these is not converted, as the generic adapter reports it on the family's tiny model.
EXCEPTIONS: dict[str, str] = {
    "nllb-moe": "transformers 5.24's NllbMoeExperts one-hot encodes the router's 0/1 first-choice mask as expert ids, "
                "so only experts 0 and 1 ever run: a lossless conversion would copy that defect (its router is the "
                "zoo's top2-capacity, exact in eval; the family converts once transformers runs the experts the "
                "router picks)",
    "vitpose_backbone": "a vision backbone, not a language model",
    "openai_privacy_filter": "no causal-LM or image-text-to-text class",
    "dots3_note_vision_encoder": "the vision encoder of dots3_note, not a language model",
    **{t: _TEXT_PART for t in (
        "deepseek_ocr2_text", "diffusion_gemma_text", "ernie4_5_vl_moe_text", "glm4v_moe_text", "glm5_next_text",
        "hy_v4_vl_text", "mistral_large4_text", "muse_spark_text", "qwen3_omni_moe_talker_text",
        "qwen3_omni_moe_text", "qwen3_vl_moe_text", "step3p5", "unlimited_ocr_text")},
}
