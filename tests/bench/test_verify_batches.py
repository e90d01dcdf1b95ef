"""`dspark bench verify --batch`: B requests x t tokens in one batched forward (runtime/bench/verify.py), its table
(format dspark-verify-costs/2) and how `dspark plan` reads it (runtime/measure/costs.py GridTable)."""

from __future__ import annotations

import json

import pytest
import torch
from ckpt_factory import DraftSpec, tiny_target

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.bench.verify import GRID_FORMAT, time_verify_batches
from dspark_cli.runtime.measure.costs import GridTable, batch_one_ms, read_cost_table
from dspark_cli.runtime.model.target import TargetModel

SPEC = DraftSpec()
CONTEXT = 6


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tiny_target(tmp_path_factory.mktemp("target") / "t", SPEC)
    return TargetModel.load(path, [i + 1 for i in SPEC.target_layer_ids])


def test_batched_passes_score_b_by_t_tokens_after_the_context(target):
    seen = []

    def record(module, args, kwargs):
        ids, cache = kwargs["input_ids"], kwargs[target.cache_kwarg]
        seen.append((tuple(ids.shape), cache.get_seq_length(), int(kwargs["position_ids"][0, 0])))

    handle = target.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        costs = time_verify_batches(target, "tiny", CONTEXT, 3, (1, 4), reps=2, warmup=1)
    finally:
        handle.remove()
    prefills = [s for s in seen if s[0][1] == CONTEXT]
    passes = [s for s in seen if s[0][1] != CONTEXT]
    assert sorted(p[0] for p in prefills) == [(1, CONTEXT), (4, CONTEXT)]
    assert {p[0] for p in passes} == {(b, t) for b in (1, 4) for t in (1, 2, 3)}
    assert len(passes) == 6 * (2 + 1)  # every (B, t) in every timed and warm-up round
    assert all(cached == CONTEXT and start == CONTEXT for _, cached, start in passes)  # cropped back each time
    assert sorted(costs.timings) == [(b, t) for b in (1, 4) for t in (1, 2, 3)]
    doc = costs.to_dict()
    assert doc["format"] == GRID_FORMAT and "not an engine's own" in doc["measured_by"]
    assert doc["batches"] == [1, 4] and doc["tokens"] == [1, 2, 3]
    assert doc["ms"][1][2] == costs.timings[4, 3].median_us / 1000


def test_hidden_states_are_captured_as_a_round_reads_them(target):
    shapes = []
    layer = target.model.get_decoder().layers[SPEC.target_layer_ids[-1]]
    handle = layer.register_forward_hook(lambda m, i, o: shapes.append(tuple((o[0] if isinstance(o, tuple) else o)
                                                                             .shape)))
    try:
        time_verify_batches(target, "tiny", CONTEXT, 2, (2,), reps=1, warmup=0)
    finally:
        handle.remove()
    assert (2, 2, SPEC.hidden_size) in shapes


def test_bad_sizes_are_refused(target):
    with pytest.raises(ValueError, match="at least 1"):
        time_verify_batches(target, "tiny", CONTEXT, 2, (0, 2), reps=1, warmup=0)
    with pytest.raises(ValueError, match="positions"):
        time_verify_batches(target, "tiny", 10**6, 2, (2,), reps=1, warmup=0)


def grid_doc(**changes) -> dict:
    doc = {"format": GRID_FORMAT, "batches": [1, 4], "tokens": [1, 2, 4],
           "ms": [[10.0, 12.0, 16.0], [20.0, 30.0, 50.0]]}
    return {**doc, **changes}


