"""Where a speculative round's time goes: ms and aten ops per loop step (draft, markov, score, accept, commit).

    .venv/bin/python benchmarks/profile_round.py                  # the demo pair, one thread, T = 0 and 0.7

Runs speculative_generate on the demo pair (128 new tokens, three prompts, after one warm-up pass), reads the
loop's SectionTimer records (ms per step per round and its share of the round), then repeats the run under
torch.profiler with each step wrapped in a record_function, and counts the aten ops (nested ones included) under
each step per round.
docs/generate.md ("Where a round's time goes") quotes its output.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from dspark_cli.runtime.decode import timing  # noqa: E402
from dspark_cli.runtime.checkpoint.read import open_checkpoint  # noqa: E402
from dspark_cli.runtime.checkpoint.config import DraftConfig  # noqa: E402
from dspark_cli.runtime.demo import DEMO_PROMPTS, demo_pair  # noqa: E402
from dspark_cli.runtime.model.draft_io import load_draft  # noqa: E402
from dspark_cli.runtime.settings import MarkovHead, Requested, resolve_settings, trained_block_size  # noqa: E402
from dspark_cli.runtime.decode.speculative import speculative_generate  # noqa: E402
from dspark_cli.runtime.model.target import TargetModel  # noqa: E402

PROMPTS = [*DEMO_PROMPTS[:2], "def fibonacci(n):\n    "]
MARK = "round step: "
timed_section = timing.SectionTimer.section


@contextlib.contextmanager
def profiled_section(self, name: str):
    with timed_section(self, name), record_function(MARK + name):
        yield


def ops_per_step(prof, rounds: int) -> dict[str, float]:
    counts: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(MARK):
            parent = parent.cpu_parent
        counts[parent.name[len(MARK) :] if parent else "outside the steps"] += 1
    return {name: count / rounds for name, count in counts.items()}


def main() -> None:
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    target_dir, draft_dir = demo_pair()
    config = DraftConfig.from_dict(open_checkpoint(draft_dir).config)
    target = TargetModel.load(target_dir, config.hidden_state_indices)
    draft = load_draft(draft_dir, target_embed=target.embed_weight,
                                        target_lm_head=target.lm_head_weight)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    block = trained_block_size(config)
    for temperature in (0.0, 0.7):
        settings = resolve_settings(config, MarkovHead.of_config(config, nvfp4=False), False,
                                    Requested(block_size=block, temperature=temperature))

        def run() -> list:
            return [speculative_generate(target, draft, p, settings, max_new_tokens=128,
                                         generator=torch.Generator().manual_seed(0)).stats for p in prompts]

        run()  # warm-up
        sections = [r for stats in run() for r in stats.sections]
        ms = {name: sum(r.get(name, 0.0) for r in sections) / len(sections) for name in sections[0]}
        with mock.patch.object(timing.SectionTimer, "section", profiled_section), profile(
            activities=[ProfilerActivity.CPU]
        ) as prof:
            rounds = sum(len(stats.rounds) for stats in run())
        ops = ops_per_step(prof, rounds)
        total = sum(ms.values())
        print(f"T={temperature}: {rounds} rounds; per round:")
        for name in [*ms, "outside the steps"]:
            print(f"  {name:<18} {ms.get(name, 0.0):8.3f} ms {ms.get(name, 0.0) / total:6.1%} "
                  f"{ops.get(name, 0.0):8.0f} aten ops")
        print(f"  {'all':<18} {total:8.3f} ms {1:6.1%} {sum(ops.values()):8.0f} aten ops")


if __name__ == "__main__":
    main()
