"""`dspark train`: data, block layout, the distillation step, checkpoints, resume, and the shipped demo pair."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.train.options import TrainOptions
from dspark_cli.runtime.train.trainer import train_loop
from dspark_cli.runtime.model.draft_io import save_draft
from dspark_cli.runtime.train.data import collect_files, load_token_stream, read_documents
from dspark_cli.runtime.train.new_draft import DraftShape, choose_mask_token, default_target_layers
from dspark_cli.runtime.train.features import TargetFeatures
from dspark_cli.runtime.train.loss import BlockBatch, build_blocks, loss_sums, normalise
from dspark_cli.runtime.train.run import prepare_run

CODE = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count
'''


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target folder with tokenizer, data folder): a random 3-layer Qwen3 and a little Python text."""
    from dspark_cli.runtime.train.tiny_target import TargetGeometry, build_tokenizer

    root = tmp_path_factory.mktemp("train")
    data = root / "data"
    data.mkdir()
    (data / "a.py").write_text(CODE * 6)
    (data / "b.jsonl").write_text(json.dumps({"text": CODE.replace("add", "mul").replace("+", "*")}) + "\n")
    tokenizer = build_tokenizer([data / "a.py"], vocab_size=300)
    target = TargetGeometry(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16).build(tokenizer.eos_token_id, 0)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    return root / "target", data


SHAPE = DraftShape(layers=1, block_size=4, markov_rank=8)
OPTIONS = TrainOptions(steps=4, batch_size=2, seq_len=32, anchors=6, lr=1e-2, seed=3)


def test_data_reads_text_jsonl_and_chat(tmp_path, tiny_pair):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    docs = read_documents(collect_files([tiny_pair[1], tmp_path / "chat.jsonl"]))
    assert [d.text is not None for d in docs] == [True, True, False]
    with pytest.raises(DsparkError, match="chat template"):
        load_token_stream([tmp_path / "chat.jsonl"], tokenizer)
    stream = load_token_stream([tmp_path / "chat.jsonl"], tokenizer, tmp_path / "chat.jinja")
    assert tokenizer.decode(stream.tokens[:-1]) == "user: hi\n"
    assert stream.tokens[-1] == tokenizer.eos_token_id
    (tmp_path / "bad.jsonl").write_text('{"prompt": 1}\n')
    with pytest.raises(DsparkError, match="bad.jsonl:1"):
        read_documents([tmp_path / "bad.jsonl"])


def test_loss_terms_on_known_distributions():
    """One block of 3 slots: the draft equals the target at slots 0 and 2 and is disjoint from it at slot 1, so
    L1 = [0, 2, 0], acceptance [1, 0, 1] and expected length 1 + 1 (the accepted prefix stops at slot 1)."""
    target_ids, draft_ids = [1, 2, 3], [1, 0, 3]

    def one_hot_logits(ids):  # [1, 1, 3, 4]: probability ~1 on each id
        return torch.full((1, 1, 3, 4), -1e4).scatter(-1, torch.tensor(ids).view(1, 1, 3, 1), 0.0)

    unused = torch.zeros(1, 1, 3, dtype=torch.long)  # loss_sums reads only labels and valid
    blocks = BlockBatch(input_ids=unused[0], positions=unused[0], labels=torch.tensor([[draft_ids]]), prev_ids=unused,
                        valid=torch.ones(1, 1, 3, dtype=torch.bool), target_index=unused,
                        attn_mask=torch.ones(1, 3, 3, dtype=torch.bool))
    options = TrainOptions(decay_gamma=0.0)  # equal weights
    terms = normalise(loss_sums(one_hot_logits(draft_ids), one_hot_logits(target_ids), None, blocks, options), options)
    assert terms.l1 == pytest.approx(2 / 3) and terms.ce == pytest.approx(0.0, abs=1e-4)
    assert terms.accept == pytest.approx([1.0, 0.0, 1.0]) and terms.expected_length == pytest.approx(2.0)
    assert terms.blocks == 1 and terms.value == pytest.approx(options.l1_alpha * 2 / 3, abs=1e-4)


