"""settings.resolve_settings on the shipped demo draft: what auto picks for greedy decoding that carries a top-k
(the cut changes nothing at temperature 0), and STS temperatures cut to the block size in use."""

from __future__ import annotations

import pytest

from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.checkpoint.read import open_checkpoint
from dspark_cli.runtime.demo import DEMO_DIR
from dspark_cli.runtime.settings import MarkovHead, Requested, SamplingParams, resolve_settings


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
