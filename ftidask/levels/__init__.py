"""The multi-node levels, written once against a group channel: L2 partner copies, L3 Reed-Solomon
parity, their differential updates, and the topology of groups.

They never know which backend (one process, MPI, Dask) moves their bytes.
"""
