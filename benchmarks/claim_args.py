"""What the claim benchmarks share: the compressors' command line, loading a model to evaluate, the geometric mean of
per-domain perplexity, and the plain table the short-run benchmarks print."""
import argparse
import math


def claim_parser(description: str, calibration_tokens: int) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="zoo-tiny-moe")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--calibration-tokens", type=int, default=calibration_tokens)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-record", action="store_true")
    return ap


def load_model(name: str):
    """``zoo.load(name).eval()``, its plain linear layers widened where bf16 products are not native
    (``zoo.moe.cpu_precision.widen_bf16_linears``: the same products; on an AVX2-only processor the bf16 ones
    take torch's slow path)."""
    import zoo
    from zoo.moe.cpu_precision import widen_bf16_linears

    model = zoo.load(name).eval()
    widen_bf16_linears(model)
    return model


def geo(ppl: dict) -> float:
    return math.exp(sum(math.log(v) for v in ppl.values()) / len(ppl))


def show(rows: list[dict]) -> None:
    """Rows of dicts as one " | "-separated table (every key of any row is a column)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))


# ------------------------------------------------------------------ evaluation draws, for zoo.evaluation.claims.judge(paired=True)

def draw_args(ap: argparse.ArgumentParser, draws: int = 4, windows: int = 16) -> argparse.ArgumentParser:
    """``--draws`` disjoint evaluation draws of ``--windows`` held-out windows per domain each (the repeats of a
    deterministic method), and ``--quick`` (2 windows per draw, one bit width, nothing recorded)."""
    ap.set_defaults(windows=windows)
    ap.add_argument("--draws", type=int, default=draws,
                    help="disjoint evaluation draws (repeats; the judge needs at least 2)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 2 windows per draw, one bit width, records nothing")
    return ap


def draw_windows(tokenizer, draw: int, windows: int, seq_len: int = 256) -> dict:
    """Evaluation draw ``draw`` (0-based): held-out windows ``[draw * windows, (draw + 1) * windows)`` of each domain,
    consecutive and non-overlapping (``zoo.data.tokens.eval_windows``), so the draws are disjoint and every model
    evaluated on draw i sees the same tokens. {domain: [windows, seq_len] ids}."""
    from zoo.data.corpus import DOMAINS
    from zoo.data.tokens import eval_windows, token_stream

    out = {}
    for domain in DOMAINS:
        every = eval_windows(token_stream(domain, "val", tokenizer), seq_len)
        if (draw + 1) * windows > len(every):
            raise ValueError(f"draw {draw} of {windows} windows needs {(draw + 1) * windows} held-out {domain} windows "
                             f"of {seq_len} tokens; the split has {len(every)}")
        out[domain] = every[draw * windows:(draw + 1) * windows]
    return out


def draw_geo(model, tokenizer, draw: int, windows: int, seq_len: int = 256, batch: int = 8) -> tuple[float, dict]:
    """``model`` on evaluation draw ``draw``: (geometric mean over domains of the perplexity, {domain: perplexity}),
    measured as ``zoo.evaluation.eval.perplexity_and_usage`` does (mean token loss over the draw's windows)."""
    import torch

    ppl = {}
    model.eval()
    with torch.no_grad():
        for domain, ids_all in draw_windows(tokenizer, draw, windows, seq_len).items():
            total = count = 0.0
            for i in range(0, len(ids_all), batch):
                ids = ids_all[i:i + batch]
                n = ids.numel() - ids.shape[0]
                total, count = total + model(input_ids=ids, labels=ids).loss.float().item() * n, count + n
            ppl[domain] = math.exp(total / count)
    return geo(ppl), ppl


def draws_geo(model, tokenizer, draws: int, windows: int) -> tuple[list[float], dict]:
    """``draw_geo`` over draws 0..draws-1: ([geo-mean per draw], {domain: perplexity over all the draws' windows}).
    The draws hold the same number of tokens, so the pooled perplexity is the geometric mean of the draws'."""
    per = [draw_geo(model, tokenizer, i, windows) for i in range(draws)]
    pooled = {d: math.exp(sum(math.log(p[d]) for _, p in per) / draws) for d in per[0][1]}
    return [g for g, _ in per], pooled


def judgement_line(name: str, j: dict, unit: str = "") -> str:
    """One comparison as the judge decided it: "<name>: <verdict>, margin .. vs noise .. over n <unit> (..)"."""
    unit = unit or ("paired draws" if j["paired"] else "seeds")
    return (f"{name}: {j['verdict']}, margin {j['margin']:.4g} vs noise {j['noise']:.4g} over {j['repeats']} {unit} "
            f"({j['reason']})")


def verdict_parts(judgements: dict) -> str:
    """"<comparison>: <verdict>; ..." of a claim's judged comparisons, for its summary."""
    return "; ".join(f"{name}: {j['verdict']}" for name, j in judgements.items())


# ------------------------------------------------------------------ seeds, and the verdict block every claim script prints

def seed_args(ap: argparse.ArgumentParser, seeds: int = 3) -> argparse.ArgumentParser:
    """``--seeds`` (the repeats of a trained or sampled arm; the judge needs at least 2) and ``--quick`` (a smoke run of
    the whole path at a tiny budget, 2 seeds, that records nothing)."""
    ap.add_argument("--seeds", type=int, default=seeds, help="repeats of each arm (the judge needs at least 2)")
    if not any(a.dest == "quick" for a in ap._actions):
        ap.add_argument("--quick", action="store_true", help="a smoke run at a tiny budget; records nothing")
    return ap


def conclude(label: str, judgements: dict, unit: str = "") -> str:
    """Print one claim's verdict block and return the verdict (``combine`` of the parts):

        <label>: <verdict>
          - <comparison>: <verdict>, margin .. vs noise .. over n <unit> (<reason>)

    ``unit``: what the repeats are ("paired draws", "seeds", "seeds, paired by seed"); by default "paired draws" for a
    paired judgement, "seeds" otherwise."""
    from zoo.evaluation.claims import combine

    verdict = combine(j["verdict"] for j in judgements.values())
    print(f"{label}: {verdict}")
    for name, j in judgements.items():
        print("  - " + judgement_line(name, j, unit))
    return verdict
