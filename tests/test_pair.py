"""runtime/pair.py, the public Python API: pre-load checks, loading, generate / baseline, and the README example."""

import contextlib
import dataclasses
import io
import re
from pathlib import Path

import pytest
import torch
from ckpt_factory import DraftSpec
from pair_factory import bigram_draft, bigram_target, write_byte_tokenizer

from dspark_cli.errors import DsparkError, SettingError
from dspark_cli.runtime.checkpoint.read import open_checkpoint, read_target_config
from dspark_cli.runtime.model.draft_io import load_draft
from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.pair import Pair, check_draft, first_divergence
from dspark_cli.runtime.settings import MarkovHead, Requested, resolve_settings
from dspark_cli.runtime.settings import SamplingParams
from loop import generate
from dspark_cli.runtime.model.target import TargetModel

SPEC = DraftSpec(block_size=8, markov_rank=64)
EOS = 1  # tiny_target's eos_token_id
README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = bigram_target(root / "target", SPEC)
    write_byte_tokenizer(target)
    return target, bigram_draft(root / "draft", SPEC, target)


@pytest.fixture(scope="module")
def pair(pair_dirs):
    return Pair.load(*pair_dirs, device="cpu", dtype="float32")


def test_check_draft_and_the_settings_resolve_and_refuse(pair_dirs):
    target_dir, draft_dir = pair_dirs
    ckpt, target_config = open_checkpoint(draft_dir), read_target_config(target_dir)
    check_draft(ckpt, target_config)
    config = DraftConfig.from_dict(ckpt.config)
    head = MarkovHead.of_config(config, nvfp4=False)

    def resolve(block_size=None, draft_topk=None):
        return resolve_settings(config, head, False, Requested(block_size=block_size, draft_topk=draft_topk))

    settings = resolve()
    assert (settings.block_size, settings.trained_block_size, settings.draft_topk) == (8, 8, None)
    assert resolve(3, 16).block_size == 3
    with pytest.raises(SettingError, match="the block size 9 is larger than the 8 draft tokens"):
        resolve(9)
    with pytest.raises(SettingError, match="the draft top-k must be between 1 and"):
        resolve(None, 300)
    with pytest.raises(DsparkError, match="cannot run with this target: DSP024"):
        check_draft(ckpt, {**target_config, "hidden_size": 32})
    with pytest.raises(DsparkError, match="cannot run with this target: DSP103"):
        check_draft(ckpt, {**target_config, "vocab_size": 512})
    with pytest.raises(DsparkError, match="DSP019"):
        check_draft(ckpt, {**target_config, "num_hidden_layers": 2})


def test_generate_is_the_speculative_loop_on_the_loaded_pair(pair, pair_dirs):
    """Pair.load + generate gives what the hand-written loading sequence and speculative_generate give."""
    target_dir, draft_dir = pair_dirs
    target = TargetModel.load(target_dir, [i + 1 for i in SPEC.target_layer_ids])
    draft = load_draft(draft_dir, target_embed=target.embed_weight,
                                        target_lm_head=target.lm_head_weight)
    ids = pair.encode("hello world")
    assert ids == pair.tokenizer("hello world")["input_ids"]
    sampled = SamplingParams(temperature=1.0)
    for params in (SamplingParams(), sampled):
        settings = pair.checked.resolve(temperature=params.temperature)
        got = pair.generate(ids, max_new_tokens=30, settings=settings, seed=3)
        expected = generate(target, draft, ids, params, block_size=8, max_new_tokens=30, stop_ids=[EOS],
                                        generator=torch.Generator().manual_seed(3))
        assert got.tokens == expected.tokens
        assert [r.accepted for r in got.stats.rounds] == [r.accepted for r in expected.stats.rounds]
    assert pair.stop_ids == [EOS] and pair.block_size == 8 and pair.settings.markov == "dense"
    plain = pair.baseline("hello world", max_new_tokens=30)
    assert pair.generate("hello world", max_new_tokens=30).tokens == plain.tokens  # lossless at greedy
    short = pair.checked.resolve(block_size=2)
    assert len(pair.generate(ids, max_new_tokens=30, settings=short).stats.rounds[0].confidences) == 2


