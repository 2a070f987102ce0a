"""llama.cpp rows for benchmarks/decode.py: the same weights as the zoo rows, as GGUF files the zoo writes itself
(``zoo.export(..., format="gguf")``), timed through llama-cpp-python. Needs ``llama_cpp`` importable (built from
its source distribution; never in CI).

Files: the bf16 model, and the zoo's int8 / int4 quantized models as exported (Q8_0 / Q4_1 blocks holding the
zoo's own codes), experts only and every matrix (``targets="all"``): like for like with the zoo's rows. And
llama.cpp's own q8_0 / Q4_0 of every matrix, quantized by llama.cpp from the bf16 file (``--own-quantized``:
on a processor that lists AMX in a virtual machine that does not enable it, llama.cpp built with its defaults
stops on these with an illegal instruction in its AMX matmul; build it with ``GGML_NATIVE=OFF`` and the AMX
options off).
"""
from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path


def gguf_files(models: dict, tokenizer, out: Path) -> dict[str, Path]:
    """``models``: {"bf16": zoo model, "int8": ..., "int4": ...} -> {row label: GGUF file}."""
    from zoo.io.gguf_export import export_gguf

    tokenizer.save_pretrained(out / "tokenizer")
    files = {}
    for key, label in (("bf16", "bf16"), ("int8", "Q8_0 experts"), ("int4", "Q4_1 experts"), ("int8 all", "Q8_0 all"),
                       ("int4 all", "Q4_1 all")):
        if key not in models:
            continue
        m = copy.copy(models[key])  # the tokenizer travels through config.name_or_path
        m.config = copy.deepcopy(models[key].config)
        m.config.name_or_path = str(out / "tokenizer")
        files[label] = out / f"{key.replace(' ', '-')}.gguf"
        export_gguf(m, files[label], progress=False)
    return files


def own_quantized(bf16: Path, out: Path) -> dict[str, Path]:
    """llama.cpp's own q8_0 and Q4_0 of every matrix (its defaults: token embedding and output included), from the
    bf16 file, by llama.cpp's quantizer."""
    import llama_cpp

    files = {}
    for label, ftype in (("own q8_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0), ("own Q4_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0)):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = ftype, 2
        files[label] = out / f"{label.replace(' ', '-')}.gguf"
        if llama_cpp.llama_model_quantize(str(bf16).encode(), str(files[label]).encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {bf16} to {label}")
    return files


def time_gguf(path: Path, prompt: list[int], new_tokens: int, prefill: list[int], threads: int) -> dict:
    """Greedy decode tok/s (per-token eval after the prompt) and prefill tok/s (one batch eval)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=1024, n_batch=512, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    llm.reset()
    llm.eval(prefill)  # warm-up
    runs = []
    for _ in range(3):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prefill)
        runs.append(time.perf_counter() - t)
    prefill_tok_s = len(prefill) / sorted(runs)[1]
    firsts, speeds = [], []
    for _ in range(3):  # the median of three runs, as the zoo rows are measured
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        firsts.append(time.perf_counter() - t)
        tokens = []
        t = time.perf_counter()
        for _ in range(new_tokens - 1):
            token = llm.sample(top_k=1, temp=0.0)
            tokens.append(token)
            llm.eval([token])
        speeds.append((new_tokens - 1) / (time.perf_counter() - t))
    decode, first = statistics.median(speeds), statistics.median(firsts)
    return {"decode": decode, "prefill": prefill_tok_s, "first_ms": first * 1e3, "tokens": tokens}


def rows(name: str, models: dict, tokenizer, prompt, prefill, new_tokens: int, threads: int, own: bool = False) -> list:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        files = gguf_files(models, tokenizer, Path(tmp))
        if own:
            files.update(own_quantized(files["bf16"], Path(tmp)))
        for label, path in files.items():
            r = time_gguf(path, prompt, new_tokens, prefill, threads)
            out.append({"model": name, "engine": f"llama.cpp {label}", "decode": r["decode"],
                        "prefill": r["prefill"], "compile_s": None, "first_ms": r["first_ms"], "same": None, "loop": None})
            print(f"  {name}: llama.cpp {label} done ({r['decode']:.0f} tok/s)", flush=True)
    return out
