"""The composition core, bottom to top: the registry of transform classes (``registry``), what a
step sees and maps (``context``), contracts as data (``contract``), compose()'s passes (``passes``),
the ``Plan`` they produce (``plan``), ``compose()`` itself (``compose``), the ``Transform`` base
class that composes with ``|`` (``transform``), strategies as data (``strategy``) and config values
to and from JSON (``codec``).
"""
