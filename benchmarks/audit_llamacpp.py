"""`dspark bench audit` against the real llama.cpp llama-server on the demo pair: the figures of docs/bench.md.

Starts llama-server twice on the demo pair's GGUFs (scripts/llamacpp_server.py: the draft under dspark's flags, and
the target alone; llama.cpp's default KV cache and attention), then:

1. the clean audit: every shipped prompt, 64 tokens at T = 0 against the plain server and dspark's float32
   reference, and the T > 0 check at the default samples;
2. each planted fault through tests/fixtures/fault_proxy.py in front of the speculative server: top_p dropped,
   top_k dropped, one token changed after the first block, drafting off, a tool-call JSON cut short;
3. the power of the T > 0 test: BIG samples per setting from the plain server with the audit's settings and with
   top_p (top_k) dropped (through the proxy), the total-variation distance at each position, and the share of
   REPEATS simulated audits of n samples per side (drawn from those histograms) that fail, with the dropped
   setting on one side (power) and with the audit's setting on both (false alarms), at the audit's threshold.

    python benchmarks/audit_llamacpp.py [--samples 400] [--big 2000] [--repeats 400] [--power-samples 50,100,200,400]
                                        [--power-only] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "scripts"), str(ROOT / "tests" / "fixtures")]

from fault_proxy import FaultProxy  # noqa: E402
from llamacpp_server import demo_gguf, llama_server  # noqa: E402

from dspark_cli.runtime.bench.audit import (POSITIONS, SAMPLING_CHECKS, AuditConfig, run_audit,  # noqa: E402
                                            sample_tokens, shipped_prompts)
from dspark_cli.runtime.bench.audit_client import GREEDY, connect_audit  # noqa: E402
from dspark_cli.runtime.bench.audit_stats import homogeneity_test, total_variation  # noqa: E402
from dspark_cli.runtime.demo import DEMO_DIR  # noqa: E402

FAULTS = {"drop_top_p": "sampling", "drop_top_k": "sampling", "change_token": "greedy", "no_draft": "greedy",
          "truncate_tool_call": "greedy"}


def summary(report, seconds: float) -> dict:
    doc = report.to_dict()
    return {"verdict": doc["verdict"], "greedy": doc["greedy"], "seconds": seconds, "timings_s": doc["timings_s"],
            "checks": [{k: c[k] for k in ("name", "position", "chi2", "df", "p", "tv", "threshold", "passed")}
                       for c in doc["sampling"]["checks"]],
            "differences": [{"prompt": p["index"], "kind": p["kind"], "vs_plain": p["vs_plain"]}
                            for p in doc["prompts"] if p["vs_plain"] is not None],
            "ties": [{"prompt": p["index"], **t} for p in doc["prompts"] for t in p["ties"]],
            "plain_vs_reference": [p["index"] for p in doc["prompts"] if p["plain_vs_reference"] is not None]}


def timed_audit(config: AuditConfig) -> dict:
    start = time.perf_counter()
    report = run_audit(config)
    return summary(report, time.perf_counter() - start)


def power(plain: str, big: int, sizes: list[int], repeats: int, alpha: float) -> list[dict]:
    """TV of a dropped top_p / top_k at each position, and the simulated test's power and false-alarm rate."""
    server = connect_audit(plain, "plain", "auto", None, 120)
    ids = server.tokenize(shipped_prompts()[0].text)
    context = ids + server.complete(ids, 8, GREEDY, 0).tokens
    threshold = alpha / (len(SAMPLING_CHECKS) * len(POSITIONS))
    rows, rng = [], random.Random(0)
    for index, (name, sampling) in enumerate(SAMPLING_CHECKS):
        with FaultProxy(plain, f"drop_{name.replace('-', '_')}") as proxy:
            dropped_server = connect_audit(proxy.url, "plain", "auto", None, 120)
            seeds = range(10**6 + index * 4 * big, 10**6 + index * 4 * big + big)
            honest = sample_tokens(server, context, sampling, list(seeds), 2)
            dropped = sample_tokens(dropped_server, context, sampling, [s + 2 * big for s in seeds], 2)
        for position in POSITIONS:
            p, q = Counter(t[position] for t in honest), Counter(t[position] for t in dropped)
            for n in sizes:
                draw = lambda counts: rng.choices(list(counts), list(counts.values()), k=n)  # noqa: E731
                fails = sum(homogeneity_test(draw(p), draw(q)).p < threshold for _ in range(repeats))
                alarms = sum(homogeneity_test(draw(p), draw(p)).p < threshold for _ in range(repeats))
                rows.append({"check": name, "position": position, "tv": total_variation(p, q), "distinct": len(p),
                             "distinct_dropped": len(q), "samples": n, "power": fails / repeats,
                             "false_alarms": alarms / repeats, "threshold": threshold})
    return rows


def audits(out: dict, spec: str, plain: str, prompts, reference, base: dict) -> None:
    """The clean audit and one per planted fault, into `out`."""
    out["clean"] = timed_audit(AuditConfig(speculative=spec, prompts=prompts, reference=reference, **base))
    print("clean", json.dumps(out["clean"]), flush=True)
    out["faults"] = {}
    for fault, kind in FAULTS.items():
        with FaultProxy(spec, fault, plain=plain if fault == "no_draft" else None) as proxy:
            changes = {"prompts": prompts[:1], "max_tokens": 12} if kind == "sampling" else {"samples": 0}
            out["faults"][fault] = timed_audit(AuditConfig(**{**base, "speculative": proxy.url, "prompts": prompts,
                                                              **changes}))
        print(fault, json.dumps(out["faults"][fault]), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--big", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=400)
    parser.add_argument("--alpha", type=float, default=0.01)
    parser.add_argument("--power-samples", default="50,100,200,400", help="sample sizes whose power is simulated")
    parser.add_argument("--power-only", action="store_true", help="skip the audits, measure the power alone")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    prompts = shipped_prompts()
    reference = (str(DEMO_DIR / "target"), str(DEMO_DIR / "draft"))
    out: dict = {"samples": args.samples, "alpha": args.alpha}
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = demo_gguf(Path(tmp))
        with llama_server(target, draft, slots=2) as spec, llama_server(target, slots=2) as plain:
            base = dict(plain=plain, max_tokens=64, samples=args.samples, alpha=args.alpha)
            if not args.power_only:
                audits(out, spec, plain, prompts, reference, base)
            sizes = [int(n) for n in args.power_samples.split(",")]
            out["power"] = power(plain, args.big, sizes, args.repeats, args.alpha)
            for row in out["power"]:
                print("power", json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
