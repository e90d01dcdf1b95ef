"""Benchmark CLI start-up: `dspark --help` (target < 0.3 s) and which heavy modules it imports.

    .venv/bin/python benchmarks/bench_startup.py [--runs 11]

Rows (medians of --runs subprocess runs, same machine, same run; wall clock and the child's CPU time):
  - baseline: `python -c pass` (interpreter start) and `python -c "import typer, rich"` (the CLI's own floor);
  - `dspark --help`, `dspark validate --help`;
  - the slowest imports of `dspark --help` (python -X importtime, cumulative).
Then, in one child process that runs `dspark --help`, whether torch / transformers / triton / modelopt /
safetensors / huggingface_hub ended up in sys.modules (none may: they cost seconds).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET_S = 0.3
HEAVY = ("torch", "transformers", "triton", "modelopt", "safetensors", "huggingface_hub", "numpy")

_PROBE = """
import sys
from dspark_cli.cli import app
try:
    app(["--help"])
except SystemExit:
    pass
print(",".join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)
"""


def median_times(args: list[str], runs: int) -> tuple[float, float]:
    """Median wall and median CPU (user + system) seconds of a subprocess; CPU time is steadier on a busy machine."""
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        done = subprocess.run(args, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        walls.append(time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr.decode()}")
    return statistics.median(walls), statistics.median(cpus)


def slowest_imports(dspark_args: list[str], count: int = 8) -> list[tuple[float, str]]:
    """(cumulative seconds, module) of the top-level imports that cost most, from python -X importtime."""
    script = "import sys; from dspark_cli.cli import main; sys.argv = ['dspark', *sys.argv[1:]]; main()"
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", script, *dspark_args], capture_output=True,
                          text=True)
    rows = []
    for line in done.stderr.splitlines():
        parts = line.split("|")
        if line.startswith("import time:") and len(parts) == 3 and parts[1].strip().isdigit():
            if not parts[2].startswith("  "):  # nested imports are indented further
                rows.append((int(parts[1]) / 1e6, parts[2].strip()))
    return sorted(rows, reverse=True)[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11)
    args = parser.parse_args()
    dspark = shutil.which("dspark", path=str(Path(sys.executable).parent)) or "dspark"

    rows = [
        ("baseline: python -c pass", median_times([sys.executable, "-c", "pass"], args.runs)),
        ("baseline: python -c 'import typer, rich.console'",
         median_times([sys.executable, "-c", "import typer, rich.console"], args.runs)),
        ("dspark --help", median_times([dspark, "--help"], args.runs)),
        ("dspark validate --help", median_times([dspark, "validate", "--help"], args.runs)),
    ]
    print(f"median of {args.runs} subprocess runs ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})")
    print(f"  {'':<50} {'wall':>8}    {'cpu':>8}")
    for label, (wall, cpu) in rows:
        print(f"  {label:<50} {wall * 1000:8.1f} ms {cpu * 1000:8.1f} ms")

    print("\nslowest top-level imports of `dspark --help` (cumulative):")
    for seconds, name in slowest_imports(["--help"]):
        print(f"  {name:<50} {seconds * 1000:8.1f} ms")

    probe = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=HEAVY)], capture_output=True, text=True)
    imported = [m for m in probe.stderr.strip().splitlines()[-1].split(",") if m] if probe.stderr.strip() else []
    print(f"\nheavy modules imported by `dspark --help`: {', '.join(imported) or 'none'} (checked: {', '.join(HEAVY)})")
    wall, cpu = rows[2][1]
    verdict = "OK" if wall < TARGET_S else ("OVER on wall clock, OK on CPU time (busy machine)" if cpu < TARGET_S
                                            else "OVER")
    print(f"dspark --help: wall {wall:.3f} s, cpu {cpu:.3f} s vs target {TARGET_S:.1f} s: {verdict}")


if __name__ == "__main__":
    main()
