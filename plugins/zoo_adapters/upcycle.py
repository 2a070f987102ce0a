"""upcycle: Sparse Upcycling. A dense decoder becomes the zoo model of its family's MoE sibling (Llama and
Mistral -> Mixtral, Qwen2 -> Qwen2-MoE, Qwen3 -> Qwen3-MoE, OLMo 2 -> FlexOlmo): every layer's FFN is copied
into ``num_experts`` experts (optionally perturbed) behind a new router; attention, norms and embeddings are
copied unchanged.

Identical experts and renormalised top-k weights (the sibling's router with ``norm_topk_prob``) make the upcycled model compute the dense
model's function at init, whatever the router picks; training then lets the experts drift apart, because each
one only gets the gradient of the tokens routed to it.

Router init: ``gate="random"`` draws N(0, initializer_range) rows (the Sparse Upcycling recipe);
``gate="hidden"`` is mergekit's ``hidden`` gate mode, with the hidden state the router itself will see: each
expert's row is the mean MLP input (after the post-attention norm) over that expert's prompts, minus the mean
of all experts' rows (the other experts' prompts act as mergekit's negative prompts), scaled to unit norm.
Default prompts: windows of the shipped corpus' *train* split, expert e from domain ``DOMAINS[e % 2]``.

``router="adamoe"`` upcycles as AdaMoE does (``zoo_adapters.adamoe_layer``): the dense FFN stays as a shared
expert averaged with the routed copies, which an AdaMoE router selects and its scale adapter weights.
``experts="mofme"`` (MoFME, arXiv:2312.16610) upcycles into one shared copy of the FFN with ``num_experts``
identity FiLM modulations (``zoo_adapters.mofme``) behind MoFME's uncertainty-aware router, with the same router
rows: again the dense function at init, at one FFN plus ``2 * num_experts * I`` parameters per layer.
"""
from __future__ import annotations

import torch

from zoo import Adapter
from zoo.io.loading import tokenizer_for
from zoo.components.options import suggest, check_float, check_int
from zoo.components.controls import Control

GATES = ("random", "hidden")
ROUTERS = ("topk-softmax", "adamoe")  # the sibling's own top-k softmax (Sparse Upcycling), or AdaMoE's layer
EXPERT_KINDS = ("swiglu", "mofme")  # copies of the FFN, or MoFME's FiLM-modulated shared FFN
PROMPT_WINDOWS, PROMPT_LEN = 4, 128  # default prompts: per expert, 4 corpus windows of 128 tokens


# Each dense family transformers ships with an MoE sibling that computes the same layer around its FFN:
# dense model class -> (sibling model_type, how the sibling's config names the expert settings).
SIBLINGS = {
    "MistralForCausalLM": "mixtral",
    "LlamaForCausalLM": "mixtral",     # Mixtral is Mistral's (= Llama's) layer with an MoE FFN
    "Qwen2ForCausalLM": "qwen2_moe",   # the shared expert is left out (None): routed experts only
    "Qwen3ForCausalLM": "qwen3_moe",
    "Olmo2ForCausalLM": "flex_olmo",   # FlexOlmo is OLMo-2's post-norm layer with an MoE FFN; OLMoE is pre-norm
}
REFUSED = {
    "OlmoForCausalLM": "OLMo 1 uses parameter-free LayerNorm and no q/k norms, while transformers' OLMoE has "
                       "RMSNorm weights and q/k RMSNorm: no MoE family of transformers computes OLMo 1's layer "
                       "(OLMo 2 upcycles to FlexOlmo)",
}


def dense_mlps(model, who: str):
    """The FFNs of a dense decoder of a family with an MoE sibling (see ``SIBLINGS``), or a TypeError saying
    what ``who`` accepts."""
    kind = type(model).__name__
    if kind in REFUSED:
        raise TypeError(f"{who}: {REFUSED[kind]}")
    if kind not in SIBLINGS:
        raise TypeError(f"{who} needs a dense decoder of a family with an MoE sibling ("
                        + ", ".join(f"{k.removesuffix('ForCausalLM')} -> {v}" for k, v in SIBLINGS.items())
                        + f"), e.g. zoo.load('zoo-tiny-dense'); got {kind}")
    cfg = model.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise TypeError(f"{who} needs SwiGLU FFNs (hidden_act='silu'), got {cfg.hidden_act!r}")
    if getattr(cfg, "mlp_bias", False):
        raise TypeError(f"{who}: the FFNs have biases (mlp_bias=True); the MoE siblings' experts have none")
    if SIBLINGS[kind] == "mixtral" and getattr(cfg, "attention_bias", False):
        raise TypeError(f"{who}: attention_bias=True has no place in Mixtral's attention (no biases)")
    return [layer.mlp for layer in model.model.layers]


