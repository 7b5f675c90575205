"""Looking at an offloaded model: the report, the trace, the link and pinning probe.

May import: every package but cli.
"""
