"""The controller (``OffloadEngine``) and its parts: forward ends, plan states, the plan policy,
CUDA graphs, status, the edit session, budgets.

May import: the packages up to hooks, and errors.
"""
