"""Saved profiles: the versioned JSON file, and reusing one.

May import: the packages up to engine, and errors.
"""
