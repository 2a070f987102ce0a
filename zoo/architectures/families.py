"""Every MoE family transformers ships, and what the zoo does with it: converted by the generic adapter
(``GENERIC``: model type -> the Auto class users load it with), converted by a first-party spec
(``FIRST_PARTY``), or not converted (``EXCEPTIONS``: model type -> why). ``tests/families`` checks that this
list covers every MoE config class of the installed transformers and that each GENERIC family converts
losslessly."""

FIRST_PARTY = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")

GENERIC: dict[str, str] = {
    # text decoders
    **{t: "causal-lm" for t in (
        "afmoe", "aria_text", "axk1", "axk2", "bailing_hybrid", "cohere2_moe", "deepseek_v2", "deepseek_v32",
        "deepseek_v4", "dots1", "dots3_note_text", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint", "gemma4_text",
        "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "granitemoe", "granitemoe_swa", "granitemoehybrid",
        "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4", "inkling_text", "inkling2_text",
        "inkling2_loop_text", "jamba", "kimi_linear", "kolibri1", "laguna", "lara_mini", "lfm2_moe", "llama4_text",
        "longcat_flash", "mellum", "mimo_v2_flash", "minimax", "minimax_m2", "minimax_m3_vl_text", "nemotron_h",
        "phimoe", "qwen3_5_moe_text", "qwen3_next", "qwen4_exp_text", "sarvam_mla", "sarvam_moe", "solar_open",
        "zaya", "beam", "doge")},
    # vision-language models: the language model's MoE blocks convert, the vision tower stays
    **{t: "image-text-to-text" for t in (
        "aria", "deepseek_ocr2", "diffusion_gemma", "dots3_note", "ernie4_5_vl_moe", "gemma4", "glm4v_moe",
        "glm5_next", "hy_v4_vl", "inkling2", "inkling2_loop", "inkling_mm_model", "llama4", "minimax_m3_vl",
        "mistral4", "mistral_large4", "muse_spark", "qwen3_5_moe", "qwen3_omni_moe_thinker", "qwen3_vl_moe",
        "qwen4_exp", "step3p7", "unlimited_ocr")},
}

# Filled from the per-family tests: each with the reason the generic path refuses it.
EXCEPTIONS: dict[str, str] = {}
