"""model/: the two networks of a pair, as torch modules.

- draft.py     `DSparkDraft` (one parallel block pass, Markov and confidence heads as pieces) and
               `DraftContext` (the draft's context K/V during one generation); knows nothing of files
- families/    one decoder-layer module per draft family (qwen3.py, gemma4.py), registered in `BACKBONES`
- heads/       one module per Markov head type (vanilla.py, gated.py, rnn.py), registered in `HEADS`
- layers.py    RMSNorm, RoPE, block attention: what the families share
- draft_io.py  `load_draft` / `save_draft` / `tie_to_target` by DeepSpec / vLLM tensor names
- target.py    `TargetModel`: any HF causal LM with hidden-state capture, scoring and its cache
- target_state.py  a stateful target's own cache and the exact rollback of its states (the families:
               checkpoint/stateful.py)
"""