def test_block_layout_and_mask():
    tokens = torch.arange(10, 20)[None]  # [1, 10]
    blocks = build_blocks(tokens, torch.tensor([[2, 7]]), block_size=3, mask_token_id=99)
    assert blocks.input_ids.tolist() == [[12, 99, 99, 17, 99, 99]]
    assert blocks.positions.tolist() == [[2, 3, 4, 7, 8, 9]]
    assert blocks.labels.tolist() == [[[13, 14, 15], [18, 19, 0]]]  # slot j predicts the token at a + j + 1
    assert blocks.valid.tolist() == [[[True] * 3, [True, True, False]]]
    assert blocks.prev_ids.tolist() == [[[12, 13, 14], [17, 18, 19]]]  # Markov input: anchor, then true tokens
    mask = blocks.attn_mask[0]  # [Q, T + Q]
    assert mask[0, :10].tolist() == [True, True] + [False] * 8  # context strictly before the anchor
    assert mask[3, :10].tolist() == [True] * 7 + [False] * 3
    assert mask[0, 10:].tolist() == [True, True, True, False, False, False]  # its own block, both directions
    assert mask[5, 10:].tolist() == [False, False, False, True, True, True]


def test_default_target_layers_follow_deepspec():
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layers(36, 1) == [18]
    assert default_target_layers(4, 3) == [0, 1, 2]


def test_target_layers_stop_before_the_targets_last_layer():
    """Ids -1 (the embeddings) .. L-2 feed a draft; the last layer's output is post-norm (validate refuses it,
    DSP034), so asking for it is refused before training, as are repeated or decreasing ids."""
    from dspark_cli.runtime.checkpoint.target_config import TargetConfig
    from dspark_cli.runtime.train.new_draft import draft_target_layers

    target = TargetConfig.from_dict({"model_type": "qwen3", "num_hidden_layers": 4, "hidden_size": 64,
                                     "vocab_size": 300})
    assert draft_target_layers(target, DraftShape(target_layers=(-1, 1, 2))) == [-1, 1, 2]
    for layers in ((0, 3), (3,), (-2, 1), (1, 1), (2, 1)):
        with pytest.raises(DsparkError, match=r"target-layers option .* -1\.\.2 \(the target has 4 layers"):
            draft_target_layers(target, DraftShape(target_layers=layers))


def test_a_draft_for_a_gelu_target_is_a_silu_qwen3_draft():
    """The draft layer is Qwen3's (SiLU MLP) whatever the target's activation: copying a Gemma-style target's
    hidden_act would describe another network and make vLLM refuse the draft (DSP035)."""
    from dspark_cli.runtime.checkpoint.config import DraftConfig
    from dspark_cli.runtime.checkpoint.families.qwen3 import backbone_values
    from dspark_cli.runtime.train.new_draft import MaskChoice, draft_config_dict

    target = {"model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 300,
              "hidden_act": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "max_position_embeddings": 512}
    config = draft_config_dict(target, DraftShape(layers=1, block_size=4, markov_rank=8), [0, 2],
                               MaskChoice(5, 300, ""), anchors=4)
    assert config["hidden_act"] == "silu"

    context = SimpleNamespace(config=DraftConfig.from_dict(config))  # the one field the rule reads
    assert list(backbone_values(context)) == []


def test_mask_token_is_added_when_the_vocabulary_is_full(tiny_pair):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    assert choose_mask_token(tokenizer, len(tokenizer), None).token_id == 1  # the demo tokenizer's <|mask|>
    tokenizer.add_special_tokens({"additional_special_tokens": []})
    choice = choose_mask_token(tokenizer, len(tokenizer), len(tokenizer))
    assert (choice.token_id, choice.vocab_size) == (len(tokenizer), len(tokenizer) + 1)
    with pytest.raises(DsparkError, match="outside"):
        choose_mask_token(tokenizer, len(tokenizer), len(tokenizer) + 5)


def _fixed_batch_loss(trainer, tokens, anchors) -> float:
    with torch.no_grad():
        return trainer.batch_loss(tokens, trainer.target_features(tokens), anchors).loss.item()


