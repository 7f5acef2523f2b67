"""The MPI backend: ranks of an mpi4py communicator, FTI's topology, heads.
"""
