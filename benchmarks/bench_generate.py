"""Benchmark speculative generation: τ (incl. bonus), tokens/s and speedup over plain decoding, per block size.

    .venv/bin/python benchmarks/bench_generate.py                        # the demo pair, else a fixture pair
    .venv/bin/python benchmarks/bench_generate.py --target T --draft D --block-sizes 1,4,7 --temperature 1

Both decoders run on the same prompts in the same process, after one warm-up run each; the baseline is the
same target decoding one token per forward (runtime.speculative.autoregressive_generate). Without the demo
pair (scripts/build_demo.py) the pair is the bigram fixture of tests/pair_factory.py: a tiny random Qwen3
target whose next token depends mostly on the current one, and a DSpark draft whose Markov head holds that
bigram (so τ is high by construction, and the figures measure the loop's overheads, not a trained draft).
Prompts: held-out-style text for a pair with a tokenizer, random token ids otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

from dspark_cli.errors import DsparkError  # noqa: E402
from dspark_cli.runtime.checkpoint import open_checkpoint  # noqa: E402
from dspark_cli.runtime.config import DraftConfig  # noqa: E402
from dspark_cli.runtime.demo import demo_pair  # noqa: E402
from dspark_cli.runtime.draft import DSparkDraft  # noqa: E402
from dspark_cli.runtime.metrics import summarize  # noqa: E402
from dspark_cli.runtime.sampling import SamplingParams  # noqa: E402
from dspark_cli.runtime.speculative import autoregressive_generate, max_block_size, speculative_generate  # noqa: E402
from dspark_cli.runtime.target import TargetModel  # noqa: E402

TEXT_PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    \"\"\"A last-in first-out container.\"\"\"\n\n    def __init__(self):\n",
    "The quick brown fox",
]


def fixture_pair(root: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(REPO / "tests"))
    from ckpt_factory import DraftSpec
    from pair_factory import bigram_draft, bigram_target, write_byte_tokenizer

    spec = DraftSpec(block_size=8, markov_rank=64)
    target = bigram_target(root / "target", spec)
    write_byte_tokenizer(target)
    return target, bigram_draft(root / "draft", spec, target)


def prompts_for(target_dir: Path, vocab: int, count: int) -> tuple[list[list[int]], str]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        prompts = [tokenizer(text)["input_ids"] for text in (TEXT_PROMPTS * count)[:count]]
    except (OSError, ValueError, TypeError):
        prompts = []
    if prompts and all(prompts):
        return prompts, "text"
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(2, vocab, (16,), generator=generator).tolist() for _ in range(count)], "random-id"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--block-sizes", default=None, help="comma-separated (default: 1, 2, 4 and the trained)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--markov", default="auto")
    parser.add_argument("--draft-topk", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        if args.target and args.draft:
            target_dir, draft_dir, label = Path(args.target), Path(args.draft), "given pair"
        else:
            try:
                (target_dir, draft_dir), label = demo_pair(), "demo pair"
            except DsparkError:
                (target_dir, draft_dir), label = fixture_pair(Path(tmp)), "bigram fixture pair (demo not built)"
        run(args, target_dir, draft_dir, label)


def run(args, target_dir: Path, draft_dir: Path, label: str) -> None:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    config = DraftConfig.from_dict(open_checkpoint(draft_dir).config)
    target = TargetModel.load(target_dir, config.hidden_state_indices, dtype=dtype, device=device)
    draft = DSparkDraft.from_checkpoint(draft_dir, target_embed=target.embed_weight,
                                        target_lm_head=target.lm_head_weight, dtype=dtype, device=device)
    trained = max_block_size(config) or 7
    block_sizes = [int(b) for b in args.block_sizes.split(",")] if args.block_sizes else sorted({1, 2, 4, trained})
    prompts, prompt_kind = prompts_for(target_dir, target.vocab_size, args.prompts)
    params = SamplingParams(temperature=args.temperature)
    stop_ids: list[int] = []  # fixed lengths: every run decodes exactly max_new_tokens per prompt

    def speculative(prompt, block_size, tokens):
        return speculative_generate(target, draft, prompt, params, block_size=block_size, max_new_tokens=tokens,
                                    strategy=args.markov, draft_topk=args.draft_topk, stop_ids=stop_ids,
                                    generator=torch.Generator(device=device).manual_seed(0))

    def baseline(prompt, tokens):
        return autoregressive_generate(target, prompt, params, max_new_tokens=tokens, stop_ids=stop_ids,
                                       generator=torch.Generator(device=device).manual_seed(0))

    speculative(prompts[0], block_sizes[-1], 16), baseline(prompts[0], 16)  # warm-up
    baseline_stats = [baseline(p, args.max_new_tokens).stats for p in prompts]
    print(f"pair: {label}\n  target {target_dir}\n  draft  {draft_dir}")
    print(f"device {device}, {str(dtype).removeprefix('torch.')}, {args.prompts} {prompt_kind} prompts x "
          f"{args.max_new_tokens} new tokens, T={args.temperature}, markov {args.markov}, threads {args.threads}")
    header = (f"{'block':>5} {'tau':>6} {'tok/s':>8} {'base tok/s':>10} {'speedup':>8} {'backbone':>9} "
              f"{'markov':>8} {'verify':>8} {'other':>8}  (ms per round)")
    print(header)
    for block_size in block_sizes:
        stats = [speculative(p, block_size, args.max_new_tokens).stats for p in prompts]
        s = summarize(stats, baseline_stats, block_size)
        b = s.round_breakdown
        print(f"{block_size:>5} {s.tau:>6.2f} {s.tokens_per_s:>8.1f} {s.baseline.tokens_per_s:>10.1f} "
              f"{s.baseline.speedup:>7.2f}x {b.draft_backbone_ms:>9.2f} {b.markov_ms:>8.2f} {b.verify_ms:>8.2f} "
              f"{b.other_ms:>8.2f}")


if __name__ == "__main__":
    main()
