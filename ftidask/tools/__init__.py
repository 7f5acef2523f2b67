"""Command-line tools and conversions: ``ftidask`` CLI, Zarr export and import.
"""
