"""The node-shared host copy: segment files, the shared store, unpacking, coded shared packs.

May import: as ``host``.
"""
