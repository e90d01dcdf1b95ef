"""`dspark validate --probe` on the demo draft and on mis-exports of it: τ and draft acceptance each one measures.

    .venv/bin/python benchmarks/probe_misexports.py [--device cpu]

The mis-exports are tests/fixtures/misexport.py's folders (built in a temporary folder from the shipped demo pair):
every norm at exactly 1.0, every norm at 0.75, target_layer_ids one layer early, every vocabulary row shifted by one
id. Prints one line per draft: τ, acceptance, rounds, whether the probe flags it (DSP608), seconds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))

from misexport import DRAFT, FOLDER_CASES, SHIFTED, TARGET, FolderCase, build_folder  # noqa: E402

from dspark_cli.runtime.probe import probe  # noqa: E402

CASES = (
    ("demo draft", None),
    ("every norm exactly 1.0", FOLDER_CASES[0]),
    ("every norm 0.75", FOLDER_CASES[1]),
    ("target_layer_ids one layer early [0, 2, 5]", FolderCase("early", "-", config={"target_layer_ids": [0, 2, 5]})),
    ("vocabulary rows shifted by one id", SHIFTED),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for index, (name, case) in enumerate(CASES):
            draft = DRAFT if case is None else build_folder(case, Path(tmp) / str(index))
            start = time.perf_counter()
            result = probe(str(TARGET), str(draft), device=args.device)
            print(f"{name}: τ {result.tau:.2f}, acceptance {result.draft_acceptance_rate:.0%}, {result.rounds} rounds, "
                  f"{'flagged (DSP608)' if result.slower else 'not flagged'}, {time.perf_counter() - start:.0f} s",
                  flush=True)


if __name__ == "__main__":
    main()
