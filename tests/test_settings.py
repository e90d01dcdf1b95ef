"""settings.resolve_settings on the shipped demo draft: what auto picks for greedy decoding that carries a top-k
(the cut changes nothing at temperature 0), and STS temperatures cut to the block size in use; on a DFlash2 draft:
its path selector and its top-k, and the Markov settings that do not apply to it refused."""

from __future__ import annotations

import pytest
from ckpt_factory import DraftSpec, draft_config

from dspark_cli.errors import SettingError
from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.checkpoint.read import open_checkpoint
from dspark_cli.runtime.demo import DEMO_DIR
from dspark_cli.runtime.settings import SELECTOR, MarkovHead, Requested, SamplingParams, resolve_settings


@pytest.fixture(scope="module")
def demo():
    config = DraftConfig.from_dict(open_checkpoint(str(DEMO_DIR / "draft")).config)
    return config, MarkovHead.of_config(config, nvfp4=False)


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.9), (5, 0.9)])
def test_greedy_with_a_top_k_or_top_p_is_not_filtered_so_auto_fuses_on_cuda(demo, top_k, top_p):
    """At temperature 0 the argmax survives any cut: greedy is not filtered sampling, and auto picks the fused walk
    on CUDA as for plain greedy (a filtered one would fall back to topk)."""
    config, head = demo
    assert not SamplingParams(0.0, top_p, top_k).filtered
    requested = Requested(draft_topk=8, top_k=top_k, top_p=top_p)
    assert resolve_settings(config, head, True, requested).markov == "fused"
    assert resolve_settings(config, head, True, Requested(draft_topk=8, temperature=0.7, top_k=top_k,
                                                          top_p=top_p)).markov == "topk"


@pytest.mark.parametrize("block_size", [None, 3])
def test_sts_temperatures_are_cut_to_the_block_size_in_use(demo, block_size):
    """A calibration of more positions than the block: the first block_size temperatures, one per drafted slot."""
    config, head = demo
    temperatures = tuple(1.0 + 0.1 * i for i in range(12))
    settings = resolve_settings(config, head, False, Requested(block_size=block_size), temperatures)
    assert settings.verify.temperatures == temperatures[:settings.block_size]
    assert len(settings.verify.temperatures) == settings.block_size == (block_size or settings.trained_block_size)


@pytest.fixture(scope="module")
def dflash2():
    config = DraftConfig.from_dict(draft_config(DraftSpec(family="dflash2", markov_rank=0, confidence=False,
                                                          block_size=7, selector_top_k=4)))
    return config, MarkovHead.of_config(config, nvfp4=False)


def test_a_dflash2_draft_resolves_its_selector_and_its_top_k(dflash2):
    """What runs after a DFlash2 draft's backbone is its path selector over the config's selector_top_k candidates:
    the settings (and every report that reads them) say so, on CUDA and sampling too."""
    config, head = dflash2
    for on_cuda, temperature in ((False, 0.0), (True, 0.0), (True, 0.8)):
        settings = resolve_settings(config, head, on_cuda, Requested(temperature=temperature))
        assert (settings.markov, settings.draft_topk) == (SELECTOR, 4)


@pytest.mark.parametrize(("requested", "setting", "words"), [
    (Requested(draft_topk=2), "draft_topk", "selector_top_k = 4 candidates it was trained with"),
    (Requested(draft_topk=4), "draft_topk", "selector_top_k = 4 candidates it was trained with"),
    (Requested(markov="topk"), "markov", "topk: a DFlash2 draft has no Markov head"),
    (Requested(markov="dense"), "markov", "dense: a DFlash2 draft has no Markov head"),
])
def test_a_dflash2_draft_refuses_a_draft_top_k_and_a_markov_strategy(dflash2, requested, setting, words):
    """Neither applies to the selector (its k x k lattice is the trained one, as the engines build it): refused by
    name rather than silently ignored."""
    config, head = dflash2
    with pytest.raises(SettingError) as refused:
        resolve_settings(config, head, False, requested)
    assert refused.value.setting == setting and words in refused.value.problem
