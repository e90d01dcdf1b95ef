"""quantize/: the Markov head's markov_w2 to NVFP4 W4A16 in ModelOpt's checkpoint format.

- write.py     `quantize_checkpoint`: shards rewritten, other files linked, quant configs, the report
- verify.py    the self-check of the written folder before it is renamed into place
- matmul_dtype.py  bf16 or fp32 for the bias screen's matmul, whichever this CPU runs faster (timed once)
The NVFP4 math itself is `dspark_cli.kernels.nvfp4`'s.
"""
