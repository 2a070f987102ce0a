"""First-party compressors: pruning and merging of experts."""
from zoo import hookimpl


@hookimpl
def register_compressors(register):
    from zoo_compressors.channel_topk import ChannelTopK
    from zoo_compressors.hc_smoe import HcSmoe
    from zoo_compressors.hodge_cover import HodgeCover
    from zoo_compressors.moe_svd import MoeSvd
    from zoo_compressors.prune_frequency import PruneFrequency
    from zoo_compressors.prune_reap import PruneReap
    from zoo_compressors.quantize import Quantize
    from zoo_compressors.sub_moe import SubMoe

    register(PruneFrequency)
    register(PruneReap)
    register(HcSmoe)
    register(Quantize)
    register(ChannelTopK)
    register(SubMoe)
    register(MoeSvd)
    register(HodgeCover)
