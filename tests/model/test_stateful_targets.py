"""Stateful targets (model/target_state.py): the support matrix of docs/stateful.md.

Every family is a tiny random model built from transformers' own classes (tests/fixtures/stateful_factory.py, the demo
tokenizer): Qwen3.5 and Qwen3-Next (Gated DeltaNet + attention), Falcon-H1, Jamba, Bamba and Granite-4 hybrids
(Mamba + attention), LFM2 (short convolution + attention), Mamba2 (no attention at all), MiniMax (lightning
attention). For each:
- rollback: after scoring 6 tokens and keeping k of them, every recurrent / conv state equals the state of a fresh
  target fed only the kept prefix (k = 0, a middle k, and all 6), and the next logits agree;
- the loop: greedy speculative decoding with proposals planned to be accepted for every length 0..N equals the
  target's own greedy decoding token for token (float32), and rounds that keep every position restore nothing;
- the CLI as a user runs it: `train` a draft for a few steps, `validate`, `generate --baseline` (tokens equal),
  a short `eval` (and on one family `--resume` and `--compare`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from loop import generate
import torch
from stateful_factory import FAMILIES, tiny_multimodal_qwen3_5, tiny_stateful_model, tiny_stateful_target
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.decode import speculative
from dspark_cli.runtime.settings import SamplingParams
from dspark_cli.runtime.model.draft_io import load_draft
from dspark_cli.runtime.model.target import TargetModel
from dspark_cli.runtime.model import target_state
from dspark_cli.runtime.model.target_state import FAMILIES as SUPPORTED, state_slots

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
runner = CliRunner()
PROMPT = [5, 17, 33, 2, 99, 7, 42, 8]
BLOCK = [12, 200, 3, 45, 9, 77]
GREEDY = SamplingParams()
CODE = "def add(a, b):\n    return a + b\n\n\nclass Counter:\n    def inc(self, step=1):\n        return step\n"
TRAIN = ["--steps", "3", "--batch-size", "2", "--seq-len", "24", "--anchors", "4", "--lr", "1e-2", "--seed", "3",
         "--device", "cpu", "--block-size", "3", "--markov-rank", "8"]


@pytest.fixture(scope="module")
def models():
    """One tiny random model per family, built once."""
    return {family: tiny_stateful_model(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """family -> (target folder, draft folder, data file): a draft trained for three steps by `dspark train`."""
    root = tmp_path_factory.mktemp("stateful")
    data = root / "code.py"
    data.write_text(CODE * 6)
    made = {}
    for family in FAMILIES:
        target = tiny_stateful_target(root / family / "target", family)
        draft = root / family / "draft"
        result = runner.invoke(app, ["train", "--target", str(target), "--data", str(data), "-o", str(draft), *TRAIN])
        assert result.exit_code == 0, (family, result.output)
        made[family] = (target, draft, data)
    return made


def cache_tensors(cache) -> dict[str, torch.Tensor]:
    """Every tensor a transformers cache holds, by name, found without target_state's own list: each layer's
    tensor attributes (attention keys / values) and dicts of tensors (conv_states, recurrent_states), and
    MiniMax's linear_cache."""
    found = {}
    for index, layer in enumerate(cache.layers):
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor):
                found[f"{index}.{name}"] = value
            elif isinstance(value, dict):
                found.update({f"{index}.{name}.{k}": v for k, v in value.items() if isinstance(v, torch.Tensor)})
    for index, value in enumerate(getattr(cache, "linear_cache", [])):
        if isinstance(value, torch.Tensor):
            found[f"linear_cache.{index}"] = value
    return found


def reference_cache(model, ids: list[int]) -> dict[str, torch.Tensor]:
    """The cache tensors of a fresh target that has read only `ids`."""
    target = TargetModel(model)
    target.prefill_plain(torch.tensor(ids))
    return cache_tensors(target.cache)


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_leaves_exactly_the_state_of_the_kept_prefix(models, family):
    model = models[family]
    target = TargetModel(model, (1,))
    assert target.family is SUPPORTED[model.config.get_text_config().model_type]
    for keep in (0, 2, len(BLOCK)):
        target.prefill(torch.tensor(PROMPT))
        target.save_state()
        logits, features = target.score(torch.tensor(BLOCK))
        assert logits.shape == (len(BLOCK), 1024) and features.shape == (len(BLOCK), 64)
        target.crop(len(PROMPT) + keep)
        assert target.cache_length == len(PROMPT) + keep
        tensors, expected = cache_tensors(target.cache), reference_cache(model, PROMPT + BLOCK[:keep])
        assert tensors.keys() == expected.keys() and len(state_slots(target.cache)) > 0
        for name, reference in expected.items():  # attention K/V within 1e-3: Bamba's block and prefill paths
            tolerance = 1e-3 if name.endswith((".keys", ".values")) else 1e-5  # differ that much anyway
            torch.testing.assert_close(tensors[name], reference, rtol=tolerance, atol=tolerance,
                                       msg=lambda text: f"{family} keep={keep} {name}: {text}")
        reference = TargetModel(model)
        reference.prefill_plain(torch.tensor(PROMPT + BLOCK[:keep]))
        torch.testing.assert_close(target.decode_one(50), reference.decode_one(50), rtol=1e-3, atol=1e-3)


