"""Tests that see the draft itself, not only the (lossless) output: a draft bug changes no greedy output, so
these pin what the draft proposes.

1. draft_block (inference: cached context K/V, one block at the anchor, the sequential Markov walk) gives the
   same distribution as draft_forward (training: one masked forward, teacher-forced Markov inputs) for the same
   context and anchor, in float32. Checked at T = 0.5 so that temperature handling is part of it, with a
   reduced-vocabulary draft (d2t) so that the Markov head's target-id input is, and with a rank-0 draft (no Markov head:
   base logits only), and for gated / RNN heads and a Gemma-4 draft (the teacher-forced latents of training
   equal the walk's).
2. The golden trace: the shipped demo pair, float32 on CPU, greedy, block 7, fixed prompts; the accepted count of
   every round is pinned in tests/fixtures/golden/demo_trace.json. Any draft-side change flips some round. After a
   deliberate demo rebuild, regenerate it with `pytest tests/model/test_draft_trace.py --update-golden`.
"""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from ckpt_factory import DraftSpec, write_draft

from dspark_cli.runtime.demo import DEMO_DIR, DEMO_PROMPTS
from dspark_cli.runtime.model.draft import DraftContext
from dspark_cli.runtime.model.draft_io import load_draft
from dspark_cli.runtime.pair import Pair
from dspark_cli.runtime.settings import SamplingParams
from dspark_cli.runtime.decode.speculative import Drafter, draft_block
from dspark_cli.runtime.train.loss import build_blocks, draft_forward

GOLDEN = Path(__file__).parents[1] / "fixtures" / "golden" / "demo_trace.json"
TRACE_PROMPTS = (*DEMO_PROMPTS, "import os\nimport sys\n\n\ndef main(argv=None):\n",
                 "\"\"\"Utilities for reading and writing configuration files.\n\nThis module provides")
TRACE_BLOCK, TRACE_TOKENS = 7, 64

SPECS = {
    "markov_d2t": DraftSpec(draft_vocab_size=96, markov_rank=32, block_size=5, dtype=torch.float32),
    "rank0": DraftSpec(markov_rank=0, confidence=False, sample_from_anchor=True, block_size=5, dtype=torch.float32),
    "gated": DraftSpec(markov_head_type="gated", markov_rank=32, block_size=5, dtype=torch.float32),
    "rnn": DraftSpec(markov_head_type="rnn", markov_rank=32, block_size=5, dtype=torch.float32),
    "gemma4_rnn": DraftSpec(family="gemma4", markov_head_type="rnn", block_size=5, dtype=torch.float32),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_inference_block_equals_training_forward(tmp_path, name):
    spec = SPECS[name]
    draft = load_draft(write_draft(tmp_path / name, spec))
    params = SamplingParams(temperature=0.5)
    gen = torch.Generator().manual_seed(1)
    start, K = 11, spec.block_size
    features = torch.randn(start + K, draft.fc.weight.shape[1], generator=gen)  # [T, n*Ht]
    tokens = torch.randint(0, 240, (start + K,), generator=gen)
    anchor = int(tokens[start])

    context = DraftContext(draft, capacity=4)  # grows on the way: covers the buffer doubling too
    context.append(draft, features[:5])
    context.append(draft, features[5:start])
    drafter = Drafter(draft, "dense", params, spec.vocab_size)
    proposal = draft_block(drafter, context, anchor, K, torch.Generator().manual_seed(2))

    tokens[start + 1 :] = proposal.tokens[: K - 1]  # teacher-force the Markov inputs with what the walk drew
    blocks = build_blocks(tokens[None], torch.tensor([[start]]), K, draft.config.mask_token_id)
    with torch.no_grad():  # features past the anchor are in the forward but masked out
        logits, confidence = draft_forward(draft, features[None], blocks)  # [1, 1, K, Vd], [1, 1, K] | None
    expected = torch.log_softmax(logits[0, 0].double() / params.temperature, -1)  # [K, Vd]
    target_ids = torch.arange(expected.shape[-1])
    if draft.d2t is not None:
        target_ids = target_ids + draft.d2t
    observed = proposal.draft_probs[:, target_ids].double().log()  # [K, Vd] on the draft vocabulary's ids
    assert torch.allclose(observed, expected, atol=2e-5, rtol=0), (observed - expected).abs().max()
    if confidence is not None:
        assert torch.allclose(proposal.confidences, torch.sigmoid(confidence[0, 0]), atol=1e-6)


def _digest(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def demo_trace() -> dict:
    target_dir, draft_dir = DEMO_DIR / "target", DEMO_DIR / "draft"
    pair = Pair.load(target_dir, draft_dir, device="cpu", dtype="float32", markov="dense", block_size=TRACE_BLOCK)
    accepted = []
    for prompt in TRACE_PROMPTS:
        result = pair.generate(pair.encode(prompt, chat=False), max_new_tokens=TRACE_TOKENS, stop_ids=())
        accepted.append([r.accepted for r in result.stats.rounds])
    return {"target_sha256": _digest(target_dir), "draft_sha256": _digest(draft_dir), "block_size": TRACE_BLOCK,
            "max_new_tokens": TRACE_TOKENS, "prompts": list(TRACE_PROMPTS), "accepted": accepted}


def test_golden_trace_of_the_demo_pair(request):
    trace = demo_trace()
    if request.config.getoption("--update-golden"):
        head = json.dumps({k: v for k, v in trace.items() if k != "accepted"}, indent=1)[:-2]
        rows = ",\n".join("  " + json.dumps(counts) for counts in trace["accepted"])
        GOLDEN.write_text(f'{head},\n "accepted": [\n{rows}\n ]\n}}\n')  # one line per prompt
    golden = json.loads(GOLDEN.read_text())
    assert (trace["target_sha256"], trace["draft_sha256"]) == (golden["target_sha256"], golden["draft_sha256"]), (
        "the demo pair was rebuilt; if on purpose, regenerate with `pytest tests/model/test_draft_trace.py --update-golden`")
    assert trace["prompts"] == golden["prompts"]
    for prompt, got, pinned in zip(trace["prompts"], trace["accepted"], golden["accepted"]):
        assert got == pinned, f"accepted counts per round changed for prompt {prompt!r}"
