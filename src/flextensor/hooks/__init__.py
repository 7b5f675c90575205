"""The model hooks and their functions, forward bracketing, the compiler-opaque custom ops.

May import: the packages up to phases, and errors.
"""
