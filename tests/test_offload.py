"""zoo.offload: experts read from the checkpoint when routed, through an LRU cache, against the model in memory."""
import gc
import mmap
import os
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from tests.tiny import padded_batch, tiny_native
from zoo.runtime.decode import greedy
from zoo.io.checkpoint import CheckpointError
from zoo.moe import kernels
from zoo.moe.layout import sync_layout
from zoo.runtime.offloaded import ExpertCache, NotOffloadable, OffloadedExperts
from zoo.moe.quantized import QuantizedExperts
from zoo.runtime.offloading import cache_of

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """fp32 tiny Mixtral checkpoints (2 layers, 4 experts top-2): dense experts, and packed experts of mixed widths."""
    dense = zoo.convert(tiny_native("mixtral")).eval()
    packed = zoo.convert(tiny_native("mixtral", seed=1)).eval()
    for layer in packed.model.layers:
        layer.mlp.experts = QuantizedExperts.from_dense(layer.mlp.experts, [4, 8, 4, 2], group_size=32)
    sync_layout(packed)
    out = {}
    for name, model in (("dense", dense), ("packed", packed)):
        out[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(out[name])
    return out


@pytest.mark.parametrize("kind,reader", [("dense", "pread"), ("packed", "pread"), ("dense", "mmap")])
@torch.no_grad()
def test_same_logits_and_tokens_as_in_memory(saved, kind, reader):
    ref = zoo.load(saved[kind]).eval()
    off = zoo.offload(saved[kind], cache_experts=3, reader=reader)  # 3 of the 8 experts: evictions on the way
    assert all(isinstance(layer.mlp.experts, OffloadedExperts) for layer in off.model.layers)
    assert not any("experts" in k for k in off.state_dict())  # nothing of the experts is held by the model
    ids, mask = padded_batch()
    with kernels.turned_off():  # offloaded experts run the sorted dispatch: the reference on the same path
        assert torch.equal(off(input_ids=ids, attention_mask=mask).logits,
                           ref(input_ids=ids, attention_mask=mask).logits)
        if reader == "pread":  # (the readers differ in how bytes arrive, not in what the model computes with them)
            assert torch.equal(greedy(off, ids[:1], 6, compile=False), greedy(ref, ids[:1], 6, compile=False))
    stats = cache_of(off).stats()
    assert stats["misses"] > 0 and stats["evictions"] > 0 and stats["cached_experts"] <= 3
    assert (stats["reads_into_evicted"] > 0) == (reader == "pread")  # the evicted experts' memory read into again


@pytest.fixture(scope="module")
def saved_int4_int8(tmp_path_factory):
    """A packed checkpoint whose widths all read on the kernel (4 and 8 bits)."""
    packed = zoo.convert(tiny_native("mixtral", seed=2)).eval()
    for layer in packed.model.layers:
        layer.mlp.experts = QuantizedExperts.from_dense(layer.mlp.experts, [4, 8, 8, 4], group_size=32)
    sync_layout(packed)
    out = tmp_path_factory.mktemp("packed48")
    packed.save_pretrained(out)
    return out


@pytest.mark.parametrize("kind", ["dense", "packed"])
@torch.no_grad()
def test_cached_experts_run_on_the_kernel_as_the_experts_in_memory_do(saved, saved_int4_int8, monkeypatch, kind):
    """With the zoo's kernel loaded, inference reads each cached expert in place on it (its kind's kernel branch, one
    slot of weight 1 per token), chosen for the layer's call as the in-memory experts' eager call chooses: the same
    logits and greedy tokens as the model in memory, bit for bit, and no expert computed by its per-expert formula
    (in either model). With gradients on, and with the kernel turned off, the per-expert formula serves (the previous
    test's reference)."""
    if not kernels.load():
        pytest.skip(f"the zoo's kernel is not available here ({kernels.unavailable_reason()})")
    folder = saved["dense"] if kind == "dense" else saved_int4_int8
    ref = zoo.load(folder).eval()
    off = zoo.offload(folder, cache_experts=3)
    formula = []
    kinds = {type(off.model.layers[0].mlp.experts.fetch(e)) for e in range(4)}
    for cls in kinds:
        real = cls.expert
        monkeypatch.setattr(cls, "expert", lambda self, e, x, real=real: formula.append(e) or real(self, e, x))
    ids, mask = padded_batch()
    # the batch's pairs per expert within every eager limit, on every instruction set (packed codes on the AVX-512
    # sets stop at 4 pairs, where both models take torch's path: the previous test's)
    monkeypatch.setattr(kernels, "PAIRS_PER_EXPERT", dict.fromkeys(kernels.PAIRS_PER_EXPERT, 10**6))
    assert torch.equal(off(input_ids=ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits)
    assert torch.equal(greedy(off, ids[:1], 6, compile=False), greedy(ref, ids[:1], 6, compile=False))
    assert formula == []
    with torch.enable_grad():
        off(input_ids=ids[:1, :3])
    assert formula  # training: the per-expert formula (the kernel has no gradients)
    formula.clear()
    with kernels.turned_off():
        off(input_ids=ids[:1, :3])
    assert formula


@torch.no_grad()
def test_evicted_memory_is_reused_only_when_nothing_holds_it(saved):
    ref = zoo.load(saved["dense"]).eval().model.layers[0].mlp.experts
    experts = zoo.offload(saved["dense"], cache_experts=1).model.layers[0].mlp.experts
    cache = cache_of(experts)
    held = experts.fetch(0).gate_up_proj  # a caller keeps a tensor of expert 0
    before = held.clone()
    experts.fetch(1)  # evicts 0: its down_proj's memory is read into again, its held gate_up_proj's is not
    assert cache.reads_into_evicted == 1
    experts.fetch(2)  # evicts 1, whose memory nothing holds: expert 2 is read into both its tensors
    assert cache.reads_into_evicted == 3
    assert torch.equal(held, before)
    for e in (2, 1, 0):  # each read into reused memory is the expert's own bytes
        module = experts.fetch(e)
        assert torch.equal(module.gate_up_proj[0], ref.gate_up_proj[e]) and torch.equal(module.down_proj[0], ref.down_proj[e])


AFTER_A_FAILED_FULLGRAPH_COMPILE = """
import json, sys, torch
from zoo.runtime.offloaded import _only_held_here


def judged():  # a storage one local name holds: free; one a tensor also holds: held
    tensor = torch.ones(4)
    storage = tensor.untyped_storage()
    del tensor
    alone = _only_held_here(storage)
    other = torch.empty(0).set_(storage)
    return [alone, _only_held_here(storage), sys.getrefcount(object())]


@torch.compile(backend="eager", fullgraph=True)
def step(x):
    raise RuntimeError("inside")


before = judged()
try:
    step(torch.ones(1))
except Exception:
    pass
print(json.dumps([before, judged()]))
"""


def test_storages_judged_free_also_after_a_failed_fullgraph_compile():
    """torch's compiler, after a fullgraph compile failed, leaves calls holding each argument once more (a fresh
    process: it stays so); evicted memory nothing holds must still be judged free, and held memory held."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", AFTER_A_FAILED_FULLGRAPH_COMPILE], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    before, after = json.loads(run.stdout.strip().splitlines()[-1])
    assert before[:2] == [True, False] and after[:2] == [True, False]


@torch.no_grad()
def test_a_deep_copy_of_an_in_place_model_within_a_budget_runs_on_its_own(saved):
    """copy.deepcopy of an in-place model held to a budget: its experts become copies in memory (a deep copy copies
    the tensors), with books and a cache of their own; it gives the same logits after the original is gone."""
    import copy

    ids, mask = padded_batch()
    off = zoo.offload(saved["dense"], reader="in-place", cache_experts=1)
    want = off(input_ids=ids, attention_mask=mask).logits
    twin = copy.deepcopy(off)
    mine = cache_of(twin)
    assert mine is not cache_of(off) and mine.max_experts == 1 and not mine.entries
    del off
    gc.collect()
    assert torch.equal(twin(input_ids=ids, attention_mask=mask).logits, want)
    assert mine.misses > 0 and len(mine.entries) == 1


@torch.no_grad()
def test_a_deep_copy_reads_on_its_own(saved, tmp_path):
    """copy.deepcopy of an offloaded model (with a reader thread): the same logits, a cache of its own with the same
    budget (empty, no thread), file descriptors of its own (the original closed and gone, the copy still reads),
    and a shard changed since the original was opened refused by the copy too."""
    import copy

    folder = tmp_path / "model"
    shutil.copytree(saved["packed"], folder)
    ids, mask = padded_batch()
    off = zoo.offload(folder, cache_experts=3, prefetch=True)
    want = off(input_ids=ids, attention_mask=mask).logits
    twin = copy.deepcopy(off)
    mine, theirs = cache_of(twin), cache_of(off)
    assert mine is not theirs and (mine.max_experts, mine.max_bytes) == (theirs.max_experts, theirs.max_bytes)
    assert not mine.entries and mine.prefetcher is None and theirs.prefetcher is not None
    assert all(layer.mlp.experts.cache is mine for layer in twin.model.layers)  # one cache for all the copy's layers
    theirs.close()
    del off, theirs
    gc.collect()
    assert torch.equal(twin(input_ids=ids, attention_mask=mask).logits, want)
    assert mine.misses > 0 and mine.entries
    mine.clear()
    shard = next(folder.glob("*.safetensors"))
    stat = shard.stat()
    shard.write_bytes(shard.read_bytes())  # rewritten in place: the same bytes, a later modification time
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10 ** 9))
    with pytest.raises(NotOffloadable, match="changed since the model was opened"):
        twin(input_ids=ids, attention_mask=mask)


@torch.no_grad()
def test_native_checkpoint_with_experts_stored_apart(tmp_path):
    """A native Mixtral checkpoint as transformers writes it (each expert's w1/w2/w3 apart): each expert's gate and
    up matrices read and concatenated as transformers' conversion does, the rest converted as zoo.load converts it."""
    tiny_native("mixtral", seed=2).save_pretrained(tmp_path)
    ref, off = zoo.load(tmp_path).eval(), zoo.offload(tmp_path, cache_experts=2)
    ids, mask = padded_batch()
    with kernels.turned_off():  # the reference on the offloaded experts' path (the sorted dispatch)
        assert torch.equal(off(input_ids=ids, attention_mask=mask).logits,
                           ref(input_ids=ids, attention_mask=mask).logits)
    assert cache_of(off).misses > 0


@torch.no_grad()
def test_misses_only_for_routed_experts_and_each_once_with_room(saved):
    off = zoo.offload(saved["dense"])  # no limit: every expert read once, on first use
    routed = set()
    for i, layer in enumerate(off.model.layers):
        layer.mlp.router.register_forward_hook(
            lambda mod, args, out, i=i: routed.update((i, e) for e in out.indices.reshape(-1).tolist() if e < 4))
    ids = torch.tensor([[5, 17, 33]])
    off(input_ids=ids)
    cache = cache_of(off)
    assert set(cache.missed) == routed and all(n == 1 for n in cache.missed.values())
    assert len(routed) < 8 or cache.misses == 8  # (a 3-token prompt may route every expert of a 4-expert layer)
    before = dict(cache.missed)
    greedy(off, ids, 6, compile=False)
    assert all(n == 1 for n in cache.missed.values()) and set(before) <= set(cache.missed) == routed
    assert cache.bytes_read == cache.resident and cache.hits > 0  # all kept, each read once


def test_byte_budget_is_respected(saved):
    one = zoo.offload(saved["packed"], cache_experts=0)
    sizes = {e: one.model.layers[0].mlp.experts.load(e)[1] for e in range(4)}  # int4, int8, int4, int2 experts
    budget = int(2.5 * max(sizes.values()))
    off = zoo.offload(saved["packed"], cache_bytes=budget)
    with torch.no_grad():
        greedy(off, torch.tensor([[5, 17, 33, 9]]), 8, compile=False)
    stats = cache_of(off).stats()
    assert stats["evictions"] > 0 and 0 < stats["peak_resident_bytes"] <= budget
    assert stats["resident_bytes"] == sum(n for _, n in cache_of(off).entries.values())
    with pytest.raises(ValueError, match="cannot hold one expert"):
        zoo.offload(saved["packed"], cache_bytes=min(sizes.values()) - 1)


def test_lru_order():
    cache = ExpertCache(max_experts=2)
    load = lambda: (object(), 10)  # noqa: E731
    for key in ("a", "b", "a", "c"):  # "b" is the least recently used when "c" arrives
        cache.get(key, load)
    assert list(cache.entries) == ["a", "c"] and (cache.hits, cache.misses, cache.evictions) == (1, 3, 1)


def test_missing_tensor_fails_with_its_name(saved, tmp_path):

    shutil.copytree(saved["dense"], tmp_path / "m", dirs_exist_ok=True)
    file = tmp_path / "m" / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.experts.down_proj"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks tensors.*model\.layers\.1\.mlp\.experts\.down_proj"):
        zoo.offload(tmp_path / "m")  # (judged when the checkpoint is opened, as every reader of it judges it)


def test_bad_options_and_saving(saved, tmp_path):
    with pytest.raises(ValueError, match="did you mean 'mmap'"):
        zoo.offload(saved["dense"], reader="mmapp")
    with pytest.raises(ValueError, match="cache_experts must be"):
        zoo.offload(saved["dense"], cache_experts=-1)
    native = tmp_path / "native"
    tiny_native("gpt_oss").save_pretrained(native)  # its experts are reshaped by the zoo's conversion
    with pytest.raises(NotOffloadable, match="convert it first"):
        zoo.offload(native)
    off = zoo.offload(saved["dense"], cache_experts=2)
    with pytest.raises(NotOffloadable, match="cannot be saved"):
        off.save_pretrained(tmp_path / "again")
    with pytest.raises(NotOffloadable, match="cannot be pickled"):  # (was a TypeError about a lock)
        torch.save(off, tmp_path / "model.pt")
    assert not (tmp_path / "again").exists()


def test_compiled_decode_is_refused_in_one_line(saved):
    off = zoo.offload(saved["dense"], cache_experts=2)
    with pytest.raises(ValueError, match="offloaded experts .* decode it with compile=False"):
        greedy(off, torch.tensor([[5, 17]]), 2)


def _file_spans(path) -> list[tuple[int, int]]:
    """Address ranges of this process's memory maps of ``path``."""
    with open("/proc/self/maps") as f:
        rows = [line.split() for line in f if line.rstrip().endswith(str(path))]
    return [tuple(int(x, 16) for x in row[0].split("-")) for row in rows]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("kind", ["dense", "packed"])
@torch.no_grad()
def test_in_place_experts_are_the_mapped_file(saved, kind):
    """reader='in-place': every expert tensor's data lies in a memory map of the shard (nothing copied), the model
    gives the in-memory model's logits and greedy tokens (the compiled step too), and a write to an expert changes
    this process's copy of the page, never the file."""
    ref = zoo.load(saved[kind]).eval()
    model = zoo.offload(saved[kind], reader="in-place")
    shard = (saved[kind] / "model.safetensors").resolve()
    spans = _file_spans(shard)
    tensors = [t for layer in model.model.layers for t in layer.mlp.experts.state_dict().values()]
    assert spans and tensors and all(any(a <= t.data_ptr() < b for a, b in spans) for t in tensors)
    assert not any(any(a <= p.data_ptr() < b for a, b in spans) for n, p in model.named_parameters()
                   if ".experts." not in n)  # the rest is loaded into memory as zoo.load loads it
    ids, mask = padded_batch()
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits,
                       ref(input_ids=ids, attention_mask=mask).logits)
    eager = greedy(ref, ids[:1], 5, compile=False)
    assert torch.equal(greedy(model, ids[:1], 5, compile=False), eager)
    if kind == "dense":
        torch._dynamo.reset()
        assert torch.equal(greedy(model, ids[:1], 5, ahead_of_time=False), eager)
    before = shard.read_bytes()
    model.model.layers[0].mlp.experts.state_dict()[next(iter(model.model.layers[0].mlp.experts.state_dict()))].zero_()
    assert shard.read_bytes() == before


def _smaps(path) -> dict[str, dict[str, list[str]]]:
    """Each of this process's memory maps of ``path`` (/proc/self/smaps): its fields by address range."""
    maps, inside = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                inside = head[0] if line.rstrip().endswith(str(path)) else None
                if inside:
                    maps[inside] = {}
            elif inside and head:
                maps[inside][head[0].rstrip(":")] = head[1:]
    return maps


def _vm_flags(path) -> dict[str, list[str]]:
    """The VmFlags of each of this process's memory maps of ``path``, by address range."""
    return {span: fields["VmFlags"] for span, fields in _smaps(path).items() if "VmFlags" in fields}


def _pmd_mapped(path) -> int:
    """Bytes of ``path`` this process maps 2 MB at a time (``FilePmdMapped``), over its maps of it."""
    return sum(int(fields.get("FilePmdMapped", ["0"])[0]) * 1024 for fields in _smaps(path).values())


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="a system with transparent huge pages (/proc/self/smaps names the advice)")
def test_in_place_maps_ask_for_huge_pages(saved):
    """The shard's map asks for 2 MB pages (MADV_HUGEPAGE: VmFlags 'hg'), so that experts faulted in from the disk
    map, and are given back, 2 MB at a time."""
    shard = (saved["dense"] / "model.safetensors").resolve()
    before = _vm_flags(shard)  # other tests' maps of the shard that are not collected yet (safetensors' own)
    model = zoo.offload(saved["dense"], reader="in-place", cache_experts=2)
    flags = {span: f for span, f in _vm_flags(shard).items() if span not in before}
    assert flags and all("hg" in f for f in flags.values()), flags
    del model


