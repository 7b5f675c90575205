"""Helpers of every layer: sizes, the JSON codec and atomic writes, the logger, progress bars.

May import: errors only (the bottom layer).
"""