def test_each_block_slot_is_compared_with_the_targets_distribution_at_its_own_position(tmp_path, tiny_pair):
    """Slot j of the block anchored at a predicts the token at a + j + 1, which the target predicts from position
    a + j. A hand-built target head puts all mass on token t at position t (last hidden state e_t, lm_head row t
    zero, the others -1e4); a draft that puts slot j's mass on token a + j then has L1 = 0 (and acceptance 1)
    everywhere, one that puts it on a + j + 1 has L1 = 2."""
    run = prepare_run(tiny_pair[0], [tiny_pair[1]], tmp_path / "out", SHAPE, OPTIONS)
    trainer, T, V = run.trainer, 16, 32
    tokens = torch.arange(T)[None]  # [1, T]
    trainer.head.lm_head = torch.nn.Linear(T, V, bias=False)
    trainer.head.lm_head.weight.data = torch.full((V, T), -1e4).fill_diagonal_(0.0)  # logits of e_t: 0 at t only
    anchors = torch.tensor([[0, 5, 9]])
    K = trainer.draft.config.block_size.value

    def draft_putting_mass_at(shift):
        def model(features, blocks):  # draft logits [1, A, K, V]: slot j of anchor a on token a + j + shift
            ids = (blocks.positions.view(1, -1, K) + shift).clamp(max=V - 1)
            return torch.full((1, ids.shape[1], K, V), -1e4).scatter(-1, ids[..., None], 0.0), None
        return model

    features = TargetFeatures(torch.zeros(1, T, 1), torch.eye(T)[None])  # layers unused by the stand-in draft
    trainer.model = draft_putting_mass_at(0)
    aligned = trainer.batch_loss(tokens, features, anchors)
    assert aligned.l1 == pytest.approx(0.0, abs=1e-4) and aligned.accept == pytest.approx([1.0] * K)
    trainer.model = draft_putting_mass_at(1)
    assert trainer.batch_loss(tokens, features, anchors).l1 == pytest.approx(2.0, abs=1e-4)


def test_training_lowers_the_loss_and_writes_a_valid_checkpoint(tmp_path, tiny_pair):
    from dspark_cli.runtime.checkpoint.read import open_checkpoint
    from dspark_cli.runtime.model.draft_io import load_draft
    from dspark_cli.runtime.checkpoint.rules import validate_checkpoint

    target_dir, data = tiny_pair
    options = TrainOptions(steps=25, batch_size=4, seq_len=32, anchors=8, lr=1e-2, seed=0, save_every=10)
    run = prepare_run(target_dir, [data], tmp_path / "out", SHAPE, options)
    tokens = run.trainer.stream.tokens[:64].view(2, 32)
    anchors = torch.tensor([[0, 5, 11, 20], [3, 9, 17, 25]])
    before = _fixed_batch_loss(run.trainer, tokens, anchors)
    out = train_loop(run.trainer, run.out)
    assert _fixed_batch_loss(run.trainer, tokens, anchors) < 0.8 * before

    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-10", "checkpoint-20", "config.json",
                                                     "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert (config["block_size"], config["markov_rank"], config["mask_token_id"]) == (4, 8, 1)
    target_config = json.loads((target_dir / "config.json").read_text())
    report = validate_checkpoint(open_checkpoint(str(out)), target_config)
    assert report.errors == [], [f.message for f in report.errors]
    draft = load_draft(str(out))
    assert draft.confidence_head is not None and draft.config.markov_rank == 8


def test_markov_rank_0_writes_deepspec_dflash_ablation(tmp_path, tiny_pair):
    """--markov-rank 0: DeepSpec's DFlash ablation (DSpark layout, no Markov head) validates with only DSP007 and
    runs, with or without a confidence head."""
    from dspark_cli.runtime.checkpoint.read import open_checkpoint
    from dspark_cli.runtime.model.draft_io import load_draft
    from dspark_cli.runtime.checkpoint.rules import validate_checkpoint

    target_dir, data = tiny_pair
    target_config = json.loads((target_dir / "config.json").read_text())
    for confidence in (False, True):
        shape = DraftShape(layers=1, block_size=4, markov_rank=0, confidence=confidence)
        run = prepare_run(target_dir, [data], tmp_path / f"out{confidence}", shape, OPTIONS)
        out = train_loop(run.trainer, run.out)
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_rank"] == 0
        report = validate_checkpoint(open_checkpoint(str(out)), target_config)
        assert report.errors == [] and [f.code for f in report.warnings] == ["DSP007"], report.codes
        draft = load_draft(str(out))
        assert draft.markov_head is None and (draft.confidence_head is not None) == confidence


