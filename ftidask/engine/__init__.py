"""The checkpoint protocol, written once for every backend: plan, write, the level's redundancy,
commit record last, retire; recovery of the newest checkpoint that verifies or can be rebuilt.
"""
