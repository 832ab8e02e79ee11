"""Built-in data: a real text corpus every Python install already has."""

from .text import ByteTokenizer, TextDataset, corpus_text

__all__ = ["ByteTokenizer", "TextDataset", "corpus_text"]