def sibling_config(dense, num_experts: int, top_k: int, intermediate: int, router_aux_loss_coef: float):
    """The MoE sibling's config: every field the dense config shares with it, then the expert settings, every
    layer sparse, routing weights renormalised over the top-k (what keeps identical experts lossless)."""
    from transformers import CONFIG_MAPPING

    target = SIBLINGS[type(dense).__name__]
    cls = CONFIG_MAPPING[target]
    fields = set(getattr(cls, "__dataclass_fields__", {})) or set(cls().to_dict())
    skip = {"model_type", "transformers_version", "architectures", "auto_map"}
    values = {k: v for k, v in dense.config.to_dict().items() if k in fields and k not in skip}
    values["router_aux_loss_coef"] = router_aux_loss_coef
    values["num_experts_per_tok"] = top_k
    if target == "mixtral":
        values.update(num_local_experts=num_experts, intermediate_size=intermediate)
        if values.get("head_dim") is None:
            values["head_dim"] = dense.config.hidden_size // dense.config.num_attention_heads
    elif target in ("qwen2_moe", "qwen3_moe"):
        values.update(num_experts=num_experts, moe_intermediate_size=intermediate, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[])
        if target == "qwen2_moe":
            values.update(shared_expert_intermediate_size=0, qkv_bias=True)  # Qwen2's q/k/v have biases
    elif target == "flex_olmo":
        values.update(num_experts=num_experts, intermediate_size=intermediate, norm_topk_prob=True)
    return cls(**values)


@torch.no_grad()
def to_sibling(dense, blocks: list[tuple], top_k: int, router_aux_loss_coef: float):
    """The zoo model of ``dense``'s MoE sibling family holding a copy of ``dense``'s attention, norm and embedding
    weights, and per layer the given ``(router [E, H], gate_up_proj [E, 2I, H], down_proj [E, H, I])``. The
    dense model is left as it was."""
    from transformers import AutoModelForCausalLM

    from zoo.io.convert import convert
    from zoo.moe.layout import moe_layers

    _, gate_up, down = blocks[0]
    config = sibling_config(dense, gate_up.shape[0], top_k, down.shape[2], router_aux_loss_coef)
    config._attn_implementation = dense.config._attn_implementation
    config._name_or_path = dense.config._name_or_path
    # families of the zoo's generic adapter (FlexOlmo) are read by running their block once: build those for real
    generic = SIBLINGS[type(dense).__name__] == "flex_olmo"
    with torch.device("cpu" if generic else "meta"):
        model = convert(AutoModelForCausalLM.from_config(config))
    for _, moe in moe_layers(model):
        moe.shared_experts = None  # Qwen2-MoE's always-on shared expert: the dense FFN is all in the experts
    state = {k: v.clone() for k, v in dense.state_dict().items() if ".mlp." not in k}
    for i, (router, gate_up, down) in enumerate(blocks):
        prefix = f"model.layers.{i}.mlp."
        state.update({prefix + "router.weight": router, prefix + "experts.gate_up_proj": gate_up,
                      prefix + "experts.down_proj": down})
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    buffers = dict(dense.named_buffers())
    for name, buf in list(model.named_buffers()):  # non-persistent buffers (rotary inv_freq) are not in the state
        if buf.is_meta or (generic and name in buffers and "." in name and not name.endswith(("weight", "bias"))):
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = buffers[name].clone()
    model.generation_config = dense.generation_config
    model.train(dense.training)
    return model


to_mixtral = to_sibling  # the name it had when only Mistral was accepted


def ffn_weights(mlp) -> tuple[torch.Tensor, torch.Tensor]:
    """A SwiGLU FFN's weights in the fused expert layout: ``gate_up [2I, H]`` (gate rows first), ``down [H, I]``."""
    return torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight


