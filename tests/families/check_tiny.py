"""Build every tiny MoE config, count parameters, find expert blocks and run a text-only forward.

Usage: python tests/families/check_tiny.py [model_type ...] [--jobs N] [--timeout S] [--force]
Each type runs in a fresh subprocess (memory-capped) so a crash or a huge allocation cannot stop the sweep.
"""
import inspect
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MEM_CAP = 6 << 30  # bytes of address space per child


def _logits(out):
    logits = getattr(out, "logits", None)
    return out[0] if logits is None else logits


def check_one(mt: str) -> dict:
    import torch

    from families.tiny_configs import model_class, tiny_config

    torch.set_num_threads(1)
    torch.manual_seed(0)
    res = {"type": mt, "ok": False}
    cls = model_class(mt)
    if cls is None:
        res["error"] = "no model class"
        return res
    res["class"] = cls.__name__
    t0 = time.perf_counter()
    model = cls(tiny_config(mt)).eval()
    res["build_s"] = round(time.perf_counter() - t0, 2)
    res["params"] = sum(p.numel() for p in model.parameters())
    blocks = [(n, type(m).__name__) for n, m in model.named_modules() if "experts" in dict(m.named_children())]
    res["n_blocks"] = len(blocks)
    shown = [b for b in blocks if "attention" not in b[0]] or blocks  # jetmoe also has attention experts
    res["block"] = f"{shown[0][1]} @ {shown[0][0]}" if blocks else None
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, 8))
    runner = model
    if type(model).forward is torch.nn.Module.forward and hasattr(model, "thinker"):
        runner, res["note"] = model.thinker, "forward via .thinker (the wrapper only has generate)"
    kwargs = {"input_ids": ids}
    if "decoder_input_ids" in inspect.signature(runner.forward).parameters:
        kwargs["decoder_input_ids"] = ids  # seq2seq, and diffusion_gemma's canvas (random when not given)
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = _logits(runner(**kwargs))
        res["fwd_s"] = round(time.perf_counter() - t0, 2)
        again = _logits(runner(**kwargs))
    res["out"] = list(logits.shape)
    res["finite"] = bool(torch.isfinite(logits).all())
    res["deterministic"] = bool(torch.equal(logits, again))
    res["ok"] = bool(blocks) and res["finite"] and res["deterministic"]
    if not blocks:
        res["error"] = "no module with an `experts` child"
    elif not res["finite"]:
        res["error"] = "non-finite output"
    elif not res["deterministic"]:
        res["error"] = "two forwards differ"
    return res


def _child(mt: str):
    import resource
    import traceback

    resource.setrlimit(resource.RLIMIT_AS, (MEM_CAP, MEM_CAP))
    try:
        res = check_one(mt)
    except BaseException as e:  # noqa: BLE001
        tb = traceback.extract_tb(e.__traceback__)
        where = f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
        res = {"type": mt, "ok": False, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]} [{where}]"}
    print("RESULT " + json.dumps(res), flush=True)


def run(mt: str, timeout: float) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mt], capture_output=True,
                           text=True, timeout=timeout)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        last = (p.stderr.strip().splitlines() or [""])[-1][:200]
        res = json.loads(lines[-1][7:]) if lines else {
            "type": mt, "ok": False, "error": f"crashed rc={p.returncode}: {last}"}
    except subprocess.TimeoutExpired:
        res = {"type": mt, "ok": False, "error": f"timeout after {timeout}s"}
    res["s"] = round(time.perf_counter() - t0, 1)
    return res


def main(argv):
    if argv[:1] == ["--child"]:
        return _child(argv[1])
    jobs, timeout, force, types = 2, 180.0, False, []
    it = iter(argv)
    for a in it:
        if a == "--jobs":
            jobs = int(next(it))
        elif a == "--timeout":
            timeout = float(next(it))
        elif a == "--force":
            force = True
        else:
            types.append(a)
    from families.tiny_configs import TINY, UNBUILDABLE, tiny_config

    types = types or sorted(TINY)
    todo = [t for t in types if force or t not in UNBUILDABLE]
    with ThreadPoolExecutor(jobs) as ex:
        results = dict(zip(todo, ex.map(lambda t: run(t, timeout), todo)))
    n_ok = 0
    for t in types:
        if t not in results:
            try:
                tiny_config(t)
                cfg = "config builds"
            except Exception as e:  # noqa: BLE001
                cfg = f"config fails: {type(e).__name__}"
            print(f"SKIP {t:28s} ({cfg}) unbuildable: {UNBUILDABLE[t]}")
            continue
        r = results[t]
        n_ok += r["ok"]
        tag = "OK  " if r["ok"] else "FAIL"
        line = f"{tag} {t:28s} {r.get('class', '-')} params={r.get('params', '-')} build={r.get('build_s', '-')}s " \
               f"fwd={r.get('fwd_s', '-')}s blocks={r.get('n_blocks', '-')} {r.get('block') or ''} ({r['s']}s)"
        if not r["ok"]:
            line += f"  -- {r.get('error')}"
        if r.get("note"):
            line += f"  [{r['note']}]"
        print(line, flush=True)
    print(f"{n_ok}/{len(todo)} OK, {len(types) - len(todo)} skipped as unbuildable")
    return 0 if n_ok == len(todo) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
