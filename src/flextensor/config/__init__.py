"""The configuration: the ``OffloadConfig`` schema, its environment / YAML sources and their
precedence, the include / exclude patterns.

May import: common, codec, errors.
"""
