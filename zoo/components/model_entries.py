"""Registry entries: public MoE checkpoints of the supported families (loaded from the Hub) and the
zoo's own small checkpoints, shipped in the package and loaded offline."""
from pathlib import Path

from zoo.hookspecs import hookimpl
from zoo.components.registry import ModelEntry

MIXTRAL = "Jiang et al., Mixtral of Experts, 2024. arXiv:2401.04088"
QWEN2 = "Qwen Team, Qwen2 Technical Report, 2024. arXiv:2407.10671"
QWEN3 = "Qwen Team, Qwen3 Technical Report, 2025. arXiv:2505.09388"
OLMOE = "Muennighoff et al., OLMoE: Open Mixture-of-Experts Language Models, 2024. arXiv:2409.02060"
DSV3 = "DeepSeek-AI, DeepSeek-V3 Technical Report, 2024. arXiv:2412.19437"
GPTOSS = "OpenAI, gpt-oss-120b & gpt-oss-20b Model Card, 2025. arXiv:2508.10925"

PUBLIC = [
    ModelEntry("mixtral.8x7b-v0.1", "mistralai/Mixtral-8x7B-v0.1", "mixtral", "apache-2.0", MIXTRAL,
               "46.7B total, 12.9B active; 8 experts, top-2"),
    ModelEntry("mixtral.8x7b-instruct-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral", "apache-2.0",
               MIXTRAL, "instruction-tuned Mixtral 8x7B"),
    ModelEntry("mixtral.8x22b-v0.1", "mistralai/Mixtral-8x22B-v0.1", "mixtral", "apache-2.0", MIXTRAL,
               "141B total, 39B active; 8 experts, top-2"),
    ModelEntry("qwen2_moe.qwen1.5-a2.7b", "Qwen/Qwen1.5-MoE-A2.7B", "qwen2_moe", "tongyi-qianwen",
               "Qwen Team, Qwen1.5-MoE: Matching 7B Model Performance with 1/3 Activated Parameters, 2024",
               "14.3B total, 2.7B active; 60 experts top-4 plus a gated shared expert"),
    ModelEntry("qwen2_moe.57b-a14b", "Qwen/Qwen2-57B-A14B", "qwen2_moe", "apache-2.0", QWEN2,
               "57B total, 14B active; 64 experts top-8 plus a shared expert"),
    ModelEntry("qwen3_moe.30b-a3b", "Qwen/Qwen3-30B-A3B", "qwen3_moe", "apache-2.0", QWEN3,
               "30.5B total, 3.3B active; 128 experts, top-8"),
    ModelEntry("qwen3_moe.235b-a22b", "Qwen/Qwen3-235B-A22B", "qwen3_moe", "apache-2.0", QWEN3,
               "235B total, 22B active; 128 experts, top-8"),
    ModelEntry("olmoe.1b-7b-0924", "allenai/OLMoE-1B-7B-0924", "olmoe", "apache-2.0", OLMOE,
               "6.9B total, 1.3B active; 64 experts, top-8"),
    ModelEntry("olmoe.1b-7b-0924-instruct", "allenai/OLMoE-1B-7B-0924-Instruct", "olmoe", "apache-2.0", OLMOE,
               "instruction-tuned OLMoE"),
    ModelEntry("deepseek_v3.v3-0324", "deepseek-ai/DeepSeek-V3-0324", "deepseek_v3", "mit", DSV3,
               "671B total, 37B active; 256 routed experts top-8 plus one shared"),
    ModelEntry("deepseek_v3.r1", "deepseek-ai/DeepSeek-R1", "deepseek_v3", "mit",
               "DeepSeek-AI, DeepSeek-R1, 2025. arXiv:2501.12948", "reasoning model on the DeepSeek-V3 architecture"),
    ModelEntry("gpt_oss.20b", "openai/gpt-oss-20b", "gpt_oss", "apache-2.0", GPTOSS,
               "21B total, 3.6B active; 32 experts, top-4"),
    ModelEntry("gpt_oss.120b", "openai/gpt-oss-120b", "gpt_oss", "apache-2.0", GPTOSS,
               "117B total, 5.1B active; 128 experts, top-4"),
]

