"""Units and their placement, the device store (arena, residents), range copies, nesting,
mapping, stream ordering, coded loads, the host budget.

May import: the packages up to host, and errors.
"""
