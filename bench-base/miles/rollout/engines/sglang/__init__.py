"""The SGLang engine: one SGLang server per engine actor, behind sglang-router."""
