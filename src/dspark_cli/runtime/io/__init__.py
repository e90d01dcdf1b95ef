"""io/: what every command reads and writes, torch-free.

- outputs.py   safe output: input-overlap guard, output checks, atomic files and folders, disk errors in one sentence
- reading.py   the one bounded reader: a regular file under a size cap, its UTF-8 text, its JSON (integer-length and
               nesting guards), errors in one sentence (ReadError)
- paths.py     refuse paths the native safetensors / tokenizers readers cannot open
"""
