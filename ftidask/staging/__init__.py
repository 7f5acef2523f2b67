"""Staging (FTI_SendFile): copying node-local output files to the global file system in the background.
"""

from .stager import StageInfo  # documented as ftidask.staging.StageInfo

__all__ = ["StageInfo"]
