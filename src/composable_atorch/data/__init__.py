"""Built-in data: a real text corpus every Python install already has."""

from composable_atorch.data.text import ByteTokenizer, TextDataset, corpus_text

__all__ = ["ByteTokenizer", "TextDataset", "corpus_text"]
