"""Decode speed as a user times it: the public calls, end to end, each engine in a fresh process, against llama.cpp.

Each row is a fresh process doing what a user does. The zoo: ``zoo.load(folder)``, ``zoo.apply(model, "quantize",
bits=..., targets="all")`` for the quantized rows, then ``zoo.runtime.decode.greedy(model, ids, max_new_tokens=65)``
on a 16-token prompt (the "huge pages" row calls ``zoo.runtime.huge_pages.collapse_to_huge_pages(model)`` after
loading): two warm-up calls (the first compiles), then three timed calls; the same for
``zoo.runtime.decode.generate`` (transformers' ``model.generate`` with the zoo's compile config) with ``--generate``.
llama.cpp through llama-cpp-python: ``Llama(file)``, then per call ``eval(prompt)`` and 64 x (greedy ``sample``,
``eval([token])``), the same 65 tokens. Wall time per generated token counts the whole call, prefill included;
prefill (the prompt's forward, the call that starts every greedy decode) and decode per token are reported apart.
"loop" is the zoo's compiled step alone, called 64 times after a prefill in the same process (what
``benchmarks/decode.py``'s zoo-loop column measures).

llama.cpp files: the same weights converted by llama.cpp's own ``convert_hf_to_gguf.py`` (bf16) and quantized by its
own quantizer (q8_0, Q4_0: every matrix, llama.cpp's defaults), and the zoo's own int8 / int4 codes exported as GGUF
(Q8_0 / Q4_1, ``zoo.export(..., format="gguf")``). llama.cpp's converter needs a tokenizer it recognises: a
sentencepiece model trained here on the zoo's shipped corpus (the ids are what is timed; the text is never decoded).

    python benchmarks/decode_user.py --llama-cpp-source DIR   # DIR: a llama.cpp source tree (convert_hf_to_gguf.py)
    python benchmarks/decode_user.py --smoke                  # a tiny model, zoo rows only, one round (seconds)

Rounds interleave the engines (one process each, the order rotated every round); medians and ranges are over rounds x
calls. Needs ``llama_cpp`` importable (built from llama-cpp-python's source distribution) and ``sentencepiece`` for
the llama.cpp rows; without them the zoo rows run alone and the reason is printed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (label, bits, 8-bit inputs): the last two rows add ``zoo.moe.kernels.int8_inputs(True)``, the kernel's option of
# multiplying int8 weights / int4 codes by inputs rounded to 8 bits (llama.cpp's q8_0/Q4_0 do the same), where the
# processor has int8 dot products
ZOO_ROWS = (("zoo bf16", 16, False), ("zoo int8 all", 8, False), ("zoo int4 all", 4, False),
            ("zoo int8 all, x int8", 8, True), ("zoo int4 all, x int8", 4, True))
# rows whose process also calls ``zoo.runtime.huge_pages.collapse_to_huge_pages(model)`` after loading
HUGE_PAGE_ROWS = (("zoo bf16, huge pages", 16, False),)
# zoo row -> the llama.cpp rows it is compared with
PAIRS = {"zoo bf16": ("llama.cpp bf16",), "zoo bf16, huge pages": ("llama.cpp bf16",),
         "zoo int8 all": ("llama.cpp q8_0", "llama.cpp zoo codes Q8_0"),
         "zoo int4 all": ("llama.cpp Q4_0", "llama.cpp zoo codes Q4_1"),
         "zoo int8 all, x int8": ("llama.cpp q8_0", "llama.cpp zoo codes Q8_0"),
         "zoo int4 all, x int8": ("llama.cpp Q4_0", "llama.cpp zoo codes Q4_1")}


def prompt_ids(vocab: int, tokens: int) -> list[int]:
    import torch

    return torch.randint(3, vocab, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()


def zoo_worker(args) -> dict:
    """One zoo row in this (fresh) process: the user's calls, timed."""
    import torch

    torch.set_num_threads(args.threads)
    import zoo
    from zoo.runtime import decode

    t = time.perf_counter()
    model = zoo.load(args.folder).eval()
    if args.bits < 16:
        model = zoo.apply(model, "quantize", bits=args.bits, targets="all")
    if args.int8_inputs:
        from zoo.moe import kernels

        kernels.load()
        kernels.int8_inputs(True)
    if args.huge_pages:
        from zoo.runtime.huge_pages import collapse_to_huge_pages

        collapse_to_huge_pages(model)
    setup = time.perf_counter() - t
    ids = torch.tensor([prompt_ids(model.config.vocab_size, args.prompt)])
    out = {"setup_s": setup}
    calls = [("greedy", lambda: decode.greedy(model, ids, max_new_tokens=args.new_tokens))]
    if args.generate:
        calls.append(("generate", lambda: decode.generate(model, ids, max_new_tokens=args.new_tokens,
                                                          min_new_tokens=args.new_tokens)))
    for name, call in calls:
        t = time.perf_counter()
        tokens = call()
        out[f"{name}_first_s"] = time.perf_counter() - t
        call()
        walls = []
        for _ in range(args.calls):
            t = time.perf_counter()
            made = call().shape[1] - ids.shape[1]
            walls.append(time.perf_counter() - t)
        assert made == args.new_tokens, (name, made)
        out[f"{name}_wall_s"] = walls
        if name == "greedy":
            out["tokens"] = tokens[0, ids.shape[1]:].tolist()
    out["prefill_s"], out["loop_s"] = prefill_and_loop(model, ids, args.new_tokens, args.calls)
    return out


