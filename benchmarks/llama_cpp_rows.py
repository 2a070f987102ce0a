"""llama.cpp rows for benchmarks/decode.py: the same weights converted to GGUF (bf16, q8_0, then Q4_0 by
llama.cpp's own quantizer) and timed through llama-cpp-python. Needs ``llama_cpp`` installed (built from
its source distribution) and llama.cpp's ``convert_hf_to_gguf.py`` folder (``--llama-cpp DIR``). Never in CI.

The zoo's tokenizer is a fresh byte-level BPE with GPT-2's pre-tokenization, which the converter cannot
recognise by its token hash; this module tells it so ("gpt-2"), and sends the Llama-family converter
(Mixtral's) straight to its GPT-2-style vocabulary path instead of trying SentencePiece first."""
from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONVERT = """
import sys
sys.path.insert(0, {dir!r}); sys.path.insert(1, {dir!r} + "/gguf-py")
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
def not_sentencepiece(self):
    raise FileNotFoundError("byte-level BPE")
TextModel._set_vocab_sentencepiece = TextModel._set_vocab_llama_hf = not_sentencepiece
sys.argv = ["convert_hf_to_gguf.py"] + {args!r}
import runpy
runpy.run_path({dir!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(model, tokenizer, converter_dir: str, out: Path) -> dict[str, Path]:
    """GGUF files of ``model`` (a native transformers model) at bf16, q8_0 and Q4_0."""
    import llama_cpp

    src = out / "hf"
    # save under transformers' default (per-expert) Mixtral names, which the converter maps, whatever names
    # the model was loaded from (the shipped checkpoint stores fused experts)
    model._weight_conversions = None
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    files = {}
    for outtype in ("bf16", "q8_0"):
        files[outtype] = out / f"model-{outtype}.gguf"
        args = [str(src), "--outtype", outtype, "--outfile", str(files[outtype])]
        run = subprocess.run([sys.executable, "-c", CONVERT.format(dir=converter_dir, args=args)],
                             capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"GGUF conversion ({outtype}) failed:\n{run.stderr[-2000:]}")
    files["Q4_0"] = out / "model-Q4_0.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    if llama_cpp.llama_model_quantize(str(files["bf16"]).encode(), str(files["Q4_0"]).encode(), params):
        raise RuntimeError("llama.cpp Q4_0 quantization failed")
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


def rows(name: str, model, tokenizer, converter_dir: str, prompt, prefill, new_tokens: int, threads: int) -> list:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        files = convert(model, tokenizer, converter_dir, Path(tmp))
        for label, path in files.items():
            r = time_gguf(path, prompt, new_tokens, prefill, threads)
            out.append({"model": name, "engine": f"llama.cpp {label}", "decode": r["decode"],
                        "prefill": r["prefill"], "compile_s": None, "first_ms": r["first_ms"], "same": None, "loop": None})
            print(f"  {name}: llama.cpp {label} done ({r['decode']:.0f} tok/s)", flush=True)
    return out
