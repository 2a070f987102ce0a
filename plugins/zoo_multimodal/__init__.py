"""First-party multimodal plugin: modality-group experts (MoHAVE), hierarchical-modality and
language-conditioned (Parrot) routers, the ``zoo_mm`` architecture, a group-restricted pruner, the Earth-Adapter
vision adapter, and the ``moe-zoo digits-mm`` commands (data, training, evaluation)."""
import pluggy

hookimpl = pluggy.HookimplMarker("moe_zoo")  # zoo.hookimpl; not imported, so importing this package never loads zoo mid-way


@hookimpl
def register_architectures(register):
    from zoo_multimodal.family import ZooMM

    register(ZooMM())


@hookimpl
def register_experts(register):
    from zoo_multimodal.modality_groups import ModalityGroupExperts

    register(ModalityGroupExperts)


@hookimpl
def register_routers(register):
    from zoo_multimodal.hierarchical_modality import HierarchicalModality
    from zoo_multimodal.language_conditioned import LanguageConditioned

    register(HierarchicalModality)
    register(LanguageConditioned)


@hookimpl
def register_compressors(register):
    from zoo_multimodal.prune_group import PruneGroup

    register(PruneGroup)


@hookimpl
def register_adapters(register):
    from zoo_multimodal.earth_adapter import EarthAdapter

    register(EarthAdapter)


@hookimpl
def register_commands(cli):
    from zoo_multimodal.commands import digits_mm

    cli.add_command(digits_mm)
