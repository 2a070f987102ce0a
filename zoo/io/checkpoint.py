"""A safetensors checkpoint read lazily: the model's skeleton on the meta device, and one decoder layer at a
time materialised from the shards (read with plain file reads, so nothing of a layer stays resident once it is released).

Key names go through transformers' own conversion mapping, so a native checkpoint in any key naming that
``from_pretrained`` accepts (e.g. Mixtral's per-expert ``w1/w2/w3``) loads; a native MoE block is converted to
a ``SparseMoE`` as soon as its layer is read.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from collections import defaultdict
from functools import lru_cache

import torch

from zoo.io import finite

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# what a decoder-layer list is called (model.layers, backbone.layers (Nemotron-H), model.llm.layers (Inkling2),
# transformer.blocks (DBRX), model.language_model.layers (a vision-language model)); which list holds the decoder
# layers is the family's (``Checkpoint.layer_of``), never guessed from a name: vision towers have lists of their own
LAYER_LISTS = ("layers", "blocks")


class CheckpointError(ValueError):
    """The folder is not a checkpoint the layer-at-a-time path can read (with the reason)."""


def weight_map(path) -> dict[str, str]:
    """``{tensor name: shard file}`` of a safetensors checkpoint folder: ``model.safetensors`` when there is one (the
    file transformers reads first), else the index (one whose JSON or shape is broken, or that names a file outside
    the folder, is a ``CheckpointError`` naming it)."""
    single = os.path.join(path, SINGLE)
    if os.path.exists(single):
        return {k: single for k in shard_header(single)[1] if k != "__metadata__"}
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        try:
            with open(index) as f:
                entries = json.load(f)["weight_map"]
            if not isinstance(entries, dict) or not all(isinstance(v, str) for v in entries.values()):
                raise TypeError("weight_map is not {tensor: file}")
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index ({type(exc).__name__}: {exc})") from None
        outside = sorted({v for v in entries.values() if os.path.basename(v) != v or v in ("", ".", "..")})
        if outside:
            raise CheckpointError(f"{index} names shard {outside[0]!r}, which is not a file of the folder")
        return {k: os.path.join(path, v) for k, v in entries.items()}
    raise CheckpointError(f"{path} has no {SINGLE} or {INDEX} (only safetensors checkpoints are read)")


def checked_weight_map(path) -> dict[str, str]:
    """``weight_map`` with every shard present and holding each tensor the index gives it (an index naming the
    wrong shard is refused with the shard it named and the one that holds the tensor, if any)."""
    files = weight_map(path)
    holders: dict[str, str] = {}
    for file in sorted(set(files.values())):
        if not os.path.isfile(file):
            raise CheckpointError(f"{path}: the index names shard {os.path.basename(file)}, which is not there")
        holders.update({k: file for k in shard_header(file)[1] if k != "__metadata__"})
    for key, file in files.items():
        if holders.get(key) != file:
            found = f"it is in {os.path.basename(holders[key])}" if key in holders else "no shard holds it"
            raise CheckpointError(f"{path}: the index puts tensor {key} in {os.path.basename(file)}, which does not "
                                  f"hold it ({found})")
    return files


def checkpoint_bytes(path) -> int:
    """Bytes on disk of a checkpoint's shards."""
    return sum(os.path.getsize(f) for f in set(weight_map(path).values()))


DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER = 100 * 1024**2  # safetensors' own bound on a header's size


def file_key(file: str) -> tuple:
    """What identifies a file's contents for a cache: its real path, inode, size and modification time (a file
    rewritten in place, or replaced, gets a new key)."""
    st = os.stat(file)
    return os.path.realpath(file), st.st_ino, st.st_size, st.st_mtime_ns


def shard_header(file: str) -> tuple[int, dict]:
    """(offset of the data, the JSON header) of a safetensors file, checked: a bounded header length, valid JSON,
    known dtypes, and every tensor's byte range inside the file and of its shape's size. Cached per file contents
    (``file_key``), so a file rewritten since it was read is read anew."""
    try:
        key = file_key(file)
    except FileNotFoundError:
        raise CheckpointError(f"shard {file} is not there") from None
    return _parsed_header(*key)


