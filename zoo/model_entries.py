"""Registry entries: public MoE checkpoints of the six supported families (loaded from the Hub) and the
zoo's own small checkpoints, shipped in the package and loaded offline."""
from pathlib import Path

from zoo.hookspecs import hookimpl
from zoo.registry import ModelEntry

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


SHIPPED = Path(__file__).resolve().parent / "_data" / "models"
CORPUS = "trained by moe-zoo on its shipped corpus: Shakespeare (public domain) and Python stdlib source (PSF)"

OWN = [
    ModelEntry("mixtral.zoo-tiny-moe", None, "mixtral", "apache-2.0", MIXTRAL,
               "the zoo's embedded default: 15.5M params, 8 experts top-2, 4 layers; " + CORPUS,
               str(SHIPPED / "zoo-tiny-moe")),
    ModelEntry("mistral.zoo-tiny-dense", None, "mistral", "apache-2.0",
               "Jiang et al., Mistral 7B, 2023. arXiv:2310.06825",
               "dense control of zoo-tiny-moe: same active parameters, same tokens; " + CORPUS,
               str(SHIPPED / "zoo-tiny-dense")),
    ModelEntry("zoo_mm.zoo-tiny-mm", None, "zoo_mm", "apache-2.0",
               "Kim et al., MoHAVE, ICML 2025, arXiv:2502.10447; Sun et al., Parrot, ICML 2025, arXiv:2406.02539",
               "multimodal digits (image, speech, prompt): modality-group experts, hierarchical routing; trained on "
               "sklearn digits and espeak-ng speech (`moe-zoo digits-mm`)", str(SHIPPED / "zoo-tiny-mm")),
]


@hookimpl
def register_models(register):
    for entry in PUBLIC + OWN:
        register(entry)
