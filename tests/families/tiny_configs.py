"""Tiny random configs for every Mixture-of-Experts model type of transformers 5.24.

``TINY[model_type]`` holds the keyword arguments (sub-configs as nested dicts) that shrink the family's own config
class: hidden 32, 2-4 layers, vocab 128, 4 heads / 2 kv heads / head_dim 8 where the keys exist, 4 routed experts
(16 for doge's product-key experts), top-k 2, expert width 16, n_group=2 / topk_group=1 where routing is grouped, a
dense layer next to a sparse one where the family allows it, and no dropout. Vision / audio / talker sub-configs are
shrunk too. MLA families keep ``num_key_value_heads == num_attention_heads`` (their attention requires it).

Non-obvious kwargs:
- dbrx: ``attn_config`` gets ``rope_theta`` (read by the attention, not a field) and ``clip_qkv`` (None breaks clamp).
- qwen3_omni_moe(_thinker): ``shared_expert_intermediate_size`` (talker text), ``spatial_merge_size`` (talker) and
  ``vision_start_token_id`` (thinker, read by generate) are read by the modeling code but are not config fields.
- gpt_oss, mistral4, mistral_large4(_text), openai_privacy_filter keep their default max_position_embeddings, so the
  YaRN factor matches (it costs no parameters).
- diffusion_gemma: ``canvas_length=8``; its forward samples a random canvas unless ``decoder_input_ids`` is given.
- deepseek_v2, deepseek_ocr2, unlimited_ocr: ``topk_method="group_limited_greedy"``, the family's grouped routing.
- ernie4_5_vl_moe, glm4v_moe, hy_v4_vl: an ``mrope_section`` that fits head_dim 8; zaya: top-1 (its validator).
- jetmoe: the only module with an ``experts`` child is the attention (JetMoeAttention.experts, mixture of attention
  heads); its MLP MoE (JetMoeMoE) holds its experts as ``input_linear`` / ``output_linear``.

``tiny_config(mt)`` builds the config, ``model_class(mt)`` picks the class a user would load it with, and
``UNBUILDABLE`` lists the types that cannot be used as a tiny MoE model, with the reason.
``python tests/families/check_tiny.py`` builds and runs them all.
"""
import transformers
from transformers import CONFIG_MAPPING
from transformers.models.auto import modeling_auto as _auto