def test_a_stateful_target_rolls_back_only_into_its_last_block(models):
    target = TargetModel(models["qwen3_5"], (1,))
    target.prefill(torch.tensor(PROMPT))
    with pytest.raises(ValueError, match="only roll back into the block it scored last"):
        target.crop(len(PROMPT) - 1)
    target.score(torch.tensor(BLOCK))
    with pytest.raises(ValueError, match="its last scored block starts at 8"):
        target.crop(len(PROMPT) - 1)


def test_jamba_scores_one_token_at_a_time_because_its_block_continuation_is_inexact(models):
    """transformers' Jamba Mamba layers restart their scan from a zero state on a multi-token forward after a
    cached prefix: one block forward differs from the full recompute, one token at a time does not. If a
    transformers release fixes this, this test fails and Jamba can score blocks (target_state.FAMILIES)."""
    model = models["jamba"]
    with torch.no_grad():
        full = model(input_ids=torch.tensor([PROMPT + BLOCK]), use_cache=False).logits[0, len(PROMPT):]
        prefix = model(input_ids=torch.tensor([PROMPT]), use_cache=True)
        block = model(input_ids=torch.tensor([BLOCK]), use_cache=True, past_key_values=prefix.past_key_values)
    assert (block.logits[0] - full).abs().max() > 1e-4  # float32 noise is ~1e-7 here
    target = TargetModel(model, (1,))
    assert target.scores_one_at_a_time
    target.prefill(torch.tensor(PROMPT))
    logits, _ = target.score(torch.tensor(BLOCK))
    torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)


def loaded_pair(model, draft_folder: Path):
    """(TargetModel capturing what the draft reads, the draft sharing its embedding and lm_head)."""
    layer_ids = json.loads((draft_folder / "config.json").read_text())["target_layer_ids"]
    target = TargetModel(model, [i + 1 for i in layer_ids])
    return target, load_draft(draft_folder, target_embed=target.embed_weight, target_lm_head=target.lm_head_weight)


def planned_proposals(monkeypatch, reference: list[int], block_size: int) -> list[int]:
    """Make the draft step propose the target's own continuation with one planned mistake per round, at slot
    r mod (block_size + 1) in round r (block_size + 1: no mistake), so every accepted length 0..N occurs."""
    rounds: list[int] = []

    def backbone(drafter, context, anchor, n_draft):
        return context.length, n_draft  # ("hidden", "base"): the anchor's position and the block size

    def markov(drafter, position, n_draft, anchor, generator, temperatures=None):
        tokens = list(reference[position + 1 : position + 1 + n_draft])
        tokens += [3] * (n_draft - len(tokens))
        wrong = len(rounds) % (n_draft + 1)
        if wrong < n_draft:
            tokens[wrong] = (tokens[wrong] + 1) % 1024
        rounds.append(wrong)
        return speculative.Proposal(torch.tensor(tokens), None, None)

    monkeypatch.setattr(speculative, "draft_backbone", backbone)
    monkeypatch.setattr(speculative, "markov_stage", markov)
    return rounds


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_equals_target_greedy_for_every_acceptance_length(models, trained, family, monkeypatch):
    target, draft = loaded_pair(models[family], trained[family][1])
    plain = speculative.autoregressive_generate(target, PROMPT, GREEDY, max_new_tokens=30)
    with torch.no_grad():  # the model's own greedy generate: the reference of both dspark decoders
        own = models[family].generate(torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False, eos_token_id=None)
    assert plain.tokens == own[0, len(PROMPT):].tolist()
    reference = PROMPT + plain.tokens
    planned_proposals(monkeypatch, reference, 3)
    result = generate(target, draft, PROMPT, GREEDY, block_size=3, max_new_tokens=30)
    assert result.tokens == plain.tokens
    accepted = [r.accepted for r in result.stats.rounds]
    assert {0, 1, 2, 3} <= set(accepted)
    timed = result.stats.sections[:-1]  # the last round has no rollback
    full = [t["rollback"] for t, r in zip(timed, result.stats.rounds) if r.accepted == 3]
    partial = [t["rollback"] for t, r in zip(timed, result.stats.rounds) if r.accepted < 3]
    assert full and partial and all("snapshot" in t for t in timed)


