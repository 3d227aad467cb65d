"""Prompt data: load a dataset into `Prompt` records, and serve them in resumable batches."""

from miles.data.iterator import PromptIterator
from miles.data.prompts import load_prompts

__all__ = ["PromptIterator", "load_prompts"]
