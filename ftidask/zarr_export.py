"""Zarr export and import: ``ftidask.zarr_export`` as documented before the package was layered. The module
is :mod:`ftidask.tools.zarr_export`; this name keeps existing imports working."""

from .tools.zarr_export import ExportResult, export_checkpoint, import_zarr, read_zarr

__all__ = ["ExportResult", "export_checkpoint", "import_zarr", "read_zarr"]