def test_rounds_that_keep_every_position_restore_and_replay_nothing(models, trained, monkeypatch):
    """The replay scheme (every block-scoring family but the Gated DeltaNet ones), on Bamba."""
    target, draft = loaded_pair(models["bamba"], trained["bamba"][1])
    plain = speculative.autoregressive_generate(target, PROMPT, GREEDY, max_new_tokens=20)
    planned_proposals(monkeypatch, PROMPT + plain.tokens, 3)
    restored, replayed = [], []
    replay_run, original_restore = target.state.replay.run, target_state.StateSnapshot.restore

    def restore(snapshot):
        restored.append(1)
        original_restore(snapshot)

    def run(keep, scored):
        replayed.append(keep)
        replay_run(keep, scored)

    monkeypatch.setattr(target_state.StateSnapshot, "restore", restore)
    monkeypatch.setattr(target.state.replay, "run", run)
    result = generate(target, draft, PROMPT, GREEDY, block_size=3, max_new_tokens=20)
    assert result.tokens == plain.tokens
    continuing = result.stats.rounds[:-1]
    assert len(restored) == sum(r.accepted < 3 for r in continuing) > 0
    assert replayed == [r.accepted + 1 for r in continuing if r.accepted < 3]


class RecordingTarget(TargetModel):
    """A TargetModel that keeps (start position, scored ids, logits) of every score pass."""

    def __init__(self, *args):
        super().__init__(*args)
        self.scored: list[tuple[int, list[int], torch.Tensor]] = []

    def score(self, block_ids):
        start = self.cache_length
        logits, features = super().score(block_ids)
        self.scored.append((start, block_ids.tolist(), logits.clone()))
        return logits, features


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_scores_every_block_with_the_targets_exact_conditionals(models, trained, family):
    """T > 0: rejection sampling is lossless when the target probabilities it uses are the target's conditionals
    given the committed prefix (the sampler itself is tested in test_speculative_lossless.py). Every score pass of
    a sampled run, rejections and rollbacks included, must give the logits of a cache-free forward over the
    committed tokens and that block."""
    model = models[family]
    layer_ids = json.loads((trained[family][1] / "config.json").read_text())["target_layer_ids"]
    target = RecordingTarget(model, [i + 1 for i in layer_ids])
    draft = load_draft(trained[family][1], target_embed=target.embed_weight, target_lm_head=target.lm_head_weight)
    generator = torch.Generator().manual_seed(7)
    result = generate(target, draft, PROMPT, SamplingParams(temperature=1.0), block_size=3,
                                              max_new_tokens=16, generator=generator)
    sequence = PROMPT + result.tokens
    assert len(target.scored) == len(result.stats.rounds) > 2
    for start, block, logits in target.scored:
        assert block[0] == sequence[start]  # the anchor is the last committed token
        with torch.no_grad():
            exact = model(input_ids=torch.tensor([sequence[:start] + block]), use_cache=False).logits[0, start:]
        torch.testing.assert_close(logits, exact, rtol=2e-3, atol=2e-3, msg=lambda text: f"{family} at {start}: {text}")


def cli(*args: str):
    return runner.invoke(app, list(args))


@pytest.mark.parametrize("family", FAMILIES)
def test_train_validate_generate_and_eval_through_the_cli(trained, family, tmp_path):
    target, draft, _ = trained[family]
    checked = cli("validate", str(draft), "--target", str(target))
    assert checked.exit_code == 0 and "vLLM can load this" in " ".join(checked.output.split()), checked.output

    report = tmp_path / "run.json"
    ran = cli("generate", "def add(a", "--target", str(target), "--draft", str(draft), "--max-new-tokens", "16",
              "--baseline", "--device", "cpu", "--dtype", "float32", "--json", str(report))
    assert ran.exit_code == 0, ran.output
    assert "rollback (crop, state restore)" in ran.output
    document = json.loads(report.read_text())
    (run,) = document["prompts"]
    assert run["tokens"] == run["baseline_tokens"] and run["first_divergence"] is None
    assert document["summary"]["round_breakdown"]["rollback_ms"] >= 0.0

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n\nclass Counter:\n")
    evaluated = cli("eval", "--target", str(target), "--draft", str(draft), "--data", str(prompts),
                    "--max-new-tokens", "8", "--device", "cpu", "--dtype", "float32", "--json",
                    str(tmp_path / "eval.json"))
    assert evaluated.exit_code == 0, evaluated.output
    rounds = [r for p in json.loads((tmp_path / "eval.json").read_text())["results"] for r in p["rounds"]]
    assert rounds and all("rollback" in r for r in rounds)


