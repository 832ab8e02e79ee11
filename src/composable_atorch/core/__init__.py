"""The composition core: transforms and their contracts as data (``transform``, ``contract``),
``compose()`` checking and ordering them (``compose``) into a ``Plan`` (``plan``), strategies as
data (``strategy``) and config values to and from JSON (``codec``).
"""
