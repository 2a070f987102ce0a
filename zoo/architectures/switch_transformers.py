"""Switch Transformers: a T5-style encoder-decoder whose sparse blocks (every ``encoder_sparse_step``-th of the encoder,
every ``decoder_sparse_step``-th of the decoder) hold an MoE layer: a top-1 router with per-sequence expert capacity
(``top1-capacity``) over ungated experts (``mlp``: wi [I, H] and wo [H, I] per expert, ReLU by default).

The zoo's layout lists the feed-forward layers of both stacks, encoder first, so index ``i`` of ``zoo_layout`` (and
of ``moe_layers``) is encoder block ``i`` for ``i < num_layers`` and decoder block ``i - num_layers`` after that."""
import torch
from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration
from transformers.models.switch_transformers.modeling_switch_transformers import (SwitchTransformersSparseMLP,
                                                                                  SwitchTransformersStack)
from transformers.utils.output_capturing import (_CAN_RECORD_REGISTRY, OutputRecorder, install_output_capuring_hook,
                                                 maybe_install_capturing_hooks)

from zoo.architectures.family import Family, NotConvertible
from zoo.moe import Router, routing_context
from zoo.moe.context import from_call

STACKS = ("encoder", "decoder")


class SwitchTransformers(Family):
    name = "switch_transformers"
    summary = "Switch Transformers encoder-decoder (top-1 router with expert capacity, ReLU experts in both stacks)."
    paper = ("Fedus et al., Switch Transformers: Scaling to Trillion Parameter Models with Simple and Efficient "
             "Sparsity, JMLR 2022. arXiv:2101.03961")
    config_class, model_class, block_class = (SwitchTransformersConfig, SwitchTransformersForConditionalGeneration,
                                              SwitchTransformersSparseMLP)
    intermediate_key = "d_ff"
    router = "top1-capacity"
    # why zoo.export(format="compressed-tensors") refuses the family (None: it does not)
    compressed_tensors_refused = ("transformers 5.24 loads no compressed-tensors Switch checkpoint (the family's "
                                  "weight init reads each expert's wi.weight, which a quantized Linear does not have); "
                                  "save the zoo model instead")
    router_config_keys = ()
    renames = {"router.classifier.": "router."}  # the router's own name (PEFT's); the experts are restacked below
    auto = "seq2seq-lm"
    zoo_forward = False  # the family's own forward: encoder, decoder and its router z-loss and balance loss
    base_attr = "base_model"  # transformers' base model of a Switch model is the model itself: it holds both stacks

    def layer_paths(self, base):
        return [f"{stack}.block.{i}.layer.{len(block.layer) - 1}"  # the feed-forward layer, last in each block
                for stack in STACKS for i, block in enumerate(getattr(base, stack).block)]

    def prepare(self, base):
        """Each stack becomes ``ZooSwitchTransformersStack`` (its calls publish their routing context; the zoo
        routers' logits are recorded), with transformers' output hooks on the routers it holds now."""
        for name in STACKS:
            stack = getattr(base, name)
            if type(stack) is not SwitchTransformersStack:
                continue
            stack.__class__ = ZooSwitchTransformersStack
            _CAN_RECORD_REGISTRY[stack] = ZooSwitchTransformersStack._can_record_outputs
            if getattr(stack, "_output_capturing_hooks_installed", False):  # a native model that ran: new routers
                for router in (m for m in stack.modules() if isinstance(m, Router)):
                    install_output_capuring_hook(router, "router_logits", 2)
            else:
                maybe_install_capturing_hooks(stack)
        # routers swapped in later get their hook from zoo.io.convert.hook_new_routers, which reads this flag
        base._output_capturing_hooks_installed = True

    # ---- structure -------------------------------------------------------------------------------
    def moe_layer_ids(self, config) -> list[int]:
        encoder = sparse_blocks(config.num_layers, config.encoder_sparse_step)
        decoder = sparse_blocks(config.num_decoder_layers, config.decoder_sparse_step)
        return encoder + [config.num_layers + i for i in decoder]

    def block_layout(self, config) -> dict:
        E = config.num_experts
        return {
            "num_experts": E,
            "num_experts_per_tok": 1,
            "router": self.router,
            "router_options": {"bias": config.router_bias, "expert_capacity": config.expert_capacity,
                               "jitter_noise": float(config.router_jitter_noise)},
            "experts": "mlp",
            "experts_options": {"num_experts": E, "hidden_size": config.d_model, "intermediate_size": config.d_ff,
                                "activation": config.dense_act_fn},
            "shared_experts": None,
            "returns_router_scores": False,
        }

    # ---- weights ---------------------------------------------------------------------------------
    def from_native(self, block, config):
        if config.router_dtype != "float32":
            raise NotConvertible(f"router_dtype={config.router_dtype!r}: the zoo's top1-capacity router computes in "
                                 "float32, as Switch Transformers' checkpoints do")
        return super().from_native(block, config)

    def to_zoo_state(self, sd: dict) -> dict:
        count = sum(key.endswith(".wi.weight") for key in sd)
        out = {"router.weight": sd["router.classifier.weight"],
               "experts.up_proj": torch.stack([sd[f"experts.expert_{e}.wi.weight"] for e in range(count)]),
               "experts.down_proj": torch.stack([sd[f"experts.expert_{e}.wo.weight"] for e in range(count)])}
        if "router.classifier.bias" in sd:
            out["router.bias"] = sd["router.classifier.bias"]
        return out

    def to_native_state(self, sd: dict) -> dict:
        out = {"router.classifier.weight": sd["router.weight"]}
        if "router.bias" in sd:
            out["router.classifier.bias"] = sd["router.bias"]
        for e, (up, down) in enumerate(zip(sd["experts.up_proj"], sd["experts.down_proj"])):
            out[f"experts.expert_{e}.wi.weight"] = up.clone()  # a tensor of its own: safetensors refuses shared ones
            out[f"experts.expert_{e}.wo.weight"] = down.clone()
        return out

    # ---- export ----------------------------------------------------------------------------------
    def native_config(self, config, layout):
        native = super().native_config(config, layout)
        start = getattr(config, "decoder_start_token_id", None)  # read by the family's _shift_right (labels)
        if start is not None:
            native.decoder_start_token_id = start
        return native

    def native_moe_values(self, values: dict, count: int, first: dict) -> dict:
        values.update(num_experts=count, d_ff=first["experts_options"].get("intermediate_size", values["d_ff"]))
        if first["router"] == self.router:  # another router is refused by the layer check that follows
            options = first["router_options"]
            values.update(router_bias=options["bias"], expert_capacity=options["expert_capacity"],
                          router_jitter_noise=options["jitter_noise"])
        return values