def test_eval_resume_and_compare_on_a_stateful_target(trained, tmp_path):
    target, draft, _ = trained["qwen3_5"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n\nclass Counter:\n\nimport os\n")
    run_file = tmp_path / "run.json"
    common = ["--target", str(target), "--draft", str(draft), "--data", str(prompts), "--max-new-tokens", "8",
              "--device", "cpu", "--dtype", "float32"]
    assert cli("eval", *common, "--json", str(run_file)).exit_code == 0
    document = json.loads(run_file.read_text())
    kept = document["results"][:1]
    document["results"] = kept
    del document["statistics"]
    run_file.write_text(json.dumps(document))
    resumed = cli("eval", "--resume", str(run_file))
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(run_file.read_text())["results"][:1] == kept
    compared = cli("eval", *common, "--compare", str(run_file))
    assert compared.exit_code == 0, compared.output


def test_an_unsupported_stateful_family_is_refused_in_one_sentence(trained, tmp_path):
    """A Mamba (v1) target keeps a recurrent state dspark has not verified: refused from its config alone (the
    folder has no weights), before the draft is checked against it."""
    import transformers as hf

    folder = tmp_path / "mamba"
    hf.MambaConfig(vocab_size=1024, hidden_size=64, num_hidden_layers=2, state_size=8).save_pretrained(folder)
    result = cli("generate", "x", "--target", str(folder), "--draft", str(trained["qwen3_5"][1]), "--device", "cpu")
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "model type 'mamba'" in text and "no exact rollback" in text and "Traceback" not in text
    with pytest.raises(DsparkError, match="no exact rollback"):
        TargetModel(hf.MambaForCausalLM(hf.MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1)))


@pytest.mark.parametrize("family", ["qwen3_5", "jamba"])
def test_serve_plans_the_vllm_command_and_says_who_keeps_the_state(trained, family):
    target, draft, _ = trained[family]
    result = cli("serve", "--target", str(target), "--draft", str(draft), "--json", "-")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["speculative_config"]["method"] == "dspark"
    (note,) = [n for n in document["notes"] if "recurrent states" in n]
    assert SUPPORTED[tiny_stateful_model(family).config.get_text_config().model_type].name in note


@pytest.mark.parametrize("family", ["qwen3_5", "jamba", "mamba2"])
def test_the_python_api_generates_like_the_baseline_and_says_when_speculation_cannot_pay(trained, family):
    from dspark_cli.runtime.pair import Pair

    target, draft, _ = trained[family]
    pair = Pair.load(str(target), str(draft), device="cpu", dtype="float32")
    pair.warm_up("def add(a", max_new_tokens=8, baseline=True)
    result = pair.generate("def add(a", max_new_tokens=12)
    assert result.tokens == pair.baseline("def add(a", max_new_tokens=12).tokens
    assert any("one forward at a time" in warning for warning in pair.warnings) == (family == "jamba")


def test_a_multimodal_qwen3_5_checkpoint_trains_validates_and_generates_as_its_text_model(trained, tmp_path):
    """Released Qwen3.5 checkpoints are Qwen3_5ForConditionalGeneration with the text model under text_config."""
    target = tiny_multimodal_qwen3_5(tmp_path / "qwen3_5_vl")
    assert json.loads((target / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    draft = tmp_path / "draft"
    trained_draft = cli("train", "--target", str(target), "--data", str(trained["qwen3_5"][2]), "-o", str(draft),
                        *TRAIN)
    assert trained_draft.exit_code == 0, trained_draft.output
    assert cli("validate", str(draft), "--target", str(target)).exit_code == 0
    report = tmp_path / "run.json"
    ran = cli("generate", "def add(a", "--target", str(target), "--draft", str(draft), "--max-new-tokens", "12",
              "--baseline", "--device", "cpu", "--dtype", "float32", "--json", str(report))
    assert ran.exit_code == 0, ran.output
    (run,) = json.loads(report.read_text())["prompts"]
    assert run["tokens"] == run["baseline_tokens"]


def test_sliding_window_layers_beside_states_are_refused(monkeypatch):
    """transformers cannot crop a full sliding-window layer without recording its past: a stateful target with one is
    refused when it is wrapped, not halfway through a generation."""
    model = tiny_stateful_model("qwen3_5")
    config = model.config.get_text_config()
    monkeypatch.setattr(config, "layer_types", ["linear_attention", "linear_attention", "sliding_attention",
                                                "linear_attention"])
    monkeypatch.setattr(config, "sliding_window", 4, raising=False)
    with pytest.raises(DsparkError, match="sliding-window attention layers beside its recurrent states"):
        TargetModel(model, (1,))
