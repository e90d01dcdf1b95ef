"""convert/: the library half of `dspark convert`: a draft rewritten in another engine's file format, or a target as
llama.cpp's GGUF, torch-free.

- gguf.py         a DSpark/DFlash draft as a llama.cpp `dflash` GGUF (keys, tensor names and the tokenizer as
                  llama.cpp's own converter writes them), or the one-sentence reason it cannot be faithful
- dequant.py      its ModelOpt NVFP4 / FP8 Linear layers (quantize --scope draft) dequantized to F32, exactly
- target_gguf.py  a Hugging Face Qwen3 / Qwen2 target as llama.cpp's `qwen3` / `qwen2` GGUF, or the reason it is refused
- gguf_vocab.py   a byte-level BPE tokenizer as GGUF tokenizer keys, the pre-tokenizer named by its regexes
- gguf_quant.py   such a GGUF quantized: Q8_0 / Q4_0 / Q4_K by dspark's block quantizers (llama-quantize --pure's
                  bytes), Q4_K_M by llama.cpp's llama-quantize; llama.cpp's rules for what stays unquantized
- gguf_kquant.py  Q4_K super-blocks (ggml's scale search, 6-bit packing) and Q5_0 blocks, its fallback
- layouts.py      a DSpark draft between DeepSpec's and speculators' layouts (both vLLM's), tensors byte for byte

    convert_to_gguf("./my-draft", "draft.gguf", target="./my-target")
    convert_target_to_gguf("./my-target", "target.gguf")
    convert_layout("./my-draft", "./my-draft-speculators", to="speculators", target="Qwen/Qwen3-8B")
"""