TINY: dict[str, dict] = {
    'afmoe': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        sliding_window=16, num_hidden_layers=2, num_dense_layers=1, global_attn_every_n_layers=2,
        num_shared_experts=1,
    ),
    'aria': dict(
        vision_config=dict(
            model_type='idefics3_vision', hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, patch_size=4, image_size=16,
        ),
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=256, moe_num_experts=4, moe_topk=2, num_hidden_layers=2,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, moe_num_shared_experts=1,
        ),
        projector_patch_to_query_dict={'16': 4},
    ),
    'aria_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_num_experts=4, moe_topk=2, num_hidden_layers=2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, moe_num_shared_experts=1,
    ),
    'axk1': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_hidden_layers=2,
        bos_token_id=1, eos_token_id=2, n_group=2, topk_group=1, mlp_layer_types=['dense', 'sparse'],
    ),
    'axk2': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=4,
        index_head_dim=8, index_n_heads=2, num_hidden_layers=2, bos_token_id=1, eos_token_id=2, n_group=2,
        topk_group=1, mlp_layer_types=['dense', 'sparse'],
    ),
    'bailing_hybrid': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, num_local_experts=4,
        num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        num_hidden_layers=2, pad_token_id=0, eos_token_id=2, n_group=2, topk_group=1,
        layer_types=['linear_attention', 'full_attention'], mlp_layer_types=['dense', 'sparse'],
        first_k_dense_replace=1, layer_group_size=2,
    ),
    'beam': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        sliding_window=16, num_hidden_layers=2, n_group=2, topk_group=1, mlp_layer_types=['dense', 'sparse'],
        layer_types=['sliding_attention', 'full_attention'],
    ),
    'cohere2_moe': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, prefix_dense_intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256, num_experts=4,
        num_experts_per_tok=2, sliding_window=16, num_hidden_layers=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, first_k_dense_replace=1, sliding_window_pattern=2, num_shared_experts=1,
    ),
    'dbrx': dict(
        vocab_size=128, d_model=32, n_heads=4, max_seq_len=256, n_layers=2,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(hidden_size=32, ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2),
    ),
    'deepseek_ocr2': dict(
        vision_config=dict(
            sam_config=dict(
                hidden_size=16, num_hidden_layers=2, num_attention_heads=2, patch_size=4, image_size=32,
                output_channels=8, window_size=2, global_attn_indexes=[1], mlp_dim=32, downsample_channels=[16, 32],
            ),
            encoder_config=dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
            ),
        ),
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4,
            num_experts_per_tok=2, num_hidden_layers=2, bos_token_id=1, eos_token_id=2, n_group=2, topk_group=1,
            n_shared_experts=1, mlp_layer_types=['dense', 'sparse'], first_k_dense_replace=1,
            topk_method='group_limited_greedy',
        ),
    ),
    'deepseek_ocr2_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, bos_token_id=1, eos_token_id=2, n_group=2, topk_group=1, n_shared_experts=1,
        mlp_layer_types=['dense', 'sparse'], first_k_dense_replace=1, topk_method='group_limited_greedy',
    ),
    'deepseek_v2': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_hidden_layers=2,
        bos_token_id=1, eos_token_id=2, n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
        topk_method='group_limited_greedy',
    ),
    'deepseek_v3': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_hidden_layers=2,
        bos_token_id=1, eos_token_id=2, n_group=2, topk_group=1, first_k_dense_replace=1,
    ),
    'deepseek_v32': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=4,
        index_head_dim=8, index_n_heads=2, num_hidden_layers=2, bos_token_id=1, eos_token_id=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, mlp_layer_types=['dense', 'sparse'],
    ),
    'deepseek_v4': dict(
        vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        q_lora_rank=16, index_topk=4, index_head_dim=8, index_n_heads=2, sliding_window=16, num_hidden_layers=2,
        bos_token_id=1, eos_token_id=2, layer_types=['sliding_attention', 'compressed_sparse_attention'],
        mlp_layer_types=['hash_moe', 'moe'], o_groups=2, o_lora_rank=16, num_nextn_predict_layers=0,
    ),
    'diffusion_gemma': dict(
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, top_k_experts=2,
            sliding_window=16, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            layer_types=['sliding_attention', 'full_attention'],
        ),
        vision_config=dict(
            model_type='gemma4_vision', hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=16,
            max_position_embeddings=256,
        ),
        canvas_length=8,
    ),
    'diffusion_gemma_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, top_k_experts=2,
        sliding_window=16, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=['sliding_attention', 'full_attention'],
    ),
    'doge': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_experts=16, num_experts_per_tok=2, sliding_window=16, num_hidden_layers=2,
        is_moe=True, keep_window_size=16,
    ),
    'dots1': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        sliding_window=16, num_hidden_layers=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
    ),
    'dots3_note': dict(
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
            head_dim=16, max_position_embeddings=256, moe_intermediate_size=16, shared_experts_intermediate_size=16,
            n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, index_topk=4, index_head_dim=8, index_n_heads=2, sliding_window=16,
            num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, n_group=2, topk_group=1,
            mlp_layer_types=['dense', 'sparse'],
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=4,
            mlp_layer_types=['dense', 'sparse'], num_local_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, adapter_in_dim=32, adapter_out_dim=32,
        ),
        audio_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=16, adapter_input_size=32, adapter_out_dim=32, feature_size=16, downsample_hidden_size=8,
            max_position_embeddings=64,
        ),
    ),
    'dots3_note_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        head_dim=16, max_position_embeddings=256, moe_intermediate_size=16, shared_experts_intermediate_size=16,
        n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, index_topk=4, index_head_dim=8, index_n_heads=2, sliding_window=16,
        num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, n_group=2, topk_group=1,
        mlp_layer_types=['dense', 'sparse'],
    ),
    'dots3_note_vision_encoder': dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, moe_intermediate_size=16, num_local_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, mlp_layer_types=['dense', 'sparse'], adapter_in_dim=32,
        adapter_out_dim=32,
    ),
    'ernie4_5_moe': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, moe_intermediate_size=16, moe_num_experts=4, moe_k=2, num_hidden_layers=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, moe_num_shared_experts=1,
    ),
    'ernie4_5_vl_moe': dict(
        vision_config=dict(hidden_size=32, intermediate_size=64, depth=1, num_heads=2, patch_size=4),
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, moe_intermediate_size=[16, 16], moe_num_experts=4, moe_k=2,
            num_hidden_layers=2, mlp_layer_types=['dense', 'sparse'], moe_num_shared_experts=1,
            rope_parameters=dict(rope_type='default', rope_theta=500000.0, mrope_section=[1, 1, 2]),
        ),
    ),
    'ernie4_5_vl_moe_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, moe_intermediate_size=[16, 16], moe_num_experts=4, moe_k=2, num_hidden_layers=2,
        mlp_layer_types=['dense', 'sparse'], moe_num_shared_experts=1,
        rope_parameters=dict(rope_type='default', rope_theta=500000.0, mrope_section=[1, 1, 2]),
    ),
    'exaone_moe': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        sliding_window=16, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, n_group=2,
        topk_group=1, first_k_dense_replace=1,
    ),
    'flex_olmo': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, pad_token_id=0,
        eos_token_id=2,
    ),
    'flint': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, sliding_window=16, num_hidden_layers=2, mlp_only_layers=[0],
        layer_types=['full_attention', 'sliding_attention'],
    ),
    'gemma4': dict(
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, top_k_experts=2,
            sliding_window=16, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            enable_moe_block=True, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, global_head_dim=8,
            layer_types=['sliding_attention', 'full_attention'],
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=16, patch_size=4, position_embedding_size=16, max_position_embeddings=256,
        ),
        audio_config=dict(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 8],
            output_proj_dims=32,
        ),
    ),
    'gemma4_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, top_k_experts=2,
        sliding_window=16, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        enable_moe_block=True, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, global_head_dim=8,
        layer_types=['sliding_attention', 'full_attention'],
    ),
    'glm4_moe': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, n_group=2, topk_group=1, first_k_dense_replace=1,
    ),
    'glm4_moe_lite': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_hidden_layers=2,
        bos_token_id=1, eos_token_id=2, n_group=2, topk_group=1, mlp_layer_types=['dense', 'sparse'],
    ),
    'glm4v_moe': dict(
        vision_config=dict(
            hidden_size=32, intermediate_size=64, depth=1, num_heads=2, patch_size=4, image_size=16,
            out_hidden_size=32,
        ),
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
            num_hidden_layers=2, n_group=2, topk_group=1, first_k_dense_replace=1,
            rope_parameters=dict(
                rope_type='default', rope_theta=10000.0, partial_rotary_factor=1.0, mrope_section=[2, 1, 1],
            ),
        ),
    ),
    'glm4v_moe_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        rope_parameters=dict(
            rope_type='default', rope_theta=10000.0, partial_rotary_factor=1.0, mrope_section=[2, 1, 1],
        ),
    ),
    'glm5_next': dict(
        vision_config=dict(
            hidden_size=32, intermediate_size=64, depth=1, num_heads=2, patch_size=4, image_size=16,
            out_hidden_size=32, projection_intermediate_size=64,
        ),
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
            kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=16, v_head_dim=8, index_topk=4, index_head_dim=8,
            index_n_heads=2, linear_head_dim=8, linear_num_heads=4, num_hidden_layers=2, pad_token_id=0, n_group=2,
            topk_group=1, mlp_layer_types=['dense', 'sparse'], layer_types=['linear_attention', 'indexed_attention'],
            qk_rope_head_dim=0, head_dim=0, index_kpool=2,
        ),
    ),
    'glm5_next_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=16, v_head_dim=8, index_topk=4, index_head_dim=8,
        index_n_heads=2, linear_head_dim=8, linear_num_heads=4, num_hidden_layers=2, pad_token_id=0, n_group=2,
        topk_group=1, mlp_layer_types=['dense', 'sparse'], layer_types=['linear_attention', 'indexed_attention'],
        qk_rope_head_dim=0, head_dim=0, index_kpool=2,
    ),
    'glm_moe_dsa': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=4,
        index_head_dim=8, index_n_heads=2, num_hidden_layers=2, bos_token_id=1, eos_token_id=2, n_group=2,
        topk_group=1, mlp_layer_types=['dense', 'sparse'],
    ),
    'gpt_oss': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=16, num_hidden_layers=2,
    ),
    'granitemoe': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, bos_token_id=1,
        eos_token_id=2,
    ),
    'granitemoe_swa': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        num_hidden_layers=2, bos_token_id=1, eos_token_id=2,
    ),
    'granitemoehybrid': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_state=8,
        mamba_chunk_size=16, num_hidden_layers=2, bos_token_id=1, eos_token_id=2,
        layer_types=['linear_attention', 'full_attention'], shared_intermediate_size=16,
    ),
    'granitemoeshared': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, bos_token_id=1,
        eos_token_id=2,
    ),
    'hunyuan_v1_moe': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, num_experts=4, moe_topk=2, num_hidden_layers=2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    ),
    'hy_v3': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2,
    ),
    'hy_v4': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=4,
        index_head_dim=8, index_n_heads=2, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        n_group=2, topk_group=1, mlp_layer_types=['dense', 'sparse'],
    ),
    'hy_v4_vl': dict(
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            patch_size=4, out_hidden_size=32, max_image_size=64,
        ),
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4,
            num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, index_topk=4, index_head_dim=8, index_n_heads=2, num_hidden_layers=2, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, n_group=2, topk_group=1, mlp_layer_types=['dense', 'sparse'],
            rope_parameters=dict(rope_type='default', rope_theta=10000.0, mrope_section=[2, 1, 1]),
        ),
    ),
    'hy_v4_vl_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=4,
        index_head_dim=8, index_n_heads=2, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        n_group=2, topk_group=1, mlp_layer_types=['dense', 'sparse'],
        rope_parameters=dict(rope_type='default', rope_theta=10000.0, mrope_section=[2, 1, 1]),
    ),
    'inkling2': dict(
        text_config=dict(
            vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, max_position_embeddings=256,
            moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, sliding_window_size=16,
            num_hidden_layers=2, eos_token_id=2, unpadded_vocab_size=128, layer_types=['hybrid_sliding', 'hybrid'],
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
            text_hidden_size=32, projection_hidden_dim=32, posemb_grid_size=4,
        ),
    ),
    'inkling2_loop': dict(
        text_config=dict(
            vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, max_position_embeddings=256,
            moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, sliding_window_size=16,
            num_hidden_layers=2, eos_token_id=2, unpadded_vocab_size=128, layer_types=['hybrid_sliding', 'hybrid'],
            loop_layer_index_start=1, loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=8,
            n_layers_per_attn_res_block=1,
        ),
        vision_config=dict(
            model_type='inkling2_vision', hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, patch_size=4, text_hidden_size=32, projection_hidden_dim=32, posemb_grid_size=4,
        ),
    ),
    'inkling2_loop_text': dict(
        vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, max_position_embeddings=256,
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, sliding_window_size=16,
        num_hidden_layers=2, eos_token_id=2, unpadded_vocab_size=128, layer_types=['hybrid_sliding', 'hybrid'],
        loop_layer_index_start=1, loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=8,
        n_layers_per_attn_res_block=1,
    ),
    'inkling2_text': dict(
        vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, max_position_embeddings=256,
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, sliding_window_size=16,
        num_hidden_layers=2, eos_token_id=2, unpadded_vocab_size=128, layer_types=['hybrid_sliding', 'hybrid'],
    ),
    'inkling_mm_model': dict(
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
            max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
            sliding_window_size=16, num_hidden_layers=2, bos_token_id=1, eos_token_id=2,
            mlp_layer_types=['dense', 'sparse'],
        ),
        vision_config=dict(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4, text_hidden_size=32,
        ),
        audio_config=dict(text_hidden_size=32, n_mel_bins=8, mel_vocab_size=16),
    ),
    'inkling_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
        max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        sliding_window_size=16, num_hidden_layers=2, bos_token_id=1, eos_token_id=2,
        mlp_layer_types=['dense', 'sparse'],
    ),
    'jamba': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, num_hidden_layers=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, use_mamba_kernels=False,
    ),
    'jetmoe': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_key_value_heads=2, kv_channels=8,
        max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, bos_token_id=1,
        eos_token_id=2,
    ),
    'kimi_linear': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, linear_head_dim=8,
        linear_num_heads=4, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, n_group=2,
        topk_group=1, layer_types=['linear_attention', 'full_attention'], mlp_layer_types=['dense', 'sparse'],
    ),
    'kolibri1': dict(
        vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=256, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, sliding_window=16, num_hidden_layers=2,
    ),
    'laguna': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, sliding_window=16, num_hidden_layers=2,
    ),
    'lara_mini': dict(
        vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=256, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, sliding_window=16, num_hidden_layers=2, eos_token_id=2,
    ),
    'lfm2_moe': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, layer_types=['conv', 'full_attention'],
        num_dense_layers=1,
    ),
    'llama4': dict(
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, num_local_experts=4,
            num_experts_per_tok=2, num_hidden_layers=2, bos_token_id=1, eos_token_id=2, interleave_moe_layer_step=2,
            attention_chunk_size=16,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
            image_size=16, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32,
        ),
    ),
    'llama4_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, bos_token_id=1, eos_token_id=2, interleave_moe_layer_step=2, attention_chunk_size=16,
    ),
    'longcat_flash': dict(
        vocab_size=128, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
        max_position_embeddings=256, expert_ffn_hidden_size=16, n_routed_experts=4, moe_topk=2, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_layers=2, bos_token_id=1,
        eos_token_id=2, zero_expert_num=2,
    ),
    'mellum': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        sliding_window=16, num_hidden_layers=2, mlp_layer_types=['dense', 'sparse'],
    ),
    'mimo_v2_flash': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        v_head_dim=8, sliding_window=16, num_hidden_layers=2, bos_token_id=1, n_group=2, topk_group=1,
    ),
    'minimax': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        num_hidden_layers=2, bos_token_id=1, eos_token_id=2,
    ),
    'minimax_m2': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        bos_token_id=1, eos_token_id=2,
    ),
    'minimax_m3_vl': dict(
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, dense_intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, num_local_experts=4,
            num_experts_per_tok=2, index_head_dim=8, index_n_heads=2, num_hidden_layers=2, bos_token_id=1,
            eos_token_id=2, mlp_layer_types=['dense', 'sparse'], shared_intermediate_size=16, rotary_dim=8,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
            image_size=16,
        ),
        projector_hidden_size=32,
    ),
    'minimax_m3_vl_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, dense_intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
        index_head_dim=8, index_n_heads=2, num_hidden_layers=2, bos_token_id=1, eos_token_id=2,
        mlp_layer_types=['dense', 'sparse'], shared_intermediate_size=16, rotary_dim=8,
    ),
    'mistral4': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_hidden_layers=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, n_group=2, topk_group=1, first_k_dense_replace=1,
    ),
    'mistral_large4': dict(
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
            head_dim=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=4, index_head_dim=8, index_n_heads=2,
            num_hidden_layers=2, bos_token_id=1, eos_token_id=2, n_group=2, topk_group=1,
            mlp_layer_types=['dense', 'sparse'],
        ),
        vision_config=dict(
            model_type='pixtral', hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            patch_size=4, image_size=16,
        ),
    ),
    'mistral_large4_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        head_dim=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=4, index_head_dim=8, index_n_heads=2,
        num_hidden_layers=2, bos_token_id=1, eos_token_id=2, n_group=2, topk_group=1,
        mlp_layer_types=['dense', 'sparse'],
    ),
    'mixtral': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        num_hidden_layers=2, bos_token_id=1, eos_token_id=2,
    ),
    'muse_spark': dict(
        text_config=dict(
            vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=16, num_hidden_layers=2, bos_token_id=1, eos_token_id=2,
            moe_hidden_size=32, mlp_layer_types=['dense', 'sparse'],  # latent experts: 32 wide in a 64-wide model
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
            pos_emb_height=4, pos_emb_width=4, max_position_embeddings=16,
        ),
        audio_config=dict(
            num_hidden_layers=1, out_hidden_size=64, patch_sizes=[4], hidden_sizes=[16], depths=[1],
        ),
        out_hidden_size=64, projector_hidden_size=32,
    ),
    'muse_spark_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=16, num_hidden_layers=2, bos_token_id=1, eos_token_id=2,
        moe_hidden_size=16, mlp_layer_types=['dense', 'sparse'],
    ),
    'nemotron_h': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
        n_routed_experts=4, num_experts_per_tok=2, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=8,
        chunk_size=16, sliding_window=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, n_group=2, topk_group=1,
    ),
    'nllb-moe': dict(
        vocab_size=128, d_model=32, max_position_embeddings=64, num_experts=4, encoder_layerdrop=0.0,
        decoder_layerdrop=0.0, dropout=0.0, attention_dropout=0.0, moe_token_dropout=0.0, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_sparse_step=2, decoder_sparse_step=2,
        decoder_start_token_id=2,
    ),
    'olmoe': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, pad_token_id=0,
        eos_token_id=2,
    ),
    'openai_privacy_filter': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=16, num_hidden_layers=2,
        pad_token_id=0, eos_token_id=2,
    ),
    'phimoe': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        num_hidden_layers=2, router_jitter_noise=0.0, bos_token_id=1, eos_token_id=2,
    ),
    'qwen2_moe': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, sliding_window=16, num_hidden_layers=2, mlp_only_layers=[0],
    ),
    'qwen3_5_moe': dict(
        vision_config=dict(
            hidden_size=32, intermediate_size=64, depth=1, num_heads=2, patch_size=4, out_hidden_size=32,
            num_position_embeddings=16,
        ),
        text_config=dict(
            vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=256, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
            num_experts_per_tok=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, num_hidden_layers=2, layer_types=['linear_attention', 'full_attention'],
        ),
    ),
    'qwen3_5_moe_text': dict(
        vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=256, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, num_hidden_layers=2, layer_types=['linear_attention', 'full_attention'],
    ),
    'qwen3_moe': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        sliding_window=16, num_hidden_layers=2, mlp_only_layers=[0],
    ),
    'qwen3_next': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, num_hidden_layers=2, mlp_only_layers=[0],
        layer_types=['linear_attention', 'full_attention'],
    ),
    'qwen3_omni_moe': dict(
        thinker_config=dict(
            text_config=dict(
                vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                sliding_window=16, num_hidden_layers=2, mlp_only_layers=[0],
            ),
            vision_config=dict(
                hidden_size=32, intermediate_size=64, depth=1, num_heads=2, patch_size=4, out_hidden_size=32,
                num_position_embeddings=16, deepstack_visual_indexes=[0],
            ),
            audio_config=dict(
                d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, output_dim=32,
                downsample_hidden_size=8, num_mel_bins=16,
            ),
            vision_start_token_id=151652,
        ),
        talker_config=dict(
            text_config=dict(
                vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                sliding_window=16, num_hidden_layers=2, mlp_only_layers=[0], shared_expert_intermediate_size=16,
            ),
            code_predictor_config=dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, head_dim=16, vocab_size=32, num_code_groups=2,
            ),
            thinker_hidden_size=32, num_code_groups=2, spatial_merge_size=2,
        ),
        code2wav_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            codebook_size=32, num_quantizers=2, decoder_dim=16, upsample_rates=[2, 2], upsampling_ratios=[2],
        ),
        enable_audio_output=True,
    ),
    'qwen3_omni_moe_talker_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        sliding_window=16, num_hidden_layers=2, mlp_only_layers=[0], shared_expert_intermediate_size=16,
    ),
    'qwen3_omni_moe_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        sliding_window=16, num_hidden_layers=2, mlp_only_layers=[0],
    ),
    'qwen3_omni_moe_thinker': dict(
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
            sliding_window=16, num_hidden_layers=2, mlp_only_layers=[0],
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, depth=1, num_heads=2, patch_size=4, out_hidden_size=32,
            num_position_embeddings=16, deepstack_visual_indexes=[0],
        ),
        audio_config=dict(
            d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, output_dim=32,
            downsample_hidden_size=8, num_mel_bins=16,
        ),
        vision_start_token_id=151652,
    ),
    'qwen3_vl_moe': dict(
        vision_config=dict(
            hidden_size=32, intermediate_size=64, depth=1, num_heads=2, patch_size=4, out_hidden_size=32,
            num_position_embeddings=16, deepstack_visual_indexes=[0],
        ),
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
            num_hidden_layers=2, mlp_only_layers=[0],
        ),
    ),
    'qwen3_vl_moe_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, mlp_only_layers=[0],
    ),
    'qwen4_exp': dict(
        vision_config=dict(
            hidden_size=32, intermediate_size=64, depth=1, num_heads=2, patch_size=4, out_hidden_size=32,
            num_position_embeddings=16,
        ),
        text_config=dict(
            vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=256, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
            num_experts_per_tok=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, num_hidden_layers=2, layer_types=['linear_attention', 'indexed_attention'],
            hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8,
            indexer_compress_ratio=2,
        ),
    ),
    'qwen4_exp_text': dict(
        vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=256, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, num_hidden_layers=2, layer_types=['linear_attention', 'indexed_attention'],
        hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8,
        indexer_compress_ratio=2,
    ),
    'sarvam_mla': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_hidden_layers=2,
        bos_token_id=1, eos_token_id=2, n_group=2, topk_group=1, first_k_dense_replace=1,
    ),
    'sarvam_moe': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, pad_token_id=0, eos_token_id=2, n_group=2, topk_group=1, first_k_dense_replace=1,
    ),
    'solar_open': dict(
        vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, n_group=2, topk_group=1,
    ),
    'step3p5': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, share_expert_dim=16, num_local_experts=4,
        n_routed_experts=4, num_experts_per_tok=2, sliding_window=16, num_hidden_layers=2, pad_token_id=0,
        mlp_layer_types=['dense', 'sparse'],
    ),
    'step3p7': dict(
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
            image_size=16, max_position_embeddings=16,
        ),
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, share_expert_dim=16,
            num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, sliding_window=16, num_hidden_layers=3,
            pad_token_id=0, mlp_layer_types=['dense', 'sparse', 'sparse'],
            # clamps on the last layer only, small enough to bite on a tiny random model (the checkpoint's: 7 and 16)
            swiglu_limits=[0.0, 0.0, 0.02], swiglu_limits_shared=[0.0, 0.0, 0.03],
        ),
    ),
    'switch_transformers': dict(
        vocab_size=128, d_model=32, num_experts=4, num_layers=2, router_jitter_noise=0.0, dropout_rate=0.0,
        pad_token_id=0, eos_token_id=2, num_decoder_layers=2, num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1, d_ff=64, d_kv=8, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
    ),
    'unlimited_ocr': dict(
        vision_config=dict(
            sam_config=dict(
                hidden_size=16, num_hidden_layers=2, num_attention_heads=2, patch_size=4, image_size=32,
                output_channels=8, window_size=2, global_attn_indexes=[1], mlp_dim=32, downsample_channels=[16, 32],
            ),
            encoder_config=dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                image_size=16,
            ),
        ),
        text_config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4,
            num_experts_per_tok=2, sliding_window=16, num_hidden_layers=2, bos_token_id=1, eos_token_id=2, n_group=2,
            topk_group=1, mlp_layer_types=['dense', 'sparse'], topk_method='group_limited_greedy',
        ),
    ),
    'unlimited_ocr_text': dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        sliding_window=16, num_hidden_layers=2, bos_token_id=1, eos_token_id=2, n_group=2, topk_group=1,
        mlp_layer_types=['dense', 'sparse'], topk_method='group_limited_greedy',
    ),
    'vitpose_backbone': dict(
        hidden_size=32, num_attention_heads=4, num_experts=4, num_hidden_layers=2, image_size=[32, 24],
        patch_size=[8, 8], mlp_ratio=2, part_features=8,
    ),
    'zaya': dict(
        vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=1,
        sliding_window=16, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        router_hidden_size=16,
    ),
}