def _present(t: torch.Tensor, row: int) -> list[bool]:
    """Whether each whole page inside row ``row`` of ``t`` is mapped in this process (/proc/self/pagemap, bit 63)."""
    size, page = t.nbytes // t.shape[0], 4096
    return _mapped_pages(-(-(t.data_ptr() + row * size) // page), (t.data_ptr() + (row + 1) * size) // page)


def _mapped_pages(begin: int, end: int) -> list[bool]:
    """Whether each 4 KB page numbered [begin, end) is mapped in this process (/proc/self/pagemap, bit 63)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(begin * 8)
        words = f.read((end - begin) * 8)
    return [bool(int.from_bytes(words[i:i + 8], "little") >> 63) for i in range(0, len(words), 8)]


@pytest.fixture(scope="module")
def saved_wide(tmp_path_factory):
    """A tiny fp32 Mixtral checkpoint whose experts' rows span hundreds of pages (intermediate size 2048)."""
    from transformers import MixtralForCausalLM

    from tests.tiny import tiny_config

    torch.manual_seed(3)
    config = tiny_config("mixtral")
    config.intermediate_size = 2048
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    out = tmp_path_factory.mktemp("wide")
    zoo.convert(model).save_pretrained(out)
    return out


@pytest.mark.skipif(not os.access("/proc/self/pagemap", os.R_OK),
                    reason="reads /proc/self/pagemap")
@pytest.mark.parametrize("kind,budget", [("wide", {"cache_experts": 3}), ("wide", {"cache_experts": 0}),
                                         ("packed", {"cache_bytes": 20_000})])
@torch.no_grad()
def test_in_place_within_a_budget_keeps_the_pages_of_the_cached_experts_alone(saved, saved_wide, kind, budget):
    """reader='in-place' with a budget: the in-memory model's logits and greedy tokens, the routed experts looked up
    in the cache, and after a call about the budget's share of the experts' pages mapped in this process, the others
    given back (to be faulted in again when routed); the compiled step looks them up too (``zoo::mapped_lookup``)."""
    path = saved_wide if kind == "wide" else saved[kind]
    ref = zoo.load(path).eval()
    model = zoo.offload(path, reader="in-place", **budget)
    ids, mask = padded_batch()
    for _ in range(2):  # the second call faults in again what the first gave back
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits,
                           ref(input_ids=ids, attention_mask=mask).logits)
    cache = cache_of(model)
    stats = cache.stats()
    assert stats["misses"] > 0 and stats["hits"] + stats["misses"] > 8
    assert stats["resident_bytes"] <= (budget.get("cache_bytes") or float("inf"))
    assert stats["cached_experts"] <= (budget.get("cache_experts", 8)) and stats["evictions"] > 0 or not stats["hits"]
    if kind == "wide":
        _pages_of_the_cached_experts_alone(model, cache)
    eager = greedy(ref, ids[:1], 5, compile=False)
    assert torch.equal(greedy(model, ids[:1], 5, compile=False), eager)
    if kind == "wide" and budget["cache_experts"]:  # the compiled step keeps the books too: same tokens, as few pages
        torch._dynamo.reset()
        looked = cache.hits + cache.misses
        assert torch.equal(greedy(model, ids[:1], 5, ahead_of_time=False), eager)
        assert cache.hits + cache.misses - looked >= 2 * 2 * 4, cache.stats()  # 2 layers, 2 experts, 4+ steps
        _pages_of_the_cached_experts_alone(model, cache)
        looked = cache.hits + cache.misses  # and the step compiled ahead of time (the lookup an opaque call in it)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert torch.equal(greedy(model, ids[:1], 5), eager)
        assert not [w for w in caught if "ahead of time" in str(w.message)]
        assert cache.hits + cache.misses - looked >= 2 * 2 * 4, cache.stats()


@torch.no_grad()
def test_in_place_lookup_takes_each_routed_expert_once_and_skips_empty_slots(saved_wide):
    """``zoo::mapped_lookup`` on routing indices with repeats and the empty slot (E, as capacity routers leave it):
    each real expert looked up once, in order; a call with nothing new is all hits, one with no real expert looks up
    nothing."""
    model = zoo.offload(saved_wide, reader="in-place", cache_experts=3)
    experts = model.model.layers[1].mlp.experts
    books, cache, E = experts.mapped_books, cache_of(model), experts.num_experts
    torch.ops.zoo.mapped_lookup(torch.tensor([[2, 2], [E, 0], [2, E]]), experts.mapped_ledger, books.key)
    assert books.used == [0, 2] and cache.misses == 2 and cache.hits == 0
    assert list(cache.entries) == [(1, 0), (1, 2)]
    torch.ops.zoo.mapped_lookup(torch.tensor([[E, E], [0, 2]]), experts.mapped_ledger, books.key)
    assert books.used == [0, 2] and cache.misses == 2 and cache.hits == 2
    torch.ops.zoo.mapped_lookup(torch.tensor([[E]]), experts.mapped_ledger, books.key)
    assert books.used == [] and cache.misses == 2 and cache.hits == 2


@pytest.mark.skipif(not os.access("/proc/self/pagemap", os.R_OK),
                    reason="reads /proc/self/pagemap")
def test_release_gives_back_whole_huge_pieces_within_the_tensor_alone(saved_wide):
    """A released row's range is widened to the 2 MB pieces it touches, never past its tensor's own pages: the range
    given to madvise stops at the tensor's edges (the shard's header and other tensors outside it), every page of the
    row goes, and a neighbouring row in the same 2 MB piece goes with it. (The bytes outside the tensor stay mapped
    where its edge pieces are mapped 4 KB at a time; a piece mapped 2 MB at a time the system unmaps whole.)"""
    model = zoo.offload(saved_wide, reader="in-place", cache_experts=3)
    books = model.model.layers[0].mlp.experts.mapped_books
    reader = books.reader
    for e in (0, books.num_experts - 1):  # the tensor's first and last rows: its edges
        for key, row in books.entries[e].rows:
            dtype, shape, offset, nbytes = reader.info(key)
            pages = reader._maps[reader.files[key]]
            base = torch.frombuffer(pages, dtype=torch.uint8, count=1).data_ptr()
            size = nbytes // shape[0]
            for a in range(offset, offset + nbytes, 4096):
                pages[a]  # fault the tensor in
            reader._maps[reader.files[key]] = recording = _RecordingMap(pages)
            given = reader.release_row(key, row)
            reader._maps[reader.files[key]] = pages
            lo, hi = offset + row * size, offset + (row + 1) * size
            [(begin, length)] = recording.ranges
            assert given == length and length % 4096 == 0 and begin % 4096 == 0
            assert -(-offset // 4096) * 4096 <= begin <= -(-lo // 4096) * 4096, (key, row)
            assert hi // 4096 * 4096 <= begin + length <= offset + nbytes, (key, row)
            assert begin in (lo // (1 << 21) * (1 << 21), -(-offset // 4096) * 4096)  # whole pieces where inside
            assert begin + length in (-(-hi // (1 << 21)) * (1 << 21), (offset + nbytes) // 4096 * 4096)
            assert not any(_mapped_at(base + a) for a in range(-(-lo // 4096) * 4096, hi // 4096 * 4096, 4096))
            other = row + 1 if row == 0 else row - 1  # the neighbouring row's pages within the same 2 MB piece
            near = [a for a in range(offset + other * size, offset + (other + 1) * size, 4096)
                    if a // (1 << 21) == (lo if row else hi - 1) // (1 << 21) and offset <= a // 4096 * 4096]
            assert not any(_mapped_at(base + a // 4096 * 4096) for a in near[1:-1])


class _RecordingMap:
    """A shard's map that records the ranges given back through it."""

    def __init__(self, pages):
        self.pages, self.ranges = pages, []

    def madvise(self, advice, start, length):
        self.ranges.append((start, length))
        self.pages.madvise(advice, start, length)


def test_a_tensors_first_miss_drops_its_cached_pages_once(saved_wide, monkeypatch):
    """Within a budget, the first miss in a layer drops the page cache's copy of each of its expert tensors, widened
    to the 2 MB pieces it touches (POSIX_FADV_DONTNEED on the shard), so that its rows are read again in 2 MB
    folios; later misses in the layer, hits, and misses again drop nothing; another layer's first miss drops its
    own tensors."""

    dropped = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: dropped.append((offset, length, advice)))
    model = zoo.offload(saved_wide, reader="in-place", cache_experts=2)

    def lookup(layer, *e):
        experts = model.model.layers[layer].mlp.experts
        torch.ops.zoo.mapped_lookup(torch.tensor([e]), experts.mapped_ledger, experts.mapped_books.key)

    def tensors(layer):
        books = model.model.layers[layer].mlp.experts.mapped_books
        return [books.reader.info(key) for key in dict.fromkeys(key for key, _ in books.entries[0].rows)]

    def each_covered(tensors, drops):  # each tensor's bytes within its drop, widened to whole 2 MB pieces only
        assert len(drops) == len(tensors) and all(advice == os.POSIX_FADV_DONTNEED for *_, advice in drops)
        for (dtype, shape, offset, nbytes), (begin, length, _) in zip(tensors, drops):
            assert begin % (1 << 21) == 0 and length % (1 << 21) == 0
            assert begin <= offset and offset + nbytes <= begin + length
            assert offset - begin < 1 << 21 and begin + length - offset - nbytes < 1 << 21

    lookup(0, 0, 2)
    each_covered(tensors(0), dropped)
    lookup(0, 0, 2)  # hits
    lookup(0, 1, 3)  # first misses of 1 and 3, evicting 0 and 2
    lookup(0, 0, 2)  # misses again: read where they lie
    assert len(dropped) == 2
    lookup(1, 0, 1)
    each_covered(tensors(1), dropped[2:])


@torch.no_grad()
def test_a_file_system_refusing_the_drop_reads_the_pages_where_they_are(saved_wide, monkeypatch):
    """Where the system refuses POSIX_FADV_DONTNEED (an error from the file system), a first miss reads the expert
    from the page cache as it lies: the in-memory model's logits."""
    import errno

    def refuse(*args):
        raise OSError(errno.EINVAL, "no advice here")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    ref = zoo.load(saved_wide).eval()
    model = zoo.offload(saved_wide, reader="in-place", cache_experts=2)
    ids, mask = padded_batch()
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits)
    assert cache_of(model).misses > 0


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not os.path.exists(
    "/sys/kernel/mm/transparent_hugepage/enabled"), reason="a Linux with transparent huge pages")
def test_an_expert_written_in_small_pages_maps_2mb_at_a_time_after_its_first_miss(saved_wide, tmp_path, monkeypatch):
    """A checkpoint just copied lies in the page cache in 4 KB folios, mapped a page at a time; after the first miss
    within a budget an expert is read from the disk in 2 MB folios and mapped 2 MB at a time (the control: the same
    copy without the drop maps nothing so)."""

    if not _page_cache_gives_2mb_folios(tmp_path / "probe"):
        pytest.skip("this system's page cache gives a map no 2 MB folios (file THP, or the filesystem's large folios)")
    copy = tmp_path / "copy"
    shutil.copytree(saved_wide, copy)
    shard = (copy / "model.safetensors").resolve()
    fd = os.open(shard, os.O_RDONLY)
    os.fsync(fd)  # written back: pages still dirty would stay where they are
    os.close(fd)

    def first_miss_maps_2mb(drop: bool) -> int:
        with monkeypatch.context() as m:
            if not drop:
                m.setattr("zoo.runtime.offloaded.ShardReader.uncache", lambda self, key: None)
            model = zoo.offload(copy, reader="in-place", cache_experts=2)
            experts = model.model.layers[0].mlp.experts
            torch.ops.zoo.mapped_lookup(torch.tensor([[1]]), experts.mapped_ledger, experts.mapped_books.key)
            float(experts.state_dict()["gate_up_proj"][1].sum())
            mapped = _pmd_mapped(shard)
            del model, experts
            gc.collect()
            assert not _smaps(shard)  # unmapped: nothing of it holds the page cache's pages
            return mapped

    assert first_miss_maps_2mb(drop=False) == 0
    assert first_miss_maps_2mb(drop=True) >= 1 << 21


def _page_cache_gives_2mb_folios(probe) -> bool:
    """Whether a file read from the disk through a map advised MADV_HUGEPAGE comes as 2 MB folios, mapped whole."""

    probe.write_bytes(bytes(8 << 20))
    fd = os.open(probe, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        pages = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    try:
        pages.madvise(mmap.MADV_HUGEPAGE)
        sum(pages[a] for a in range(0, len(pages), 4096))
        return _pmd_mapped(probe.resolve()) > 0
    finally:
        pages.close()


def _mapped_at(address: int) -> bool:
    return _mapped_pages(address // 4096, address // 4096 + 1)[0]


def _pages_of_the_cached_experts_alone(model, cache) -> None:
    """Within the budget, the expert rows' pages mapped in this process: the system maps a file's pages a folio at a
    time (on ext4, large folios that reach into neighbouring rows) and a release unmaps whole folios, so the count is
    not the cached rows' exactly; it stays near the budget's share, where nothing given back would leave every
    routed row mapped. Clearing the cache gives its experts' pages back; a release unmaps every page of its row, and
    a read maps them again."""
    rows = [(t, e) for layer in model.model.layers for t in layer.mlp.experts.state_dict().values() for e in range(4)]
    share = sum(sum(_present(t, e)) for t, e in rows) / sum(len(_present(t, e)) for t, e in rows)
    assert share <= (cache.max_experts or 0) / 8 + 0.3, share
    held = list(cache.entries)
    cache.clear()  # gives the cached experts' pages back too
    for layer, e in held:
        assert not any(p for t in model.model.layers[layer].mlp.experts.state_dict().values() for p in _present(t, e))
    layer, e = held[0] if held else (0, 0)
    experts = model.model.layers[layer].mlp.experts
    experts.mapped_books.entries[e].release()
    assert not any(p for t in experts.state_dict().values() for p in _present(t, e))
    float(experts.state_dict()["gate_up_proj"][e].sum())
    assert all(_present(experts.state_dict()["gate_up_proj"], e))


def test_in_place_refuses_what_it_cannot_map(saved, tmp_path, monkeypatch):
    monkeypatch.setattr("zoo.runtime.offloading.can_release", lambda: False)
    with pytest.raises(ValueError, match="madvise"):
        zoo.offload(saved["dense"], reader="in-place", cache_experts=2)
    monkeypatch.undo()
    apart = tmp_path / "apart"
    tiny_native("mixtral", seed=2).save_pretrained(apart)
    with pytest.raises(NotOffloadable, match="stores each expert's matrices apart"):
        zoo.offload(apart, reader="in-place")
    halved = tmp_path / "bf16"
    zoo.load(saved["dense"]).to(torch.bfloat16).save_pretrained(halved)
    config = (halved / "config.json").read_text().replace('"bfloat16"', '"float32"')
    (halved / "config.json").write_text(config)  # a config whose dtype is not the stored one
    with pytest.raises(NotOffloadable, match="stored as torch.bfloat16, the model holds it as torch.float32"):
        zoo.offload(halved, reader="in-place")
