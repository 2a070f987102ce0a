"""First-party routers."""
from zoo import hookimpl


@hookimpl
def register_routers(register):
    from zoo_routers.sigmoid_bias import SigmoidBias
    from zoo_routers.topk_softmax import TopKSoftmax

    register(TopKSoftmax)
    register(SigmoidBias)
