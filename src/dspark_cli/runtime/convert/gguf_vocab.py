"""A model's byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json) as llama.cpp's GGUF tokenizer keys,
shared by the target and the draft GGUF (a draft takes its target's tokenizer).

What llama.cpp b11434 reads was taken from its source: src/llama-vocab.cpp (llama_vocab::impl::load: the
`tokenizer.ggml.*` keys, the pre-tokenizer names and, in llm_tokenizer_bpe, each name's regexes), gguf-py's
constants.py (the key names, TokenType). The GGUF's `tokenizer.ggml.pre` is chosen by comparing the regexes the
tokenizer.json pre-tokenizes with against PRE_TOKENIZERS, which holds them as tokenizer.json writes them
(llama-vocab.cpp quotes that spelling beside its own: `(?i:'s|...)` expanded to `(?:'[sS]|...)` for its regex
engine; GPT-2's written without the final `|\\s+`, which llama.cpp's splitter gets by keeping unmatched text as a
piece). No match is refused: llama.cpp would split the text differently and the token ids would change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.read import read_json

# The regex HF's ByteLevel pre-tokenizer applies when its use_regex is true (tokenizers' byte_level.rs).
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """One of llama-vocab.cpp's pre-tokenizer names: its regexes (tokenizer.json's spelling) and whether it
    applies the merges to a piece that is already a token (llama.cpp sets ignore_merges for llama-bpe)."""

    name: str
    regexes: tuple[str, ...]
    ignore_merges: bool = False


PRE_TOKENIZERS = (
    PreTokenizer("gpt-2", (GPT2_REGEX,)),  # LLAMA_VOCAB_PRE_TYPE_GPT2 ("gpt2" is not a name llama.cpp knows)
    PreTokenizer("qwen2", (QWEN2_REGEX,)),  # LLAMA_VOCAB_PRE_TYPE_QWEN2 (Qwen2, Qwen2.5, Qwen3)
    PreTokenizer("llama-bpe", (LLAMA3_REGEX,), ignore_merges=True),  # LLAMA_VOCAB_PRE_TYPE_LLAMA3
)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5  # gguf-py constants.py TokenType
NORMALIZERS = (None, "NFC")  # llama.cpp normalizes nothing; NFC leaves text that is already NFC unchanged


@dataclass(frozen=True)
class Vocab:
    """The GGUF tokenizer keys of one tokenizer, values ready to write."""

    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int]  # "bos" / "eos" / "pad" / "unk" -> token id, those the tokenizer names
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def read_vocab(model_dir: Path, vocab_size: int) -> Vocab:
    """The tokenizer in model_dir as GGUF keys, its token list padded to vocab_size (the embedding's rows);
    DsparkError, in one sentence, for a tokenizer llama.cpp would not reproduce."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise DsparkError(f"{model_dir} has no tokenizer.json; the GGUF's tokenizer is read from it, so pass the "
                          "folder that holds it.")
    tokenizer = read_json(path, "tokenizer.json")
    check_types(path, tokenizer)
    config = _json_or_empty(model_dir / "tokenizer_config.json")
    model = tokenizer.get("model") or {}
    _check_bpe(path, tokenizer, model)
    vocab = {**model["vocab"], **{t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}}
    if max(vocab.values()) >= vocab_size:
        raise DsparkError(f"{path} has token id {max(vocab.values())}, beyond the model's vocab_size {vocab_size}; "
                          "the tokenizer does not belong to this model.")
    tokens, types = _tokens(tokenizer, vocab, vocab_size)
    bos_eos = _post_processor_specials(tokenizer)
    return Vocab(
        pre=pre_tokenizer_name(path, tokenizer),
        tokens=tokens, token_types=types, merges=_merges(model["merges"]),
        special_ids=_special_ids(config, _json_or_empty(model_dir / "config.json"), vocab),
        add_bos=_flag(config, "add_bos_token", bos_eos[0]), add_eos=_flag(config, "add_eos_token", bos_eos[1]),
        chat_template=_chat_template(model_dir, config),
    )