# families converted by the generic adapter (zoo.architectures.families)
GLM45 = "GLM-4.5 Team, GLM-4.5: Agentic, Reasoning, and Coding Foundation Models, 2025. arXiv:2508.06471"
GENERIC_PUBLIC = [
    ModelEntry("deepseek_v2.lite", "deepseek-ai/DeepSeek-V2-Lite", "deepseek_v2", "other",
               "DeepSeek-AI, DeepSeek-V2: A Strong, Economical, and Efficient MoE Language Model, 2024. "
               "arXiv:2405.04434",
               "15.7B total, 2.4B active; 64 routed experts top-6 plus 2 shared"),
    ModelEntry("deepseek_v32.exp", "deepseek-ai/DeepSeek-V3.2-Exp", "deepseek_v32", "mit",
               "DeepSeek-AI, DeepSeek-V3.2-Exp, 2025", "671B total, 37B active; DeepSeek-V3 MoE with sparse attention"),
    ModelEntry("glm4_moe.4.5-air", "zai-org/GLM-4.5-Air", "glm4_moe", "mit", GLM45,
               "106B total, 12B active; sigmoid routing with selection bias, shared expert"),
    ModelEntry("glm4v_moe.4.5v", "zai-org/GLM-4.5V", "glm4v_moe", "mit", GLM45,
               "vision-language model on GLM-4.5-Air's MoE language model"),
    ModelEntry("ernie4_5_moe.21b-a3b", "baidu/ERNIE-4.5-21B-A3B-PT", "ernie4_5_moe", "apache-2.0",
               "Baidu ERNIE Team, ERNIE 4.5 Technical Report, 2025", "21B total, 3B active"),
    ModelEntry("hunyuan_v1_moe.a13b-instruct", "tencent/Hunyuan-A13B-Instruct", "hunyuan_v1_moe", "other",
               "Tencent Hunyuan Team, Hunyuan-A13B Technical Report, 2025", "80B total, 13B active"),
    ModelEntry("minimax_m2.base", "MiniMaxAI/MiniMax-M2", "minimax_m2", "mit", "MiniMax, MiniMax-M2, 2025",
               "230B total, 10B active; sigmoid routing with selection bias"),
    ModelEntry("minimax.text-01", "MiniMaxAI/MiniMax-Text-01-hf", "minimax", "other",
               "MiniMax, MiniMax-01: Scaling Foundation Models with Lightning Attention, 2025. arXiv:2501.08313",
               "456B total, 45.9B active; lightning-attention hybrid"),
    ModelEntry("dots1.llm1-base", "rednote-hilab/dots.llm1.base", "dots1", "mit",
               "rednote-hilab, dots.llm1 Technical Report, 2025. arXiv:2506.05767", "142B total, 14B active"),
    ModelEntry("jamba.mini-1.5", "ai21labs/AI21-Jamba-Mini-1.5", "jamba", "other",
               "Jamba Team, Jamba-1.5: Hybrid Transformer-Mamba Models at Scale, 2024. arXiv:2408.12570",
               "52B total, 12B active; Mamba/attention hybrid with MoE every other layer"),
    ModelEntry("granitemoe.3.1-3b-a800m-instruct", "ibm-granite/granite-3.1-3b-a800m-instruct", "granitemoe",
               "apache-2.0", "IBM Granite Team, Granite 3.0 Language Models, 2024", "3.3B total, 800M active"),
    ModelEntry("qwen3_next.80b-a3b-instruct", "Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3_next", "apache-2.0", QWEN3,
               "80B total, 3B active; 512 experts top-10 plus a gated shared expert; linear-attention hybrid"),
    ModelEntry("qwen3_vl_moe.30b-a3b-instruct", "Qwen/Qwen3-VL-30B-A3B-Instruct", "qwen3_vl_moe", "apache-2.0",
               "Qwen Team, Qwen3-VL Technical Report, 2025",
               "vision-language; 30B total, 3B active MoE language model"),
    ModelEntry("kimi_linear.48b-a3b-instruct", "moonshotai/Kimi-Linear-48B-A3B-Instruct", "kimi_linear", "mit",
               "Kimi Team, Kimi Linear: An Expressive, Efficient Attention Architecture, 2025. arXiv:2510.26692",
               "48B total, 3B active; linear-attention hybrid"),
    ModelEntry("flex_olmo.7x7b-1t", "allenai/FlexOlmo-7x7B-1T", "flex_olmo", "apache-2.0",
               "Shi et al., FlexOlmo: Open Language Models for Flexible Data Use, 2025. arXiv:2507.07024",
               "7 independently trained experts of 7B"),
    ModelEntry("longcat_flash.chat", "meituan-longcat/LongCat-Flash-Chat", "longcat_flash", "mit",
               "Meituan LongCat Team, LongCat-Flash Technical Report, 2025. arXiv:2509.01322", "560B total"),
    ModelEntry("aria.base", "rhymes-ai/Aria", "aria", "apache-2.0",
               "Li et al., Aria: An Open Multimodal Native Mixture-of-Experts Model, 2024. arXiv:2410.05993",
               "vision-language; 25.3B total, 3.9B active"),
]

SHIPPED = Path(__file__).resolve().parents[1] / "_data" / "models"
CORPUS = "trained by moe-zoo on its shipped corpus: Shakespeare (public domain) and Python stdlib source (PSF)"

OWN = [
    ModelEntry("mixtral.zoo-tiny-moe", None, "mixtral", "apache-2.0", MIXTRAL,
               "the zoo's embedded default: 15.5M params, 8 experts top-2, 4 layers; " + CORPUS,
               str(SHIPPED / "zoo-tiny-moe")),
    ModelEntry("mistral.zoo-tiny-dense", None, "mistral", "apache-2.0",
               "Jiang et al., Mistral 7B, 2023. arXiv:2310.06825",
               "dense control of zoo-tiny-moe: same active parameters, same tokens; " + CORPUS,
               str(SHIPPED / "zoo-tiny-dense")),
    ModelEntry("mixtral.zoo-tiny-upcycled", None, "mixtral", "apache-2.0",
               "Komatsuzaki et al., Sparse Upcycling: Training Mixture-of-Experts from Dense Checkpoints, ICLR 2023, "
               "arXiv:2212.05055",
               "zoo-tiny-dense upcycled (8 copies of its FFN, top-2) and trained 5.3M more tokens: 28.1M params, "
               "experts of one origin; " + CORPUS, str(SHIPPED / "zoo-tiny-upcycled")),
    ModelEntry("zoo_mm.zoo-tiny-mm", None, "zoo_mm", "apache-2.0",
               "Kim et al., MoHAVE, ICML 2025, arXiv:2502.10447; Sun et al., Parrot, ICML 2025, arXiv:2406.02539",
               "multimodal digits (image, speech, prompt): modality-group experts, hierarchical routing; trained on "
               "sklearn digits and espeak-ng speech (`moe-zoo digits-mm`)", str(SHIPPED / "zoo-tiny-mm")),
]


@hookimpl
def register_models(register):
    from zoo.architectures.families import EXCEPTIONS

    for entry in PUBLIC + [e for e in GENERIC_PUBLIC if e.family not in EXCEPTIONS] + OWN:
        register(entry)