def test_train_lm_head_and_embeddings_train_own_copies(tmp_path, tiny_pair):
    """--train-lm-head / --train-embeddings: the draft's copies learn and are saved; the target is untouched;
    resuming without the same flags is refused in one sentence."""
    from dspark_cli.runtime.checkpoint.read import open_checkpoint
    from dspark_cli.runtime.checkpoint.rules import validate_checkpoint

    target_dir, data = tiny_pair
    shape = DraftShape(layers=1, block_size=4, markov_rank=8, train_embeddings=True, train_lm_head=True)
    options = TrainOptions(**{**vars(OPTIONS), "save_every": 2})
    run = prepare_run(target_dir, [data], tmp_path / "out", shape, options)
    target_before = {n: p.clone() for n, p in run.trainer.target.named_parameters()}
    draft = run.trainer.draft
    initial = {n: getattr(draft, n).weight.detach().clone() for n in ("embed_tokens", "lm_head")}
    out = train_loop(run.trainer, run.out)
    for name, before in initial.items():
        assert not torch.equal(getattr(draft, name).weight, before), name
    for name, p in run.trainer.target.named_parameters():
        assert torch.equal(p, target_before[name]), name
    target_config = json.loads((target_dir / "config.json").read_text())
    assert validate_checkpoint(open_checkpoint(str(out)), target_config).errors == []
    with pytest.raises(DsparkError, match="resume with the same values"):
        prepare_run(target_dir, [data], out, SHAPE, OPTIONS, resume=out / "checkpoint-2")


def test_resume_continues_where_the_checkpoint_left_off(tmp_path, tiny_pair):
    from safetensors.torch import load_file

    target_dir, data = tiny_pair
    straight = prepare_run(target_dir, [data], tmp_path / "a", SHAPE, OPTIONS.__class__(**{**vars(OPTIONS),
                                                                                          "save_every": 2}))
    train_loop(straight.trainer, straight.out)
    resumed = prepare_run(target_dir, [data], tmp_path / "a", SHAPE, OPTIONS,
                          resume=tmp_path / "a" / "checkpoint-2")
    assert resumed.trainer.step == 2
    train_loop(resumed.trainer, tmp_path / "b")
    first = {k: v for k, v in straight.trainer.draft.state_dict().items()}
    for name, value in resumed.trainer.draft.state_dict().items():
        torch.testing.assert_close(value, first[name], rtol=0, atol=0, msg=name)
    assert load_file(str(tmp_path / "b" / "model.safetensors")).keys() == load_file(
        str(tmp_path / "a" / "model.safetensors")).keys()


def test_refuses_to_overwrite_output(tmp_path, tiny_pair):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(DsparkError, match="the force option"):
        prepare_run(tiny_pair[0], [tiny_pair[1]], tmp_path / "out", SHAPE, OPTIONS)
    assert (tmp_path / "out" / "keep.txt").exists()


def test_shipped_demo_pair_is_lossless_at_greedy():
    from dspark_cli.runtime.demo import DEMO_DIR
    from dspark_cli.runtime.pair import Pair

    if not (DEMO_DIR / "draft" / "config.json").is_file():
        pytest.skip("the demo pair is not built (scripts/build_demo.py)")
    pair = Pair.load(device="cpu", dtype="float32")
    prompt = pair.encode("import os\n\n\ndef read_config(path):\n", chat=False)
    plain = pair.baseline(prompt, max_new_tokens=48, stop_ids=())
    spec = pair.generate(prompt, max_new_tokens=48, stop_ids=())
    assert spec.tokens == plain.tokens
    assert len(spec.stats.rounds) < 48 / 1.5  # the draft is accepted often, not just lossless


def test_demo_build_is_deterministic(tmp_path):
    """Two builds of a tiny recipe from the same files give byte-identical tokenizer, target and draft."""
    from dataclasses import replace

    from dspark_cli.runtime.train.demo_build import DemoRecipe, build_demo, report_from_json, report_json
    from dspark_cli.runtime.train.tiny_target import TargetGeometry

    sources = []
    for i in range(6):
        sources.append(tmp_path / f"m{i}.py")
        sources[-1].write_text(CODE.replace("Counter", f"Counter{i}") * (i + 2))
    recipe = DemoRecipe(
        vocab_size=300,
        target=TargetGeometry(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16),
        target_steps=4, target_batch_size=2, target_seq_len=32,
        draft=DraftShape(layers=1, block_size=4, target_layers=(0, 1), markov_rank=8),
        draft_options=TrainOptions(steps=3, batch_size=2, seq_len=32, anchors=4, lr=1e-2),
        distill_sequences=4, distill_prompt_tokens=8, held_out_every=3, eval_prompts=2, eval_prompt_tokens=8,
        eval_new_tokens=8)
    reports = [build_demo(tmp_path / f"out{i}", tmp_path / f"work{i}", recipe, log=lambda _: None, sources=sources)
               for i in range(2)]
    assert len(reports[0].drafts) == 2 and reports[0].drafts[0].tau == reports[1].drafts[0].tau
    text = report_json(reports[0])
    assert report_json(report_from_json(text, recipe)) == text  # build_demo.py --card-only
    with pytest.raises(ValueError, match="different recipe"):
        report_from_json(report_json(reports[0]), replace(recipe, target_steps=5))
    for name in ("target/tokenizer.json", "target/model.safetensors", "draft/model.safetensors", "draft/config.json"):
        assert (tmp_path / "out0" / name).read_bytes() == (tmp_path / "out1" / name).read_bytes(), name
    assert (tmp_path / "work0/dflash_draft/model.safetensors").read_bytes() == (
        tmp_path / "work1/dflash_draft/model.safetensors").read_bytes()


