"""io/: what every command reads and writes, torch-free.

- outputs.py   safe output: input-overlap guard, output checks, atomic files and folders, disk errors in one sentence
- paths.py     refuse paths the native safetensors / tokenizers readers cannot open
"""
