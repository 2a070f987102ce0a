"""ZooMMConfig: a small decoder over text tokens plus image patch and audio frame tokens, with MoE blocks."""
from __future__ import annotations

from transformers import PreTrainedConfig


class ZooMMConfig(PreTrainedConfig):
    model_type = "zoo_mm"

    vocab_size: int = 32
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    moe_intermediate_size: int = 64
    group_sizes: list | None = None  # experts per modality group, in the order of `groups`
    groups: list | None = None  # default ["text", "vision", "audio"]
    top_groups: int = 1
    num_experts_per_tok: int = 2
    image_size: int = 8
    patch_size: int = 2
    num_mel_bins: int = 32
    audio_frames: int = 16
    max_text_positions: int = 16
    vision_experts: int = 4  # Parrot's language-conditioned experts on the visual tokens (0: none)
    vision_experts_per_tok: int = 1
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.01
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    tie_word_embeddings: bool = False
    zoo_layout: list | None = None  # per decoder layer, SparseMoE.layout() (None: built from the fields above)
    zoo_vision_moe: dict | None = None  # the visual-token block's layout
    zoo_recipe: list | None = None
    zoo_components: dict | None = None  # the zoo's config keys: zoo.io.config_keys

    def __post_init__(self, **kwargs):
        if self.groups is None:
            self.groups = ["text", "vision", "audio"]
        if self.group_sizes is None:
            self.group_sizes = [2] * len(self.groups)
        super().__post_init__(**kwargs)

    @property
    def num_experts(self) -> int:
        return sum(self.group_sizes)
