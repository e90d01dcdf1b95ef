"""TargetModel (runtime/model/target.py): hidden-state capture, verify + crop against a full recompute, both cache kwargs."""

import inspect

import pytest
import torch
from ckpt_factory import DraftSpec, tiny_target

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.model.target import TargetModel

PROMPT = [5, 17, 33, 2, 99, 7]
BLOCK = [12, 200, 3, 45, 9]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("target") / "t", DraftSpec())  # 4 layers, vocab 256


def full_forward(target: TargetModel, ids: list[int]):
    """A cache-free forward of the whole sequence: (logits [T, V], hidden_states tuple of [T, H])."""
    with torch.no_grad():
        out = target.model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return out.logits[0], [h[0] for h in out.hidden_states]


@pytest.mark.parametrize("indices", [(1, 3), (0, 2)])  # 0 = the embedding output
def test_prefill_features_are_the_requested_hidden_states(target_dir, indices):
    target = TargetModel.load(target_dir, indices)
    logits, features = target.prefill(torch.tensor(PROMPT))
    full_logits, hidden = full_forward(target, PROMPT)
    torch.testing.assert_close(logits, full_logits[-1])
    torch.testing.assert_close(features, torch.cat([hidden[i] for i in indices], dim=-1))
    assert target.cache_length == len(PROMPT)


def test_last_layer_feature_is_the_raw_layer_output_not_the_final_norm(target_dir):
    """Capture index L (layer L-1) is the residual stream DeepSpec and vLLM use; HF's hidden_states[L] is post-norm."""
    target = TargetModel.load(target_dir, (2, 4))
    _, features = target.prefill(torch.tensor(PROMPT))
    _, hidden = full_forward(target, PROMPT)
    decoder = target.model.get_decoder()
    final_norm, decoder.norm = decoder.norm, torch.nn.Identity()
    try:
        _, raw = full_forward(target, PROMPT)  # without the final norm, hidden_states[L] is layer L-1's output
    finally:
        decoder.norm = final_norm
    torch.testing.assert_close(features, torch.cat([raw[2], raw[4]], dim=-1))
    assert not torch.allclose(features[:, 64:], hidden[4], atol=1e-3)  # HF's last entry: after the final norm


@pytest.mark.parametrize("kwarg", ["cache", "past_key_values"])
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_verify_and_crop_equal_a_full_recompute(target_dir, kwarg):
    target = TargetModel.load(target_dir, (1, 3))
    if kwarg == "cache" and target.cache_kwarg != "cache":
        pytest.skip("this transformers version (< 5.24) has no `cache` kwarg")
    target.cache_kwarg = kwarg  # 5.24 accepts both (past_key_values deprecated); 5.17/5.18 only past_key_values
    target.prefill(torch.tensor(PROMPT))
    logits, features = target.score(torch.tensor(BLOCK))
    full_logits, hidden = full_forward(target, PROMPT + BLOCK)
    torch.testing.assert_close(logits, full_logits[len(PROMPT) :], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(features, torch.cat([hidden[1], hidden[3]], -1)[len(PROMPT) :], rtol=1e-5, atol=1e-5)

    keep = len(PROMPT) + 2  # accept two block tokens, then continue with a different one
    target.crop(keep)
    assert target.cache_length == keep
    logits, _ = target.score(torch.tensor([77, 78]))
    sequence = PROMPT + BLOCK[:2] + [77, 78]
    full_logits, _ = full_forward(target, sequence)
    torch.testing.assert_close(logits, full_logits[keep:], rtol=1e-5, atol=1e-5)


def test_cache_kwarg_follows_the_installed_transformers(target_dir):
    target = TargetModel.load(target_dir, (1,))
    parameters = inspect.signature(target.model.forward).parameters
    assert target.cache_kwarg == ("cache" if "cache" in parameters else "past_key_values")
    assert target.cache_kwarg in parameters


def test_plain_decoding_matches_a_full_forward_and_captures_nothing(target_dir):
    target = TargetModel.load(target_dir, (1, 3))
    first = target.prefill_plain(torch.tensor(PROMPT))
    second = target.decode_one(BLOCK[0])
    full_logits, _ = full_forward(target, PROMPT + BLOCK[:1])
    torch.testing.assert_close(first, full_logits[-2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, full_logits[-1], rtol=1e-5, atol=1e-5)
    assert target._captured == {}


def test_geometry_and_shared_weights(target_dir):
    target = TargetModel.load(target_dir, (1,))
    assert (target.vocab_size, target.hidden_size, target.num_layers) == (256, 64, 4)
    assert target.embed_weight.shape == target.lm_head_weight.shape == (256, 64)
    assert target.device.type == "cpu" and target.dtype == torch.float32


def test_crop_cannot_grow_the_cache(target_dir):
    target = TargetModel.load(target_dir, (1,))
    target.prefill(torch.tensor(PROMPT))
    with pytest.raises(ValueError, match="holds only"):
        target.crop(len(PROMPT) + 1)


def test_capture_index_beyond_the_depth_is_a_clear_error(target_dir):
    with pytest.raises(DsparkError, match="target hidden state 5 .* has 4 layers"):
        TargetModel.load(target_dir, (1, 5))


def test_missing_target_is_a_clear_error(tmp_path):
    with pytest.raises(DsparkError, match="cannot load the target model"):
        TargetModel.load(tmp_path / "nothing", (1,))


def copy_target(target_dir, dst, *, drop=(), edit=None):
    """A copy of the target folder without the tensors in `drop`, with config keys from `edit`."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(target_dir, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in drop}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **(edit or {})}))
    return dst


def test_pickle_only_weights_are_refused_without_being_opened(target_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    folder = copy_target(target_dir, tmp_path / "pickle")
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()

    def no_unpickling(*args, **kwargs):
        raise AssertionError("a pickle was opened")

    monkeypatch.setattr(torch, "load", no_unpickling)
    with pytest.raises(DsparkError, match=r"only pickle weights \(pytorch_model.bin\) and dspark loads safetensors"):
        TargetModel.load(folder)
    (folder / "adapter.safetensors").write_bytes((folder / "pytorch_model.bin").read_bytes()[:0])  # not weights
    with pytest.raises(DsparkError, match="cannot load the target model"):  # transformers itself is told: no pickle
        TargetModel.load(folder)


@pytest.mark.parametrize("drop", [["model.layers.1.mlp.down_proj.weight"],
                                  ["lm_head.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
                                   "model.layers.3.mlp.up_proj.weight"]])
def test_missing_weights_are_refused(target_dir, tmp_path, drop):
    folder = copy_target(target_dir, tmp_path / "incomplete", drop=drop)
    with pytest.raises(DsparkError, match=f"lacks {len(drop)} weight tensor") as error:
        TargetModel.load(folder)
    assert sorted(drop)[0] in error.value.message


def test_a_tied_lm_head_is_not_missing(target_dir, tmp_path):
    folder = copy_target(target_dir, tmp_path / "tied", drop=["lm_head.weight"], edit={"tie_word_embeddings": True})
    target = TargetModel.load(folder)
    assert target.lm_head_weight.data_ptr() == target.embed_weight.data_ptr()
