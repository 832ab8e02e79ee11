"""Training state on disk: sharded atomic save and resume on DCP (``save``), its file layout
(``files``), Hugging Face model directories (``hf``) and experiment trackers (``trackers``).
"""
