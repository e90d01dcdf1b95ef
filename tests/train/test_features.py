"""The training feature contract (train/features.py): hook capture equals HF's hidden states under dspark's layer-id
convention, the frozen head reproduces the target's own distribution, the new step trains exactly like the old
full-logits one, and the lm_head sees only the valid anchor-block slots."""

from __future__ import annotations

import pytest
import torch
from ckpt_factory import DraftSpec, tiny_target
from full_logits_step import full_logits_step

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.train.data import TokenStream
from dspark_cli.runtime.train.features import (FeatureRecord, FeatureSpec, TargetHead, capture_target_features,
                                                stack_records)
from dspark_cli.runtime.train.loss import build_blocks, sample_anchors
from dspark_cli.runtime.train.new_draft import DraftShape, build_draft, new_draft_config
from dspark_cli.runtime.train.options import TrainOptions
from dspark_cli.runtime.train.tiny_target import TargetGeometry
from dspark_cli.runtime.train.trainer import DraftTrainer


def qwen3_target(layers: int = 5, seed: int = 0):
    torch.manual_seed(seed)
    return TargetGeometry(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16).build(0, seed).eval()


@pytest.fixture(scope="module")
def gemma4_target(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = tiny_target(tmp_path_factory.mktemp("gemma4") / "t", DraftSpec(family="gemma4", target_layers=4))
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def test_captured_layers_are_hf_hidden_states_at_id_plus_one():
    """Layer id k is the output of decoder layer k: HF hidden_states[k + 1], for the embedding (-1), the first, an
    interior and the last layer a draft may read (L - 2); for the target's last layer HF stores the final norm's output, the capture the raw
    layer output (as TargetModel in generation), and last_hidden is the post-norm state."""
    target = qwen3_target(layers=5)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = target(input_ids=tokens, output_hidden_states=True).hidden_states  # L + 1 x [B, T, Ht]
    ids = [-1, 0, 2, 3]
    features = capture_target_features(target, tokens, ids)
    assert torch.equal(features.layers, torch.cat([hidden[k + 1] for k in ids], dim=-1))
    assert torch.equal(features.last_hidden, hidden[5])
    raw_last = capture_target_features(target, tokens, [4]).layers
    assert torch.equal(target.model.norm(raw_last), hidden[5]) and not torch.allclose(raw_last, hidden[5])
    with pytest.raises(DsparkError, match="layer id 5 does not exist"):
        capture_target_features(target, tokens, [5])


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_the_frozen_head_on_last_hidden_is_the_targets_own_distribution(family, gemma4_target):
    target = qwen3_target() if family == "qwen3" else gemma4_target  # gemma4: a logit soft-cap after the lm_head
    tokens = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        own = torch.softmax(target(input_ids=tokens).logits, dim=-1)
        head = TargetHead(target)
        mine = torch.softmax(head(capture_target_features(target, tokens, [0]).last_hidden), dim=-1)
    assert torch.allclose(mine, own, atol=1e-6, rtol=1e-5)
    head.check(target, tokens[:1], "t")  # passes: the same logits


def test_a_head_that_does_not_reproduce_the_target_is_refused():
    target = qwen3_target()
    head = TargetHead(target)
    head.softcap = 1.0  # a transform this target does not have
    with pytest.raises(DsparkError, match="not supported for training"):
        head.check(target, torch.arange(8)[None], "t")


def _trainer(target, seed: int = 5) -> DraftTrainer:
    options = TrainOptions(steps=6, batch_size=3, seq_len=24, anchors=5, lr=3e-3, seed=seed)
    shape = DraftShape(layers=1, block_size=4, markov_rank=8, target_layers=(1, 3), mask_token_id=63)
    config, _ = new_draft_config(target.config.to_dict(), None, shape, options.anchors)
    torch.manual_seed(seed)
    stream = TokenStream(torch.randint(1, 63, (400,), generator=torch.Generator().manual_seed(seed)))
    return DraftTrainer(target, build_draft(config, target), stream, options)


def test_the_new_step_trains_exactly_like_the_full_logits_step():
    """Same seed, batches and anchors: the same losses over every step and the same weights after them."""
    target = qwen3_target()
    new, old = _trainer(target), _trainer(target)
    new_losses = [new.run_step().value for _ in range(6)]
    old_losses = [full_logits_step(old).value for _ in range(6)]
    assert new_losses == pytest.approx(old_losses, rel=1e-6, abs=0)
    assert len(set(new_losses)) == 6  # the draft did train
    for (name, a), b in zip(new.draft.named_parameters(), old.draft.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name


def test_the_lm_head_sees_only_the_valid_anchor_block_slots():
    """One step runs the target's lm_head on one row per valid slot (the capture computes no logits); anchors near
    the window's end have slots past it, which are not computed either."""
    target = qwen3_target()
    trainer = _trainer(target)
    seen = []
    target.get_output_embeddings().register_forward_hook(lambda m, inputs, out: seen.append(inputs[0].shape[:-1].numel()))
    replay = torch.Generator()
    replay.set_state(trainer.generator.get_state())
    tokens = trainer.stream.sample(trainer.options.batch_size, trainer.seq_len, replay)  # the batch run_step draws
    anchors = sample_anchors(tokens.shape[0], tokens.shape[1], trainer.anchors, replay)
    blocks = build_blocks(tokens, anchors, trainer.draft.config.block_size.value, trainer.draft.config.mask_token_id)
    trainer.run_step()
    B, T = tokens.shape
    assert sum(seen) == int(blocks.valid.sum()) < blocks.valid.numel() < B * T


def test_a_loss_mask_removes_the_masked_labels_from_the_loss():
    target = qwen3_target()
    trainer = _trainer(target)
    tokens = trainer.next_tokens()
    anchors = sample_anchors(tokens.shape[0], tokens.shape[1], trainer.anchors, trainer.generator)
    features = trainer.target_features(tokens)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[:, :12] = False  # a chat prompt: no label from it
    full, masked = trainer.batch_loss(tokens, features, anchors), trainer.batch_loss(tokens, features, anchors, mask)
    blocks = build_blocks(tokens, anchors, 4, 63, mask)
    label_positions = blocks.positions.view_as(blocks.labels) + 1
    assert not blocks.valid[label_positions < 12].any() and blocks.valid[(label_positions >= 12) & (label_positions < 24)].all()
    assert masked.value != full.value


def test_spec_and_records_round_trip_and_refuse_what_does_not_fit():
    spec = FeatureSpec(target="Qwen/Qwen3-8B", revision=None, layer_ids=(1, 17, 33), hidden_size=4096,
                       vocab_size=151936, dtype="bfloat16", tokenizer_hash="ab", template_hash=None, max_length=8)
    assert FeatureSpec.from_dict(spec.to_dict()) == spec
    assert spec.bytes_per_token == 32 * 1024  # 3 layers + last, 4096 wide, bf16
    with pytest.raises(DsparkError, match="key 'version' is 0"):
        FeatureSpec.from_dict({**spec.to_dict(), "version": 0}, "spec.json")
    with pytest.raises(DsparkError, match="key 'layer_ids'"):
        FeatureSpec.from_dict({**spec.to_dict(), "layer_ids": "1,2"}, "spec.json")
    small = FeatureSpec("t", None, (0, 1), 4, 10, "float32", "h", None, 8)
    record = FeatureRecord(torch.arange(5), torch.ones(5, dtype=torch.bool), torch.zeros(5, 8), torch.zeros(5, 4))
    again = FeatureRecord.from_tensors(record.to_tensors(), small, "r.safetensors")
    tokens, mask, features = stack_records([again, again])
    assert tokens.shape == mask.shape == (2, 5) and features.layers.shape == (2, 5, 8)
    with pytest.raises(DsparkError, match="'layers' is torch.float32 \\[5, 6\\], expected torch.float32 \\[5, 8\\]"):
        FeatureRecord.from_tensors({**record.to_tensors(), "layers": torch.zeros(5, 6)}, small, "r.safetensors")


def test_the_frozen_head_divides_by_a_granite_targets_logits_scaling():
    """Granite divides its lm_head's output by logits_scaling (8 here): the frozen head's logits are the model's."""
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    config = GraniteConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, logits_scaling=8.0)
    target = GraniteForCausalLM(config).eval()
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        own = target(input_ids=tokens).logits
        mine = TargetHead(target)(capture_target_features(target, tokens, [0]).last_hidden)
    assert torch.allclose(mine, own, atol=1e-6, rtol=1e-5) and own.abs().max() > 0.01
    TargetHead(target).check(target, tokens[:1], "t")