def prefill_and_loop(model, ids, new_tokens: int, calls: int) -> tuple[list, list]:
    """greedy's two parts apart, in its own order: the prompt's eager forward into a static cache (exactly greedy's
    prefill call), then the compiled step (greedy's, already built by the calls above) alone, 64 times."""
    import torch
    from transformers import StaticCache

    from zoo.runtime.decode import ahead_of_time_step, cache_length, next_token

    prompt = ids.shape[1]
    length = cache_length(model, prompt + new_tokens)
    step = ahead_of_time_step(model, 1, length)
    prefills, loops = [], []
    with torch.no_grad():
        for _ in range(calls):
            cache = StaticCache(config=model.config, max_cache_len=length)
            t = time.perf_counter()
            logits = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(prompt), use_cache=True,
                           logits_to_keep=1).logits
            token = next_token(logits)
            t1 = time.perf_counter()
            for i in range(new_tokens - 1):
                token = next_token(step(token, prompt + i, cache))
            loops.append(time.perf_counter() - t1)
            prefills.append(t1 - t)
    return prefills, loops


def llama_worker(args) -> dict:
    """One llama.cpp row in this (fresh) process: load, then eval the prompt and one token at a time."""
    from llama_cpp import Llama

    t = time.perf_counter()
    llm = Llama(model_path=args.gguf, n_ctx=256, n_batch=512, n_threads=args.threads, n_threads_batch=args.threads,
                verbose=False)
    setup = time.perf_counter() - t
    ids = prompt_ids(llm.n_vocab(), args.prompt)

    def call():
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        tokens = [llm.sample(top_k=1, temp=0.0)]
        t1 = time.perf_counter()
        for _ in range(args.new_tokens - 1):
            llm.eval([tokens[-1]])
            tokens.append(llm.sample(top_k=1, temp=0.0))
        return tokens, t1 - t0, time.perf_counter() - t0

    tokens, _, first = call()
    call()
    walls, prefills = [], []
    for _ in range(args.calls):
        _, prefill, wall = call()
        walls.append(wall)
        prefills.append(prefill)
    return {"setup_s": setup, "greedy_first_s": first, "greedy_wall_s": walls, "prefill_s": prefills,
            "tokens": tokens}


def dot_products() -> bool:
    """Whether the zoo's kernel loads here with an instruction set that has int8 dot products."""
    from zoo.moe import kernels

    return kernels.load() and kernels.best_isa() in kernels.INT8_DOT_ISAS


