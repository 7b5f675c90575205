"""What a forward does in each phase: learning (and the phase values), discovery, profiling,
the steady-state step, the timeline, the autocast cache pause.

May import: the packages up to weights, and errors.
"""