def test_the_pairs_stop_ids_end_generation_unless_overridden(pair):
    free = pair.generate("hello world", max_new_tokens=30, stop_ids=())
    stop = free.tokens[5]
    stopping = dataclasses.replace(pair, stop_ids=[stop])
    expected = free.tokens[: free.tokens.index(stop) + 1]
    result = stopping.generate("hello world", max_new_tokens=30)
    assert result.finished_by_stop and result.tokens == expected
    assert stopping.baseline("hello world", max_new_tokens=30).tokens == expected
    assert stopping.generate("hello world", max_new_tokens=30, stop_ids=()).tokens == free.tokens


def test_the_chat_template_is_used_when_present_unless_refused(pair_dirs):
    checked = Pair.check(*pair_dirs, device="cpu")
    checked.tokenizer.chat_template = "<{{ messages[0]['content'] }}>"
    assert checked.chat() is True and checked.chat(False) is False
    assert checked.encode("hi") == checked.tokenizer("<hi>", add_special_tokens=False)["input_ids"]
    assert checked.encode("hi", chat=False) == checked.tokenizer("hi")["input_ids"]


def test_check_refuses_bad_input_before_any_weight_is_read(pair_dirs, monkeypatch):
    from dspark_cli.runtime.model import target as target_module

    monkeypatch.setattr(target_module.TargetModel, "load", classmethod(lambda *a, **k: pytest.fail("loaded")))
    target, draft = map(str, pair_dirs)
    checked = Pair.check(target, draft, device="cpu")
    assert (checked.block_size, str(checked.dtype), checked.chat()) == (8, "torch.float32", False)
    with pytest.raises(DsparkError, match="4,097 positions, more than the 4,096"):
        checked.check_context([len(checked.encode("b" * 4000))], 97)
    for options, message in [({"markov": "sparse"}, "the Markov strategy must be one of"),
                             ({"confidence_threshold": 0.0}, "the confidence threshold must be in \\(0, 1\\]"),
                             ({"dtype": "int8"}, "the dtype must be"),
                             ({"device": "tpu:x"}, "the device .* is not a device"),
                             ({"block_size": 9}, "the block size 9 is larger"),
                             ({"temperature": 1e-300}, "the temperature must be 0 \\(greedy\\) or at least")]:
        with pytest.raises(SettingError, match=message):
            Pair.check(target, draft, **options)
    with pytest.raises(DsparkError, match="give both a target and a draft"):
        Pair.check(target)


def test_a_strategy_that_cannot_run_is_refused_before_loading(pair_dirs):
    with pytest.raises(SettingError, match="the Markov strategy nvfp4: the nvfp4 Markov strategy needs"):
        Pair.check(*pair_dirs, device="cpu", markov="nvfp4", draft_topk=8)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2 and first_divergence([1, 2, 3], [1]) == 1


def test_the_readme_example_runs_on_the_demo_pair():
    from dspark_cli.runtime.demo import DEMO_DIR

    if not (DEMO_DIR / "draft" / "config.json").is_file():
        pytest.skip("the demo pair is not built (scripts/build_demo.py)")
    section = README.read_text(encoding="utf-8").split("## Use from Python", 1)[1]
    (code,) = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    assert len(code.strip().splitlines()) <= 5
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), namespace)
    pair, result = namespace["pair"], namespace["result"]
    assert pair.decode(result.tokens) in printed.getvalue() and len(result.tokens) == 48
    assert result.tokens == pair.baseline("def read_config(path):\n", max_new_tokens=48).tokens
    assert len(result.stats.rounds) < 48 / 2  # the demo draft is accepted often


def test_with_draft_reuses_the_loaded_target_and_keeps_the_settings(pair_dirs, tmp_path):
    """A second draft beside the same loaded target (the quantize guard's two drafts): only the draft is read, the
    requested settings carry over, and a draft reading other target layers is refused."""
    target, draft = pair_dirs
    first = Pair.load(target, draft, device="cpu", dtype="float32", temperature=0.0, block_size=4)
    other = bigram_draft(tmp_path / "other", SPEC, target, w2_noise=0.5)
    second = first.with_draft(other)
    assert second.target is first.target and second.draft is not first.draft
    assert second.block_size == 4 and second.checked.draft_source == str(other)
    prompt = "ab"
    assert second.generate(prompt, max_new_tokens=12).tokens == first.baseline(prompt, max_new_tokens=12).tokens
    shifted = bigram_draft(tmp_path / "shifted", SPEC.with_(target_layer_ids=[0]), target)
    with pytest.raises(DsparkError, match="other target layers"):
        first.with_draft(shifted)
