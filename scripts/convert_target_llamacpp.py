"""Convert a plain HF target (the demo's Qwen3) to GGUF with llama.cpp's own converter, its pre-tokenizer check
relaxed to GPT-2's.

llama.cpp's `convert_hf_to_gguf.py` identifies a BPE tokenizer's pre-tokenizer by a hash of how it splits a test
string (conversion/base.py, TextModel.get_vocab_base_pre) and refuses an unknown hash. The demo's byte-level BPE
tokenizer is unknown to it although its pre-tokenizer is GPT-2's (ByteLevel with the GPT-2 regex), so this script
answers "gpt-2" for it (the name src/llama-vocab.cpp gives GPT-2's regex; it knows no "gpt2") and runs the
converter unchanged otherwise. Qwen2Model.set_vocab (conversion/qwen.py) tries SentencePiece first and falls back
to GPT-2 BPE on FileNotFoundError, but imports `sentencepiece` before it looks for tokenizer.model; the demo has no
tokenizer.model, so the script goes to the fallback directly. Nothing of llama.cpp is copied: the converter is
imported from the built tree (scripts/build_llamacpp.sh).

    python scripts/convert_target_llamacpp.py TARGET_DIR OUT.gguf [--llamacpp-src DIR]
    python scripts/convert_target_llamacpp.py DRAFT_DIR OUT.gguf --target-model-dir TARGET_DIR   # llama.cpp's
        own DSparkModel conversion of a draft: the reference `dspark convert` is compared with
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_SRC = Path(os.environ.get("DSPARK_LLAMACPP_CACHE",
                                  Path.home() / ".cache/dspark/llama.cpp-b11434")) / "src"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--llamacpp-src", type=Path, default=DEFAULT_SRC)
    parser.add_argument("--target-model-dir", type=Path, help="for a draft: the target that gives the tokenizer")
    args = parser.parse_args()
    if args.out.exists():
        sys.exit(f"{args.out} exists; remove it first.")
    sys.path[:0] = [str(args.llamacpp_src / "gguf-py"), str(args.llamacpp_src)]
    import convert_hf_to_gguf
    from conversion.base import TextModel
    from conversion.qwen import Qwen2Model

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    Qwen2Model.set_vocab = lambda self: self._set_vocab_gpt2()
    sys.argv = ["convert_hf_to_gguf.py", str(args.target), "--outfile", str(args.out), "--outtype", "auto"]
    if args.target_model_dir:
        sys.argv += ["--target-model-dir", str(args.target_model_dir)]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