def run_worker(kind: str, env: dict, args, **extra) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--threads", str(args.threads), "--prompt", str(args.prompt),
           "--new-tokens", str(args.new_tokens), "--calls", str(args.calls)]
    for key, value in extra.items():
        if value is False:
            continue
        cmd += [f"--{key.replace('_', '-')}", str(value)] if value is not True else [f"--{key.replace('_', '-')}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def make_files(folder: Path, smoke: bool, source: Path | None, llama: bool) -> tuple[dict, list[str]]:
    """The native checkpoint (the 304M Mixtral of benchmarks/decode.py with the zoo's tokenizer) and, where
    llama.cpp is here, its GGUF files: {row: path}, and the reasons for rows left out."""
    sys.path.insert(0, str(HERE))
    from decode import mixtral_shaped

    import zoo

    native = folder / "native"
    model = mixtral_shaped(smoke)
    model.save_pretrained(native)
    zoo.load_tokenizer("zoo-tiny-moe").save_pretrained(native)
    files, skipped = {"native": native}, []
    if not llama:
        return files, ["llama.cpp rows: llama_cpp is not importable (build llama-cpp-python from its source)"]
    import llama_cpp

    if source is None or not (source / "convert_hf_to_gguf.py").is_file():
        skipped.append("llama.cpp's own files: pass --llama-cpp-source (a llama.cpp tree with convert_hf_to_gguf.py)")
    elif importlib.util.find_spec("sentencepiece") is None:
        skipped.append("llama.cpp's own files: sentencepiece is not importable (its converter needs a tokenizer)")
    else:
        own = folder / "for-llama-cpp"
        own.mkdir()
        for name in ("config.json", "model.safetensors"):
            (own / name).symlink_to(native / name)
        write_sentencepiece(own / "tokenizer.model", folder, model.config.vocab_size)
        files["llama.cpp bf16"] = folder / "own-bf16.gguf"
        env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
        subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(own), "--outtype", "bf16",
                        "--outfile", str(files["llama.cpp bf16"])], check=True, capture_output=True, env=env)
        for label, ftype in (("llama.cpp q8_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0),
                             ("llama.cpp Q4_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0)):
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.nthread = ftype, 2
            files[label] = folder / f"{label.split()[-1]}.gguf"
            if llama_cpp.llama_model_quantize(str(files["llama.cpp bf16"]).encode(), str(files[label]).encode(),
                                              params) != 0:
                raise RuntimeError(f"llama.cpp could not quantize to {label}")
    for bits, label in ((8, "llama.cpp zoo codes Q8_0"), (4, "llama.cpp zoo codes Q4_1")):
        files[label] = folder / f"zoo-int{bits}.gguf"
        zoo.export(zoo.apply(zoo.load(native), "quantize", bits=bits, targets="all"), files[label], format="gguf")
    return files, skipped


def write_sentencepiece(path: Path, folder: Path, vocab: int) -> None:
    """A byte-fallback BPE sentencepiece model of at most ``vocab`` pieces trained on the zoo's English corpus."""
    import lzma

    import sentencepiece as spm

    corpus = Path(__file__).resolve().parent.parent / "zoo" / "_data" / "corpus" / "english-train.txt.xz"
    text = folder / "corpus.txt"
    text.write_text(lzma.open(corpus, "rt").read(3_000_000))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(folder / "spm"), vocab_size=vocab,
                                   model_type="bpe", byte_fallback=True, hard_vocab_limit=False,
                                   input_sentence_size=200000, shuffle_input_sentence=True, minloglevel=2)
    (folder / "spm.model").rename(path)


def summary(results: dict, args) -> None:
    def ms(xs):
        return f"{statistics.median(xs) * 1e3:7.2f} [{min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f}]"

    n = args.new_tokens
    print(f"\n{n} greedy tokens after a {args.prompt}-token prompt, batch 1, {args.threads} threads; per engine "
          f"{len(next(iter(results.values())))} fresh processes x {args.calls} timed calls; median [range] ms")
    head = (f"{'engine':26} {'wall/token':>22} {'prefill':>22} {'decode/token':>22} {'loop/token':>22} "
            f"{'generate wall/token':>22} {'tok/s':>7} {'1st call s':>10}")
    print(head + "\n" + "-" * len(head))
    per_token = {}
    for engine, runs in results.items():
        wall = [w / n for r in runs for w in r["greedy_wall_s"]]
        prefill = [p for r in runs for p in r["prefill_s"]]
        decode = [(w - statistics.median(prefill)) / (n - 1) for r in runs for w in r["greedy_wall_s"]]
        loop = [s / (n - 1) for r in runs for s in r.get("loop_s", [])]
        gen = [w / n for r in runs for w in r.get("generate_wall_s", [])]
        per_token[engine] = (statistics.median(wall), statistics.median(decode))
        first = statistics.median(r["greedy_first_s"] for r in runs)  # load excluded; compiling included
        print(f"{engine:26} {ms(wall)} {ms(prefill)} {ms(decode)} {ms(loop) if loop else '-':>22} "
              f"{ms(gen) if gen else '-':>22} {1 / statistics.median(wall):7.1f} {first:10.1f}")
    print("\nzoo / llama.cpp speed (higher: the zoo faster), end to end per token (prefill in) and decode alone:")
    for zoo_row, others in PAIRS.items():
        for other in others:
            if zoo_row in per_token and other in per_token:
                (zw, zd), (lw, ld) = per_token[zoo_row], per_token[other]
                print(f"  {zoo_row:20} vs {other:26} {lw / zw:5.2f}x end to end   {ld / zd:5.2f}x decode")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="processes per engine (interleaved)")
    ap.add_argument("--calls", type=int, default=3, help="timed calls per process, after two warm-up calls")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=65)
    ap.add_argument("--generate", action="store_true", help="also time zoo.runtime.decode.generate (compiles again)")
    ap.add_argument("--llama-cpp-source", type=Path, help="a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, the zoo bf16 row, one round")
    ap.add_argument("--worker", choices=("zoo", "llama"), help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--bits", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--int8-inputs", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--huge-pages", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps((zoo_worker if args.worker == "zoo" else llama_worker)(args)))
        return
    if args.smoke:
        args.rounds, args.calls, args.new_tokens = 1, 1, 8
    llama = not args.smoke and importlib.util.find_spec("llama_cpp") is not None
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TQDM_DISABLE": "1"}
    with tempfile.TemporaryDirectory(prefix="zoo-decode-user-") as tmp:
        files, skipped = make_files(Path(tmp), args.smoke, args.llama_cpp_source, llama)
        for reason in skipped:
            print(reason)
        dots = dot_products()
        if not dots:
            print("the 8-bit-input rows are left out: the kernel has no int8 dot products on this processor")
        rows = [(row, False) for row in ZOO_ROWS] + [(row, True) for row in HUGE_PAGE_ROWS]
        engines = [(label, "zoo", {"folder": files["native"], "bits": bits, "int8_inputs": inputs8, "huge_pages": huge})
                   for (label, bits, inputs8), huge in (rows[:1] if args.smoke else rows) if dots or not inputs8]
        engines += [(label, "llama", {"gguf": path}) for label, path in files.items() if label.startswith("llama")]
        results = {label: [] for label, _, _ in engines}
        for r in range(args.rounds):
            for label, kind, extra in engines[r % len(engines):] + engines[:r % len(engines)]:
                if kind == "zoo" and args.generate:
                    extra = {**extra, "generate": True}
                results[label].append(run_worker(kind, env, args, **extra))
                last = results[label][-1]["greedy_wall_s"]
                print(f"  round {r + 1}: {label} {statistics.median(last) / args.new_tokens * 1e3:.2f} ms/token",
                      flush=True)
    summary(results, args)
    from moe_gemv import cpu_flags

    print(f"processor flags: {cpu_flags()}")


if __name__ == "__main__":
    main()