def check_types(path: Path, tokenizer: Any) -> None:
    """The values of tokenizer.json this module reads, by type (as the tokenizers library, and so transformers,
    reads them): one sentence naming the key, not a traceback from the code after it."""
    def problem() -> str | None:
        if not isinstance(tokenizer, dict):
            return "it is not a JSON object"
        for key in ("normalizer", "pre_tokenizer", "post_processor"):
            if tokenizer.get(key) is not None and not isinstance(tokenizer[key], dict):
                return f"{key} is {tokenizer[key]!r} (an object or null is needed)"
        added = tokenizer.get("added_tokens", [])
        if not isinstance(added, list) or not all(isinstance(t, dict) and _is_id(t.get("id"))
                                                  and isinstance(t.get("content"), str) for t in added):
            return "added_tokens is not a list of objects with an integer id and a string content"
        model = tokenizer.get("model")
        if not isinstance(model, dict):
            return f"model is {model!r} (an object is needed)"
        vocab, merges = model.get("vocab"), model.get("merges")
        if isinstance(vocab, dict) and not all(_is_id(index) for index in vocab.values()):
            return "model.vocab has an id that is not a non-negative integer"
        if isinstance(merges, list) and not all(isinstance(m, str) or (isinstance(m, list) and len(m) == 2 and all(
                isinstance(part, str) for part in m)) for m in merges):
            return "model.merges has an entry that is neither \"a b\" nor [\"a\", \"b\"]"
        return None

    found = problem()
    if found:
        raise DsparkError(f"{path} cannot be read: {found}; fix that value or re-download the tokenizer.")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def write_vocab(writer, vocab: Vocab) -> None:
    """The tokenizer keys llama-vocab.cpp reads for a BPE ("gpt2") model."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    for kind, token_id in vocab.special_ids.items():
        getattr(writer, f"add_{kind}_token_id")(token_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template is not None:
        writer.add_chat_template(vocab.chat_template)


def pre_tokenizer_name(path: Path, tokenizer: dict) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer regexes; DsparkError naming them when none matches."""
    regexes = tuple(split_regexes(path, tokenizer))
    ignore_merges = bool((tokenizer.get("model") or {}).get("ignore_merges", False))
    for pre in PRE_TOKENIZERS:
        if pre.regexes == regexes and pre.ignore_merges == ignore_merges:
            return pre.name
    names = ", ".join(pre.name for pre in PRE_TOKENIZERS)
    shown = " then ".join(f"`{regex}`" for regex in regexes) or "none"
    raise DsparkError(f"{path} pre-tokenizes with the regex {shown} (ignore_merges "
                      f"{ignore_merges}), which is none of the llama.cpp pre-tokenizers dspark writes ({names}), so "
                      "llama.cpp would split text differently; convert this model with llama.cpp's own converter.")


def split_regexes(path: Path, tokenizer: dict) -> list[str]:
    """The regexes tokenizer.json splits text with, in order: each Split step's, and GPT-2's for a ByteLevel step
    whose use_regex is true. DsparkError for a step llama.cpp has no counterpart for."""
    pre = tokenizer.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    regexes, byte_level = [], False
    for step in steps:
        kind = step.get("type")
        pattern = step.get("pattern") or {}
        if kind == "Split" and "Regex" in pattern and step.get("behavior") == "Isolated" and not step.get("invert"):
            regexes.append(pattern["Regex"])
        elif kind == "ByteLevel" and not step.get("add_prefix_space", False):
            byte_level = True
            if step.get("use_regex", True):
                regexes.append(GPT2_REGEX)
        else:
            raise DsparkError(f"{path} has the pre-tokenizer step {json.dumps(step)}, which llama.cpp's BPE "
                              "tokenizer does not reproduce; convert this model with llama.cpp's own converter.")
    if not byte_level:
        raise DsparkError(f"{path} has no ByteLevel pre-tokenizer step; dspark writes byte-level BPE tokenizers "
                          "only, so convert this model with llama.cpp's own converter.")
    return regexes


