"""DFlash2 per-round parity with the real llama.cpp b11434 (scripts/dflash2_parity.py): the demo DFlash2 draft's
rounds (proposed, accepted) in llama-server, read from its debug log, equal dspark's float32 rounds on held-out
prompts, but for differences at a near tie of the selector walk; the same draft with its attention-path kernel
perturbed in llama-server only differs away from a near tie. The log reader and the length rule are checked on
fixed inputs. The real tests skip without the llama.cpp build or the demo DFlash2 draft
(scripts/build_dflash2_demo.py)."""

from __future__ import annotations

import pytest

from dspark_cli.runtime.demo import DEMO_DIR

from llama_server import needs_llamacpp

import dflash2_parity as parity  # scripts/, on the path once llama_server is imported

DRAFT = parity.REPO / "build" / "dflash2-demo" / "draft"
LOG = """\
0.00.594 D slot handle_last_: id  0 | task 4 | generate_draft: id=260, #tokens=27, #draft=7, pos_next=27
0.00.623 D slot   operator(): id  0 | task 4 | add accepted tokens: sampled=341, ids.size=1, n_draft=7
0.00.624 D slot   operator(): id  0 | task 4 | accepted 0/7 draft tokens, new n_tokens = 28
0.00.700 D slot   operator(): id  0 | task 4 | add accepted tokens: sampled=85, ids.size=3, n_draft=7
0.01.200 D slot   operator(): id  0 | task 12 | add accepted tokens: sampled=9, ids.size=5, n_draft=4
0.01.300 D slot   operator(): id  0 | task 12 | add accepted tokens: sampled=10, ids.size=2, n_draft=1
"""


def test_log_rounds_are_per_request_in_task_order():
    assert parity.log_rounds(LOG) == [
        [{"proposed": 7, "accepted": 0}, {"proposed": 7, "accepted": 2}],
        [{"proposed": 4, "accepted": 4}, {"proposed": 1, "accepted": 1}],
    ]


def test_engine_rounds_cap_the_last_drafts_at_the_remaining_tokens_minus_one():
    """12 new tokens: the first, then rounds of 7 drafts; llama-server verifies at most n_remaining - 1 of them
    and decodes the last token without a draft."""
    rounds = [{"drafted": [0] * 7, "accepted": a} for a in (2, 6, 3)]
    assert [(r["proposed"], r["accepted"]) for r in parity.engine_rounds(rounds, 12)] == [(7, 2), (7, 6)]
    assert [(r["proposed"], r["accepted"]) for r in parity.engine_rounds(rounds, 13)] == [(7, 2), (7, 6), (1, 1)]


def test_compare_names_the_margin_where_the_drafts_must_differ():
    ours = {"prompts": [{"prompt": [1], "tokens": [5, 6], "rounds": [
        {"proposed": 7, "accepted": 3, "drafted": [0] * 7, "margins": [1.0, 1.0, 1.0, 0.002, 1.0, 1.0, 1.0]}]}]}
    theirs = {"prompts": [{"prompt": [1], "tokens": [5, 6], "rounds": [{"proposed": 7, "accepted": 2}]}]}
    same, lines = parity.compare(ours, theirs)
    assert not same and lines == ["prompt 0: round 0: (proposed, accepted) (7, 3) against (7, 2); walk margin at "
                                  "slot 3: 1.0000"]
    theirs["prompts"][0]["rounds"][0]["accepted"] = 4
    assert parity.compare(ours, theirs)[1][0].endswith("slot 4: 0.0020 (a near tie)")
    assert parity.compare(ours, ours) == (True, ["prompt 0: identical, 1 rounds"])


needs_draft = pytest.mark.skipif(not (DRAFT / "model.safetensors").is_file(),
                                 reason=f"no DFlash2 demo draft at {DRAFT}: run scripts/build_dflash2_demo.py")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return parity.held_out_prompts(3, 48)


@pytest.fixture(scope="module")
def dspark_runs(prompts) -> dict:
    return {"prompts": parity.dspark_side(DEMO_DIR / "target", DRAFT, prompts, 32)}


def llama_runs(prompts, tmp_path, perturb: str = "none") -> dict:
    draft = DRAFT if perturb == "none" else parity.perturbed_draft(DRAFT, perturb, tmp_path / "draft")
    return {"prompts": parity.llama_side(DEMO_DIR / "target", draft, prompts, 32, tmp_path / "gguf")}


@needs_llamacpp
@needs_draft
def test_llama_server_rounds_equal_dspark_but_at_near_ties(dspark_runs, prompts, tmp_path):
    theirs = llama_runs(prompts, tmp_path)
    _, lines = parity.compare(dspark_runs, theirs)
    assert all(line.endswith((" rounds", "(a near tie)")) for line in lines), lines
    assert sum(r["accepted"] for p in theirs["prompts"] for r in p["rounds"]) > 0  # the draft is drafting


@needs_llamacpp
@needs_draft
def test_a_perturbed_draft_in_llama_server_differs(dspark_runs, prompts, tmp_path):
    same, lines = parity.compare(dspark_runs, llama_runs(prompts, tmp_path, "conv"))
    assert not same and not all(line.endswith((" rounds", "(a near tie)")) for line in lines), lines
