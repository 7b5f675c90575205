"""Whole pipelines (several offloaded components): their configs, entry methods and profiles.

May import: the packages up to profiles, and errors.
"""
