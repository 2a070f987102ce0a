"""channel-topk: per token and routed expert, read only the channels a selector picks before reading the weights
(Channel Selection for MoE Decoding Needs No Calibration Data, 2026; WINA, 2025). See zoo/moe/channel_topk.py."""
from zoo import Compressor
from zoo.components.controls import Control
from zoo.moe.channel_topk import SELECTORS, ChannelTopKExperts, check_options
from zoo.moe.experts import SwiGLUExperts


class ChannelTopK(Compressor):
    name = "channel-topk"
    summary = ("Per token and routed expert, read only the top-k channels of gate, up and down that a selector "
               "picks before reading (ternary sketch with low-rank recovery by default; WINA; down-only).")
    paper = ("Channel Selection for MoE Decoding Needs No Calibration Data (2026); Chen et al., WINA: Weight Informed "
             "Neuron Activation for Accelerating LLM Inference, 2025, arXiv:2505.19427")
    card = "cards/channel-topk.md"
    space = "compression-lab"
    experts_after = "channel-topk"  # what a later step of the same recipe is judged on

    @classmethod
    def demo_controls(cls, model=None):
        return [Control("budget", "float", 0.5, low=0.05, high=1.0, step=0.05,
                        help="fraction of each expert's weights a token reads"),
                Control("selector", "choice", "sketch", choices=SELECTORS,
                        help="sketch: the paper's weight-only reader; wina: WINA's input-side scores; "
                             "down: gate and up read whole, only down's columns selected")]

    @classmethod
    def demo_presets(cls, model=None):
        return {"mild": {"budget": 0.75}, "strong": {"budget": 0.4}}

    def __init__(self, budget: float = 0.5, selector: str = "sketch", rule: str = "topk", rank: int | None = None):
        """
        budget: fraction of each expert weight matrix a token reads, in (0, 1]
        selector: sketch (the paper's weight-only reader), wina (WINA's input-side scores), down (gate and up read whole)
        rule: topk (the paper's: a fixed count per token, no calibration) or threshold (calibrated baseline)
        rank: rank of the sketch's low-rank recovery map (default 8; 0: none; sketch selector only)
        """
        resolved = check_options(budget, selector, rule, rank)
        super().__init__(budget=budget, selector=selector, rule=rule, rank=rank)
        self.budget, self.selector, self.rule, self.rank = float(budget), selector, rule, resolved
        # the calibrated-threshold baseline reads calibration tokens; top-k needs none (the paper's point)
        self.needs_calibration = rule == "threshold"
        self.inputs_for = ("compress",) if rule == "threshold" else ()
        self.results: dict = {}

    def check_layer(self, index, block):
        if type(block.experts) is not SwiGLUExperts:
            raise ValueError(f"layer {index} has {block.experts.name!r} experts; channel-topk needs dense experts")
        smaller = min(block.experts.hidden_size, block.experts.intermediate_size)
        if self.selector == "sketch" and self.rank > smaller:
            raise ValueError(f"rank={self.rank} exceeds layer {index}'s down projection's smaller side {smaller}")

    def compress_layer(self, index, block, inputs):
        experts = ChannelTopKExperts.from_dense(block.experts, budget=self.budget, selector=self.selector,
                                                rule=self.rule, rank=None if self.selector != "sketch" else self.rank)
        if self.rule == "threshold":
            routing = block.router(inputs)
            kept = experts.calibrate(inputs, routing.indices)
            self.results.setdefault("calibrated_kept", {})[str(index)] = {k: round(v, 4) for k, v in kept.items()}
        return block.with_parts(experts=experts)

