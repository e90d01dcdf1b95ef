import json

import pytest
import torch
from ckpt_factory import DraftSpec, drop, rename, write_draft, write_nvfp4_draft

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.model.draft_io import load_draft, save_draft
from dspark_cli.runtime.decode.markov import draft_to_target


def _context(model, length, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n_features = model.fc.weight.shape[1]
    features = torch.randn(1, length, n_features, generator=gen)
    return model.project_context(features), torch.arange(length)[None]


def _block(model, ids, start, kv):
    ids = torch.tensor([ids])
    return model.block_hidden(ids, torch.arange(start, start + ids.shape[1])[None], kv)


def test_incremental_context_kv_equals_recompute(draft_dir):
    model = load_draft(draft_dir)
    context, positions = _context(model, 12)
    full = model.context_kv(context, positions)
    parts = [model.context_kv(context[:, a:b], positions[:, a:b]) for a, b in ((0, 5), (5, 6), (6, 12))]
    for layer, (k, v) in enumerate(full):
        assert torch.allclose(torch.cat([p[layer][0] for p in parts], 2), k, atol=1e-6)
        assert torch.allclose(torch.cat([p[layer][1] for p in parts], 2), v, atol=1e-6)


def test_block_is_non_causal_and_reads_context(draft_dir):
    model = load_draft(draft_dir)
    context, positions = _context(model, 8)
    kv = model.context_kv(context, positions)
    base = _block(model, [5, 250, 250, 250], 8, kv)
    later_changed = _block(model, [5, 250, 250, 7], 8, kv)
    assert not torch.allclose(base[0, 0], later_changed[0, 0])  # slot 0 sees a later slot
    other_context = model.context_kv(*_context(model, 8, seed=1))
    assert not torch.allclose(base, _block(model, [5, 250, 250, 250], 8, other_context))
    masked = model.block_hidden(torch.tensor([[5, 250, 250, 7]]), torch.arange(8, 12)[None], kv,
                                attn_mask=torch.tril(torch.ones(4, 12, dtype=torch.bool), diagonal=8)[None])
    assert torch.allclose(masked[0, 0], model.block_hidden(
        torch.tensor([[5, 250, 250, 250]]), torch.arange(8, 12)[None], kv,
        attn_mask=torch.tril(torch.ones(4, 12, dtype=torch.bool), diagonal=8)[None])[0, 0], atol=1e-6)


def test_save_and_reload_round_trip(tmp_path, draft_dir):
    model = load_draft(draft_dir)
    again = load_draft(save_draft(model, tmp_path / "saved"))
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_draft_loaded_from_nvfp4_is_saved_dense_without_its_quantization_config(tmp_path):
    """Loading dequantizes markov_w2, so the saved draft is a dense one: a quantization_config kept from the input
    would describe NVFP4 tensors the folder no longer holds."""
    source = write_nvfp4_draft(tmp_path / "nvfp4")
    assert "quantization_config" in json.loads((source / "config.json").read_text())
    model = load_draft(source)
    saved = save_draft(model, tmp_path / "saved", dtype=torch.float32)
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    assert sorted(p.name for p in saved.iterdir()) == ["config.json", "model.safetensors"]  # no hf_quant_config.json
    again = load_draft(saved)
    assert torch.equal(again.markov_head.markov_w2.weight, model.markov_head.markov_w2.weight)


def test_embed_and_lm_head_are_shared_from_the_target(tmp_path, spec):
    path = write_draft(tmp_path / "d", spec.with_(own_embed=False, own_lm_head=False))
    with pytest.raises(DsparkError, match="share"):
        load_draft(path)
    embed, head = torch.randn(spec.vocab_size, spec.hidden_size), torch.randn(spec.vocab_size, spec.hidden_size)
    model = load_draft(path, target_embed=embed, target_lm_head=head)
    assert torch.equal(model.embed_tokens.weight, embed) and torch.equal(model.lm_head.weight, head)
    assert "embed_tokens.weight" not in model.state_for_save()
    with pytest.raises(DsparkError, match="incompatible"):
        load_draft(path, target_embed=embed[:10], target_lm_head=head)


def test_reduced_vocab_maps_draft_ids_through_d2t(tmp_path, spec):
    model = load_draft(write_draft(tmp_path / "d", spec.with_(draft_vocab_size=64)))
    targets = draft_to_target(model.d2t, torch.arange(64))
    assert targets.unique().numel() == 64 and targets.max() < spec.vocab_size and targets[-1] == spec.vocab_size - 1


def test_missing_and_misshaped_tensors_are_one_sentence_errors(tmp_path, spec):
    with pytest.raises(DsparkError, match="markov_w1.weight' is missing"):
        load_draft(write_draft(tmp_path / "a", spec, mutate=drop("markov_head.markov_w1.weight")))
    with pytest.raises(DsparkError, match="shape"):
        load_draft(write_draft(tmp_path / "b", spec, edit={"markov_rank": 16}))


def test_confidence_flag_without_weights_drops_the_head(tmp_path, spec):
    path = write_draft(tmp_path / "d", spec, mutate=drop("confidence_head.proj.weight", "confidence_head.proj.bias"))
    assert load_draft(path).confidence_head is None


def test_dflash_aliases_load(tmp_path):
    spec = DraftSpec(markov_rank=0, confidence=False, num_hidden_layers=1)
    path = write_draft(tmp_path / "d", spec, mutate=lambda t: rename("fc.weight", "encoder.fc.weight")(
        {k.replace("layers.0.", "midlayer."): v for k, v in t.items()}))
    model = load_draft(path)
    assert model.markov_head is None and model.config.kind == "dflash"
