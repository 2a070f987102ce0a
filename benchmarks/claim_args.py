"""What the claim benchmarks share: the compressors' command line, the geometric mean of per-domain perplexity, and
the plain table the short-run benchmarks print."""
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


def geo(ppl: dict) -> float:
    return math.exp(sum(math.log(v) for v in ppl.values()) / len(ppl))


def show(rows: list[dict]) -> None:
    """Rows of dicts as one " | "-separated table (every key of any row is a column)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))