class Upcycle(Adapter):
    name = "upcycle"
    summary = "Sparse Upcycling: copy each dense FFN into E experts behind a new router (random or hidden-state init)."
    paper = ("Komatsuzaki et al., Sparse Upcycling: Training Mixture-of-Experts from Dense Checkpoints, ICLR 2023, "
             "arXiv:2212.05055")
    card = "cards/upcycle.md"
    space = "model-zoo"
    accepts_dense = True  # zoo.apply passes the dense model as it is (no zoo.convert first)

    @classmethod
    def demo_controls(cls, model=None):
        return [Control("num_experts", "int", 8, low=2, high=16, step=1, help="copies of the dense FFN"),
                Control("top_k", "int", 2, low=1, high=4, step=1, help="experts per token (at most num_experts)"),
                Control("gate", "choice", "random", choices=GATES, help="how the new router starts"),
                Control("noise", "float", 0.0, low=0.0, high=0.1, step=0.005, help="noise added to each copy"),
                Control("router", "choice", "topk-softmax", choices=ROUTERS,
                        help="adamoe: AdaMoE's layer (shared dense FFN + decoupled router)"),
                Control("experts", "choice", "swiglu", choices=EXPERT_KINDS,
                        help="swiglu: copies of the FFN; mofme: one shared FFN, a FiLM per expert (MoFME)")]

    @classmethod
    def demo_presets(cls, model=None):
        return {"mild": {"num_experts": 4, "top_k": 2}, "strong": {"num_experts": 8, "top_k": 2, "noise": 0.01}}

    def __init__(self, num_experts: int = 8, top_k: int = 2, gate: str = "random", noise: float = 0.0,
                 prompts: list | None = None, seed: int = 0, router_aux_loss_coef: float = 0.01,
                 router: str = "topk-softmax", experts: str = "swiglu"):
        super().__init__(num_experts=num_experts, top_k=top_k, gate=gate, noise=noise, prompts=prompts, seed=seed,
                         router_aux_loss_coef=router_aux_loss_coef, router=router, experts=experts)
        self.num_experts = check_int("num_experts", num_experts, 1)
        self.top_k = check_int("top_k", top_k, 1, num_experts)
        if gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {gate!r}{suggest(str(gate), GATES)}")
        self.gate = gate
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {router!r}{suggest(str(router), ROUTERS)}")
        self.router = router
        self.noise = check_float("noise", noise, 0.0)
        self.seed = check_int("seed", seed, 0)
        self.router_aux_loss_coef = check_float("router_aux_loss_coef", router_aux_loss_coef, 0.0)
        if experts not in EXPERT_KINDS:
            raise ValueError(f"experts must be one of {EXPERT_KINDS}, got {experts!r}"
                             f"{suggest(str(experts), EXPERT_KINDS)}")
        if experts == "mofme" and router != "topk-softmax":
            raise ValueError("experts='mofme' comes with MoFME's own uncertainty-aware router; leave router at its "
                             "default")
        if experts == "mofme" and noise:
            raise ValueError("noise perturbs copies of the FFN; experts='mofme' shares one FFN (no copies to perturb)")
        self.experts = experts
        if prompts is not None:
            if gate != "hidden":
                raise ValueError("prompts are only used by gate='hidden'")
            if not isinstance(prompts, (list, tuple)) or len(prompts) != num_experts:
                raise ValueError(f"prompts must be a list of {num_experts} items (one per expert: a text, a list of "
                                 "texts, or a list of token ids)")
        self.prompts = prompts
        self.results = {}

    @torch.no_grad()
    def attach(self, model):
        mlps = dense_mlps(model, self.name)
        E = self.num_experts
        g = torch.Generator().manual_seed(self.seed)
        routers = self.router_rows(model, mlps, g)
        if self.experts == "mofme":
            return self.attach_mofme(model, mlps, routers)
        blocks = []
        for mlp, router in zip(mlps, routers):
            gate_up, down = ffn_weights(mlp)
            gate_up, down = gate_up.expand(E, *gate_up.shape).clone(), down.expand(E, *down.shape).clone()
            if self.noise:
                for w in (gate_up, down):
                    w += self.noise * w.float().std() * torch.randn(w.shape, generator=g).to(w.dtype)
            blocks.append((router.to(gate_up.dtype), gate_up, down))
        moe = to_sibling(model, blocks, self.top_k, self.router_aux_loss_coef)
        if self.router == "adamoe":
            from zoo_adapters.adamoe_layer import to_adamoe

            to_adamoe(moe, mlps, routers, self.top_k, model.config.initializer_range, g)
        return moe

    def attach_mofme(self, model, mlps, routers):
        """The sibling built with one expert per layer, then each block given the shared FFN as MoFME experts and
        the router rows behind the uncertainty-aware router (both built before the model is put together)."""
        from zoo.moe.layout import component_class, moe_layers, set_block, sync_layout

        mofme, uar = component_class("experts", "mofme"), component_class("router", "uncertainty-aware")
        E, k, H = self.num_experts, self.top_k, model.config.hidden_size
        parts = []
        for mlp, rows in zip(mlps, routers):
            gate_up, down = ffn_weights(mlp)
            router = uar(H, E, k).to(device=down.device, dtype=down.dtype)
            router.weight.data.copy_(rows)
            parts.append((router, mofme.from_ffn(gate_up, down, E)))
        single = [(torch.zeros(1, H, dtype=down.dtype), gate_up[None], down[None])
                  for gate_up, down in (ffn_weights(mlp) for mlp in mlps)]
        out = to_sibling(model, single, 1, self.router_aux_loss_coef)
        for (i, moe), (router, experts) in zip(moe_layers(out), parts):
            set_block(out, i, moe.with_parts(router=router, experts=experts))
        for key in ("num_local_experts", "num_experts"):  # the sibling's own name for the expert count
            if hasattr(out.config, key):
                setattr(out.config, key, E)
        out.config.num_experts_per_tok = k
        sync_layout(out)
        out.train(model.training)
        return out

    def router_rows(self, model, mlps, g) -> list[torch.Tensor]:
        H, E = model.config.hidden_size, self.num_experts
        if self.gate == "random":
            std = model.config.initializer_range
            self.results = {"router_init": f"random N(0, {std}^2)"}
            return [torch.randn(E, H, generator=g) * std for _ in mlps]
        per_expert, described = self.expert_prompts(model)
        self.results = {"router_init": "hidden", "router_prompts": described}
        sums = torch.zeros(len(mlps), E, H, dtype=torch.float64)
        for e, batches in enumerate(per_expert):
            sums[:, e] = mean_mlp_inputs(model, mlps, batches)
        if E > 1:
            sums -= sums.mean(dim=1, keepdim=True)
        rows = sums / sums.norm(dim=-1, keepdim=True).clamp(min=1e-8)
        return [r.float() for r in rows]

    def expert_prompts(self, model) -> tuple[list[list[torch.Tensor]], str]:
        """Per expert, a list of token batches ``[B, S]``, and a description for the recipe."""
        if self.prompts is not None:
            tok = None
            out = []
            for item in self.prompts:
                items = [item] if isinstance(item, str) or (item and isinstance(item[0], int)) else list(item)
                batches = []
                for p in items:
                    if isinstance(p, str):
                        tok = tok or tokenizer_for(model)
                        p = tok(p)["input_ids"]
                    batches.append(torch.tensor([list(p)], dtype=torch.long))
                if any(b.numel() == 0 or b.min() < 0 or b.max() >= model.config.vocab_size for b in batches):
                    raise ValueError(f"prompts must be non-empty with token ids in [0, {model.config.vocab_size}) "
                                     "(texts are tokenized with the model's tokenizer, else the zoo's)")
                out.append(batches)
            return out, f"{len(out)} user prompt sets"
        from zoo.editing import calibration
        from zoo.data.corpus import DOMAINS

        try:
            tok = tokenizer_for(model, required=True)  # the model's own (checked to fit), or the zoo's for its models
        except ValueError as exc:
            raise ValueError(f"gate='hidden' without prompts tokenizes the zoo corpus: {exc}; or pass prompts") from None
        out = []
        for e in range(self.num_experts):
            spec = calibration.corpus(DOMAINS[e % len(DOMAINS)], PROMPT_WINDOWS * PROMPT_LEN, PROMPT_LEN, self.seed + e)
            out.append(calibration.batches(spec, tok))
        return out, (f"zoo corpus train split: per expert {PROMPT_WINDOWS} windows of {PROMPT_LEN} tokens, expert e "
                     f"from {DOMAINS[0]} (e even) or {DOMAINS[1]} (e odd), seed {self.seed} + e")


@torch.no_grad()
def mean_mlp_inputs(model, mlps, batches) -> torch.Tensor:
    """[L, H] mean over all tokens of ``batches`` of each layer's FFN input."""
    sums = torch.zeros(len(mlps), model.config.hidden_size, dtype=torch.float64)
    count = 0

    def hook(module, args, i):
        sums[i] += args[0].reshape(-1, args[0].shape[-1]).double().sum(0)

    handles = [m.register_forward_pre_hook(lambda mod, args, i=i: hook(mod, args, i)) for i, m in enumerate(mlps)]
    was_training = model.training
    model.eval()
    try:
        for ids in batches:
            model(input_ids=ids.to(model.device))
            count += ids.numel()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return sums / max(count, 1)