@lru_cache(maxsize=256)
def _parsed_header(file: str, _inode: int, size: int, _mtime: int) -> tuple[int, dict]:
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file} is not a safetensors file ({size} bytes: shorter than a header)")
        n = struct.unpack("<Q", head)[0]
        if n > min(MAX_HEADER, size - 8):
            raise CheckpointError(f"{file} is not a safetensors file (or is truncated): its header claims {n} bytes "
                                  f"in a file of {size}")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{file} has a corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} has a corrupt safetensors header (not a JSON object)")
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = DTYPES.get(info["dtype"]), tuple(info["shape"]), info["data_offsets"]
            numel = math.prod(shape)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: the header entry of tensor {name} is malformed") from None
        if dtype is None:
            raise CheckpointError(f"{file}: tensor {name} has dtype {info['dtype']}, which the zoo does not read")
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data) or \
                any(not isinstance(d, int) or d < 0 for d in shape):
            raise CheckpointError(f"{file}: tensor {name} lies outside the file (truncated, or a corrupt header)")
        if end - begin != numel * dtype.itemsize:
            raise CheckpointError(f"{file}: tensor {name} holds {end - begin} bytes, its shape {list(shape)} needs "
                                  f"{numel * dtype.itemsize}")
    return 8 + n, header


def stored_dtypes(path) -> dict | None:
    """``{tensor: torch dtype}`` of the safetensors checkpoint in the folder ``path``, every shard's header checked
    (``checked_weight_map``); None when the folder holds no safetensors weights (another format: its loader checks)."""
    if not (os.path.exists(os.path.join(path, INDEX)) or os.path.exists(os.path.join(path, SINGLE))):
        return None
    out = {}
    for key, file in checked_weight_map(path).items():
        out[key] = DTYPES[shard_header(file)[1][key]["dtype"]]
    return out


def check_loading_info(where, info: dict, model) -> None:
    """``CheckpointError`` when transformers' loading report shows a tensor the model has no place for, one of another
    shape, or a weight the checkpoint lacks (it would be left at its random initialisation)."""
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = sorted(k for k in info.get("unexpected_keys") or () if not any(p.search(k) for p in ignored))
    if unexpected:
        raise CheckpointError(f"{where}: tensors the model has no place for: {unexpected[:5]}"
                              f"{' ...' if len(unexpected) > 5 else ''} (a checkpoint of another layout, or a config "
                              "that does not match it?)")
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        key, got, want = mismatched[0]
        raise CheckpointError(f"{where}: tensor {key} has shape {tuple(got)}, the config needs {tuple(want)}")
    missing_ok = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or []]
    missing = sorted(k for k in info.get("missing_keys") or () if not any(p.search(k) for p in missing_ok))
    if missing:
        raise CheckpointError(f"{where} lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}: they would "
                              "load as random numbers")


def check_stored_dtypes(where, stored: dict, model) -> None:
    """``CheckpointError`` when a stored tensor's dtype cannot be the weight it loads into: integers or booleans
    into a floating-point tensor of ``model`` (they would load as numbers converted from codes), or a float into an
    integer one (packed codes). ``stored``: ``{name: torch dtype}``; a name the model does not have is renamed by the
    family's conversion, which knows its own formats (DeepSeek-V4's integer hash tables, for one)."""
    targets = {k: t.dtype for k, t in model.state_dict(keep_vars=True).items()}
    for name, dtype in stored.items():
        target = targets.get(name)
        if target is not None and dtype.is_floating_point != target.is_floating_point:
            raise CheckpointError(f"{where}: tensor {name} is stored as {dtype}, but it loads into a {target} tensor: "
                                  "the checkpoint is corrupt or of another format")


class ShardTensor:
    """One tensor of a safetensors shard, read when indexed (``t[...]``, as transformers' loader does with
    safetensors slices) by plain file reads into memory of its own. A memory-mapped tensor keeps the whole
    mapping alive, and every page of it that was touched counts as resident: with mmap, a layer read peaked
    at its size twice (the file pages and the converted copy); with reads, once."""

    def __init__(self, file: str, key: str):
        self.file, self.key = file, key
        start, header = shard_header(file)
        info = header.get(key)
        if info is None or key == "__metadata__":
            raise CheckpointError(f"{file} does not hold tensor {key} (the index names the wrong shard?)")
        self.dtype, self.shape = DTYPES[info["dtype"]], tuple(info["shape"])
        self.offset, self.nbytes = start + info["data_offsets"][0], info["data_offsets"][1] - info["data_offsets"][0]

    def read(self) -> torch.Tensor:
        buf = torch.empty(self.nbytes, dtype=torch.uint8)
        with open(self.file, "rb") as f:
            f.seek(self.offset)
            if f.readinto(buf.numpy()) != self.nbytes:
                raise CheckpointError(f"{self.file}: tensor {self.key} is cut short (the file is truncated)")
        return buf.view(self.dtype).reshape(self.shape)

    def __getitem__(self, index):
        return self.read()[index]


