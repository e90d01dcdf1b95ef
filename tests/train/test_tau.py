"""The τ train prints (train/tau.py) is the τ of the real speculative loop: exact on the shipped demo pair."""

from __future__ import annotations

import json as json_module
from pathlib import Path

import pytest
import torch

from dspark_cli.runtime.demo import DEMO_DIR
from dspark_cli.runtime.model.target import TargetModel
from dspark_cli.runtime.train.data import TokenStream
from dspark_cli.runtime.train.run import hold_out_prompts
from dspark_cli.runtime.train.tau import TauProbe, chained_tau, eval_prompts, held_out


@pytest.fixture(scope="module")
def demo():
    from dspark_cli.runtime.pair import Pair

    if not (DEMO_DIR / "draft" / "config.json").is_file():
        pytest.skip("the demo pair is not built (scripts/build_demo.py)")
    return Pair.load(device="cpu", dtype="float32")


@pytest.mark.parametrize("with_stop", [False, True])
def test_chained_tau_is_the_loops_tau_round_for_round(demo, with_stop):
    """Greedy, M new tokens per prompt: the estimator's rounds are the loop's rounds, also with a stop token that
    ends a prompt's generation early (accepted among the drafts or as the next token)."""
    text = Path(json_module.__file__).with_name("decoder.py").read_text()
    ids = torch.tensor(demo.encode(text, chat=False))
    P, M = 32, 40
    prompts = [ids[start:start + P] for start in (0, 300, 600, 900)]  # 4 x [P]
    stops = ()
    if with_stop:  # a token the target writes early after the first prompt, and more often elsewhere
        stops = (demo.baseline(prompts[0].tolist(), max_new_tokens=12, stop_ids=()).tokens[-1],)
    draft = demo.draft
    held = held_out(TargetModel(demo.target.model), prompts, M, demo.block_size, draft.config.layer_ids, stops)
    estimate = chained_tau(draft, held, demo.target.vocab_size)
    results = [demo.generate(prompt.tolist(), max_new_tokens=M, stop_ids=stops) for prompt in prompts]
    rounds = [r for result in results for r in result.stats.rounds]
    assert any(result.finished_by_stop for result in results) == with_stop
    assert estimate.rounds == len(rounds)
    assert estimate.tau == pytest.approx(sum(r.emitted for r in rounds) / len(rounds), abs=1e-12)
    assert estimate.tau > 2.0  # a trained draft: the rounds are long, so the chaining is exercised
    K = demo.block_size
    assert estimate.accepted_at == pytest.approx([sum(r.accepted > j for r in rounds) / len(rounds) for j in range(K)])


def test_a_stop_token_as_the_first_new_token_ends_that_prompt_with_no_round(demo):
    """The target's first new token (from the prefill) is a stop token: the loop runs no round for that prompt, and
    the estimator neither drafts past it (an IndexError) nor counts a round; the other prompt is measured as usual."""
    text = Path(json_module.__file__).with_name("decoder.py").read_text()
    ids = torch.tensor(demo.encode(text, chat=False))
    prompts = [ids[0:32], ids[300:332]]
    stops = (demo.baseline(prompts[0].tolist(), max_new_tokens=1, stop_ids=()).tokens[-1],)
    held = held_out(TargetModel(demo.target.model), prompts, 24, demo.block_size, demo.draft.config.layer_ids, stops)
    estimate = chained_tau(demo.draft, held, demo.target.vocab_size)
    results = [demo.generate(prompt.tolist(), max_new_tokens=24, stop_ids=stops) for prompt in prompts]
    assert results[0].stats.rounds == [] and results[0].finished_by_stop
    rounds = [r for result in results for r in result.stats.rounds]
    assert estimate.rounds == len(rounds) > 0
    assert estimate.tau == pytest.approx(sum(r.emitted for r in rounds) / len(rounds), abs=1e-12)


def test_a_prompt_set_is_encoded_as_eval_encodes_it(demo):
    path = DEMO_DIR / "eval_code.jsonl"
    texts = [json_module.loads(line)["turns"][0] for line in path.read_text().splitlines()]
    assert eval_prompts(path, demo.tokenizer, str(DEMO_DIR / "target")) == [demo.encode(t) for t in texts]


def test_the_prompts_are_held_out_of_the_training_stream():
    stream = TokenStream(torch.arange(1000))
    probe = TauProbe(every=10, prompts=2, prompt_tokens=16)
    kept, prompts, note = hold_out_prompts(stream, probe)
    assert torch.equal(prompts.flatten(), torch.arange(968, 1000)) and len(kept) == 968 and "every 10 steps" in note
    small, none, why = hold_out_prompts(TokenStream(torch.arange(300)), probe)
    assert none is None and len(small) == 300 and "not measured" in why
    assert hold_out_prompts(stream, TauProbe(every=0))[1] is None


def test_the_loop_measures_tau_every_n_steps_and_at_the_end(tmp_path):
    from dspark_cli.runtime.train.new_draft import DraftShape, build_draft, new_draft_config
    from dspark_cli.runtime.train.options import TrainOptions
    from dspark_cli.runtime.train.tiny_target import TargetGeometry
    from dspark_cli.runtime.train.trainer import DraftTrainer, train_loop

    target = TargetGeometry(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16).build(0, 0).eval()
    options = TrainOptions(steps=5, batch_size=2, seq_len=16, anchors=4, lr=1e-2, seed=0)
    shape = DraftShape(layers=1, block_size=3, markov_rank=4, target_layers=(0, 1), mask_token_id=63)
    config, _ = new_draft_config(target.config.to_dict(), None, shape, options.anchors)
    stream = TokenStream(torch.randint(1, 63, (300,), generator=torch.Generator().manual_seed(0)))
    trainer = DraftTrainer(target, build_draft(config, target), stream, options, tau_every=2)
    trainer.held_out = held_out(TargetModel(target), list(stream.tokens[:16].view(2, 8)), 6, 3, [0, 1])
    reports = []
    train_loop(trainer, tmp_path / "out", reports.append)
    assert [r.step for r in reports if r.tau is not None] == [2, 4, 5]
    assert reports[-1].tau == trainer.measure_tau().tau and 1.0 <= reports[-1].tau <= 4.0
