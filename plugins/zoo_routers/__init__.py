"""First-party routers."""
from zoo import hookimpl


@hookimpl
def register_routers(register):
    from zoo_routers.adamoe import AdaMoE
    from zoo_routers.expert_choice import ExpertChoice
    from zoo_routers.gemma4_topk import Gemma4TopK
    from zoo_routers.inkling_topk import InklingTopK
    from zoo_routers.top1_capacity import Top1Capacity
    from zoo_routers.top2_capacity import Top2Capacity
    from zoo_routers.mixture_of_heads import MixtureOfHeads
    from zoo_routers.otp import OnlineTopAnyPruning
    from zoo_routers.product_key import ProductKey
    from zoo_routers.remix import Remix
    from zoo_routers.scored_topk import ScoredTopK
    from zoo_routers.sigmoid_bias import SigmoidBias
    from zoo_routers.sparsemixer import SparseMixer
    from zoo_routers.steer import Steer
    from zoo_routers.token_hash import TokenHash
    from zoo_routers.top_p import TopP
    from zoo_routers.topk_softmax import TopKSoftmax
    from zoo_routers.uncertainty_aware import UncertaintyAware
    from zoo_routers.zaya_mlp import ZayaMLP

    register(TopKSoftmax)
    register(SigmoidBias)
    register(ExpertChoice)
    register(TopP)
    register(OnlineTopAnyPruning)
    register(Steer)
    register(MixtureOfHeads)
    register(Remix)
    register(ScoredTopK)
    register(SparseMixer)
    register(TokenHash)
    register(AdaMoE)
    register(UncertaintyAware)
    register(Gemma4TopK)
    register(InklingTopK)
    register(Top1Capacity)
    register(Top2Capacity)
    register(ZayaMLP)
    register(ProductKey)
