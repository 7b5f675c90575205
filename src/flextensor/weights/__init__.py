"""Selection, packing (model -> packs, with rollback), streamed weights as seen from outside,
edits and their guards, tensor subclasses.

May import: the packages up to store, and errors.
"""