def test_grid_table_reads_equal_length_requests(tmp_path):
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(grid_doc()))
    table = read_cost_table(path)
    assert isinstance(table, GridTable) and not table.batch_one and "not the engine's" in table.kind
    assert table.seconds(1, 2) == pytest.approx(0.012)  # the probes exactly
    assert table.seconds(4, 16) == pytest.approx(0.050)  # 4 requests x 4 tokens
    assert table.seconds(4, 12) == pytest.approx(0.040)  # 3 tokens each: between the t = 2 and t = 4 probes
    assert table.seconds(2, 4) == pytest.approx((12.0 + (30.0 - 12.0) / 3) / 1000)  # R = 2 between the rows
    assert table.seconds(8, 64) == pytest.approx(0.050)  # clamped at the largest batch and length
    assert table.largest_probe == 16
    assert batch_one_ms(grid_doc(), path) == {1: 10.0, 2: 12.0, 4: 16.0}  # plain `dspark plan` reads row B = 1
    path.write_text(json.dumps(grid_doc(measured_by="llama.cpp b11434 llama-server's own timings (a script): ...")))
    assert read_cost_table(path).kind == "batch table: llama.cpp b11434 llama-server's own timings"


@pytest.mark.parametrize("changes, message", [
    ({"ms": [[10.0, 12.0, 16.0]]}, "one row per batch size"),
    ({"ms": [[10.0, 12.0, 16.0], [20.0, 0.0, 50.0]]}, "one time above 0"),
    ({"batches": [4, 1]}, "'batches' must be a list"),
])
def test_bad_grid_is_one_sentence(tmp_path, changes, message):
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(grid_doc(**changes)))
    with pytest.raises(DsparkError, match=message):
        read_cost_table(path)


def test_plain_plan_needs_a_batch_one_row(tmp_path):
    path = tmp_path / "grid.json"
    with pytest.raises(DsparkError, match="no batch-1 row"):
        batch_one_ms(grid_doc(batches=[2, 4]), path)


def test_the_largest_batch_is_checked_against_free_memory_before_the_target_loads(tmp_path, monkeypatch):
    """bench verify --batch shares bench markov's memory check (devices.check_fits): the estimate's parts for the
    largest batch, exactly; one byte short of them is refused before TargetModel.load, exactly enough goes on."""
    from dspark_cli.runtime.bench import verify
    from dspark_cli.runtime.checkpoint.read import open_checkpoint

    path = tiny_target(tmp_path / "t", SPEC)
    c = json.loads((path / "config.json").read_text())
    parts = verify.batch_memory_needed(c, open_checkpoint(str(path)).tensors.values(), torch.float32, 512, 8, 1000)
    kv_per_position = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * 4
    assert parts["KV cache for 1000 x 520 positions"] == 1000 * 520 * kv_per_position
    assert parts["prefill activations"] == 3 * 1000 * 512 * c["intermediate_size"] * 4
    assert parts["logits"] == 4 * 1000 * 8 * c["vocab_size"]
    assert parts["weights"] == 4 * sum(t.numel for t in open_checkpoint(str(path)).tensors.values())

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(TargetModel, "load", load)
    total = sum(parts.values())
    monkeypatch.setattr(verify, "available_memory", lambda device: total - 1)
    with pytest.raises(DsparkError, match=r"bench verify at batch 1000 needs about .* KV cache for 1000 x 520"):
        verify.batch_verify_costs(str(path), None, torch.device("cpu"), torch.float32, 512, 8, (1, 1000), 1, 0)
    monkeypatch.setattr(verify, "available_memory", lambda device: total)
    with pytest.raises(Loaded):
        verify.batch_verify_costs(str(path), None, torch.device("cpu"), torch.float32, 512, 8, (1, 1000), 1, 0)


def test_cli_refuses_a_batch_that_cannot_fit_in_one_sentence(tmp_path):
    from typer.testing import CliRunner

    from dspark_cli.cli import app

    path = tiny_target(tmp_path / "t", SPEC)
    result = CliRunner().invoke(app, ["bench", "verify", "--target", str(path), "--batch", "1,1000000", "--device",
                                      "cpu", "--json", str(tmp_path / "costs.json")])
    assert result.exit_code == 2, result.output
    assert "bench verify at batch 1000000 needs about" in " ".join(result.output.split())
    assert "Traceback" not in result.output and not (tmp_path / "costs.json").exists()
