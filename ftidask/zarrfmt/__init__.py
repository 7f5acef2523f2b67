"""The Zarr format: stores with a hash manifest (level 4 in Zarr, export and import use it).
"""
