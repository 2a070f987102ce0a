"""The forward of a family that keeps its own causal-LM forward (the generic adapter's families): the family's
forward runs as it is (logit scaling, soft-capping, its own label loss), except for the balance loss.

The family's own balance loss stacks every layer's router logits as one expert count (``self.num_experts`` of
the config it was built with), which fails once a prune or merge leaves layers with different counts. So the
family's forward runs with router logits off, the logits are recorded off the zoo's routers, and the zoo adds the
family's balance loss (``zoo.moe.losses.family_aux_loss``: the family's own function where the layout is uniform,
the mean of its per-layer values where it is not) with the family's coefficient, as the family's forward would."""
import dataclasses
import functools
import inspect

from transformers.utils import can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg

from zoo.moe.losses import family_aux_loss, native_balance_loss
from zoo.moe.router_capture import recorded_router_logits


def forward_with_zoo_balance_loss(model_class, loss_function=None):
    """The forward of ``model_class`` (the family's own, which calls its balance loss) with the zoo's balance loss
    in its place (``loss_function``: the family's, see ``Family.balance_loss``; None: its modeling module's); same
    signature, so generation and training read the family's arguments off it."""
    native, loss_function = model_class.forward, loss_function or native_balance_loss(model_class)
    signature = inspect.signature(native)
    renamed = "cache" in signature.parameters and "past_key_values" not in signature.parameters

    def forward(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs)
        wanted = call.arguments.get("output_router_logits")
        if wanted is None:
            wanted = getattr(self.config.get_text_config(), "output_router_logits", False)
        call.arguments["output_router_logits"] = False
        call.arguments.pop("return_dict", None)
        if not wanted:
            return native(*call.args, return_dict=True, **call.kwargs)
        with recorded_router_logits(self) as recorded:
            out = native(*call.args, return_dict=True, **call.kwargs)
        values = {field.name: getattr(out, field.name) for field in dataclasses.fields(out)}
        values["router_logits"] = logits = tuple(lg for _, lg in recorded)
        if logits:
            values["aux_loss"] = family_aux_loss(loss_function, logits, [router.top_k for router, _ in recorded],
                                                 call.arguments.get("attention_mask"))
            if call.arguments.get("labels") is not None and out.loss is not None:
                values["loss"] = out.loss + balance_loss_coef(self) * values["aux_loss"].to(out.loss.device)
        return type(out)(**values)  # built anew: its tuple form keeps the family's field order

    forward = functools.wraps(native)(forward)
    if renamed:  # as the family's own forward takes it
        forward = deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)
    return can_return_tuple(forward)


def balance_loss_coef(model) -> float:
    """The coefficient the family's forward scales its balance loss by: the attribute its ``__init__`` copies from
    the config, else the one the family reads off its (text) config."""
    for name in ("router_aux_loss_coef", "aux_loss_coef"):  # JetMoE's is aux_loss_coef
        coef = getattr(model, name, None)
        if coef is not None:
            return coef
    return type(model).zoo_family.aux_loss_coef(model.config.get_text_config())