_NO_CLASS = ("no model class (not in the causal-LM, image-text-to-text, multimodal-LM, seq2seq-LM or base model "
             "mappings)")
UNBUILDABLE: dict[str, str] = {
    # sub-configs of a composite model: their MoE is built and checked through the composite type
    "deepseek_ocr2_text": f"{_NO_CLASS}; text part of deepseek_ocr2",
    "diffusion_gemma_text": f"{_NO_CLASS}; text part of diffusion_gemma",
    "dots3_note_vision_encoder": f"{_NO_CLASS}; vision part (with MoE layers) of dots3_note",
    "ernie4_5_vl_moe_text": f"{_NO_CLASS}; text part of ernie4_5_vl_moe",
    "qwen3_omni_moe_talker_text": f"{_NO_CLASS}; talker text part of qwen3_omni_moe",
    "qwen3_omni_moe_text": f"{_NO_CLASS}; thinker text part of qwen3_omni_moe / qwen3_omni_moe_thinker",
    "step3p5": f"{_NO_CLASS}; config class is Step3p7TextConfig, the text part of step3p7",
    "unlimited_ocr_text": f"{_NO_CLASS}; text part of unlimited_ocr",
    "vitpose_backbone": f"{_NO_CLASS}; VitPoseBackbone is only in the backbone mapping (not a language model)",
    # builds, but is not usable as a tiny MoE model
    "doge": "builds and runs, but its MoE (DogeCDMoE, product-key embedding experts down_embed/up_embed) has no "
            "`experts` child module, which this sweep looks for (it converts: tests/test_doge.py)",
    "llama4": "Llama4ForConditionalGeneration builds, but its forward fails in transformers 5.24: AttributeError: "
              "'MoeCausalLMOutputWithPast' object has no attribute 'image_outputs' (modeling_llama4.py:1318); the "
              "families test reads its forward's code below the decorators, and the zoo model has a forward of its "
              "own (tests/test_llama4_vl.py)",
}

_MAPPINGS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
)


def tiny_config(model_type: str):
    """The family's config class built from ``TINY[model_type]``."""
    return CONFIG_MAPPING[model_type](**TINY[model_type])


def model_class(model_type: str):
    """Causal-LM class, else image-text-to-text, else multimodal-LM, else seq2seq-LM, else the base model; None if none.

    A causal-LM class whose ``config_class`` is the composite's *text* sub-config (llama4, qwen3_5_moe, qwen4_exp,
    dots3_note) is skipped: built from the composite config it fails, so the next mapping's class is used."""
    text_cls = getattr(CONFIG_MAPPING[model_type], "sub_configs", {}).get("text_config")
    for name in _MAPPINGS:
        cls_name = getattr(_auto, name).get(model_type)
        if not cls_name:
            continue
        cls = getattr(transformers, cls_name)
        if text_cls is not None and getattr(cls, "config_class", None) is text_cls:
            continue
        return cls
    return None
