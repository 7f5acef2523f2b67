"""Where files live and how they are written: paths and every file name, atomic files, trash,
the run lock and the directory checks.
"""
