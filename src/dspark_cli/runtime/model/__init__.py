"""model/: the two networks of a pair, as torch modules.

- draft.py     `DSparkDraft` (one parallel block pass, Markov and confidence heads as pieces) and
               `DraftContext` (the draft's context K/V during one generation); knows nothing of files
- draft_io.py  `load_draft` / `save_draft` / `tie_to_target` by DeepSpec / vLLM tensor names
- target.py    `TargetModel`: any HF causal LM with hidden-state capture, scoring and its cache
"""
