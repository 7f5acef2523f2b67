"""Staging (FTI_SendFile): copying node-local output files to the global file system in the background.
"""
