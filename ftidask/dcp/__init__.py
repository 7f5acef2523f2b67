"""Differential checkpoints' building blocks: block digests and patched files, the changed byte
ranges between two files, and the kernel's write tracking of the protected memory.
"""
