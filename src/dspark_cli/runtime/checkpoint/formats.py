"""The checkpoint layouts dspark reads, by `DraftConfig.format` key, with the names reports show
(docs/formats-other.md §5). A leaf module: config.py detects the layout, the rules and reports name it."""

FORMAT_NAMES = {
    "deepspec": "DeepSpec (Qwen3DSparkModel)",
    "deepspec-gemma4": "DeepSpec Gemma-4 (Gemma4DSparkModel)",
    "specforge": "SpecForge DSpark (DSparkDraftModel, fields under dflash_config)",
    "speculators-dspark": "speculators DSpark (speculators_model_type 'dspark')",
    "speculators-dflash": "speculators DFlash (speculators_model_type 'dflash')",
    "dflash": "z-lab DFlash (no Markov head)",
    "dflash2": "DFlash2 (DFlash2DraftModel: grouped dynamic convolution, path selector)",
    "other-dspark": "DSpark of another model family",
    "deepseek-v4": "DeepSeek-V4 DSpark drafter",
    "gguf-dflash": "llama.cpp dflash GGUF",
    "unknown": "not a DSpark or DFlash draft",
}
