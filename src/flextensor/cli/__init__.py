"""The ``flextensor`` command and its demo.

May import: anything in flextensor.
"""