def read_checked(file: str, key: str) -> torch.Tensor:
    """Tensor ``key`` of the shard ``file``, read through the checked header and refused if it holds NaN or inf."""
    tensor = ShardTensor(file, key).read()
    if finite.enabled() and finite.non_finite([(key, tensor)]):
        raise CheckpointError(f"{file}: NaN or inf in {key}")
    return tensor


def read_tensors(keys_by_file: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """The named tensors, read into memory of their own."""
    return {k: ShardTensor(file, k).read() for file, keys in keys_by_file.items() for k in keys}


def _libc():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: the allocator's own policy applies
        return None


LIBC = _libc()
if LIBC is not None:
    # glibc raises its mmap threshold (up to 32 MB) each time a large block is freed; a layer's tensors then come
    # from the heap and its freed pages stay resident. A fixed threshold keeps large tensors in their own mappings,
    # which go back to the system when freed (measured on a 3.7 GB model: 1.0 GB held after 2 layers without it).
    LIBC.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def trim_memory() -> None:
    """Give freed heap memory back to the system (glibc)."""
    if LIBC is not None:
        LIBC.malloc_trim(0)


class Checkpoint:
    """``Checkpoint(path)``: ``model`` is the skeleton (every layer on the meta device; embeddings, final norm
    and LM head loaded); ``load_layer(i)`` materialises decoder layer i, ``release(i)`` returns it to meta."""

    def __init__(self, path):
        from transformers import AutoConfig

        import zoo  # noqa: F401  (registers the zoo_<family> model types)
        from zoo.moe.layout import decoder_layers

        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path} is not a checkpoint folder")
        self.files = checked_weight_map(self.path)
        self.config = AutoConfig.from_pretrained(self.path)
        self.config._name_or_path = self.path
        self.dtype = self.config.dtype if isinstance(self.config.dtype, torch.dtype) else torch.float32
        self.model = self._skeleton()
        self.layers = decoder_layers(self.model, self.family)
        self._check_whole()
        extra = sorted(i for i in self.by_layer if i is not None and not 0 <= i < len(self.layers))
        if extra:
            raise CheckpointError(f"{self.path} holds tensors of layer {extra[0]}"
                                  f"{f' (and {len(extra) - 1} more layers)' if len(extra) > 1 else ''}, but its config "
                                  f"has {len(self.layers)} layers: they would be dropped (fix num_hidden_layers)")

    def _index(self, model) -> None:
        """``by_layer``: per decoder layer (None: outside the layers), per shard, the tensor names. A stored name is
        read as the model's (through transformers' conversion mapping: a vision-language checkpoint may store its
        language model's layers under another prefix), so a vision tower's own ``layers``/``blocks`` stay outside."""
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        renamings = [m for m in self.weight_mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in self.weight_mapping if isinstance(m, WeightConverter)]
        meta = dict.fromkeys(model.state_dict())
        # what the family's own loader drops on purpose (DeepSeek-V3's multi-token-prediction layer 61): a stored
        # tensor the model has no place for that one of its patterns names (a pattern never drops a tensor the model
        # holds: Unlimited-OCR's "lm_head" names the head it loads)
        ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
        self.by_layer: dict[int | None, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
        dropped = set()
        for key, file in self.files.items():
            name, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
            if name not in meta and any(p.search(key) for p in ignored):
                dropped.add(key)
                continue
            self.by_layer[self.layer_of(name)][file].append(key)
        self.files = {k: f for k, f in self.files.items() if k not in dropped}

    def layer_of(self, name: str) -> int | None:
        """The decoder layer a model tensor or module name lies in (``model.language_model.layers.3.mlp``), else None."""
        m = self._layer_name.match(name)
        return int(m.group(1)) if m else None

    def in_layers(self, name: str) -> bool:
        """Whether a model module name lies inside a decoder layer."""
        return self.layer_of(name + ".") is not None

    def _check_whole(self) -> None:
        """At open, from the headers alone: every stored dtype fits the weight it loads into, and (a zoo checkpoint,
        whose names are the model's own) every tensor of every layer is there, so a broken layer is refused before
        the first one is worked on, not halfway through."""
        stored = {k: DTYPES[shard_header(f)[1][k]["dtype"]] for k, f in self.files.items()}
        check_stored_dtypes(self.path, stored, self.model)
        if not self.native:
            missing = sorted(k for k in self.model.state_dict() if self.layer_of(k) is not None and k not in self.files)
            if missing:
                raise CheckpointError(f"{self.path} lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    @property
    def nbytes(self) -> int:
        return sum(os.path.getsize(f) for f in set(self.files.values()))

    def _skeleton(self):
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.initialization import no_init_weights
        from transformers.modeling_utils import local_torch_dtype

        from zoo.architectures.lookup import family_of
        from zoo.components.registry import registry

        # the class users load the family with (Qwen3.5-MoE's config also maps to a text-only causal LM)
        name = self.config.model_type.removeprefix("zoo_")
        spec = next((r.obj for r in registry.all("architecture") if r.obj.name == name), None)
        autos = {"causal-lm": AutoModelForCausalLM, "image-text-to-text": AutoModelForImageTextToText}
        auto = autos.get(spec.auto) if spec is not None else next(
            (a for a in autos.values() if type(self.config) in a._model_mapping), None)
        if auto is None:
            raise CheckpointError(f"{self.path}: streaming works on causal-LM and vision-language decoders; this "
                                  f"{self.config.model_type} model is worked on in memory (--no-stream)")
        with init_empty_weights(include_buffers=True), no_init_weights(), local_torch_dtype(self.dtype):
            model = auto.from_config(self.config)
        model.eval()
        self.family = family_of(model)  # unsupported families are refused here
        if getattr(self.family, "stream_refused", None):
            raise CheckpointError(f"{self.path}: {self.family.stream_refused}: work on it in memory (--no-stream)")
        self.family.discover(getattr(model, self.family.base_attr))
        if self.family.layers_path.rsplit(".", 1)[-1] not in LAYER_LISTS:
            raise CheckpointError(f"{self.path}: streaming works on decoders whose layers are a list (layers, "
                                  f"blocks); this {self.family.name} model keeps them at {self.family.base_attr}."
                                  f"{self.family.layers_path}: work on it in memory (--no-stream)")
        from zoo.moe.layout import layer_prefix

        root = layer_prefix(model, 0, self.family)[:-len("0.")]
        self._layer_name = re.compile(rf"^{re.escape(root)}(\d+)\.")
        self.native = getattr(type(model), "zoo_family", None) is None  # its MoE blocks are the family's own
        adapters = [p for p, spec in (getattr(self.config, "zoo_modules", None) or {}).items() if "adapter" in spec]
        for attr, found in (("zoo_attention", any(getattr(self.config, "zoo_attention", None) or [])),
                            ("zoo_modules", adapters)):
            if found:  # (a compressor's modules, quantized linears, are plain tensors: they stream)
                raise CheckpointError(f"{self.path} has {attr.replace('zoo_', '')} adapters outside the MoE blocks; "
                                      "such a model is worked on in memory (--no-stream)")
        self.weight_mapping = get_model_conversion_mapping(model)
        self._index(model)
        # everything outside the decoder layers: loaded now; non-persistent buffers (rotary tables) rebuilt
        self._load(model, self.by_layer.get(None, {}), prefix_filter=lambda k: self.layer_of(k) is None)
        for name, module in model.named_modules():
            if self.in_layers(name) or not any(b.is_meta for b in module.buffers(recurse=False)):
                continue
            # the family's initialisation computes the buffers (Gemma's embedding scale) but would also overwrite
            # the module's weights, just read: they are put back (any still on meta is refused below)
            loaded = {key: param.data for key, param in module.named_parameters(recurse=False)}
            module.to_empty(device="cpu", recurse=False)  # (swaps each parameter's data in place)
            model._init_weights(module)
            for key, data in loaded.items():
                getattr(module, key).data = data
        if any(getattr(c, "tie_word_embeddings", False) for c in (self.config, self.config.get_text_config())):
            model.tie_weights()  # (a vision-language model states it in its text part)
        meta = [k for k, t in model.state_dict().items() if t.is_meta and self.layer_of(k) is None]
        if meta:
            raise CheckpointError(f"{self.path} lacks tensors {meta[:5]}{' ...' if len(meta) > 5 else ''}")
        return model

    def _load(self, model, keys_by_file, prefix_filter):
        """Load tensors through transformers' conversion mapping (renames, fused experts) into ``model``."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
        from transformers.utils import logging

        verbosity = logging.get_verbosity()
        logging.set_verbosity_error()  # its per-call progress bar and key reports are ours to give
        async_load = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
        # lazy tensors, read one target tensor at a time (synchronously): the sources of a fused tensor are
        # freed as soon as it is built, instead of the whole layer's sources being read at once
        os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
        try:
            lazy = {k: ShardTensor(file, k) for file, keys in keys_by_file.items() for k in keys}
            info, _ = convert_and_load_state_dict_in_model(
                model, lazy, LoadStateDictConfig(dtype=self.dtype, weight_mapping=self.weight_mapping,
                                                 device_map={"": "cpu"}))
        finally:
            logging.set_verbosity(verbosity)
            if async_load is None:
                os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
            else:
                os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = async_load
        wanted = {k for k in info.missing_keys if prefix_filter(k)}
        ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
        unexpected = sorted(k for k in info.unexpected_keys if not any(p.search(k) for p in ignored))
        if unexpected:
            raise CheckpointError(f"{self.path}: tensors the model has no place for: {unexpected[:5]}"
                                  f"{' ...' if len(unexpected) > 5 else ''} (a checkpoint of another layout?)")
        if info.mismatched_keys:
            key, got, want = sorted(info.mismatched_keys)[0]
            raise CheckpointError(f"{self.path}: tensor {key} has shape {tuple(got)}, the config needs {tuple(want)}")
        return wanted

    def load_layer(self, i: int):
        """Decoder layer i with its weights (native MoE blocks converted to ``SparseMoE``)."""
        from transformers.initialization import no_init_weights
        from transformers.modeling_utils import local_torch_dtype

        from zoo.moe.layout import build_block, layer_prefix
        from zoo.moe import SparseMoE

        old = self.layers[i]
        # a native checkpoint names a regrouped family's tensors as its native layer holds them (Gemma 4)
        cls = self.family.native_layer_class(type(old)) if self.native else type(old)
        with no_init_weights(), local_torch_dtype(self.dtype):
            # fresh on CPU: non-persistent buffers are built, weights come next (a vision-language model: its text part)
            layer = cls(self.config.get_text_config(), i)
            attr = self.family.block_attr
            if not self.native and isinstance(getattr(old, attr, None), SparseMoE):
                setattr(layer, attr, build_block(getattr(old, attr).layout()))
        layer.eval()
        self.layers[i] = layer
        prefix = layer_prefix(self.model, i, self.family)
        missing = self._load(self.model, self.by_layer.get(i, {}), lambda k: k.startswith(prefix))
        if missing:
            self.layers[i] = old
            raise CheckpointError(f"{self.path} lacks tensors of layer {i}: {sorted(missing)[:5]}")
        bad = finite.non_finite((f"{prefix}{k}", t) for k, t in layer.state_dict().items()) if finite.enabled() else []
        if bad:
            self.layers[i] = old
            raise CheckpointError(f"{self.path}: NaN or inf in {', '.join(bad[:5])}")
        if self.native:
            self.family.regroup_layer(layer)
        if isinstance(getattr(layer, attr, None), self.family.block_class):
            setattr(layer, attr, self.family.from_native(getattr(layer, attr), self.config))
        return layer

    def release_outer(self, keep=()) -> None:
        """Return the modules outside the decoder layers (embeddings, LM head) to meta, except ``keep``."""
        keep_ids = {id(p) for m in keep for p in m.parameters()}
        for name, module in self.model.named_modules():
            if self.in_layers(name) or name.endswith(LAYER_LISTS):
                continue
            for key, p in list(module.named_parameters(recurse=False)):
                if id(p) not in keep_ids:
                    setattr(module, key, torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad))
        trim_memory()

    def release(self, i: int) -> None:
        """Return layer i to the meta device (its structure stays, for the layout of what is written)."""
        self.layers[i] = self.layers[i].to("meta")
        trim_memory()