def _check_bpe(path: Path, tokenizer: dict, model: dict) -> None:
    normalizer = (tokenizer.get("normalizer") or {}).get("type")
    extras = ("byte_fallback", "continuing_subword_prefix", "end_of_word_suffix")
    plain = isinstance(model.get("vocab"), dict) and model["vocab"] and isinstance(model.get("merges"), list) \
        and not any(model.get(key) for key in extras)
    if model.get("type") != "BPE" or not plain:
        raise DsparkError(f"{path} is not a plain byte-level BPE tokenizer (model type {model.get('type')!r}), the "
                          "only kind dspark writes into a GGUF; convert this model with llama.cpp's own converter.")
    if normalizer not in NORMALIZERS:
        raise DsparkError(f"{path} has the normalizer {normalizer!r}, which llama.cpp does not apply; convert this "
                          "model with llama.cpp's own converter.")


def _tokens(tokenizer: dict, vocab: dict[str, int], vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens by id, as llama.cpp's converter types them (conversion/base.py get_vocab_base): an id the tokenizer
    lacks is `[PADn]`, UNUSED (llama.cpp never matches it in text; USER_DEFINED would turn the text "[PADn]" into
    that id); an added token CONTROL when it is special or looks special (`does_token_look_special`), else
    USER_DEFINED; the rest NORMAL."""
    by_id = {index: token for token, index in vocab.items()}
    special = {t["id"]: bool(t.get("special")) for t in tokenizer.get("added_tokens", [])}
    tokens, types = [], []
    for index in range(vocab_size):
        token = by_id.get(index, f"[PAD{index}]")
        tokens.append(token)
        if index not in by_id:
            types.append(UNUSED)
        elif index in special:
            types.append(CONTROL if special[index] or looks_special(token) else USER_DEFINED)
        else:
            types.append(NORMAL)
    return tokens, types


def looks_special(token: str) -> bool:
    """An added token llama.cpp's converter types CONTROL though its `special` is false (`<|...|>` and the few
    names it lists: conversion/base.py does_token_look_special)."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _merges(merges: list) -> list[str]:
    """tokenizer.json's merges ("a b" strings, or [a, b] pairs in newer files) as GGUF's "a b" strings."""
    return [merge if isinstance(merge, str) else " ".join(merge) for merge in merges]


def _special_ids(config: dict, model_config: dict, vocab: dict[str, int]) -> dict[str, int]:
    """bos/eos/pad/unk: the token tokenizer_config.json names, else config.json's `<kind>_token_id` (the first of
    a list), as transformers resolves them."""
    ids = {}
    for kind in ("bos", "eos", "pad", "unk"):
        token = config.get(f"{kind}_token")
        token = token.get("content") if isinstance(token, dict) else token
        fallback = model_config.get(f"{kind}_token_id")
        fallback = fallback[0] if isinstance(fallback, list) and fallback else fallback
        if isinstance(token, str) and token in vocab:
            ids[kind] = vocab[token]
        elif isinstance(fallback, int) and not isinstance(fallback, bool):
            ids[kind] = fallback
    return ids


def _post_processor_specials(tokenizer: dict) -> tuple[bool, bool]:
    """Whether the post-processor puts a special token before / after a single sequence (how HF adds BOS/EOS)."""
    post = tokenizer.get("post_processor") or {}
    steps = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    single = next((step.get("single") for step in steps if step.get("type") == "TemplateProcessing"), None) or []
    if not single:
        return False, False
    return "SpecialToken" in single[0], "SpecialToken" in single[-1]


def _flag(config: dict, key: str, default: bool) -> bool:
    value = config.get(key)
    return value if isinstance(value, bool) else default


def _chat_template(model_dir: Path, config: dict) -> str | None:
    """tokenizer_config.json's chat_template (the "default" one of a list), else chat_template.jinja."""
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if isinstance(template, str):
        return template
    path = model_dir / "chat_template.jinja"
    return path.read_text(encoding="utf-8") if path.is_file() else None


def _json_or_empty(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = read_json(path, path.name)
    return data if isinstance(data, dict) else {}