def test_build_script_replaces_the_pair_and_keeps_the_other_demo_files(tmp_path):
    """scripts/build_demo.py publishes target/, draft/ and MODEL_CARD.md into the demo folder and leaves the prompt
    sets that live beside them (and anything else there) alone."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_demo", Path(__file__).parents[2] / "scripts/build_demo.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out, staging = tmp_path / "demo", tmp_path / ".demo.building"
    for folder, text in ((out, "old"), (staging, "new")):
        (folder / "target").mkdir(parents=True)
        (folder / "target" / "config.json").write_text(text)
        (folder / "MODEL_CARD.md").write_text(text)
    (out / "eval_code.jsonl").write_text("prompts")
    script.publish(staging, out)
    assert sorted(p.name for p in out.iterdir()) == ["MODEL_CARD.md", "eval_code.jsonl", "target"]
    assert (out / "target/config.json").read_text() == (out / "MODEL_CARD.md").read_text() == "new"
    assert (out / "eval_code.jsonl").read_text() == "prompts" and not staging.exists()


@pytest.mark.parametrize("shape", [
    SHAPE,
    DraftShape(layers=2, block_size=4, markov_rank=0, confidence=False),
    DraftShape(layers=1, block_size=4, markov_rank=8, confidence_with_markov=False, train_embeddings=True,
               train_lm_head=True),
    DraftShape(layers=1, block_size=4, markov_rank=8, mask_token_id=300),  # an added mask row: own embedding
], ids=["default", "dflash", "trained-copies", "added-mask-row"])
def test_memory_estimate_counts_the_trainable_parameters(tmp_path, tiny_pair, shape):
    """The estimate checked before allocating counts exactly the weights the optimizer will hold."""
    from dspark_cli.runtime.train.new_draft import trainable_parameters
    from dspark_cli.runtime.train.checks import run_memory_estimate

    target_dir, data = tiny_pair
    target_config = json.loads((target_dir / "config.json").read_text())
    if shape.mask_token_id is not None:
        shape = DraftShape(**{**vars(shape), "mask_token_id": target_config["vocab_size"]})
    run = prepare_run(target_dir, [data], tmp_path / "out", shape, OPTIONS)
    save_draft(run.trainer.draft, tmp_path / "saved", include_shared=True)
    draft_config = json.loads((tmp_path / "saved" / "config.json").read_text())
    estimate = run_memory_estimate(target_config, draft_config, shape, OPTIONS, run.trainer.seq_len,
                                   torch.device("cpu"))
    trainable = sum(p.numel() for p in trainable_parameters(run.trainer.draft))
    assert estimate.draft_state == 16 * trainable
    target_params = sum(p.numel() for p in run.trainer.target.parameters())
    assert estimate.target_weights == 4 * target_params


def test_non_finite_loss_stops_the_loop_before_writing(tmp_path, tiny_pair):
    """A diverging run raises at the first non-finite loss and writes no final draft over the last checkpoint."""
    target_dir, data = tiny_pair
    options = TrainOptions(**{**vars(OPTIONS), "lr": 1e30, "save_every": 1})
    run = prepare_run(target_dir, [data], tmp_path / "out", SHAPE, options)
    with pytest.raises(DsparkError, match=r"diverged at step 2: the loss is nan .*checkpoint-1"):
        train_loop(run.trainer, run.out)
    assert sorted(p.name for p in run.out.iterdir()) == ["checkpoint-1"]
