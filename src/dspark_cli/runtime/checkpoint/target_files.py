"""The target's files checked before its weights are read, and its tokenizer: one sentence for each broken file.

transformers, safetensors and tokenizers raise many exception types for a bad file (a config value of the wrong
type, a rope_parameters list, layer_types shorter than the depth, a tokenizer.json without its keys, a truncated
shard); here each becomes one DsparkError naming the file and what to do. Torch-free (serve uses it).
"""

from __future__ import annotations

from pathlib import Path

from dspark_cli.errors import DsparkError


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
OPTIONAL_COUNTS = ("num_key_value_heads", "head_dim")  # null: transformers derives them
FLAGS = ("tie_word_embeddings", "attention_bias", "use_sliding_window")


def refuse_pickle_only(path: str | Path) -> None:
    """A local model folder with pickle weights and no safetensors: one sentence, before anything is opened."""
    folder = Path(path).expanduser()
    if not folder.is_dir() or any(folder.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise DsparkError(f"the target {path} has only pickle weights ({pickles[0]}) and dspark loads safetensors "
                          "only, because opening a pickle can run code; convert the weights to safetensors (e.g. "
                          "save_pretrained in an environment you trust) and try again.")


def first_line(error: BaseException) -> str:
    """An exception from transformers / safetensors / tokenizers as one short clause: its type and first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " ".join(lines[:2])
    if len(text) > 240:
        text = text[:240].rsplit(" ", 1)[0] + " ..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def check_target_files(source: str | Path, config: bool = True):
    """The target's config.json and safetensors headers, before any weight is read: one sentence naming the file.
    -> the PretrainedConfig transformers built (None with config=False).

    A local folder's weight headers go through the same reader as a draft's (truncated files, files that are not
    safetensors, headers whose offsets do not fit the file or the shapes); then transformers must be able to build
    the model's config from config.json (value types, rope_parameters, layer_types against the depth); config=False
    checks the common values by type instead, without importing transformers (serve)."""
    from dspark_cli.runtime.checkpoint.read import open_checkpoint

    folder = Path(source).expanduser()
    if folder.is_dir():
        refuse_pickle_only(folder)
        if any(folder.glob("*.safetensors")) or any(folder.glob("*.safetensors.index.json")):
            open_checkpoint(folder)  # CheckpointError (one sentence, the file named) for broken weight files
    if not config:
        _check_config_values(folder / "config.json" if folder.is_dir() else Path(str(source)), source)
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(source), trust_remote_code=False)
    except Exception as error:  # transformers raises many types for a bad value; each is bad input here
        where = folder / "config.json" if folder.is_dir() else source
        raise DsparkError(f"the target's config.json ({where}) cannot be built by transformers: "
                          f"{first_line(error)}; fix that value or re-download the model.") from error


def _check_config_values(config_path: Path, source: str | Path) -> None:
    """Without transformers (serve): the config values every causal LM is built from, by type. transformers (and so
    vLLM, which reads the config through it) refuses the same values with its own exceptions."""
    from dspark_cli.runtime.checkpoint.read import read_target_config
    from dspark_cli.runtime.checkpoint.target_config import TargetConfig

    text = TargetConfig.from_dict(read_target_config(source)).text

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    problems = [f"{key} is {text[key]!r} (a positive integer is needed)"
                for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                            "max_position_embeddings", "intermediate_size") if key in text and not count(text[key])]
    problems += [f"{key} is {text[key]!r} (a positive integer is needed)" for key in OPTIONAL_COUNTS
                 if text.get(key) is not None and not count(text[key])]
    problems += [f"{key} is {text[key]!r} (a positive number is needed)" for key in ("rms_norm_eps", "rope_theta")
                 if key in text and not number(text[key])]
    problems += [f"{key} is {text[key]!r} (true or false is needed)" for key in FLAGS
                 if text.get(key) is not None and not isinstance(text[key], bool)]
    problems += [f"{key} is {text[key]!r} (an object is needed)" for key in ("rope_parameters", "rope_scaling")
                 if text.get(key) is not None and not isinstance(text[key], dict)]
    types, layers = text.get("layer_types"), text.get("num_hidden_layers")
    if types is not None and (not isinstance(types, list) or (count(layers) and len(types) != layers)):
        problems.append(f"layer_types has {len(types) if isinstance(types, list) else types!r} entries for "
                        f"{layers} layers")
    elif types is not None and not all(isinstance(kind, str) for kind in types):
        problems.append(f"layer_types is {types!r} (a list of layer type names is needed)")
    if problems:
        raise DsparkError(f"the target's config.json ({config_path}) cannot be built: {'; '.join(problems)}; fix "
                          "that value or re-download the model.")


def load_target_tokenizer(source: str | Path):
    """AutoTokenizer.from_pretrained of the target, or one sentence naming its tokenizer files."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source))
    except Exception as error:  # a malformed tokenizer.json / tokenizer_config.json raises KeyError, AttributeError...
        raise DsparkError(f"cannot load the tokenizer of the target {source} ({first_line(error)}); its tokenizer "
                          "files (tokenizer.json, tokenizer_config.json) are missing or malformed, re-download "
                          "them.") from error
