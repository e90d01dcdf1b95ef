"""checkpoint/: a draft and its target as files, before any weight is loaded (torch-free).

- read.py      open a local folder or hub id: config.json, safetensors headers, one tensor on demand, through
               io/reading.py (`open_checkpoint`, `read_target_config`, `read_safetensors_header`, `CheckpointError`)
- config.py    `DraftConfig`: every config key and its vLLM resolution order; other draft formats mapped onto it
- formats.py   the layouts by `DraftConfig.format` key and the names reports give them
- layout.py    the tensor schema: names, aliases, the tensors a config implies, the Linear layers vLLM builds
- families/    one `Family` per draft family (qwen3.py, gemma4.py): its tensors, key resolution, vLLM rules, the
               targets it is train's default for and a new draft's config.json; found by architectures or by target
- heads.py     the Markov head types (vanilla, gated, rnn) and the tensors each adds
- rules/       `validate_checkpoint` -> `Report` of findings (what `dspark validate` prints)
- target_config.py  `TargetConfig`: a target's config.json and its text config (one rule), typed
- target_files.py  the target's config, tokenizer and weight headers checked before its weights load
- stateful.py  the stateful target families dspark rolls back exactly, told from a config
"""
