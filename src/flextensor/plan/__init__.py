"""Planning, without torch: ``Plan``, the planner, the stream simulator, the ring layout, the
measurements it plans from, the host plan (which units go through the staging ring).

May import: common, codec, config, errors; never torch (tests/test_import_rules.py checks).
"""
