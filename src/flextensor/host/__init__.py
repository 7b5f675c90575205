"""Host-side packs (pinned, coded, staged, on disk), the staging ring and checkpoint reading;
``host.shared`` holds the node-shared copy.

May import: the packages up to device, and errors.
"""