def sparse_blocks(count: int, step: int) -> list[int]:
    """The blocks of a stack of ``count`` that the family makes sparse (its own rule, edge cases included)."""
    return [i for i in range(count) if step > 0 and (i % step == 1 or step == 1)]


class ZooSwitchTransformersStack(SwitchTransformersStack):
    """A Switch Transformers stack holding zoo blocks. Each call publishes the routing context of its own tokens,
    which ``top1-capacity`` counts capacity over (the encoder's and the decoder's sequences differ in length), and
    the zoo routers' logits ``[T, E]`` come back as the family's ``[B, S, E]`` for its losses."""

    _can_record_outputs = {**SwitchTransformersStack._can_record_outputs,
                           "router_logits": OutputRecorder(Router, index=2)}

    def forward(self, input_ids=None, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                inputs_embeds=None, cache=None, use_cache=None, **kwargs):
        tokens = input_ids if input_ids is not None else inputs_embeds
        context = None if tokens is None else from_call(
            self, input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
            cache=cache if cache is not None else kwargs.get("past_key_values"))
        if cache is not None:
            kwargs["cache"] = cache
        with routing_context(context):
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask,
                                  encoder_hidden_states=encoder_hidden_states,
                                  encoder_attention_mask=encoder_attention_mask, inputs_embeds=inputs_embeds,
                                  use_cache=use_cache, **kwargs)
        logits = getattr(out, "router_logits", None)
        if logits and tokens is not None:
            out.router_logits = tuple(l.view(*tokens.shape[:2], -1) for l in logits)
        return out
