"""channel-topk: calibration-free top-k channel selection inside each expert (weight-informed scores)."""
from zoo import Compressor
from zoo.moe.channel_topk import ChannelTopKExperts
from zoo.moe.experts import SwiGLUExperts
from zoo.demo_controls import Control


class ChannelTopK(Compressor):
    name = "channel-topk"
    summary = "Per token, read only the top-k intermediate channels of each expert's down projection (no calibration)."
    paper = ("Channel Selection for MoE Decoding Needs No Calibration Data (2026); Chen et al., WINA: Weight Informed "
             "Neuron Activation for Accelerating LLM Inference, 2025, arXiv:2505.19427")
    card = "cards/channel-topk.md"
    space = "compression-lab"

    @classmethod
    def demo_controls(cls, model=None):
        return [Control("budget", "float", 0.5, low=0.05, high=1.0, step=0.05,
                        help="fraction of each expert's channels a token reads")]

    @classmethod
    def demo_presets(cls, model=None):
        return {"mild": {"budget": 0.75}, "strong": {"budget": 0.4}}

    def __init__(self, budget: float = 0.5):
        if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not 0 < budget <= 1:
            raise ValueError(f"budget (fraction of channels read per token) must be in (0, 1], got {budget!r}")
        super().__init__(budget=budget)
        self.budget = float(budget)

    def check_layer(self, index, block):
        if type(block.experts) is not SwiGLUExperts:
            raise ValueError(f"layer {index} has {block.experts.name!r} experts; channel-topk needs dense experts")

    def compress_layer(self, index, block, inputs):
        experts = ChannelTopKExperts.from_dense(block.experts, self.budget)
        return block.with_parts(experts=experts)
